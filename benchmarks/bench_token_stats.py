"""Token statistics over a whole run: from the token summary (engine.runlog.summary) against row by row.

    python benchmarks/bench_token_stats.py --logs-dir bench_logs                  # every bench_dashboard.py run there
    python benchmarks/bench_token_stats.py --logs-dir bench_logs --exact-repeat 0  # the summary only (100M rows)

The runs are bench_dashboard.py's (`--build-only`). For each run, in a process of its own per path (so the peak
resident memory is the path's, with the dashboard's DuckDB memory limit): the Token statistics page's queries over
all its steps (`token_data.token_stats` without and by 8 positions, `entropy_bins` of 10 bins, `covariance_drivers`,
`covariance_per_step`), median of `--repeat` (wall and CPU seconds, the latter summed over DuckDB's threads and
less moved by other processes on a busy machine): cold = a new reader (its first query reads the Parquet footers; the
files are in the page cache), warm = the same reader again (what a step-range move pays: the page caches no other
result). "summary": the run's summary rows; "row by row": the same functions with the summary left out (a run
logged before it). The two paths' tables are compared. And the write side: `step_summary` of one bench step next to
`stored_passes`, which the writer already runs per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUERIES = ["token_stats", "token_stats by 8", "entropy_bins", "covariance_drivers", "covariance_per_step"]


def page_queries(reader, run: str, first: int, last: int) -> dict:
    from dashboard import token_data

    return {
        "token_stats": lambda: token_data.token_stats(reader, run, first, last, 0),
        "token_stats by 8": lambda: token_data.token_stats(reader, run, first, last, 8),
        "entropy_bins": lambda: token_data.entropy_bins(reader, (run,), first, last, 10),
        "covariance_drivers": lambda: token_data.covariance_drivers(reader, run, first, last, 0, 20),
        "covariance_per_step": lambda: token_data.covariance_per_step(reader, run, first, last),
    }


def one_path(logs_dir: str, run: str, path: str, repeat: int, out: str) -> None:
    """Time the page's queries on one path (in this process) and save the tables and timings to `out`."""
    from dashboard.data import READER_MEMORY_LIMIT
    from engine.runlog import RunReader
    from engine.runlog.schema import DATA_TABLES

    tables = DATA_TABLES if path == "summary" else [t for t in DATA_TABLES if t != "token_summary"]

    def reader():
        return RunReader(logs_dir, runs=run, memory_limit=READER_MEMORY_LIMIT, tables=tables)

    steps = reader().sql("SELECT min(step) AS first, max(step) AS last FROM steps")
    first, last = int(steps["first"][0]), int(steps["last"][0])
    times = {kind: {q: [] for q in QUERIES} for kind in ("cold", "warm", "cold_cpu", "warm_cpu")}
    results = {}
    for _ in range(repeat):
        fresh = reader()
        for name, query in page_queries(fresh, run, first, last).items():
            for kind in ("cold", "warm"):
                start, start_cpu = time.perf_counter(), time.process_time()
                results[name] = query()
                times[kind][name].append(time.perf_counter() - start)
                times[f"{kind}_cpu"][name].append(time.process_time() - start_cpu)  # every thread's
        fresh.close()
    with open(out + ".json", "w") as f:
        json.dump({**{kind: {q: statistics.median(t) for q, t in by_query.items()} for kind, by_query in times.items()},
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)
    for name, frame in results.items():
        frame.to_pickle(f"{out}.{name.replace(' ', '_')}.pkl")


def compare(summary_out: str, exact_out: str) -> float:
    """The largest relative difference between the two paths' numbers (the tables must have the same rows)."""
    import numpy as np
    import pandas as pd

    worst = 0.0
    for name in QUERIES:
        a, b = (pd.read_pickle(f"{o}.{name.replace(' ', '_')}.pkl") for o in (summary_out, exact_out))
        pd.testing.assert_frame_equal(a, b, check_dtype=False, rtol=1e-9, atol=1e-12, obj=name)
        for column in a.select_dtypes("number"):
            x, y = a[column].to_numpy(float), b[column].to_numpy(float)
            scale = np.maximum(np.abs(y), 1e-300)
            worst = max(worst, float(np.nanmax(np.abs(x - y) / scale, initial=0.0)))
    return worst


def write_cost(repeat: int) -> tuple[float, float]:
    """Median seconds of `stored_passes` and of `step_summary` on one bench_dashboard.py step (512 completions)."""
    import numpy as np
    from bench_dashboard import short_shape, synthetic_step

    from engine.runlog.derived import stored_passes
    from engine.runlog.schema import table_rows
    from engine.runlog.summary import step_summary

    data = synthetic_step(3, short_shape(64, 8, 650), 2, np.random.default_rng(0))
    rows = {t: table_rows(t, data[t], "bench", 3) for t in ("rollouts", "tokens", "token_passes")}
    passes_times, summary_times = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        passes = stored_passes(rows["tokens"], rows["token_passes"])
        middle = time.perf_counter()
        step_summary(rows["rollouts"], rows["tokens"], passes)
        passes_times.append(middle - start)
        summary_times.append(time.perf_counter() - middle)
    return statistics.median(passes_times), statistics.median(summary_times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logs-dir", default="bench_logs")
    parser.add_argument("--runs", default="", help="comma separated (default: every run of the folder)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--exact-repeat", type=int, default=1, help="0: skip the row-by-row path")
    parser.add_argument("--scratch", default=None, help="where the two paths' tables go (default: a temp folder)")
    parser.add_argument("--one-path", nargs=3, metavar=("RUN", "PATH", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_path:
        run, path, out = args.one_path
        one_path(args.logs_dir, run, path, args.repeat, out)
        return 0
    import tempfile

    scratch = args.scratch or tempfile.mkdtemp(prefix="bench-token-stats-")
    runs = args.runs.split(",") if args.runs else sorted(p.name for p in Path(args.logs_dir).iterdir()
                                                          if (p / "run.json").exists())
    print(f"load average {os.getloadavg()}")
    passes_s, summary_s = write_cost(args.repeat)
    print(f"write side, one step of 512 completions: stored_passes {passes_s:.3f} s, step_summary {summary_s:.3f} s")
    for run in runs:
        paths = [("summary", args.repeat)] + ([("row by row", args.exact_repeat)] if args.exact_repeat else [])
        outs = {}
        for path, repeat in paths:
            outs[path] = os.path.join(scratch, f"{run}-{path.replace(' ', '_')}")
            subprocess.run([sys.executable, __file__, "--logs-dir", args.logs_dir, "--repeat", str(repeat),
                            "--one-path", run, path, outs[path]], check=True)
            with open(outs[path] + ".json") as f:
                measured = json.load(f)
            print(f"{run} {path} (median of {repeat}; load average {os.getloadavg()[0]:.1f}): "
                  f"peak {measured['peak_rss_mb']:.0f} MB")
            for query in [*QUERIES, "all"]:
                cold, warm, cold_cpu, warm_cpu = (
                    sum(measured[kind].values()) if query == "all" else measured[kind][query]
                    for kind in ("cold", "warm", "cold_cpu", "warm_cpu"))
                print(f"  {query:<22} cold {cold:7.3f} s ({cold_cpu:6.3f} s CPU)   "
                      f"warm {warm:7.3f} s ({warm_cpu:6.3f} s CPU)")
        if len(outs) == 2:
            print(f"  the two paths' tables are equal (largest relative difference "
                  f"{compare(outs['summary'], outs['row by row']):.1e})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
