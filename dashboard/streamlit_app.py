"""PolicyLens dashboard: the entry point (`policylens dashboard`, or
`streamlit run dashboard/streamlit_app.py -- --logs-dir logs`).

This file is the frame around every page: it finds the runs, draws the shared run and step pickers in the sidebar
(mirrored into the URL so a view can be bookmarked), watches running runs so new steps appear by themselves, and
hands over to the page chosen in `st.navigation`. Each page in `app_pages/` is thin: query -> figure -> render.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `streamlit run` puts this file's folder on sys.path, not the repository root; without an installed package the
# `dashboard` and `engine` imports would fail.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from dashboard import common, data, prefetch, queries  # noqa: E402
from dashboard.app_pages import empty_state  # noqa: E402

prefetch.script_started()  # a guess computing the next view ahead makes way for this run (dashboard.prefetch)

LIVE_POLL_SECONDS = 3
PAGES_DIR = Path(__file__).resolve().parent / "app_pages"
STATUS_MARK = {"running": "● ", "crashed": "✖ ", "stopped": "■ ", "finished": ""}

common.release_large_blocks()
st.set_page_config(page_title="PolicyLens", page_icon=common.app_icon(), layout="wide")
logs = common.logs_dir()

try:
    runs = queries.runs_table(logs)
except Exception as error:  # an unreadable logs folder must still leave a page that says so
    common.show_error(f"the runs in {logs}", error)
    runs = None


def watch_for_changes(signature: tuple, live: bool) -> None:
    """Rerun the whole app when a run logs a new step or changes status (cheap: reads the cached run list)."""

    @st.fragment(run_every=LIVE_POLL_SECONDS if live else None)
    def watcher() -> None:
        try:
            now = queries.live_signature(logs)
        except Exception:
            return  # a run being written or removed: try again at the next tick
        if now != signature:
            st.rerun()
        if live:
            st.caption(f"● live: checking for new steps every {LIVE_POLL_SECONDS} s")

    watcher()


if runs is None or runs.empty:
    # Nothing logged yet: one page telling how to start, polling so that the dashboard fills in by itself.
    page = st.navigation([st.Page(empty_state.render, title="Start", icon=":material/rocket_launch:")])
    with st.sidebar:
        watch_for_changes(() if runs is None else queries.live_signature(logs), live=True)
    page.run()
    st.stop()

# ---------------------------------------------------------------- shared run and step pickers
status_of = dict(zip(runs["run"], runs["status"], strict=True))
run_names = list(runs["run"])
running = [r for r in run_names if status_of.get(r) == "running"]
fallback_run = running[-1] if running else run_names[-1]
run, problem = common.initial_value("run", "run", str, run_names, fallback_run)
if problem:
    st.sidebar.warning(
        f"Run {common.linked('run')} from the link is not in the logs folder; "
        f"showing {common.md(repr(run))}."
    )
st.session_state["run"] = run
run = st.sidebar.selectbox(
    "Run", run_names, key="run", format_func=lambda r: f"{STATUS_MARK.get(status_of.get(r), '? ')}{r}",
    help="● running  ■ stopped  ✖ crashed",
)
info = data.run_overview(runs, run)
last_logged, version = info.last_step, info.version
try:
    steps = queries.step_numbers(logs, run, version)
except Exception as error:
    common.show_error(f"the steps of run {run!r}", error)
    steps = []

step = None
if steps:
    latest = steps[-1]
    # Follow the newest step while the user is looking at the newest step: a live run then advances by itself.
    latest_seen = st.session_state.setdefault("_latest_seen", {})
    if st.session_state.get("step") == latest_seen.get(run) and latest_seen.get(run) in steps:
        st.session_state["step"] = latest
    latest_seen[run] = latest
    step, problem = common.initial_value("step", "step", int, steps, latest)
    if problem:
        st.sidebar.warning(
            f"Step {common.linked('step')} from the link was not logged; showing step {step}."
        )
    st.session_state["step"] = step
    if len(steps) > 1:
        step = st.sidebar.select_slider("Step", steps, key="step")
    else:
        st.sidebar.caption(f"Step {step} (the only one logged so far)")

if info.status == "running":
    st.sidebar.success(f"{common.md(run)} is training")
elif info.status == "crashed":
    at_step = f"at step {last_logged}" if last_logged >= 0 else "before logging any step"
    st.sidebar.error(f"{common.md(run)} crashed {at_step}; its logged steps are shown.")
shown_logs = common.md(common.shown_path(logs))
# A run without a task (an import, a TRL run) names none: no empty part between two dots.
named = [common.md(part) for part in (info.algorithm, info.task) if part]
st.sidebar.caption(" · ".join([*named, f"logs: {shown_logs}"]))
try:
    problems = queries.reader_problems(logs)
except Exception:  # the runs table above already worked; a failure here only hides the list
    problems = []
if problems:
    with st.sidebar.expander(f"⚠ {len(problems)} file(s) or run(s) left out", expanded=False):
        st.caption("They could not be read (damaged, foreign or of a newer format); everything else is shown.")
        for problem in problems[:50]:
            st.text(problem)

common.set_url_value("run", run)
common.set_url_value("step", step)
st.session_state["_selection"] = common.Selection(logs_dir=logs, info=info, step=step, steps=tuple(steps))

with st.sidebar:
    watch_for_changes(queries.live_signature(logs), live=bool(running))

page = st.navigation(
    [
        st.Page(PAGES_DIR / "runs.py", title="Runs", icon=":material/table_chart:", url_path="runs", default=True),
        st.Page(PAGES_DIR / "replay.py", title="Replay", icon=":material/replay:", url_path="replay"),
        st.Page(PAGES_DIR / "token_trajectories.py", title="Token trajectories", icon=":material/timeline:",
                url_path="trajectories"),
        st.Page(PAGES_DIR / "groups.py", title="Groups", icon=":material/view_column:", url_path="groups"),
        st.Page(PAGES_DIR / "token_inspector.py", title="Token inspector", icon=":material/text_fields:",
                url_path="tokens"),
        st.Page(PAGES_DIR / "token_stats.py", title="Token statistics", icon=":material/query_stats:",
                url_path="token-stats"),
        st.Page(PAGES_DIR / "prm_steps.py", title="PRM steps", icon=":material/stairs:", url_path="prm"),
        st.Page(PAGES_DIR / "advantages.py", title="Advantages", icon=":material/stacked_line_chart:",
                url_path="advantages"),
        st.Page(PAGES_DIR / "algorithm_weighting.py", title="Algorithm weighting", icon=":material/balance:",
                url_path="weighting"),
        st.Page(PAGES_DIR / "mismatch.py", title="Mismatch", icon=":material/compare_arrows:", url_path="mismatch"),
    ]
)
# The page runs inside the script run, not as a fragment of its own: a fragment rerun calls `page.run()` a second
# time without `st.navigation`, which Streamlit refuses, so every widget inside a page would crash it. A widget
# change reruns the frame too, which costs a few cached lookups (see docs/benchmarks.md).
page.run()
