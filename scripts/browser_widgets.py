"""Change every widget a dashboard page shows, in a real browser, and fail on any exception or error box.

Used by tests/test_browser_widgets.py (every page, every widget, on a served `policylens dashboard`) and by
benchmarks/bench_browser.py (which times the same changes). The widgets are found in the page itself, not in a
hand-kept list, so a widget added to a page is exercised the day it is added.

How "the app has finished" is known: Streamlit's own messages. A `ServerWatch` reads every message the server sends
on the page's websocket (Streamlit's `ForwardMsg` protobuf) and counts the script runs reported finished, full runs
and fragment runs alike; the running indicator in the page can come and go between two polls of a fast fragment run
and so cannot be trusted alone. The same messages carry every exception and `st.error` the script drew.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import expect

QUIET_MS = 300
"""A change is drawn once nothing in the document changed for this long after the script finished."""
LOAD_QUIET_MS = 1000
"""The same for a page load, whose first tables and charts wait for their code to be fetched."""

WIDGETS = ("stSelectbox", "stMultiSelect", "stSlider", "stRadio", "stCheckbox", "stNumberInput", "stTextInput",
           "stTextArea", "stButton", "stDownloadButton", "stButtonGroup", "stDataFrame")
"""Streamlit's test ids of the widgets a page can show (a `stDataFrame` counts when it has editable cells)."""

# Installed before any script of the page: the time of the latest change to the document, and of the latest key
# pressed (the moment of a keyboard action, after the driver found and focused its widget). A change inside a
# <canvas> does not count: a canvas's content is its fallback, never shown where canvases are drawn. There the table
# widget (glide-data-grid) keeps an accessible copy of its cells, which it rewrites about 250 ms after drawing them.
WATCH_MUTATIONS = """
window.__lastChange = performance.now();
{
  const shown = (record) => {
    const node = record.type === 'attributes' ? record.target.parentElement
        : record.target.nodeType === Node.ELEMENT_NODE ? record.target : record.target.parentElement;
    return !node?.closest('canvas');
  };
  new MutationObserver((records) => { if (records.some(shown)) window.__lastChange = performance.now(); })
      .observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
}
document.addEventListener("keydown", () => { window.__lastKey = performance.now(); }, true);
"""

# The widgets of the main area, then the sidebar's (changing the run there changes every other widget), in document
# order; an editable table counts, a read-only one does not; hidden ones (a collapsed expander) do not.
ALL_WIDGETS = """
(ids) => {
  const out = [];
  for (const area of ['stMain', 'stSidebar']) {
    const root = document.querySelector(`[data-testid="${area}"]`);
    if (!root) continue;
    for (const el of root.querySelectorAll(ids.map(id => `[data-testid="${id}"]`).join(','))) {
      const readOnlyTable = el.dataset.testid === 'stDataFrame'
          && !el.querySelector('td[role="gridcell"][aria-readonly="false"]');
      if (readOnlyTable || el.offsetParent === null) continue;
      out.push([area, el]);
    }
  }
  return out;
}
"""
FIND_WIDGETS = f"""
(ids) => {{
  const seen = {{}};
  return ({ALL_WIDGETS})(ids).map(([area, el], index) => {{
    const kind = el.dataset.testid;
    el.dataset.plWidget = index;  // for `change` to find it
    const labelled = el.querySelector('label, [data-testid="stWidgetLabel"]');
    let label = (labelled ? labelled.innerText : el.innerText || '').trim().split('\\n')[0].slice(0, 60);
    if (!label) label = el.getAttribute('aria-label') || '';
    let name = `${{area === 'stMain' ? 'main' : 'sidebar'}}: ${{kind}} "${{label}}"`;
    seen[name] = (seen[name] || 0) + 1;
    if (seen[name] > 1) name += ` #${{seen[name]}}`;
    return {{name, kind, index}};
  }});
}}
"""


