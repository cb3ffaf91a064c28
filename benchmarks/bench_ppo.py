"""What the critic costs: PPO vs GRPO step time and peak memory on the same task, batch and loop.

    python benchmarks/bench_ppo.py                          # linear, default batch (256), 2 rounds x 6 steps
    python benchmarks/bench_ppo.py --steps 4 --rounds 1 --batch-size 64

GRPO dropped PPO's critic to save a model's memory and compute (arXiv 2402.03300, Sec. 4.1.1). Both algorithms
train the same config here (seed, batch, group size, epochs x mini-batches, warm start); PPO adds the critic, a
value head on a deep copy of the warm-started transformer: its forward for the values, and its own epochs x
mini-batches of value-loss updates. Each run is a fresh process, so its peak resident memory (ru_maxrss) is that
run's own; the difference PPO - GRPO is the critic's weights, gradients, AdamW state and activations (everything
else, Python, torch and the policy, is the same in both). Step time is the median of `steps.step_seconds` with the
first step dropped (warm-up); `critic_seconds` is the part of a PPO step spent in the critic. Rounds alternate the
order so load from other processes hits both alike. Per-token logging and held-out evaluation are off (the same
work in both).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(args) -> int:
    """Train one run in this process and print its step times and peak memory as JSON."""
    from engine.config import TrainConfig
    from engine.runlog import RunReader
    from engine.train import train

    cfg = TrainConfig(algo=args.algo, task=args.task, steps=args.steps, batch_size=args.batch_size,
                      eval_every=0, checkpoint_every=0, log_tokens=False)
    train(cfg, args.name, args.logs, cache_dir=args.cache_dir, progress=False, num_threads=args.threads)
    with RunReader(args.logs) as r:
        steps = r.sql("SELECT * FROM steps WHERE run = ? ORDER BY step", [args.name])
    timed = steps.iloc[1:]  # the first step warms up allocators and caches
    critic = timed["critic_seconds"].dropna().tolist() if "critic_seconds" in timed else []
    memory = timed["critic_memory_mb"].dropna().tolist() if "critic_memory_mb" in timed else []
    print(json.dumps({
        "step_seconds": timed.step_seconds.tolist(),
        "critic_seconds": critic,
        "critic_memory_mb": max(memory) if memory else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="linear")
    ap.add_argument("--baseline", default="grpo", help="the critic-free algorithm to compare with")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default="logs/.cache", help="warm-start cache (shared with policylens train)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--algo", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--logs", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    algos = (args.baseline, "ppo")
    results: dict[str, list[dict]] = {a: [] for a in algos}
    with tempfile.TemporaryDirectory(prefix="bench-ppo-") as tmp:
        for i in range(args.rounds):
            for algo in (algos if i % 2 == 0 else algos[::-1]):
                name = f"r{i}-{algo}"
                cmd = [sys.executable, __file__, "--child", "--algo", algo, "--name", name, "--logs", tmp,
                       "--task", args.task, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                       "--threads", str(args.threads), "--cache-dir", args.cache_dir]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                results[algo].append(res)
                print(f"{name}: median step {statistics.median(res['step_seconds']):.2f} s, "
                      f"peak RSS {res['peak_rss_mb']:.0f} MB", flush=True)

    def median(algo: str, key: str) -> float:
        return statistics.median(x for r in results[algo] for x in r[key])

    base, ppo = median(args.baseline, "step_seconds"), median("ppo", "step_seconds")
    rss_base = statistics.median(r["peak_rss_mb"] for r in results[args.baseline])
    rss_ppo = statistics.median(r["peak_rss_mb"] for r in results["ppo"])
    print(f"\n{args.task}, batch {args.batch_size}, {args.rounds} rounds x {args.steps - 1} timed steps, "
          f"{args.threads} thread(s)")
    print(f"median step time: {args.baseline} {base:.2f} s, ppo {ppo:.2f} s -> x{ppo / base:.2f} "
          f"(critic: {median('ppo', 'critic_seconds'):.2f} s of a PPO step)")
    print(f"peak resident memory: {args.baseline} {rss_base:.0f} MB, ppo {rss_ppo:.0f} MB -> "
          f"+{rss_ppo - rss_base:.0f} MB (critic's own count: "
          f"{max(r['critic_memory_mb'] for r in results['ppo']):.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
