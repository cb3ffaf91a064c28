"""The steps next to the one on screen, computed while the user looks at it.

A page whose step costs seconds of server work (Algorithm weighting on a whole step of long completions, Mismatch's
corrections) hands `ahead` a function that asks its cached queries for a given step, exactly as the page would with
its current choices. Once the page is drawn and no script runs, one thread of the server calls it for the next step,
then the previous one: moving the step slider by one (a key press) then finds every answer in the caches. What is
computed is only what the caches keep anyway, so a guess that goes unused costs CPU time, never memory beyond theirs.

The thread gives way to the user: it starts a step's work only once no script has run (in any session) for
`QUIET_S`, the time the browser takes to draw what the script sent, and a newer page's request replaces one not
started. A step whose work fails is left to the page, which reports the error when
it asks itself. No Streamlit calls here: what `work` calls runs outside any session (cached functions only).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

SCRIPT_THREAD = "ScriptRunner.scriptThread"
"""The name Streamlit gives the thread of a script run (streamlit.runtime.scriptrunner.script_runner): one lives
while a session's script (or fragment) runs."""
QUIET_S = 1.0
"""Seconds without a script run before a step's work starts: after a script ends the browser still draws what it
sent (about a second for the heavy pages on two cores), and a user who acts at once does not wait for a guess."""
POLL_S = 0.05

_log = logging.getLogger(__name__)
_condition = threading.Condition()
_pending: list[tuple[Callable[[int], object], list[int]]] = []  # at most one request: (work, steps left)
_busy = False  # the thread is inside some work
_last_script = 0.0  # time.monotonic() when a script was last seen running
_thread: threading.Thread | None = None


def neighbours(steps: Sequence[int], step: int) -> list[int]:
    """The steps a one-key move of the step slider reaches from `step`: the next logged one, then the previous."""
    if step not in steps:
        return []
    at = list(steps).index(step)
    return [steps[i] for i in (at + 1, at - 1) if 0 <= i < len(steps)]


def ahead(work: Callable[[int], object], steps: Sequence[int]) -> None:
    """Call `work(step)` for each of `steps`, in order, on the server's prefetch thread, each once no script runs.
    Replaces a request whose steps have not started."""
    global _thread, _last_script
    with _condition:
        _last_script = time.monotonic()  # the caller's
        _pending[:] = [(work, list(steps))] if steps else []
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="policylens-prefetch", daemon=True)
            _thread.start()
        _condition.notify_all()


def settled(timeout: float) -> bool:
    """Wait until every request is done (for tests and benchmarks); False if `timeout` seconds passed first."""
    deadline = time.monotonic() + timeout
    with _condition:
        return _condition.wait_for(lambda: not _pending and not _busy, max(0.0, deadline - time.monotonic()))


def script_running() -> bool:
    """Whether some session's script is running in this process."""
    return any(thread.name == SCRIPT_THREAD for thread in threading.enumerate())


def _next_step() -> tuple[Callable[[int], object], int]:
    """Wait for a request and for `QUIET_S` without a script run; take its next step."""
    global _busy, _last_script
    while True:
        with _condition:
            _busy = False
            _condition.notify_all()
            _condition.wait_for(lambda: bool(_pending))
        if script_running():  # the user is waiting for a page: do not take a core from it
            _last_script = time.monotonic()
        if time.monotonic() - _last_script < QUIET_S:
            time.sleep(POLL_S)
            continue
        with _condition:
            if not _pending:
                continue
            work, steps = _pending[0]
            step = steps.pop(0)
            if not steps:
                _pending.clear()
            _busy = True
            return work, step


def _serve() -> None:
    while True:
        work, step = _next_step()
        try:
            work(step)
        except Exception:  # the page asks again when the user gets there, and shows what fails
            _log.debug("prefetching step %s failed", step, exc_info=True)
