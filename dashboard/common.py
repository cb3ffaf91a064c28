"""What every page shares: the logs folder, the run and step being looked at, error display.

The run and step live in `st.session_state` (driven by the sidebar pickers) and are mirrored into the URL's query
parameters on every rerun, so any view can be bookmarked or shared; a new session starts from the URL.
Page-specific parameters (rollout, channel, pass, group, ...) go through `url_value` / `set_url_value`.
"""

from __future__ import annotations

import ctypes
import functools
import json
import numbers
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from dashboard.data import RunOverview
from dashboard.tokens import is_missing, number, plain  # noqa: F401  (pages use them through common)

LOGS_DIR_ENV = "POLICYLENS_LOGS_DIR"


def logs_dir(argv: list[str] | None = None) -> str:
    """Absolute logs folder: `--logs-dir DIR` after `--` on the streamlit command line (the app's arguments, or
    `argv`), else the environment."""
    argv = sys.argv[1:] if argv is None else argv
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


# Every ASCII punctuation character may be backslash-escaped in CommonMark, and escaping all of them leaves no
# formatting, link, image, HTML, table, heading or `$...$` formula that a logged string could start.
_ASCII_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")
# Escaping does not stop GitHub-flavoured markdown from turning bare `http://...`, `www.…` and `a@b.c` into links, nor
# Streamlit from turning `:name:` into an emoji or icon: those are matched in the text after unescaping. An invisible
# word joiner after every ':' and '@' and between 'www' and '.' breaks each pattern without changing what is read.
_LINK_STARTS = re.compile(r"[:@]|(?i:www)(?=\.)")
WORD_JOINER = "\u2060"


def md(value) -> str:
    """Logged or URL-supplied text made literal for Streamlit's markdown (captions, headers, warnings, errors).

    The one way any logged string (prompt, completion, answer, filter reason, task, error message...) may enter a
    markdown element: it is shown as its characters, never as a link, an image fetched from anywhere, a formula or
    formatting. A missing value (None, NaN, NA) reads as "–". Whole blocks of logged text use `st.text`/`st.code`
    instead, and token text never goes through markdown at all (see tokens.py)."""
    if is_missing(value):
        return "–"
    text = _LINK_STARTS.sub(lambda match: match.group(0) + WORD_JOINER, str(value))
    return _ASCII_PUNCTUATION.sub(r"\\\1", text)


def static_table(container, frame, formats: dict[str, str] | None = None, max_rows: int = 30) -> None:
    """A small table drawn as static HTML (`st.table`), for the tables redrawn at every step or knob change:
    chromium draws a few rows in milliseconds, an interactive `st.dataframe` (a canvas grid) in about 70 ms on a
    2-core machine. But each cell of `st.table` is a markdown element, so a long table costs far more than the
    grid (400 rows: 2 s): more than `max_rows` rows go to `st.dataframe`. `st.table` renders markdown in every cell
    and header, so each one goes through `md`; numbers are formatted with `formats[column]` (default: whole
    numbers as such, others to 4 significant digits); a missing value reads "–"."""
    if len(frame) > max_rows:
        container.dataframe(frame, hide_index=True)
        return
    formats = formats or {}

    def cell(value, spec: str | None) -> str:
        if is_missing(value):
            return "–"
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            return md(value)
        if spec is None:
            spec = "d" if float(value).is_integer() and abs(value) < 1e15 else ".4g"
            value = int(value) if spec == "d" else value
        return md(format(value, spec))

    shown = pd.DataFrame({md(name): [cell(v, formats.get(name)) for v in frame[name]] for name in frame.columns})
    container.table(shown, hide_index=True)


