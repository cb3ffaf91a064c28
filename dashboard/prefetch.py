"""The views a user is likely to ask for next (the steps next to the one on screen), computed while they look.

A page whose step costs seconds of server work (Algorithm weighting on a whole step of long completions, Mismatch's
corrections) hands `ahead` a function that asks its cached queries for one guess (a step, or a step and a scope),
exactly as the page would with its current choices. Once the page is drawn, one thread of the server calls it for
each guess in turn: moving the step slider by one (a key press) then finds every answer in the caches. What is
computed is only what the caches keep anyway, so a guess that goes unused costs CPU time, never memory beyond theirs.

The thread gives way to the user: it starts a guess only once no script has run (in any session) for `QUIET_S`,
the time the browser takes to draw what the script sent, and a newer page's request replaces one not started. A
guess under way stops at its next `give_way` (its work calls it between its cached calls) when a script is running
or has started since the guess did (`script_started`, called by the app at the top of every run: a short script can
start and end between two `give_way`s, and the guess then held the interpreter while the server sent that script's
page), and at once when a page asks for the reader while the guess's query runs (the query is interrupted): it is done
again later, what it finished found in the caches, unless a newer request replaced its own. A guess
whose work fails is left to the page, which reports the error when it asks itself. No Streamlit calls here: what
`work` calls runs outside any session (cached functions only).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import duckdb

SCRIPT_THREAD = "ScriptRunner.scriptThread"
"""The name Streamlit gives the thread of a script run (streamlit.runtime.scriptrunner.script_runner): one lives
while a session's script (or fragment) runs."""
QUIET_S = 1.0
"""Seconds without a script run before a guess starts: after a script ends the browser still draws what it sent
(about a second for the heavy pages on two cores), and a user who acts at once does not wait for a guess."""
POLL_S = 0.05
THREAD = "policylens-prefetch"
T = TypeVar("T")

_log = logging.getLogger(__name__)
_condition = threading.Condition()
_pending: list[tuple[int, Callable[[Any], object], list]] = []  # at most one request: (number, work, guesses left)
_requests = 0  # how many requests `ahead` took: the number of the newest one
_busy = False  # the thread is inside some work
_last_script = 0.0  # time.monotonic() when a script was last seen running
_scripts = 0  # how many scripts `script_started` saw start
_scripts_at_guess = 0  # `_scripts` when the guess under way started
_thread: threading.Thread | None = None


class _WithoutSession(logging.Filter):
    """Streamlit warns ("missing ScriptRunContext") whenever a thread without a session reaches a cached function's
    spinner: the prefetch thread has none by design, and would fill the server's log with it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD


logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context").addFilter(_WithoutSession())


def neighbours(steps: Sequence[int], step: int) -> list[int]:
    """The steps a one-key move of the step slider reaches from `step`: the next logged one, then the previous."""
    if step not in steps:
        return []
    at = list(steps).index(step)
    return [steps[i] for i in (at + 1, at - 1) if 0 <= i < len(steps)]


def ahead(work: Callable[[Any], object], guesses: Sequence) -> None:
    """Call `work(guess)` for each of `guesses`, in order, on the server's prefetch thread, each once no script has
    run for `QUIET_S`. Replaces a request whose guesses have not started."""
    global _thread, _last_script, _requests
    with _condition:
        _last_script = time.monotonic()  # the caller's
        _requests += 1
        _pending[:] = [(_requests, work, list(guesses))] if guesses else []
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name=THREAD, daemon=True)
            _thread.start()
        _condition.notify_all()


class GaveWay(Exception):
    """Raised by `give_way`: the guess under way stopped for a user's script."""


def guessing() -> bool:
    """Whether the calling thread is the one that makes the guesses (the dashboard's reader interrupts its queries
    when a page asks for the reader: `engine.runlog.RunReader`'s `gives_way`)."""
    return threading.current_thread().name == THREAD