@dataclass
class ServerWatch:
    """What the server said on the page's websocket: finished script runs, exceptions and error boxes."""

    finished: int = 0
    running: bool = False
    last_message: float = field(default_factory=time.monotonic)
    action_started: float = 0.0  # time.monotonic() of the last widget change `change_every_widget` made
    statuses: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, page) -> ServerWatch:
        page.on("websocket", self._on_socket)
        page.add_init_script(WATCH_MUTATIONS)
        return self

    def _on_socket(self, socket) -> None:
        if "_stcore/stream" in socket.url:
            socket.on("framereceived", self._on_frame)

    def _on_frame(self, payload) -> None:
        from streamlit.proto.Alert_pb2 import Alert
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        if isinstance(payload, str):
            return
        message = ForwardMsg()
        try:
            message.ParseFromString(payload)
        except Exception:  # not a message of this Streamlit version: say so rather than miss problems silently
            with self._lock:
                self.problems.append("a websocket frame that is not a ForwardMsg")
            return
        kind = message.WhichOneof("type")
        with self._lock:
            self.last_message = time.monotonic()
            if kind == "session_status_changed":
                self.running = message.session_status_changed.script_is_running
            elif kind == "script_finished":
                self.finished += 1
                self.statuses.append(ForwardMsg.ScriptFinishedStatus.Name(message.script_finished))
            elif kind == "delta" and message.delta.WhichOneof("type") == "new_element":
                element = message.delta.new_element
                if element.WhichOneof("type") == "exception":
                    self.problems.append(f"exception {element.exception.type}: {element.exception.message}")
                elif element.WhichOneof("type") == "alert" and element.alert.format == Alert.ERROR:
                    self.problems.append(f"error box: {element.alert.body}")

    def count(self) -> int:
        with self._lock:
            return self.finished

    def idle(self, runs_before: int | None, quiet_s: float = 0.0) -> bool:
        """Whether a script run finished since `runs_before` (None: no run expected), none is running now, and the
        server said nothing for `quiet_s` (a page's first run can be followed by another one)."""
        with self._lock:
            return ((runs_before is None or self.finished > runs_before) and not self.running
                    and time.monotonic() - self.last_message > quiet_s)

    def take_problems(self) -> list[str]:
        with self._lock:
            problems, self.problems = self.problems, []
            return problems


def page_problems(page) -> list[str]:
    """Exceptions and error boxes drawn in the page right now (the server's messages are the first witness), and
    figures with a trace plotly.js drew as another type than asked (a served plotly.js without that trace type,
    dashboard/plotly_bundle.py: plotly draws an unknown type as an empty scatter, silently)."""
    return page.eval_on_selector_all(
        '[data-testid="stException"], [data-testid="stAlertContentError"]',
        "els => els.map(e => e.innerText.slice(0, 300))") + page.eval_on_selector_all(
        ".js-plotly-plot", """plots => plots.flatMap(gd => (gd._fullData || [])
            .filter(t => (gd.data[t.index].type || 'scatter') !== t.type)
            .map(t => `a ${gd.data[t.index].type} trace drawn as ${t.type}: the served plotly.js lacks the type`))""")


# The page clock, the time of its last change, and whether it still shows work under way: Streamlit's running
# indicator, a skeleton where an element's code is still being fetched, or a figure on screen that plotly.js has
# not drawn yet (dashboard/figure.js: plotly.js itself may still be on its way; plotly marks a plot it drew with the
# class js-plotly-plot). Without the last, a first load whose plotly.js took over a second to arrive (the server
# busy) was taken as done before its figures were drawn.
PAGE_STATE = """() => [performance.now(), window.__lastChange,
    document.querySelectorAll('[data-testid="stStatusWidget"], [data-testid="stSkeleton"]').length > 0
    || [...document.querySelectorAll('.policylens-figure:not(.js-plotly-plot)')].some((plot) => {
        const box = plot.getBoundingClientRect();
        return box.width > 0 && box.bottom > -200 && box.top < window.innerHeight + 200;
    })]"""


def wait_idle(page, watch: ServerWatch, runs_before: int | None, timeout_s: float = 60.0,
              quiet_ms: float = QUIET_MS) -> None:
    """Wait until the script runs an action started have finished and the page stopped changing.

    `runs_before`: the finished-run count before the action; None for an action that starts no script run (a
    download). Generous deadline: this waits for work to end, it does not time it."""
    deadline = time.monotonic() + timeout_s
    while not watch.idle(runs_before):
        if time.monotonic() > deadline:
            raise TimeoutError("the app never reported the script run this change should start")
        page.wait_for_timeout(50)
    while time.monotonic() < deadline:
        now, last, running = page.evaluate(PAGE_STATE)
        if not running and now - last > quiet_ms and watch.idle(runs_before, quiet_ms / 1000):
            return
        page.wait_for_timeout(50)
    raise TimeoutError("the page never became idle")