def dashed(frame: pd.DataFrame, formats: dict[str, str] | None = None) -> pd.DataFrame:
    """A table for `st.dataframe` whose missing cells read "–" (as the README promises), not "None": a text column
    with a missing value gets "–" there; a number column with one becomes text, its numbers formatted with
    `formats[column]` (default 4 significant digits). Columns without a missing value are left as they are (numbers
    stay numbers, sortable and formatted by the column config)."""
    formats = formats or {}
    out = frame.copy()
    for name in frame.columns:
        missing = frame[name].map(is_missing)
        if not missing.any():
            continue
        spec = formats.get(name, ".4g")
        out[name] = [("–" if gone else format(v, spec) if isinstance(v, numbers.Real) and not isinstance(v, bool)
                      else str(v)) for v, gone in zip(frame[name], missing, strict=True)]
    return out


def latest_steps_within(steps: list[int], tokens_per_step: dict[int, int], budget: int) -> int:
    """The first of the latest `steps` whose tokens add up to at most `budget` (the last step at least)."""
    first, total = steps[-1], 0
    for step in reversed(steps):
        total += tokens_per_step.get(step, 0)
        if total > budget:
            break
        first = step
    return first


def flag(value) -> bool:
    """A logged boolean that may be NULL (a column the logger left out): only a real True counts."""
    return not is_missing(value) and bool(value)


def reward_breakdown(rollout) -> str:
    """"reward R = name v + name v ...": a rollout's total reward and its parts, as plain text (pass it through `md`).

    The parts are the logged `reward_components` (a JSON object, one value per reward function, e.g. a TRL run's)
    when present, else the engine's correct / process / length terms."""
    def value(v) -> str:
        return number(v) if is_missing(v) or (isinstance(v, numbers.Real) and not isinstance(v, bool)) else "unreadable"

    components = getattr(rollout, "reward_components", None)
    if isinstance(components, str):
        try:
            parsed = json.loads(components)
        except ValueError:
            parsed = None
        parts = list(parsed.items()) if isinstance(parsed, dict) else [("components", "unreadable")]
    else:
        parts = [("correct", rollout.reward_correct), ("process", rollout.reward_process),
                 ("length", rollout.reward_length)]
        parts = [(name, v) for name, v in parts if name != "process" or not is_missing(v)]
    return f"reward {value(rollout.reward)} = " + " + ".join(f"{name} {value(v)}" for name, v in parts)


M_MMAP_THRESHOLD = -3  # glibc's malloc.h
LARGE_BLOCK_BYTES = 1 << 20


@functools.cache
def release_large_blocks() -> bool:
    """Have glibc's malloc give every freed block of 1 MB or more back to the system at once (a fixed mmap
    threshold), for the server's life; True where it took effect (False where malloc is not glibc's).

    By default glibc raises that threshold to the size of the largest block freed so far (up to 32 MB), after which
    a page's (B, T) arrays of a step of long completions come from the heap, and the server keeps their memory once
    the page is drawn, so the next page's peak starts higher. On the Algorithm weighting page over a whole step of
    256 completions of up to 16k tokens (AppTest): resident afterwards 0.55 instead of 1.1-1.3 GB, peak 1.04
    instead of 1.24-1.33 GB."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES) == 1
    except (OSError, AttributeError):
        return False


@functools.cache
def app_icon():
    """The browser tab's icon, drawn here: a Material or emoji `page_icon` makes the browser fetch it from a font
    or emoji CDN on every page, and the dashboard must work offline without a single outbound request."""
    from PIL import Image, ImageDraw

    icon = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    draw = ImageDraw.Draw(icon)
    draw.ellipse((4, 4, 48, 48), outline=(31, 119, 180, 255), width=7)  # a lens...
    draw.line((42, 42, 60, 60), fill=(31, 119, 180, 255), width=9)  # ...with its handle
    draw.rectangle((16, 28, 21, 37), fill=(214, 39, 40, 255))  # and three bars of a chart inside it
    draw.rectangle((24, 20, 29, 37), fill=(44, 160, 44, 255))
    draw.rectangle((32, 14, 37, 37), fill=(255, 127, 14, 255))
    return icon


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
    """The run and step chosen in the sidebar, with the run's row of the runs table parsed once (`info`, its
    config included), so no page reads or parses it again."""

    logs_dir: str
    info: RunOverview
    step: int | None
    steps: tuple[int, ...]

    @property
    def run(self) -> str:
        return self.info.run

    @property
    def status(self) -> str:
        return self.info.status

    @property
    def algorithm(self) -> str:
        return self.info.algorithm

    @property
    def task(self) -> str:
        return self.info.task

    @property
    def config(self) -> dict:
        """The run's config ({} when none was logged or it is unreadable)."""
        return self.info.config

    @property
    def version(self) -> tuple:
        """Changes whenever the run gets a new step or status: keys run-wide caches."""
        return self.info.version


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
    if (lacks := imported_lacks(selection.config)) is not None:
        st.caption(lacks)
    return selection


