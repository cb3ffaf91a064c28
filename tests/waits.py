"""Waiting in tests for work done by other processes: fail only when no progress was made for a long time.

A fixed deadline encodes a speed, and on a busy machine work that is progressing can take several times longer;
`wait_until` instead restarts its clock whenever `progress()` returns something new.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

STALL_SECONDS = 300.0
"""How long nothing may change before a wait fails: generous, as one step of a tiny run takes about a second."""


def wait_until(condition: Callable[[], bool], what: str, progress: Callable[[], Any] = lambda: None,
               stall_seconds: float = STALL_SECONDS, poll_seconds: float = 0.2) -> None:
    """Poll until `condition()` holds; raise AssertionError once `progress()` has not changed for `stall_seconds`."""
    seen = progress()
    changed = time.monotonic()
    while not condition():
        now_seen = progress()
        if now_seen != seen:
            seen, changed = now_seen, time.monotonic()
        elif time.monotonic() - changed > stall_seconds:
            raise AssertionError(f"no progress for {stall_seconds:.0f} s while waiting for {what} (last: {seen!r})")
        time.sleep(poll_seconds)
