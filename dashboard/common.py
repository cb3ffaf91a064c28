"""What every page shares: the logs folder, the run and step being looked at, error display.

The run and step live in `st.session_state` (driven by the sidebar pickers) and are mirrored into the URL's query
parameters on every rerun, so any view can be bookmarked or shared; a new session starts from the URL.
Page-specific parameters (rollout, channel, pass, group, ...) go through `url_value` / `set_url_value`.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

LOGS_DIR_ENV = "POLICYLENS_LOGS_DIR"


def logs_dir() -> str:
    """Absolute logs folder: `--logs-dir DIR` after `--` on the streamlit command line, else the environment."""
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg == "--logs-dir" and i + 1 < len(argv):
            return str(Path(argv[i + 1]).resolve())
        if arg.startswith("--logs-dir="):
            return str(Path(arg.split("=", 1)[1]).resolve())
    return str(Path(os.environ.get(LOGS_DIR_ENV, "logs")).resolve())


def shown_path(path: str) -> str:
    """A folder as the user would type it: relative to the working directory when inside it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~$:])")


def md(value) -> str:
    """Any logged or URL-supplied text made literal for Streamlit's markdown (captions, warnings, headers).

    A prompt, a run's task name or a hand-edited link could otherwise render as a link, an image fetched from
    anywhere, or formatting. Token text never goes through markdown at all (see tokens.py)."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", str(value))


def linked(key: str) -> str:
    """The URL's value for `key`, quoted and escaped, for messages about a link that asked for something missing."""
    return md(repr(st.query_params.get(key)))


def url_value(key: str, cast=str, default=None):
    """A query parameter converted with `cast`, or `default` when absent or malformed."""
    raw = st.query_params.get(key)
    if raw is None:
        return default
    try:
        return cast(raw)
    except (TypeError, ValueError):
        return default


def set_url_value(key: str, value) -> None:
    """Mirror a page's choice into the URL (removed when None), only when it changed, to avoid needless updates."""
    written = st.session_state.setdefault("_url_written", {})
    written[key] = None if value is None else str(value)
    if value is None:
        if key in st.query_params:
            del st.query_params[key]
    elif st.query_params.get(key) != str(value):
        st.query_params[key] = str(value)


def initial_value(state_key: str, url_key: str, cast, options: list, fallback):
    """The value a widget should start from, and a message when the link asked for something that does not exist.

    The URL wins when it differs from what this session last wrote into it (a bookmark, a link from another page,
    a hand-edited address); otherwise the widget keeps its session value; otherwise `fallback`.
    """
    raw = st.query_params.get(url_key)
    url_changed = raw is not None and raw != st.session_state.get("_url_written", {}).get(url_key)
    if not url_changed and st.session_state.get(state_key) in options:
        return st.session_state[state_key], None
    if raw is None:
        return fallback, None
    try:
        wanted = cast(raw)
    except (TypeError, ValueError):
        wanted = None
    if wanted in options:
        return wanted, None
    if st.session_state.get(state_key) in options:
        fallback = st.session_state[state_key]
    return fallback, f"{url_key} {raw!r} from the link does not exist here"


@dataclass(frozen=True)
class Selection:
    """The run and step chosen in the sidebar, with what pages need to know about the run."""

    logs_dir: str
    run: str
    step: int | None
    steps: tuple[int, ...]
    status: str
    algorithm: str
    task: str
    version: tuple  # changes whenever the run gets a new step or status: keys run-wide caches


def current() -> Selection | None:
    """The sidebar's selection (set by streamlit_app.py before the page runs)."""
    return st.session_state.get("_selection")


def require_selection(need_step: bool = True) -> Selection:
    """The selection, or stop the page with a clear message."""
    selection = current()
    if selection is None:
        st.info("No run selected.")
        st.stop()
    if need_step and selection.step is None:
        st.info(f"Run **{md(selection.run)}** has not logged any step yet. It will appear here once it does.")
        st.stop()
    return selection


def show_error(what: str, error: Exception) -> None:
    """A failed query (damaged file, run deleted meanwhile...) is reported without taking the page down."""
    st.error(f"Could not read {md(what)}: {type(error).__name__}: {md(error)}")


def load(what: str, function, *args, **kwargs):
    """Call a query; on failure show why and stop this page (the sidebar and other pages keep working)."""
    try:
        return function(*args, **kwargs)
    except Exception as error:  # a damaged Parquet file, a vanished run, a DuckDB error: all shown, none fatal
        show_error(what, error)
        st.stop()


def train_groups(selection: Selection):
    """(group summary, train rollouts) of the selected step (dashboard.queries), or stop the page saying there are
    none."""
    from dashboard import queries

    summary = load("the groups", queries.group_summary, selection.logs_dir, selection.run, selection.step)
    rollouts = load("the rollouts", queries.step_rollouts, selection.logs_dir, selection.run, selection.step, "train")
    if summary.empty or rollouts.empty:
        st.info(f"Step {selection.step} of {md(selection.run)} has no train groups.")
        st.stop()
    return summary, rollouts


def group_picker(container, summary, state_key: str) -> int:
    """A selectbox of the step's train groups labelled with their outcome, defaulting to the first mixed one (a group
    with signal), started from the URL's `group`; the caller mirrors the choice back into the URL."""
    group_ids = [int(g) for g in summary["group_id"]]
    mixed = summary[summary["outcome"] == "mixed"]["group_id"]
    outcome_of = dict(zip(summary["group_id"], summary["outcome"], strict=True))
    group_id, _ = initial_value(state_key, "group", int, group_ids, int(mixed.iloc[0]) if len(mixed) else group_ids[0])
    st.session_state[state_key] = group_id
    return container.selectbox("Group", group_ids, key=state_key, format_func=lambda g: f"group {g} · {outcome_of[g]}")