def give_way() -> None:
    """For a guess's work to call between its steps: raises GaveWay (on the prefetch thread only) when some
    session's script is running or has started since the guess did, so that the user's page has the cores and the
    server's interpreter while it sends the page; the guess is done again later, its finished steps found in the
    caches. Does nothing in any other thread (a page calling the same function)."""
    if guessing() and (_scripts != _scripts_at_guess or script_running()):
        raise GaveWay


def script_started() -> None:
    """For the app to call first in every script run: a guess under way gives way at its next `give_way`, and the
    next one waits `QUIET_S` from now, even when this script ends before the prefetch thread looks."""
    global _scripts, _last_script
    with _condition:
        _scripts += 1
        _last_script = time.monotonic()


class LastInputs:
    """For an input too big to cache many of (a whole step of long completions as tensors: ~100 MB), the last one
    the pages asked for and the last one a guess asked for, kept under their key: a page that asks for the key a
    guess read (the user moved to the guessed view while or after it was computed) takes that one as its own, and
    two threads asking for the same key read it once, the second waiting for the first. One read per key at a time;
    an entry older than `ttl` seconds is read again (a live run's step may have grown meanwhile)."""

    def __init__(self, ttl: float):
        self._ttl = ttl
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Any, float, Any]] = {}  # "page" / "guess" -> (key, when read, value)
        self._reading: dict[Any, threading.Lock] = {}  # key -> the lock of its read under way

    def get(self, key, read: Callable[[], Any]):
        """The value of `key`: a held one, else `read()` (kept as the page's or as the guess's, by the thread)."""
        holder = "guess" if guessing() else "page"
        with self._lock:
            reading = self._reading.setdefault(key, threading.Lock())
        with reading:
            try:
                with self._lock:
                    for held in self._held.values():
                        if held[0] == key and time.monotonic() - held[1] < self._ttl:
                            self._held[holder] = held
                            return held[2]
                value = read()
                with self._lock:
                    self._held[holder] = (key, time.monotonic(), value)
                return value
            finally:
                with self._lock:
                    if self._reading.get(key) is reading:
                        del self._reading[key]


def giving_way(items: Iterable[T]) -> Iterator[T]:
    """`items`, calling `give_way` before each: a guess's long loop (a step's corrections, chunk by chunk) stops
    within one item of a user's script starting, where stopping only between cached calls kept the user's page
    waiting for the rest of the loop (0.3-0.8 s on a step of long completions)."""
    for item in items:
        give_way()
        yield item


def settled(timeout: float) -> bool:
    """Wait until every request is done (for tests and benchmarks); False if `timeout` seconds passed first."""
    deadline = time.monotonic() + timeout
    with _condition:
        return _condition.wait_for(lambda: not _pending and not _busy, max(0.0, deadline - time.monotonic()))


def script_running() -> bool:
    """Whether some session's script is running in this process."""
    return any(thread.name == SCRIPT_THREAD for thread in threading.enumerate())


def _next_guess() -> tuple[int, Callable[[Any], object], Any]:
    """Wait for a request and for `QUIET_S` without a script run; take its next guess: (the request's number, its
    work, the guess)."""
    global _busy, _last_script, _scripts_at_guess
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
            number, work, guesses = _pending[0]
            guess = guesses.pop(0)
            if not guesses:
                _pending.clear()
            _busy = True
            _scripts_at_guess = _scripts
            return number, work, guess


def _put_back(number: int, work: Callable[[Any], object], guess) -> None:
    """Make `guess` of request `number` the next one again, unless a newer request replaced that request."""
    with _condition:
        if number != _requests:
            return
        if _pending:  # the request's guesses after this one
            _pending[0][2].insert(0, guess)
        else:
            _pending.append((number, work, [guess]))


def _serve() -> None:
    while True:
        number, work, guess = _next_guess()
        try:
            work(guess)
        except (GaveWay, duckdb.InterruptException):  # gave way between its steps, or a page stopped its query
            _put_back(number, work, guess)
        except Exception:  # the page asks again when the user gets there, and shows what fails
            _log.debug("prefetching %r failed", guess, exc_info=True)
