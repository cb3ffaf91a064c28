"""How long a newcomer waits: the demo from an empty logs folder to its first steps and to its end.

    python benchmarks/bench_demo.py                        # a fresh temporary logs folder, no cached warm start
    python benchmarks/bench_demo.py --logs-dir /tmp/x      # keep the runs afterwards
    python benchmarks/bench_demo.py --keep-cache           # reuse the warm start in logs/.cache (a second start)

Starts the demo's training exactly as `policylens demo` does (engine.demo.start_demo), without the dashboard
server, and polls the logs folder every half second as the dashboard would. Reported, in seconds from the start:
when the warm start's SFT was done, when each run's step 0 (the warm start's held-out evaluation) and first
training step became readable, and when every run had finished. Targets (issue: the demo): first steps within
2 minutes, the whole demo within 20 minutes, on 2 CPU cores.
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


def main(argv: list[str] | None = None) -> int:
    from engine import demo
    from engine.runlog import list_runs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs-dir", help="where the demo runs go (default: a temporary folder, removed afterwards)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="copy the cached warm starts of logs/.cache first (time a start with the cache filled)")
    ap.add_argument("--timeout-minutes", type=float, default=40.0)
    args = ap.parse_args(argv)

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
