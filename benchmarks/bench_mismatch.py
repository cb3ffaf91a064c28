"""How large the sampler/trainer mismatch is on a task, for each cause alone (engine.sampler).

    python benchmarks/bench_mismatch.py                          # the tiny model on linear, 4 steps per cause
    python benchmarks/bench_mismatch.py --model-size default --steps 6 --batch-size 64

One run per cause (bf16 sampler; lag 1; lag 2; top-p 0.9; top-k 20; and the defaults as a control), same seed; over
the training tokens of every step after the first `lag` ones (a lagged sampler equals the trainer until then): the
mean |old_logp - sampler_logp|, the share of tokens whose ratio pi_trainer / pi_sampler leaves [0.9, 1.1] (the band
of TRL issue 6789), and verl's chi2_token; plus the seconds per step.

    python benchmarks/bench_mismatch.py --cost                   # + what the sampler and its columns cost

With `--cost`: (a) the sampler copy's memory (`PolicySampler.memory_bytes`: the copy plus its lag snapshots) and
the median time of one refresh (the weight sync after every update) for bf16 / lag 1 / bf16 + lag 2 on the chosen
model, against the median step time of the bf16 run above; (b) logging overhead of the sampler columns: one real
step of a bf16, lag 2 run with token TIS and seq_mean_k3 rejection, logged through `RunWriter.log_step` and written
(`flush`) with and without its sampler_logp, sampler_logp_full, is_weight and rejected columns, alternating, median
of `--repeats`; the difference as a share of that run's median step time (target: within 2%).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CAUSES = {
    "defaults (float32, lag 0)": {},
    "bf16 sampler": {"sampler_dtype": "bfloat16"},
    "lag 1": {"sampler_lag": 1},
    "lag 2": {"sampler_lag": 2},
    "top-p 0.9": {"top_p": 0.9},
    "top-k 20": {"top_k": 20},
}
# The columns the sampler and the corrections add, per table (logged with and without them by --cost)
SAMPLER_COLUMNS = {"tokens": ("sampler_logp", "sampler_logp_full"), "token_passes": ("is_weight", "rejected")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=None, help="warm-start cache (default: a temporary folder)")
    parser.add_argument("--cost", action="store_true", help="also measure the sampler's and its columns' cost")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from engine.config import TrainConfig
    from engine.runlog import RunReader
    from engine.train import train

    logs = Path(tempfile.mkdtemp(prefix="bench-mismatch-"))
    cache = args.cache_dir or logs / ".cache"
    base = dict(task="linear", model_size=args.model_size, batch_size=args.batch_size, group_size=4, eval_every=0,
                checkpoint_every=0, steps=args.steps, **({"sft_steps": 200} if args.model_size == "tiny" else {}))
    print(f"{'cause':28} {'mean |old-sampler|':>19} {'outside [0.9,1.1]':>18} {'chi2_token':>11} {'s/step':>7}")
    for i, (name, knobs) in enumerate(CAUSES.items()):
        run = f"cause-{i}"
        train(TrainConfig(**base, **knobs), run, logs, cache_dir=cache, progress=False, num_threads=args.threads)
        first = 1 + knobs.get("sampler_lag", 0)
        with RunReader(logs) as reader:
            row = reader.sql(
                "SELECT avg(abs(old_logp - sampler_logp)) AS gap, "
                "avg(CASE WHEN exp(old_logp - sampler_logp) NOT BETWEEN 0.9 AND 1.1 THEN 1.0 ELSE 0.0 END) AS off, "
                "avg(exp(2 * least(greatest(old_logp - sampler_logp, -20), 20))) - 1 AS chi2 "
                "FROM tokens WHERE run = ? AND step >= ? AND sampler_logp IS NOT NULL", [run, first]).iloc[0]
            seconds = reader.sql("SELECT median(step_seconds) AS s FROM steps WHERE run = ? AND step >= 1",
                                 [run]).iloc[0]["s"]
        print(f"{name:28} {row.gap:19.5f} {100 * row.off:17.2f}% {row.chi2:11.5f} {seconds:7.2f}")
    if args.cost:
        sampler_cost(args.model_size, run_seconds(logs, "cause-1"), args.repeats)
        train(TrainConfig(**base, sampler_dtype="bfloat16", sampler_lag=2, rollout_is="token",
                          rollout_rs="seq_mean_k3"), "cost", logs, cache_dir=cache, progress=False,
              num_threads=args.threads)
        column_cost(logs, "cost", run_seconds(logs, "cost"), args.repeats)


def run_seconds(logs: Path, run: str) -> float:
    from engine.runlog import RunReader

    with RunReader(logs) as reader:
        return float(reader.sql("SELECT median(step_seconds) AS s FROM steps WHERE run = ? AND step >= 1",
                                [run]).iloc[0]["s"])


def sampler_cost(model_size: str, step_seconds: float, repeats: int) -> None:
    """(a): memory and refresh time of the sampler for three settings, printed."""
    from engine import policy as pol
    from engine.sampler import PolicySampler
    from engine.train import model_config

    model = pol.build_model(pol.build_tokenizer(), model_config(model_size), seed=0)
    policy_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"\nsampler cost on the {model_size} model ({policy_bytes / 1e6:.2f} MB of float32 weights), median "
          f"step {step_seconds:.3f} s (bf16 run above)")
    for dtype, lag in (("bfloat16", 0), ("float32", 1), ("bfloat16", 2)):
        sampler = PolicySampler(model, dtype, lag)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sampler.refresh(model)
            times.append(time.perf_counter() - t0)
        refresh = statistics.median(times)
        print(f"  {dtype:9} lag {lag}: {sampler.memory_bytes() / 1e6:6.2f} MB "
              f"({sampler.memory_bytes() / policy_bytes:.2f}x the policy), refresh {1000 * refresh:.2f} ms "
              f"({100 * refresh / step_seconds:.2f}% of a step)")


def column_cost(logs: Path, run: str, step_seconds: float, repeats: int) -> None:
    """(b): one logged step written with and without the sampler columns, printed."""
    from engine.runlog import RunReader, RunWriter

    with RunReader(logs) as reader:
        step = int(reader.sql("SELECT max(step) AS s FROM steps WHERE run = ?", [run]).iloc[0]["s"])
        tables = {table: reader.sql(f"SELECT * EXCLUDE (run, step) FROM {table} WHERE run = ? AND step = ?",
                                    [run, step]) for table in ("rollouts", "tokens", "token_passes")}
    # every column the run logged (a column left NULL throughout is left out: the writer writes it NULL again)
    full = {table: {c: frame[c].astype(object).where(frame[c].notna(), None).tolist() if frame[c].hasnans
                    else frame[c].to_numpy() for c in frame.columns if frame[c].notna().any()}
            for table, frame in tables.items()}
    without = {table: {c: v for c, v in columns.items() if c not in SAMPLER_COLUMNS.get(table, ())}
               for table, columns in full.items()}
    times: dict[bool, list[float]] = {True: [], False: []}
    with RunWriter.create(logs / "bench-columns", "columns", algorithm="bench", task="bench") as writer:
        for i in range(2 * repeats + 2):
            on = i % 2 == 0
            t0 = time.perf_counter()
            writer.log_step(i, **(full if on else without))
            writer.flush()
            if i >= 2:
                times[on].append(time.perf_counter() - t0)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    rows = len(tables["tokens"]), len(tables["token_passes"])
    print(f"\nlogging one step ({rows[0]} token rows, {rows[1]} token-pass rows) with the sampler columns "
          f"{1000 * on:.1f} ms, without {1000 * off:.1f} ms: {1000 * (on - off):+.2f} ms = "
          f"{100 * (on - off) / step_seconds:+.2f}% of a {step_seconds:.3f} s step (median of {repeats})")


if __name__ == "__main__":
    main()
