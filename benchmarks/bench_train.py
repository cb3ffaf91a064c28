"""Cost of per-token logging or of per-step checkpoints: training step time with the feature on vs off.

    python benchmarks/bench_train.py                       # per-token logging, default config, 3 rounds x 8 steps
    python benchmarks/bench_train.py --compare checkpoints # a checkpoint after every step vs none
    python benchmarks/bench_train.py --algo dapo --steps 10 --rounds 2

Both variants train the same config from the same seed, so they sample the same batches and do the same updates;
the only difference is `log_tokens` (tokens, token_passes and prm_steps tables plus the reference forward that only
feeds them when beta = 0) or `checkpoint_every` (1 vs 0: model, optimizer and RNG state written after every step).
Step time is the gap between consecutive `steps.wall_time` values, which includes everything: sampling, the update
passes, building the tables, writing the checkpoint and waiting for the previous step's write. The first step of
each run is dropped (warm-up). Rounds alternate on/off so that load from other processes hits both alike. Held-out
evaluation is off (it is the same work in both variants). Reported: median step time of each variant and the
overhead in percent (target: at most 5%). With `--compare checkpoints`, also the median time of writing one
checkpoint, measured directly (less noisy than a difference of step times), and what a kill costs: the work of the
step in flight, at most one step time.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FEATURES = {"tokens": ("log_tokens", True, False), "checkpoints": ("checkpoint_every", 1, 0)}
"""--compare choice -> (TrainConfig field, value with the feature on, value with it off)."""


def step_times(logs_dir: Path, run: str) -> list[float]:
    from engine.runlog import RunReader

    with RunReader(logs_dir) as r:
        wall = r.sql("SELECT wall_time FROM steps WHERE run = ? ORDER BY step", [run]).wall_time.tolist()
    return [b - a for a, b in itertools.pairwise(wall)][1:]  # drop the first (warm-up) step


def checkpoint_write_seconds(run_dir: Path, repeats: int = 5) -> tuple[float, int]:
    """(median seconds, bytes) of writing the run's last checkpoint again, exactly as the trainer does."""
    import torch

    from engine.train import checkpoint_steps

    found = checkpoint_steps(run_dir)
    state = torch.load(found[max(found)], weights_only=False)
    times = []
    for i in range(repeats):
        path = run_dir / f"bench-{i}.pt"
        t0 = time.perf_counter()
        torch.save(state, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", choices=FEATURES, default="tokens", help="the feature to switch on and off")
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("--task", default="linear")
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=3, help="on/off pairs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default="logs/.cache", help="warm-start cache (shared with policylens train)")
    args = ap.parse_args(argv)

    import torch

    from engine.config import TrainConfig
    from engine.runlog import RunReader
    from engine.train import train

    field, on_value, off_value = FEATURES[args.compare]
    torch.set_num_threads(args.threads)
    times: dict[bool, list[float]] = {True: [], False: []}
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        logs = Path(tmp)
        for i in range(args.rounds):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                name = f"r{i}-{'on' if on else 'off'}"
                knobs = {"eval_every": 0, "checkpoint_every": 0, field: on_value if on else off_value}
                cfg = TrainConfig(algo=args.algo, task=args.task, steps=args.steps, **knobs)
                t0 = time.perf_counter()
                train(cfg, name, logs, cache_dir=args.cache_dir, progress=False, num_threads=args.threads)
                t = step_times(logs, name)
                times[on] += t
                print(f"{name}: median step {statistics.median(t):.3f} s over {len(t)} steps "
                      f"(run {time.perf_counter() - t0:.1f} s)", flush=True)
        with RunReader(logs) as r:
            for table in ("tokens", "token_passes", "rollouts", "prm_steps"):
                rows[table] = int(r.sql(f"SELECT count(*) AS n FROM {table} WHERE run = 'r0-on'").n[0])
        if args.compare == "checkpoints":
            write_seconds, size = checkpoint_write_seconds(logs / "r0-on")
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"\n{args.algo} on {args.task}, {args.rounds} rounds x {args.steps - 1} timed steps, "
          f"{args.threads} thread(s), {field} {on_value} vs {off_value}")
    if args.compare == "tokens":
        print("rows logged per step with per-token logging: "
              + ", ".join(f"{k} {v / args.steps:.0f}" for k, v in rows.items()))
    print(f"median step time: {args.compare} on {on:.3f} s, off {off:.3f} s -> overhead {100 * (on - off) / off:+.1f}%")
    if args.compare == "checkpoints":
        print(f"one checkpoint ({size / 1e6:.1f} MB) written in {1000 * write_seconds:.0f} ms (median), "
              f"{100 * write_seconds / off:.1f}% of a step; a kill loses at most the step in flight, "
              f"about {off:.1f} s of training")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