def find_widgets(page) -> list[dict]:
    return page.evaluate(FIND_WIDGETS, list(WIDGETS))


# Glide Data Grid, behind st.data_editor, draws the table on a canvas and keeps an accessible <table> mirror of it
# inside the canvas element: its cells say which one is selected and which are editable, and keys pressed with the
# focus on one of them reach the grid's own key handler (the canvas is their ancestor). So a cell is edited with the
# keyboard, as a person without a mouse would: arrow keys to the cell, Enter opens its editor, type, Enter commits.
# (Focusing a mirror cell selects it too, but not always: the grid ignores the focus of the cell it saw focused last.)
EDITABLE_CELL = 'td[role="gridcell"][aria-readonly="false"]'
GRID_EDITOR = """() => ['INPUT', 'TEXTAREA'].includes(document.activeElement.tagName)
    && document.activeElement.closest('.gdg-clip-region') !== null"""  # the cell editor the grid opened, focused


GRID_ROW_PX = 35  # st.data_editor's header and row height in CSS pixels


def _selected_cell(table) -> tuple[int, int] | None:
    """(column, row) of the grid's selected cell, as its mirror says (a moment late: the mirror is redrawn 0.2 s
    after the grid changed); None before anything is selected."""
    ids = table.locator('td[aria-selected="true"]').evaluate_all("cells => cells.map(c => c.id)")
    return tuple(int(n) for n in ids[0].rsplit("-", 2)[1:]) if ids else None


def _walk_to_cell(page, table, cell, deadline: float) -> None:
    """Select `cell` (a mirror td) with arrow keys, one key at a time, each awaited in the mirror."""
    target = tuple(int(n) for n in cell.get_attribute("id").rsplit("-", 2)[1:])
    other = table.locator(f'td[role="gridcell"]:not([id="{cell.get_attribute("id")}"])').first
    focus_attempts, stuck = 0, False
    while (at := _selected_cell(table)) != target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the grid's selection never reached cell {target} (at {at})")
        if stuck or at is None or not cell.evaluate(
                "cell => cell.closest('canvas').contains(document.activeElement)"):
            # keys reach the grid only while it has the focus (a rerun can redraw it): it takes the focus, and
            # selects a cell of its choice. It ignores the focus of the cell it saw focused last, and after another
            # widget of the page changed a focused mirror cell can select nothing or take no key at all, so the
            # attempts alternate: focus the cell, click the middle of the target's row (a click selects a cell
            # and gives the grid the keyboard; the arrow keys then walk from it), focus another cell.
            if focus_attempts % 3 == 1 and (box := table.locator("canvas").first.bounding_box()):
                page.mouse.click(box["x"] + box["width"] / 2, box["y"] + (target[1] + 1.5) * GRID_ROW_PX)
            else:
                (other if focus_attempts % 3 == 2 and other.count() else cell).evaluate("cell => cell.focus()")
            focus_attempts += 1
        else:
            page.keyboard.press("ArrowRight" if at[0] < target[0] else "ArrowLeft" if at[0] > target[0]
                                else "ArrowDown" if at[1] < target[1] else "ArrowUp")
        # until the mirror shows the move (it can also show a move made before this one: the loop reads it again),
        # or for 2 s: a focus or a key the grid ignored (stuck) is followed by another focus attempt
        moved_by = min(deadline, time.monotonic() + 2.0)
        page.wait_for_timeout(50)
        while _selected_cell(table) == at and time.monotonic() < moved_by:
            page.wait_for_timeout(50)
        stuck = _selected_cell(table) == at


