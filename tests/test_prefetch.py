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


def script_thread(release: threading.Event) -> threading.Thread:
    """A thread named as Streamlit names a session's script run, running until `release` is set."""
    script = threading.Thread(target=release.wait, name=prefetch.SCRIPT_THREAD, daemon=True)
    script.start()
    return script


def work_giving_way(calls: list, finished: list, first_step_done: threading.Event, go_on: threading.Event,
                    gave_way: threading.Event):
    """A guess's work in two steps with `give_way` between them; its first call waits for `go_on` after its first
    step (so that the test can start a script then)."""
    def work(step):
        calls.append(step)
        if len(calls) == 1:
            first_step_done.set()
            go_on.wait()
        try:
            prefetch.give_way()
        except prefetch.GaveWay:
            gave_way.set()
            raise
        finished.append(step)
    return work


@pytest.mark.usefixtures("prefetching")
def test_a_guess_under_way_stops_for_a_script_and_is_done_again_after_it():
    calls, finished = [], []
    first_step_done, go_on, gave_way, release = (threading.Event() for _ in range(4))
    prefetch.ahead(work_giving_way(calls, finished, first_step_done, go_on, gave_way), [3, 4])
    assert first_step_done.wait(SETTLE_S)
    script = script_thread(release)  # the user acts while guess 3 is under way
    go_on.set()
    try:
        assert gave_way.wait(SETTLE_S)
        assert finished == []  # stopped before its second step
        assert not prefetch.settled(timeout=prefetch.QUIET_S + 1.0)  # and not taken again while the script runs
        assert calls == [3]
    finally:
        release.set()
        script.join()
    assert prefetch.settled(timeout=SETTLE_S)
    assert (calls, finished) == ([3, 3, 4], [3, 4])  # guess 3 again, then the rest of the request


@pytest.mark.usefixtures("prefetching")
def test_a_guess_stopped_for_a_script_is_dropped_when_that_script_asks_for_other_guesses():
    calls, finished = [], []
    first_step_done, go_on, gave_way, release = (threading.Event() for _ in range(4))
    prefetch.ahead(work_giving_way(calls, finished, first_step_done, go_on, gave_way), [3, 4])
    assert first_step_done.wait(SETTLE_S)
    script = script_thread(release)
    go_on.set()
    try:
        assert gave_way.wait(SETTLE_S)
        prefetch.ahead(finished.append, [9])  # the page the user moved to asks for its own neighbours
    finally:
        release.set()
        script.join()
    assert prefetch.settled(timeout=SETTLE_S)
    assert (calls, finished) == ([3], [9])


def test_give_way_does_nothing_outside_the_prefetch_thread():
    release = threading.Event()
    script = script_thread(release)
    try:
        prefetch.give_way()  # a page calling the same function as a guess: it is the script itself
    finally:
        release.set()
        script.join()


def _as_guess(function):
    """Run `function` on a thread named as the prefetch thread (a guess), return its result."""
    out = []
    thread = threading.Thread(target=lambda: out.append(function()), name=prefetch.THREAD)
    thread.start()
    thread.join(SETTLE_S)
    return out[0]


def test_the_page_keeps_its_last_input_and_takes_a_guesss_without_reading_it_again():
    reads = []
    inputs = prefetch.LastInputs(ttl=600)

    def get(key):
        return inputs.get(key, lambda: reads.append(key) or f"value of {key}")

    assert get("A") == "value of A" and get("A") == "value of A" and reads == ["A"]
    assert _as_guess(lambda: get("B")) == "value of B" and reads == ["A", "B"]
    assert get("A") == "value of A" and reads == ["A", "B"]  # a guess did not push the page's out
    assert get("B") == "value of B" and reads == ["A", "B"]  # the user moved to the guessed view: taken
    assert _as_guess(lambda: get("C")) == "value of C" and get("B") == "value of B" and reads == ["A", "B", "C"]
    assert get("A") == "value of A" and reads == ["A", "B", "C", "A"]  # one of each: A was given up for B


