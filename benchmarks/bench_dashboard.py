"""How long each dashboard page takes to render (server time) on a run with about one million token rows.

    python benchmarks/bench_dashboard.py [--logs-dir DIR] [--steps 40] [--repeat 3]

Writes a synthetic run through the real RunWriter (shaped like the engine's: groups, tokens, two optimisation
passes, PRM steps) unless DIR already holds it, then renders every page with streamlit's AppTest:
- cold: the page's query results are not cached yet (first look at a step), `st.cache_data` cleared before;
- warm: the same page again (what every widget interaction and the live refresh cost).
It also times the main query + figure functions on their own. Prints a table; the issue's bar is < 1 s per page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the synthetic run is test data: tests/synthetic_runs.py

PAGES = ["runs", "replay", "groups", "token_inspector", "prm_steps", "advantages", "algorithm_weighting", "token_stats",
         "token_trajectories"]
RUN = "bench-1m"


def ensure_run(logs_dir: Path, steps: int, groups: int, group_size: int, length: int) -> int:
    """Write the benchmark run if missing; return its number of token rows."""
    from synthetic_runs import write_synthetic_run

    from engine.runlog import RunReader

    if not (logs_dir / RUN / "run.json").exists():
        started = time.perf_counter()
        write_synthetic_run(str(logs_dir), RUN, steps=steps, groups=groups, group_size=group_size, length=length,
                            passes=2, seed=0)
        print(f"wrote {RUN} in {time.perf_counter() - started:.1f} s")
    reader = RunReader(logs_dir)
    counts = reader.sql("SELECT (SELECT count(*) FROM tokens) AS tokens, "
                        "(SELECT count(*) FROM token_passes) AS passes, "
                        "(SELECT count(*) FROM rollouts) AS rollouts")
    print(f"{RUN}: {int(counts.tokens[0]):,} token rows, {int(counts.passes[0]):,} token_pass rows, "
          f"{int(counts.rollouts[0]):,} rollouts")
    return int(counts.tokens[0])


def time_reruns(at, repeat: int) -> dict[str, float]:
    """Median server time of re-running the current page with an empty data cache (cold) and right after (warm)."""
    import streamlit as st

    cold, warm = [], []
    for _ in range(repeat):
        st.cache_data.clear()
        started = time.perf_counter()
        at.run()
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        at.run()
        warm.append(time.perf_counter() - started)
        assert not at.exception, [e.message for e in at.exception]
    return {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm)}


def time_pages(logs_dir: Path, repeat: int) -> list[dict]:
    from streamlit.testing.v1 import AppTest

    os.environ["POLICYLENS_LOGS_DIR"] = str(logs_dir)
    at = AppTest.from_file(str(ROOT / "dashboard" / "streamlit_app.py"), default_timeout=300)
    at.query_params["run"] = RUN
    at.run()
    rows = []
    for page in PAGES:
        at.switch_page(f"app_pages/{page}.py").run()  # warm-up: imports (torch for the weighting page)
        assert not at.exception, [e.message for e in at.exception]
        rows.append({"page": page, **time_reruns(at, repeat)})
    # The heaviest view: every completion of the step through the six objectives at once.
    at.switch_page("app_pages/algorithm_weighting.py").run()
    at.radio(key="weigh_scope").set_value("the whole step")
    rows.append({"page": "weighting, whole step", **time_reruns(at, repeat)})
    return rows


def time_functions(logs_dir: Path) -> list[tuple[str, float, float]]:
    """Query + chart functions on their own (no Streamlit script run), caches bypassed via __wrapped__."""
    import streamlit as st

    from dashboard import charts, queries
    from dashboard.tokens import CHANNELS, token_heatmap_html

    st.cache_data.clear()
    logs = str(logs_dir)
    reader = queries.get_reader(logs)
    last = int(reader.sql("SELECT max(step) AS s FROM steps WHERE run = ?", [RUN])["s"][0])
    version = (RUN, last)
    out = []

    def timed(name, function, *args):
        started, cpu = time.perf_counter(), time.process_time()
        value = function(*args)
        # CPU seconds of every thread (DuckDB's included): the cost on a machine busy with other work too
        out.append((name, time.perf_counter() - started, time.process_time() - cpu))
        return value

    timed("runs_table", queries.runs_table, logs)
    steps = timed("run_steps", queries.run_steps, logs, (RUN,), version)
    timed("metric_curves figure", charts.metric_curves, steps)
    rollouts = timed("step_rollouts", queries.step_rollouts, logs, RUN, last, None)
    timed("group_summary", queries.group_summary, logs, RUN, last)
    rollout = int(rollouts["rollout_id"].iloc[0])
    tokens = timed("rollout_tokens (1 rollout)", queries.rollout_tokens, logs, RUN, last, (rollout,), 1)
    timed("token_heatmap_html", token_heatmap_html, tokens, "ratio")
    timed("token_channel_heatmap figure", charts.token_channel_heatmap, tokens, list(CHANNELS))
    group = tuple(int(r) for r in rollouts[rollouts["group_id"] == rollouts["group_id"].iloc[0]]["rollout_id"])
    group_tokens = timed("rollout_tokens (1 group)", queries.rollout_tokens, logs, RUN, last, group, 1)
    timed("prm_steps (1 group)", queries.prm_steps, logs, RUN, last, group)
    timed("eval_prompt_history", queries.eval_prompt_history, logs, RUN, 0, version)
    first = int(reader.sql("SELECT min(step) AS s FROM steps WHERE run = ?", [RUN])["s"][0])
    stats = timed("token_stats (whole run)", queries.token_stats, logs, RUN, first, last, 0, version)
    timed("token_stats (whole run, by 8 positions)", queries.token_stats, logs, RUN, first, last, 8, version)
    timed("rollouts_with_token (whole run)", queries.rollouts_with_token, logs, RUN, first, last,
          str(stats["token_text"].iloc[0]), 0, None)
    bins = timed("entropy_bins (whole run)", queries.entropy_bins, logs, (RUN,), first, last, 10, version)
    timed("entropy_bin_bars figure", charts.entropy_bin_bars, bins, 10, queries.ASPO_ENTROPY_QUANTILE)

    from dashboard import recompute
    from engine.objectives import ALGORITHMS

    batch = timed("batch_from_tokens (1 group)", recompute.batch_from_tokens, group_tokens)
    for algo in ALGORITHMS:
        timed(f"policy_loss {algo} (1 group)", recompute.weigh, batch, algo, {})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs-dir", default=str(ROOT / "logs" / ".bench-dashboard"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    logs_dir = Path(args.logs_dir).resolve()
    ensure_run(logs_dir, args.steps, args.groups, args.group_size, args.length)

    print("\nquery and figure functions (uncached):")
    print(f"  {'':<40} {'wall':>9} {'cpu':>9}")
    for name, seconds, cpu in time_functions(logs_dir):
        print(f"  {name:<40} {seconds * 1000:6.1f} ms {cpu * 1000:6.1f} ms")
    print(f"\npage render, server time (AppTest, median of {args.repeat}):")
    print(f"  {'page':<22} {'cold (s)':>9} {'warm (s)':>9}")
    worst = 0.0
    for row in time_pages(logs_dir, args.repeat):
        worst = max(worst, row["cold_s"], row["warm_s"])
        print(f"  {row['page']:<22} {row['cold_s']:9.3f} {row['warm_s']:9.3f}")
    print(f"\nslowest: {worst:.3f} s ({'under' if worst < 1 else 'OVER'} the 1 s bar)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