def _edit_first_editable_cell(page, table, name: str, attempts: int = 3, timeout_s: float = 30.0) -> None:
    """Give the first editable cell of the table a new value, and wait until the grid shows it (the script run the
    edit starts is then awaited as for any widget). Raises AssertionError when the grid did not take it.

    Measured on a loaded 2-core machine, about one edit in ten is dropped by the grid itself: the editor opened on
    the right cell, held the typed value, and Enter closed it without a change (no message to the server either);
    once in a whole suite, the Enter on the selected cell opened no editor at all, and once in five benchmark sweeps
    the editor closed before it held the typed value (30 s of waiting). Such an edit is made again, with
    a warning, up to `attempts` times; one the app saw and failed on is not."""
    cell = table.locator(EDITABLE_CELL).first
    if not cell.count():
        raise LookupError(f"{name}: no editable cell")
    cell_id = cell.get_attribute("id")
    shown = table.locator(f'td[id="{cell_id}"]')
    value = "0.25" if cell.text_content().strip() == "0.5" else "0.5"  # a value the cell does not hold yet
    for attempt in range(1, attempts + 1):
        _walk_to_cell(page, table, cell, time.monotonic() + timeout_s)
        page.keyboard.press("Enter")
        try:
            page.wait_for_function(GRID_EDITOR, timeout=timeout_s * 1000)
            page.keyboard.press("Control+a")
            page.keyboard.type(value)
            page.wait_for_function("value => document.activeElement.value === value", arg=value,
                                   timeout=timeout_s * 1000)
        except PlaywrightTimeoutError:  # no editor opened, or it closed before it held the value (a rerun redrew
            # the grid and took the keyboard): again
            warnings.warn(f"{name}: no editor holding the value on cell {cell_id} (attempt {attempt} of "
                          f"{attempts})", stacklevel=2)
            continue
        # The editor's value is in the DOM before the grid's own state has it: Enter pressed in between closes the
        # editor with the old value (an edit the grid drops). Two animation frames let the grid take the value.
        page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")
        page.evaluate("() => { window.__committed = performance.now(); }")  # where a person's edit starts
        page.keyboard.press("Enter")
        try:
            expect(shown).to_have_text(value, timeout=timeout_s * 1000 / attempts)
            return
        except AssertionError:
            if page.evaluate(GRID_EDITOR):
                page.keyboard.press("Escape")
            warnings.warn(f"{name}: the grid dropped the edit of cell {cell_id} (attempt {attempt} of {attempts})",
                          stacklevel=2)
    raise AssertionError(f"{name}: the grid never showed the new value {value} in cell {cell_id}")


# The options of an open dropdown not chosen yet (not "select all", not the "No results" line).
OTHER_OPTIONS = '[role="listbox"] [role="option"][aria-selected="false"]:not([data-key="__select_all__"])'
# Said when an open list shows its options, just before one is chosen: the list took until then to open (timed on its
# own), and the choice, where a person's change starts, is timed from then like a table edit from its Enter.
LIST_OPEN = "() => { window.__listOpen = window.__committed = performance.now(); }"
FROM_ENTER, OPENING_THE_LIST, FROM_THE_CHOICE = PARTS = (", from the edit's Enter", ", opening the list",
                                                         ", from the choice")
"""What `change_every_widget` appends to a widget's name for a part of its change."""


