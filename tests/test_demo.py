"""The demo: seven runs trained side by side in the background, reused when asked again, stopped cleanly."""

from __future__ import annotations

import pytest
from conftest import TINY
from waits import wait_until

from engine import demo
from engine.runlog import list_runs


def tiny_train_args(warm_cache, steps: int) -> tuple[str, ...]:
    """The demo's runs on the tests' tiny model (its warm start is cached once per checkout by conftest)."""
    args = ["--steps", str(steps), "--cache-dir", str(warm_cache), "--checkpoint-every", "1"]
    for field, value in TINY.items():
        if field != "checkpoint_every":
            args += [f"--{field.replace('_', '-')}", str(value)]
    return tuple(args)


def wait_for(condition, logs, what: str):
    """Wait until `condition()` holds while the demo in `logs` makes progress (SFT steps, logged steps, statuses):
    fail only after a long time with no progress at all (see waits.wait_until), never for being slow."""
    wait_until(condition, what, progress=lambda: (demo.demo_progress(logs), statuses(logs)))


def statuses(logs_dir) -> dict[str, tuple[str, int | None, str]]:
    return {run["run"]: (run["status"], run["last_step"], run["run_id"]) for run in list_runs(logs_dir)}


@pytest.fixture(autouse=True)
def no_demo_left_running(tmp_path):
    """A failing test must not leave a demo training in the background."""
    yield
    demo.stop_demo(tmp_path / "logs", timeout=60)


@pytest.mark.slow
def test_demo_trains_all_runs_then_reuses_them(tmp_path):
    logs, cache = tmp_path / "logs", tmp_path / "cache"  # an empty cache: the demo must build the warm start
    demo.start_demo(logs, train_args=tiny_train_args(cache, steps=2))
    assert demo.running_supervisor(logs) is not None
    assert demo.start_demo(logs) == demo.running_supervisor(logs)  # a second start while it runs is a no-op
    wait_for(lambda: demo.running_supervisor(logs) is None, logs, "the demo to finish")

    first = statuses(logs)
    assert set(first) == {run.name for run in demo.DEMO_RUNS}
    assert all(status == "finished" and last_step == 2 for status, last_step, _ in first.values()), first
    algorithms = {run["run"]: (run["algorithm"], run["config"]["supervision"]) for run in list_runs(logs)}
    assert algorithms == {run.name: (run.algo, run.supervision) for run in demo.DEMO_RUNS}
    samplers = {run["run"]: (run["config"]["sampler_dtype"], run["config"]["sampler_lag"]) for run in list_runs(logs)}
    assert samplers == {run.name: ("bfloat16", 2) if run.name == "demo-grpo-bf16-lag2" else ("float32", 0)
                        for run in demo.DEMO_RUNS}
    progress = demo.demo_progress(logs)
    assert progress["running"] is False and progress["fraction"] == 1.0
    assert {(r["steps_done"], r["steps"]) for r in progress["runs"]} == {(2, 2)}
    # The first run built the warm start (reporting its progress), alone; the others started after it and
    # found it in the cache.
    assert progress["warm_start"]["step"] == progress["warm_start"]["steps"] == TINY["sft_steps"]
    (cached,) = cache.glob("warmstart-*")
    found_cached = {run["run"]: f"cached {cached.name}" in run["model"] for run in list_runs(logs)}
    assert found_cached == {run.name: run is not demo.DEMO_RUNS[0] for run in demo.DEMO_RUNS}

    # Asked again: nothing is retrained (same run ids, same steps).
    demo.start_demo(logs, train_args=tiny_train_args(cache, steps=2))
    wait_for(lambda: demo.running_supervisor(logs) is None, logs, "the second demo start to return")
    assert statuses(logs) == first


@pytest.mark.slow
def test_stopping_the_demo_stops_training_cleanly_and_a_restart_resumes(tmp_path, warm_cache):
    logs = tmp_path / "logs"
    # Without dynamic sampling: on the tiny model demo-dapo's groups are all wrong by its step 4, and its dynamic
    # sampling then stops the run with an error (as it should), so a stop that came later found it crashed.
    train_args = (*tiny_train_args(warm_cache, steps=40), "--no-dynamic-sampling")
    demo.start_demo(logs, train_args=train_args)

    def some_run_has_a_step():
        return any((last or 0) >= 1 for _, last, _ in statuses(logs).values())

    wait_for(some_run_has_a_step, logs, "a first logged step")
    demo.stop_demo(logs, timeout=120)
    assert demo.running_supervisor(logs) is None
    stopped = statuses(logs)
    assert stopped and all(status in ("stopped", "finished") for status, _, _ in stopped.values()), stopped

    # A restart resumes the stopped runs (same run id, numbering continues) instead of starting them over.
    demo.start_demo(logs, train_args=train_args)
    name, (_, last_step, run_id) = next((n, s) for n, s in stopped.items() if (s[1] or 0) >= 1)
    wait_for(lambda: (statuses(logs)[name][1] or 0) > last_step, logs, f"{name} to continue after step {last_step}")
    assert statuses(logs)[name][2] == run_id
    demo.stop_demo(logs, timeout=120)


@pytest.mark.slow
def test_demo_command_with_runs_present_only_serves_the_dashboard_and_stops_on_sigterm(tmp_path):
    """`policylens demo` (what `make run` calls) on a logs folder that already holds a run: the dashboard answers
    on loopback, no demo training starts, and a SIGTERM stops the server and frees the port."""
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    import numpy as np
    from synthetic_runs import synthetic_step

    from engine.runlog import RunWriter

    logs = tmp_path / "logs"
    with RunWriter.create(logs, "mine", algorithm="grpo", task="linear", config={}, model="m") as writer:
        writer.log_step(0, **synthetic_step(0, 2, 2, 8, 1, np.random.default_rng(0)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "engine.cli", "demo", "--logs-dir", str(logs),
                               "--port", str(port), "--no-browser"], stdout=subprocess.PIPE, text=True)
    try:
        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_until(lambda: answers() or server.poll() is not None, "the dashboard to answer")
        assert server.poll() is None, "the demo command exited"
        assert demo.running_supervisor(logs) is None and not (logs / ".demo").exists()  # nothing to train
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert "training the demo" not in server.stdout.read()
    with socket.socket() as s:
        # The port is free again: no orphaned server. SO_REUSEADDR ignores the closed connections the server leaves
        # in TIME_WAIT (they made this bind fail now and then), while a socket still listening there would still
        # make it fail (Linux).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