def imported_lacks(config: dict) -> str | None:
    """What a run imported from another trainer's dumps lacks, from its config (None for a run PolicyLens trained)."""
    source = config.get("import")
    if not isinstance(source, dict):
        return None
    name = md(str(source.get("source", "another trainer")))
    logps = ("no log-probs (the dump holds text and rewards only; tokens only with --tokenizer)"
             if name in ("trl", "verl") else "the sampler's and the trainer's log-probs per token, no reference "
             "log-probs unless the dump had them")
    return (f"Imported from {name} dumps: {logps}; no optimisation passes (no new log-prob, ratio, clip event, "
            "gradient weight or token loss per pass), so Algorithm weighting recomputes every algorithm from the "
            "logged log-probs and advantages, and Replay has nothing of the trainer's own to replay.")


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


# The bins of token positions a per-token figure of long completions gets (DuckDB bins them): about a pixel each on
# a wide page; completions of at most this many tokens get one bin per token.
SCREEN_BINS = 1000
PANEL_BINS = SCREEN_BINS // 3  # a heatmap in a figure of three panels a row (a 16k-token completion: ~50 a bin)


def page_of(container, frame: pd.DataFrame, rows: int, key: str) -> pd.DataFrame:
    """The rows of `frame` on the page a "Page" number input (drawn only when there is more than one) picks: a long
    table goes to the browser `rows` at a time."""
    pages = max(1, -(-len(frame) // rows))
    page = container.number_input(f"Page (of {pages})", 1, pages, 1, key=key) if pages > 1 else 1
    return frame.iloc[(page - 1) * rows: page * rows]


def train_groups(selection: Selection):
    """(group summary, train rollouts without their texts: `data.ROLLOUT_NUMBERS`) of the selected step
    (dashboard.queries), or stop the page saying there are none."""
    from dashboard import queries

    summary = load("the groups", queries.group_summary, selection.logs_dir, selection.run, selection.step)
    rollouts = load("the rollouts", queries.step_rollout_numbers, selection.logs_dir, selection.run, selection.step,
                    "train")  # without their texts: no page that picks a group draws its completions
    rollouts = rollouts[rollouts["rollout_id"].notna()]  # without an id a rollout's tokens cannot be found
    summary = summary[summary["group_id"].notna()]  # rollouts logged without a group_id still count for the whole step
    if rollouts.empty:
        st.info(f"Step {selection.step} of {md(selection.run)} has no train rollouts with a rollout_id.")
        st.stop()
    return summary, rollouts


def group_picker(container, summary, state_key: str) -> int | None:
    """A selectbox of the step's train groups labelled with their outcome, defaulting to the first mixed one (a group
    with signal), started from the URL's `group`; the caller mirrors the choice back into the URL. None when no
    rollout of the step was logged with a group."""
    group_ids = [int(g) for g in summary["group_id"]]
    if not group_ids:
        container.caption("No rollout of this step was logged with a group_id.")
        return None
    mixed = summary[summary["outcome"] == "mixed"]["group_id"]
    outcome_of = dict(zip(summary["group_id"], summary["outcome"], strict=True))
    group_id, _ = initial_value(state_key, "group", int, group_ids, int(mixed.iloc[0]) if len(mixed) else group_ids[0])
    st.session_state[state_key] = group_id
    return container.selectbox("Group", group_ids, key=state_key, format_func=lambda g: f"group {g} · {outcome_of[g]}")
