"""Cost of per-token logging: training step time with full logging vs with per-token logging off.

    python benchmarks/bench_train.py                       # default config (grpo, linear), 3 rounds x 8 steps
    python benchmarks/bench_train.py --algo dapo --steps 10 --rounds 2

Both variants train the same config from the same seed, so they sample the same batches and do the same updates;
the only difference is `log_tokens` (tokens, token_passes and prm_steps tables plus the reference forward that only
feeds them when beta = 0). Step time is the gap between consecutive `steps.wall_time` values, which includes
everything: sampling, the update passes, building the tables and waiting for the previous step's write. The first
step of each run is dropped (warm-up). Rounds alternate on/off so that load from other processes hits both alike.
Held-out evaluation is off (it is the same work in both variants). Reported: median step time of each variant and
the overhead in percent (target: at most 5%).
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


def step_times(logs_dir: Path, run: str) -> list[float]:
    from engine.runlog import RunReader

    with RunReader(logs_dir) as r:
        wall = r.sql("SELECT wall_time FROM steps WHERE run = ? ORDER BY step", [run]).wall_time.tolist()
    return [b - a for a, b in itertools.pairwise(wall)][1:]  # drop the first (warm-up) step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    torch.set_num_threads(args.threads)
    times: dict[bool, list[float]] = {True: [], False: []}
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        logs = Path(tmp)
        for i in range(args.rounds):
            for log_tokens in ((True, False) if i % 2 == 0 else (False, True)):
                name = f"r{i}-{'on' if log_tokens else 'off'}"
                cfg = TrainConfig(algo=args.algo, task=args.task, steps=args.steps, eval_every=0,
                                  checkpoint_every=0, log_tokens=log_tokens)
                t0 = time.perf_counter()
                train(cfg, name, logs, cache_dir=args.cache_dir, progress=False, num_threads=args.threads)
                t = step_times(logs, name)
                times[log_tokens] += t
                print(f"{name}: median step {statistics.median(t):.3f} s over {len(t)} steps "
                      f"(run {time.perf_counter() - t0:.1f} s)", flush=True)
        with RunReader(logs) as r:
            for table in ("tokens", "token_passes", "rollouts", "prm_steps"):
                rows[table] = int(r.sql(f"SELECT count(*) AS n FROM {table} WHERE run = 'r0-on'").n[0])
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"\n{args.algo} on {args.task}, {args.rounds} rounds x {args.steps - 1} timed steps, "
          f"{args.threads} thread(s)")
    print("rows logged per step with per-token logging: "
          + ", ".join(f"{k} {v / args.steps:.0f}" for k, v in rows.items()))
    print(f"median step time: logging on {on:.3f} s, off {off:.3f} s -> overhead {100 * (on - off) / off:+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
