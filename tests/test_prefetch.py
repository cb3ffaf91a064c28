"""dashboard.prefetch: the steps next to the one on screen, computed on one thread while no script runs."""

from __future__ import annotations

import threading
import time

import pytest

from dashboard import prefetch

SETTLE_S = 60  # generous: the work below is appending to a list


def test_neighbours_are_the_next_logged_step_then_the_previous():
    assert prefetch.neighbours((0, 5, 10, 20), 10) == [20, 5]
    assert prefetch.neighbours((0, 5, 10), 10) == [5]  # the last step: no next one
    assert prefetch.neighbours((0, 5, 10), 0) == [5]
    assert prefetch.neighbours((3,), 3) == []
    assert prefetch.neighbours((0, 5), 7) == []  # a step no longer listed: nothing to guess from


@pytest.mark.usefixtures("prefetching")
def test_work_waits_while_a_script_runs_and_a_quiet_moment_after_then_runs_for_each_step_in_order():
    done = []
    release = threading.Event()
    script = threading.Thread(target=release.wait, name=prefetch.SCRIPT_THREAD, daemon=True)  # as Streamlit names it
    script.start()
    try:
        prefetch.ahead(lambda step: done.append((step, time.monotonic())), [4, 2])
        assert not prefetch.settled(timeout=prefetch.QUIET_S + 1.0)  # a script runs: the request waits
        assert done == []
    finally:
        release.set()
        script.join()
        ended = time.monotonic()
    assert prefetch.settled(timeout=SETTLE_S)
    assert [step for step, _ in done] == [4, 2]
    assert done[0][1] - ended >= prefetch.QUIET_S / 2  # (a poll late at most): the browser draws what was sent


@pytest.mark.usefixtures("prefetching")
def test_a_newer_request_replaces_one_not_started_and_a_failure_stops_neither():
    done = []
    release = threading.Event()
    script = threading.Thread(target=release.wait, name=prefetch.SCRIPT_THREAD, daemon=True)
    script.start()
    try:
        prefetch.ahead(done.append, [1, 2])  # the user moved on before this one started
        prefetch.ahead(lambda step: 1 / 0 if step == 7 else done.append(step), [7, 8])
    finally:
        release.set()
        script.join()
    assert prefetch.settled(timeout=SETTLE_S)
    assert done == [8]  # step 7's failure is the page's to report when the user gets there
    prefetch.ahead(done.append, [9])
    assert prefetch.settled(timeout=SETTLE_S)
    assert done == [8, 9]


@pytest.mark.usefixtures("prefetching")
def test_streamlit_warns_of_no_session_in_other_threads_but_not_in_the_prefetch_thread():
    import logging

    from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.threadName)
    logger = logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context")
    logger.addHandler(handler)
    try:
        get_script_run_ctx()  # this thread has no session either: warned
        prefetch.ahead(lambda step: get_script_run_ctx(), [1])  # as a cached function's spinner does
        assert prefetch.settled(timeout=SETTLE_S)
    finally:
        logger.removeHandler(handler)
    assert warned == [threading.current_thread().name]