def test_two_threads_asking_for_the_same_input_read_it_once_and_an_old_one_is_read_again():
    reads, started, release = [], threading.Event(), threading.Event()
    inputs = prefetch.LastInputs(ttl=600)

    def slow_read():
        reads.append("A")
        started.set()
        release.wait(SETTLE_S)
        return len(reads)

    guess = threading.Thread(target=lambda: inputs.get("A", slow_read), name=prefetch.THREAD)
    guess.start()
    assert started.wait(SETTLE_S)
    page = []
    asking = threading.Thread(target=lambda: page.append(inputs.get("A", slow_read)))
    asking.start()
    asking.join(0.2)
    assert asking.is_alive()  # waiting for the guess's read, not reading itself
    release.set()
    guess.join(SETTLE_S)
    asking.join(SETTLE_S)
    assert page == [1] and reads == ["A"]
    stale = prefetch.LastInputs(ttl=0)  # every entry is already too old
    assert stale.get("A", lambda: 1) == 1 and stale.get("A", lambda: 2) == 2


@pytest.mark.usefixtures("prefetching")
def test_a_guess_looping_over_chunks_stops_within_one_chunk_of_a_script_starting():
    done, release, second_chunk = [], threading.Event(), threading.Event()
    script = []

    def work(step):
        for chunk in prefetch.giving_way(range(5)):
            done.append((step, chunk))
            if chunk == 1 and not script:  # the user acts while the guess is at its second chunk
                script.append(script_thread(release))
                second_chunk.set()

    prefetch.ahead(work, [3])
    try:
        assert second_chunk.wait(SETTLE_S)
        assert not prefetch.settled(timeout=prefetch.QUIET_S + 1.0)
        assert done == [(3, 0), (3, 1)]  # not a third chunk while the script runs
    finally:
        release.set()
        script[0].join()
    assert prefetch.settled(timeout=SETTLE_S)
    assert done == [(3, 0), (3, 1)] + [(3, chunk) for chunk in range(5)]  # done again, whole, after the script
    assert list(prefetch.giving_way("ab")) == ["a", "b"]  # outside the prefetch thread: the items, nothing else


@pytest.mark.usefixtures("prefetching")
def test_a_script_that_started_and_ended_between_two_chunks_still_stops_the_guess():
    """A short script (a cached page) can run entirely while a guess computes one chunk: the guess must not go on
    holding the interpreter while the server sends that script's page."""
    done, at_second_chunk = [], threading.Event()
    scripts = []

    def work(step):
        for chunk in prefetch.giving_way(range(3)):
            done.append((step, chunk))
            if chunk == 1 and not scripts:
                scripts.append(time.monotonic())
                prefetch.script_started()  # as the app's first line; no script thread is left running
                at_second_chunk.set()

    prefetch.ahead(work, [3])
    assert at_second_chunk.wait(SETTLE_S)
    assert prefetch.settled(timeout=SETTLE_S)
    assert done == [(3, 0), (3, 1)] + [(3, chunk) for chunk in range(3)]  # stopped, then done again, whole
    assert time.monotonic() - scripts[0] >= prefetch.QUIET_S  # not before a quiet moment after the script


@pytest.mark.usefixtures("prefetching")
def test_a_pages_query_stops_a_guesss_query_at_once_and_the_guess_is_made_again(tmp_path):
    """The dashboard's reader interrupts a guess's query when a page asks for the reader: the page does not wait
    for it, and the guess is made again once the page is done."""
    import duckdb

    from engine.runlog import RunReader

    reader = RunReader(tmp_path, gives_way=prefetch.guessing)
    calls, done, stopped = [], [], []

    def work(guess):
        calls.append(guess)
        if len(calls) == 1:  # about ten seconds of work on two cores, unless a page's query stops it
            try:
                reader.sql("SELECT sum(i) FROM range(20000000000) t(i)")
            except duckdb.InterruptException:
                stopped.append(guess)
                raise
        done.append(guess)

    prefetch.ahead(work, [5])
    deadline = time.monotonic() + SETTLE_S
    while not done and time.monotonic() < deadline:  # the page's queries, until one met the guess's
        assert reader.sql("SELECT 42 AS answer")["answer"].tolist() == [42]
        time.sleep(0.05)
    assert prefetch.settled(timeout=SETTLE_S)
    assert (calls, stopped, done) == ([5, 5], [5], [5])
    assert reader.sql("SELECT 43 AS answer")["answer"].tolist() == [43]  # the connection still answers