def change(page, widget: dict) -> bool:
    """Change `widget` (from `find_widgets`, fresh) to another value as a person would. Returns whether the change
    starts a script run (a download does not). Raises LookupError when the widget offers no other value."""
    handle = page.locator(f'[data-pl-widget="{widget["index"]}"]')
    if handle.count() != 1:
        raise LookupError(f"{widget['name']} is no longer on the page")
    handle.scroll_into_view_if_needed()
    kind = widget["kind"]
    if kind == "stSelectbox":
        handle.locator('[role="combobox"], input').first.click()
        option = page.locator(OTHER_OPTIONS).first
        option.wait_for(timeout=10_000)
        page.evaluate(LIST_OPEN)
        option.click()
    elif kind == "stMultiSelect":  # add the first option not chosen; with every option chosen, remove one
        handle.locator("input").first.click()
        page.locator('[role="listbox"]').first.wait_for(timeout=10_000)
        options = page.locator(OTHER_OPTIONS)
        if options.count():
            page.evaluate(LIST_OPEN)
            options.first.click()
        else:
            page.keyboard.press("Escape")
            remove = handle.locator('button[aria-label^="Remove "]')
            if not remove.count():
                raise LookupError(f"{widget['name']} has no option to add or remove")
            page.evaluate(LIST_OPEN)  # the list looked at; the click on a chosen option's "x" is the choice
            remove.first.click()
        page.keyboard.press("Escape")
    elif kind == "stSlider":  # one key press on its (first) thumb: right, or left from the end
        thumb = handle.locator('input[type="range"]').first
        at_end = thumb.input_value() == thumb.get_attribute("max")
        thumb.focus()
        page.keyboard.press("ArrowLeft" if at_end else "ArrowRight")
    elif kind == "stRadio":
        handle.locator('label:has(input:not(:checked))').first.click()
    elif kind == "stCheckbox":
        if handle.locator("input").first.is_disabled():
            raise LookupError(f"{widget['name']} is disabled")
        handle.locator("label").first.click()
    elif kind == "stNumberInput":
        up = handle.locator('[data-testid="stNumberInputStepUp"]')
        (up if up.is_enabled() else handle.locator('[data-testid="stNumberInputStepDown"]')).click()
    elif kind in ("stTextInput", "stTextArea"):
        field_ = handle.locator("input, textarea").first
        field_.fill("x")
        field_.press("Control+Enter" if kind == "stTextArea" else "Enter")
    elif kind == "stButton":
        handle.locator("button").first.click()
    elif kind == "stButtonGroup":
        handle.locator('button[aria-checked="false"], button:not([kind$="Active"])').first.click()
    elif kind == "stDownloadButton":
        with page.expect_download(timeout=120_000) as download:
            handle.locator("button").first.click()
        if download.value.failure():
            raise AssertionError(f"{widget['name']}: the download failed: {download.value.failure()}")
        return False
    elif kind == "stDataFrame":  # an editable table: a new value in its first editable cell
        _edit_first_editable_cell(page, handle, widget["name"])
    else:
        raise ValueError(f"no way to change a {kind}")
    return True


def change_every_widget(page, watch: ServerWatch, skip: set[str] = frozenset()):
    """Change every widget the page shows, one after the other, widgets that appear on the way included; yield
    (widget name, seconds from the action to the page's last change once idle, problems) for each, and for a table
    edit also ("<name>, from the edit's Enter", seconds from the key press that committed the edit): the first
    figure includes the driver walking the grid's selection to the cell with arrow keys, which a person's click
    does not. For a list (selectbox, multiselect) also ("<name>, opening the list", seconds from the click to its
    options shown) and ("<name>, from the choice", seconds from the click on the option or a chosen one's "x"): a
    person opens the list, reads it, then chooses; the first figure adds both with no reading between. A change that
    raised a problem is followed by a reload of the page, so the next widget starts from a working page."""
    done = set(skip)
    url = page.url
    while todo := [w for w in find_widgets(page) if w["name"] not in done]:
        widget = todo[0]
        done.add(widget["name"])
        before = watch.count()
        started = page.evaluate("() => { window.__committed = window.__listOpen = null; return performance.now(); }")
        watch.action_started = time.monotonic()
        try:
            reruns = change(page, widget)
            wait_idle(page, watch, before if reruns else None)
            problems = watch.take_problems() + page_problems(page)
        except LookupError as reason:  # nothing else to choose (one option, disabled)
            yield f"{widget['name']} (not changed: {reason})", 0.0, []
            continue
        except (AssertionError, TimeoutError, PlaywrightError) as error:  # the widget did not take the change, or
            # the app never ended its run: a failure of this widget, the next ones are still tried
            problems = [f"{type(error).__name__}: {str(error).splitlines()[0]}"]
        last, committed, list_open = page.evaluate("[window.__lastChange, window.__committed, window.__listOpen]")
        yield widget["name"], max(last - started, 0.0) / 1000, problems
        if list_open is not None and not problems:
            yield widget["name"] + OPENING_THE_LIST, max(list_open - started, 0.0) / 1000, []
            yield widget["name"] + FROM_THE_CHOICE, max(last - committed, 0.0) / 1000, []
        elif committed is not None and not problems:
            yield widget["name"] + FROM_ENTER, max(last - committed, 0.0) / 1000, []
        if problems:
            before = watch.count()
            page.goto(url)
            wait_idle(page, watch, before, quiet_ms=LOAD_QUIET_MS)
            watch.take_problems()
