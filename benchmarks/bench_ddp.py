"""Data-parallel scaling: training samples per second on 1 process and on N processes (torchrun, gloo on CPU).

    python benchmarks/bench_ddp.py                          # tiny model, 1 vs 2 processes, 2 rounds x 6 steps
    python benchmarks/bench_ddp.py --model-size small --batch-size 64 --steps 8 --rounds 3
    python benchmarks/bench_ddp.py --sft-steps 200 --cache-dir .pytest_cache/d/policylens-warmstart  # tests' warm start
    python benchmarks/bench_ddp.py --algo ppo               # PPO: its critic is data-parallel too (a second DDP model)

Each round trains the same config from the same seed twice: `policylens train` on one process, then
`policylens train --nproc N` (one torch thread per process either way). Throughput is completions per second of
training steps: batch_size x steps over the time between the first and the last logged step (`steps.wall_time`,
so the first step's warm-up and the warm start are left out; held-out evaluation and checkpoints are off). It
includes everything a step does: sampling, rewards, the old/reference forwards, the update passes (with DDP's
gradient all-reduce; with PPO also the critic's forward and update, its own DDP all-reduce), the step metrics'
all-reduce and the run-log writes. Reported: the median over rounds of each and the speed-up N-process / 1-process,
next to the machine's load average before each run, since on a shared machine other processes take cores away
from the ranks (the speed-up cannot pass the number of idle cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def samples_per_second(logs_dir: Path, run: str, batch_size: int) -> float:
    from engine.runlog import RunReader

    with RunReader(logs_dir) as r:
        wall = r.sql("SELECT wall_time FROM steps WHERE run = ? AND step > 0 ORDER BY step", [run]).wall_time.tolist()
    return batch_size * (len(wall) - 1) / (wall[-1] - wall[0])


def train(logs_dir: Path, cache_dir: Path, run: str, nproc: int, args) -> None:
    cmd = [sys.executable, "-m", "engine.cli", "train", "--logs-dir", str(logs_dir), "--cache-dir", str(cache_dir),
           "--run-name", run, "--no-progress", "--threads", "1", "--algo", args.algo, "--task", args.task,
           "--model-size", args.model_size, "--batch-size", str(args.batch_size), "--group-size",
           str(args.group_size), "--steps", str(args.steps), "--eval-every", "0", "--checkpoint-every", "0",
           "--nproc", str(nproc), *(["--sft-steps", str(args.sft_steps)] if args.sft_steps else [])]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"training failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--task", default="linear")
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, help="warm start SFT steps (default: the config's)")
    parser.add_argument("--cache-dir", help="cached warm starts (default: a temporary folder; the first run trains it)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        logs_dir = Path(tmp) / "logs"
        cache_dir = Path(args.cache_dir) if args.cache_dir else Path(tmp) / "cache"
        rates: dict[int, list[float]] = {1: [], args.nproc: []}
        print(f"{os.cpu_count()} cores; {args.model_size} model, {args.algo}, batch {args.batch_size} "
              f"(groups of {args.group_size}), {args.steps} steps per run")
        for round_ in range(args.rounds):
            for nproc in (1, args.nproc):
                load = os.getloadavg()[0]
                run = f"bench-r{round_}-n{nproc}"
                train(logs_dir, cache_dir, run, nproc, args)
                rates[nproc].append(samples_per_second(logs_dir, run, args.batch_size))
                print(f"round {round_}: {nproc} process(es): {rates[nproc][-1]:7.1f} samples/s "
                      f"(load average before: {load:.2f})")
        one, many = statistics.median(rates[1]), statistics.median(rates[args.nproc])
        print(f"median: 1 process {one:.1f} samples/s, {args.nproc} processes {many:.1f} samples/s, "
              f"speed-up x{many / one:.2f}")


if __name__ == "__main__":
    main()
