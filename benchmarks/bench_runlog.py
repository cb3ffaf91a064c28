"""Benchmark of the run log (engine/runlog/): storage size, query latency, logging overhead.

    python benchmarks/bench_runlog.py                       # storage + queries on a 1M-token-row synthetic run
    python benchmarks/bench_runlog.py --steps 1000 --rollouts 16   # same rows spread over many more steps
    python benchmarks/bench_runlog.py --overhead            # + logging overhead with a synthetic training step

(a) Storage: writes a synthetic run (`--steps` x `--rollouts` x ~`--tokens` tokens, `--passes` optimisation passes
    per token) through `RunWriter`, then reports bytes per token row on disk and the median latency of the queries
    the dashboard makes most: one rollout's tokens, one rollout's token passes, the whole `steps` table.
    Targets (issue 4): one rollout's tokens < 100 ms and the `steps` table < 100 ms on >= 1M token rows.
(b) Overhead: `measure_overhead(step_fn, ...)` times a training step with and without `log_step`. `step_fn(step)`
    does one step of work and returns the keyword arguments of `RunWriter.log_step` (metrics, rollouts, tokens,
    ...). Pass the real trainer's step to measure the true overhead (target: at most 5% slower); from the command
    line, `--overhead` uses a synthetic step that does `--step-ms` of work and logs a realistic step's tables.
    The overhead in the real trainer (default config, per-token logging on vs off) is `benchmarks/bench_train.py`.
(c) A query that fails without naming a file (as some damaged data pages do) makes the reader decode every file once
    to find the damaged one: the first such error costs a full read of the run, later ones are cheap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.runlog import RunReader, RunWriter, data_dir_of


def synthetic_step(step: int, rollouts: int, tokens: int, passes: int, rng: np.random.Generator) -> dict:
    """The tables of one step, shaped like the trainer's (groups of 8, lengths around `tokens`)."""
    lengths = rng.integers(max(1, tokens // 2), tokens * 3 // 2 + 1, rollouts)  # (N,)
    n = int(lengths.sum())
    rollout_id = np.repeat(np.arange(rollouts), lengths)  # (n,)
    position = np.concatenate([np.arange(length) for length in lengths])
    advantage = rng.normal(size=rollouts)
    vocab = np.array([f"tok{i}" for i in range(400)], dtype=object)
    token_ids = rng.integers(0, 400, n)
    old_logp = -rng.exponential(0.7, n)
    out = {
        "metrics": {"reward_mean": float(rng.random()), "reward_std": 0.3, "accuracy": 0.5, "loss": 0.1,
                    "heldout_accuracy": 0.4 if step % 10 == 0 else None, "lr": 1e-6, "kl": 0.01},
        "rollouts": {
            "rollout_id": np.arange(rollouts), "group_id": np.arange(rollouts) // 8,
            "index_in_group": np.arange(rollouts) % 8, "kind": ["train"] * rollouts,
            "prompt_id": np.arange(rollouts) // 8 + step * 100,
            "prompt": [f"What is {i} + {i + 1}? Think step by step." for i in range(rollouts)],
            "completion": [" ".join(vocab[token_ids[rollout_id == i]]) for i in range(rollouts)],
            "answer": [str(2 * i + 1) for i in range(rollouts)], "reward": rng.random(rollouts),
            "advantage": advantage, "length": lengths, "truncated": lengths > tokens * 1.4,
            "filtered": np.zeros(rollouts, dtype=bool),
        },
        "tokens": {
            "rollout_id": rollout_id, "position": position, "token_id": token_ids,
            "token_text": pa.array(vocab[token_ids], pa.string()), "old_logp": old_logp,
            "ref_logp": old_logp + rng.normal(0, 0.05, n), "entropy": rng.exponential(1.0, n),
            "advantage": advantage[rollout_id],
        },
    }
    if passes:
        k = np.repeat(np.arange(passes), n)
        ratio = np.exp(rng.normal(0, 0.1, n * passes))
        out["token_passes"] = {
            "pass": k, "rollout_id": np.tile(rollout_id, passes), "position": np.tile(position, passes),
            "new_logp": np.tile(old_logp, passes) + np.log(ratio), "ratio": ratio,
            "clip": np.where(ratio > 1.28, 2, np.where(ratio < 0.8, 1, 0)).astype(np.int8),
            "grad_weight": rng.normal(size=n * passes), "token_loss": rng.normal(size=n * passes),
        }
        # the trainer's k3 KL to the reference (engine.objectives.k3_kl)
        x = np.tile(out["tokens"]["ref_logp"], passes) - out["token_passes"]["new_logp"]
        out["token_passes"]["kl"] = np.exp(x) - x - 1
    return out


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def bench_storage(logs_dir: Path, steps: int, rollouts: int, tokens: int, passes: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    write_times = []
    with RunWriter.create(logs_dir, "bench", algorithm="grpo", task="synthetic", config={}) as writer:
        for step in range(steps):
            tables = synthetic_step(step, rollouts, tokens, passes, rng)
            t0 = time.perf_counter()
            writer.log_step(step, **tables)
            write_times.append(time.perf_counter() - t0)
    reader = RunReader(logs_dir)
    counts = reader.sql("SELECT (SELECT count(*) FROM tokens) AS t, (SELECT count(*) FROM token_passes) AS p")
    token_rows, pass_rows = int(counts.t[0]), int(counts.p[0])
    sizes = {}
    for path in (logs_dir / "bench" / "data").rglob("*.parquet"):
        sizes[path.stem] = sizes.get(path.stem, 0) + path.stat().st_size
    total = sum(os.path.getsize(p) for p in (logs_dir / "bench").rglob("*") if p.is_file())

    pick = np.random.default_rng(1)

    def one_rollout_tokens():
        step, rollout = int(pick.integers(steps)), int(pick.integers(rollouts))
        df = reader.sql(
            "SELECT * FROM tokens WHERE run = ? AND step = ? AND rollout_id = ? ORDER BY position",
            ["bench", step, rollout],
        )
        assert len(df) > 0

    def one_rollout_passes():
        step, rollout = int(pick.integers(steps)), int(pick.integers(rollouts))
        reader.sql(
            "SELECT * FROM token_passes WHERE run = ? AND step = ? AND rollout_id = ? ORDER BY pass, position",
            ["bench", step, rollout],
        )

    def steps_table():
        df = reader.sql("SELECT * FROM steps WHERE run = ? ORDER BY step", ["bench"])
        assert len(df) == steps

    one_rollout_tokens()  # first query pays for opening and checking files once
    result = {
        "steps": steps,
        "token_rows": token_rows,
        "token_pass_rows": pass_rows,
        "bytes_per_token_row (tokens files)": sizes.get("tokens", 0) / token_rows,
        "bytes_per_token_pass_row": sizes.get("token_passes", 0) / max(pass_rows, 1),
        "bytes_per_token_row (whole run folder)": total / token_rows,
        "log_step_ms (median)": statistics.median(write_times) * 1000,
        "log_step_ms (mean, incl. compaction)": statistics.mean(write_times) * 1000,
        "query_ms one rollout's tokens": _median_ms(one_rollout_tokens, repeats),
        "query_ms one rollout's token_passes": _median_ms(one_rollout_passes, repeats),
        "query_ms full steps table": _median_ms(steps_table, repeats),
        "data folders": len(os.listdir(data_dir_of(logs_dir / "bench"))),
    }
    reader_cold = RunReader(logs_dir)
    t0 = time.perf_counter()
    reader_cold.sql("SELECT count(*) FROM steps")
    result["cold reader first query ms"] = (time.perf_counter() - t0) * 1000

    def failing_query():
        # A query error that names no file could be a damaged data page: the reader then decodes every file it
        # has not fully read yet, once (the worst case of a damaged file), and re-raises when all are whole.
        try:
            reader_cold.sql("SELECT CAST(token_text AS INTEGER) FROM tokens")
        except duckdb.Error:
            return
        raise AssertionError("the query was meant to fail")

    t0 = time.perf_counter()
    failing_query()
    result["query_ms unexplained error, first (every file read)"] = (time.perf_counter() - t0) * 1000
    result["query_ms unexplained error, again"] = _median_ms(failing_query, 3)
    result["MB of Parquet"] = sum(sizes.values()) / 1e6
    return result


def measure_overhead(
    step_fn: Callable[[int], dict], logs_dir: Path, steps: int = 10, warmup: int = 2
) -> dict:
    """Median step time of `step_fn` without and with logging its result through `RunWriter.log_step`.

    `step_fn(step)` runs one training step and returns `log_step` keyword arguments. Runs alternate between the
    two modes step by step so that drift (thermal, other processes) affects both equally.
    """
    plain, logged = [], []
    with RunWriter.create(logs_dir, f"overhead-{os.getpid()}", algorithm="bench", task="bench") as writer:
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            step_fn(step)
            t1 = time.perf_counter()
            tables = step_fn(step)
            writer.log_step(step, **tables)
            t2 = time.perf_counter()
            if step >= warmup:
                plain.append(t1 - t0)
                logged.append(t2 - t1)
    off, on = statistics.median(plain), statistics.median(logged)
    return {"step_ms logging off": off * 1000, "step_ms logging on": on * 1000, "overhead %": 100 * (on / off - 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rollouts", type=int, default=64, help="completions per step")
    parser.add_argument("--tokens", type=int, default=80, help="mean completion length")
    parser.add_argument("--passes", type=int, default=2, help="optimisation passes logged per token")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--overhead", action="store_true", help="also measure logging overhead (synthetic step)")
    parser.add_argument("--step-ms", type=float, default=1000.0, help="work per synthetic training step")
    parser.add_argument("--skip-storage", action="store_true", help="only run the overhead measurements")
    parser.add_argument("--dir", help="where to write (default: a temporary folder, deleted afterwards)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if not args.skip_storage:
            result = bench_storage(Path(tmp), args.steps, args.rollouts, args.tokens, args.passes, args.repeats)
            for key, value in result.items():
                print(f"{key:40s} {value:12.2f}" if isinstance(value, float) else f"{key:40s} {value:12d}")
        if args.overhead:
            rng = np.random.default_rng(2)

            def step_fn(step: int) -> dict:
                deadline = time.perf_counter() + args.step_ms / 1000
                tables = synthetic_step(step, args.rollouts, args.tokens, args.passes, rng)
                while time.perf_counter() < deadline:  # stands in for sampling + the optimizer step
                    pass
                return tables

            for key, value in measure_overhead(step_fn, Path(tmp)).items():
                print(f"{key:40s} {value:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
