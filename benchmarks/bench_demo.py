"""How long a newcomer waits: the demo from an empty logs folder to its first steps and to its end.

    python benchmarks/bench_demo.py                        # a fresh temporary logs folder, no cached warm start
    python benchmarks/bench_demo.py --logs-dir /tmp/x      # keep the runs afterwards
    python benchmarks/bench_demo.py --keep-cache           # reuse the warm start in logs/.cache (a second start)

Starts the demo's training exactly as `policylens demo` does (engine.demo.start_demo), without the dashboard
server, and polls the logs folder every half second as the dashboard would. Reported, in seconds from the start:
when the warm start's SFT was done, when each run's step 0 (the warm start's held-out evaluation) and first
training step became readable, and when every run had finished. Targets (issue: the demo): first steps within
2 minutes, the whole demo within 20 minutes, on 2 CPU cores.

    python benchmarks/bench_demo.py --busy-core            # the warm start's SFT speed with a core kept busy

measures instead the demo's warm start (the default model's SFT on one thread per core, as the demo's first run
trains it) in a fresh process, once on the machine as it is and once while another process keeps one core busy
(`while True: pass`), with OpenMP's threads spinning while they wait (OMP_WAIT_POLICY=ACTIVE, what torch did
before) and sleeping (PASSIVE, what `policylens` sets). Reported: SFT steps/s of each and the slowdown a busy core
causes (target: about its share, 2x on 2 cores, not 10x).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sft_steps_per_second(steps: int) -> float:
    """SFT steps/s of the demo's warm start on one thread per core (engine.train.default_warm_start_threads),
    timed from the first progress report (step 25) to the last."""
    from engine import policy as pol
    from engine.tasks import get_task
    from engine.train import default_warm_start_threads

    task = get_task("linear", seed=0)
    tokenizer = pol.build_tokenizer()
    model = pol.build_model(tokenizer, pol.ModelConfig(), seed=0)
    marks: dict[int, float] = {}
    sft = pol.SFTConfig(steps=steps, num_threads=default_warm_start_threads())
    pol.warm_start(task, tokenizer, model, sft, seed=0, progress=lambda step, total, loss: marks.setdefault(
        step, time.perf_counter()))
    first, last = min(marks), max(marks)
    return (last - first) / (marks[last] - marks[first])


def busy_core_benchmark(steps: int) -> int:
    import os
    import subprocess

    def measure(policy: str) -> float:
        env = dict(os.environ, OMP_WAIT_POLICY=policy)
        out = subprocess.run([sys.executable, __file__, "--sft-child", str(steps)], env=env, check=True,
                             capture_output=True, text=True).stdout
        return float(out.split()[-1])

    results: dict[tuple[str, str], float] = {}
    for policy in ("ACTIVE", "PASSIVE"):
        results[policy, "as is"] = measure(policy)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            results[policy, "one core busy"] = measure(policy)
        finally:
            busy.kill()
            busy.wait()
        for case in ("as is", "one core busy"):
            print(f"OMP_WAIT_POLICY={policy:7s} {case:13s}: {results[policy, case]:.2f} SFT steps/s", flush=True)
    for policy in ("ACTIVE", "PASSIVE"):
        slowdown = results[policy, "as is"] / results[policy, "one core busy"]
        print(f"{policy}: a busy core makes the warm start {slowdown:.1f}x slower")
    return 0


def main(argv: list[str] | None = None) -> int:
    from engine import demo
    from engine.runlog import list_runs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs-dir", help="where the demo runs go (default: a temporary folder, removed afterwards)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="copy the cached warm starts of logs/.cache first (time a start with the cache filled)")
    ap.add_argument("--timeout-minutes", type=float, default=40.0)
    ap.add_argument("--busy-core", action="store_true", help="time the warm start's SFT with a core kept busy")
    ap.add_argument("--sft-steps", type=int, default=100, help="SFT steps timed per case with --busy-core")
    ap.add_argument("--sft-child", type=int, help=argparse.SUPPRESS)  # one timing, in a fresh process
    args = ap.parse_args(argv)
    if args.sft_child:
        print(f"{sft_steps_per_second(args.sft_child):.4f}")
        return 0
    if args.busy_core:
        return busy_core_benchmark(args.sft_steps)

    logs = Path(args.logs_dir or tempfile.mkdtemp(prefix="policylens-bench-demo-"))
    if logs.exists() and any(logs.iterdir()):
        print(f"{logs} is not empty; the demo would reuse its runs. Give an empty or new folder.", file=sys.stderr)
        return 2
    if args.keep_cache and Path("logs/.cache").is_dir():
        shutil.copytree("logs/.cache", logs / ".cache")

    t0 = time.monotonic()
    demo.start_demo(logs)
    events: dict[str, float] = {}
    try:
        while time.monotonic() - t0 < 60 * args.timeout_minutes:
            now = time.monotonic() - t0
            warm = demo.warm_start_progress(logs)
            if warm and warm.get("step") == warm.get("steps"):
                events.setdefault("warm start done", now)
            runs = list_runs(logs)
            for run in runs:
                if run["last_step"] is not None:
                    events.setdefault(f"{run['run']} step 0", now)
                if (run["last_step"] or 0) >= 1:
                    events.setdefault(f"{run['run']} step 1", now)
            if len(runs) == len(demo.DEMO_RUNS) and all(r["status"] == "finished" for r in runs):
                events["all finished"] = now
                break
            if demo.running_supervisor(logs) is None and runs:
                events["supervisor ended"] = now
                break
            time.sleep(0.5)
    finally:
        demo.stop_demo(logs)
        if args.logs_dir is None:
            shutil.rmtree(logs, ignore_errors=True)

    for name, seconds in sorted(events.items(), key=lambda item: item[1]):
        print(f"{seconds:8.1f} s  {name}")
    for label in ("step 0", "step 1"):
        times = [s for name, s in events.items() if name.endswith(label)]
        if times:
            print(f"{label} of the {len(times)} runs: first {min(times):.1f} s, median {statistics.median(times):.1f}"
                  f" s, last {max(times):.1f} s (target: within 120 s)")
    if "all finished" in events:
        print(f"whole demo: {events['all finished'] / 60:.1f} min (target: within 20 min)")
    else:
        print("the demo did not finish (see the events above)")
    return 0 if "all finished" in events else 1


if __name__ == "__main__":
    raise SystemExit(main())
