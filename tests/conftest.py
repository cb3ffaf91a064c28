"""Shared fixtures: real tiny training runs made by the engine, for the engine's and the dashboard's tests.

    def test_something(tiny_run):
        logs_dir, run_name = tiny_run          # a finished 3-step GRPO run (outcome supervision)
    def test_prm(tiny_process_run):
        logs_dir, run_name = tiny_process_run  # a finished 3-step GRPO run with process supervision
    def test_critic(tiny_ppo_run):
        logs_dir, run_name = tiny_ppo_run      # a finished 2-step PPO run (critic, GAE)

The tiny warm start (a ~90k-parameter model, a short SFT) is cached in pytest's cache folder (.pytest_cache), so it
is trained once per checkout, not once per test session.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadscope`): a module's tests stay on one
worker, so a module-scoped fixture is built once, and slow modules go first (`pytest_collection_modifyitems`). The
session fixtures below are built once for both workers: the first worker that asks builds them under a file lock in
a folder the workers share, the other waits and reuses them.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

TINY = dict(
    task="linear",
    model_size="tiny",
    sft_steps=200,
    batch_size=16,
    group_size=4,
    eval_size=8,
    eval_every=2,
    checkpoint_every=0,
)
"""The tiny config every engine test starts from: a few seconds per run on one CPU thread."""


@pytest.fixture(autouse=True, scope="session")
def figures_served():
    """The pages draw their figures as a server started by `policylens dashboard` does (`dashboard.figures`):
    plotly.js published, Streamlit's static file serving on (for AppTest too, which serves nothing)."""
    from streamlit import config

    from dashboard import figures

    assert figures.publish_plotly_js()
    config.set_option("server.enableStaticServing", True)


@pytest.fixture(autouse=True)
def prefetch_off(request, monkeypatch):
    """`dashboard.prefetch` works after a page's run on a thread of the process that ran it: here, the test's. Off
    (nothing requested) unless the test asks for `prefetching`, so that no page's guesses run into the next test's
    counted queries or removed folders."""
    if "prefetching" not in request.fixturenames:
        from dashboard import prefetch

        monkeypatch.setattr(prefetch, "ahead", lambda work, guesses: None)


@pytest.fixture
def prefetching():
    """`dashboard.prefetch` on, as in a server; every request done before the next test starts."""
    from dashboard import prefetch

    yield prefetch
    assert prefetch.settled(timeout=300), "the prefetch thread is still working 300 s after the test"


def tiny_config(**overrides):
    from engine.config import TrainConfig

    return TrainConfig(**{**TINY, **overrides})


def settle_run_logs() -> None:
    """Wait until the folders that the last merges of closed runs replaced are deleted (`RunWriter.close` leaves
    that to a thread, after a grace period): tests that read the Parquet files directly then see each row once."""
    for thread in threading.enumerate():
        if thread.name.startswith("runlog-delete-"):
            thread.join()


def shared_folder(tmp_path_factory) -> Path:
    """A folder of this session that every xdist worker sees (the parent of the workers' own temporary folders);
    without xdist, the session's temporary folder."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(folder: Path, build) -> Path:
    """`folder`, filled by `build(folder)` unless a worker of this session already did: the first worker to ask
    builds it while holding a lock, the others wait for it. A build that failed leaves nothing to reuse."""
    from filelock import FileLock  # (a dependency of torch)

    done = folder.with_name(folder.name + ".built")  # (beside it: tests list the folder)
    with FileLock(f"{folder}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            done.touch()
    return folder


def pytest_collection_modifyitems(config, items):
    """On xdist workers, the modules that have slow tests come first. `make test` hands modules to the workers in
    this order (`--no-loadscope-reorder`), so the last ones handed out are short and neither worker waits long for
    the other at the end (xdist's own order, by number of tests, would hand out a one-test module of minutes last)."""
    if not hasattr(config, "workerinput"):
        return
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)  # (stable: collection order otherwise)


@pytest.fixture(scope="session")
def warm_cache(request, tmp_path_factory):
    """Folder of cached warm-started models, persistent across sessions when pytest's cache is enabled. The tiny
    config's warm start is in it (trained here, once for all workers, when absent)."""
    from filelock import FileLock

    from engine.config import resolve_device
    from engine.tasks import get_task
    from engine.train import load_models

    cache = getattr(request.config, "cache", None)
    if cache is not None:
        folder = Path(cache.mkdir("policylens-warmstart"))
    else:
        folder = shared_folder(tmp_path_factory) / "warmstart-cache"
        folder.mkdir(exist_ok=True)
    with FileLock(folder / ".tiny.lock"):  # one worker trains it, the other then finds it cached
        cfg = tiny_config()
        load_models(cfg, get_task(cfg.task, seed=cfg.task_seed), resolve_device(cfg.device), folder, sft_threads=1)
    return folder


@pytest.fixture(scope="session")
def run_tiny(warm_cache):
    """run_tiny(logs_dir, name, **overrides) -> status: train a tiny run (quietly, one thread)."""
    from engine.train import train

    def run(logs_dir, name, resume=False, **overrides):
        status = train(tiny_config(**overrides), name, logs_dir, resume=resume, cache_dir=warm_cache,
                       progress=False, num_threads=1)
        settle_run_logs()
        return status

    return run


def shared_tiny_run(tmp_path_factory, run_tiny, folder: str, name: str, **overrides) -> tuple[Path, str]:
    """(logs_dir, name) of a finished tiny run, trained once per session for all workers (tests only read it)."""
    logs_dir = build_once(shared_folder(tmp_path_factory) / folder, lambda logs: run_tiny(logs, name, **overrides))
    return logs_dir, name


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, run_tiny):
    """(logs_dir, run_name) of a finished 3-step GRPO run on `linear`, group size 4, evaluated at steps 0 and 2-3."""
    return shared_tiny_run(tmp_path_factory, run_tiny, "logs-grpo", "tiny-grpo", algo="grpo", steps=3)


@pytest.fixture(scope="session")
def tiny_process_run(tmp_path_factory, run_tiny):
    """(logs_dir, run_name) of a finished 3-step GRPO run with process supervision (PRM step rewards), sampled by a
    bfloat16 copy of the policy one update behind, so its sampler and trainer log-probs really differ (the Mismatch
    page has data)."""
    return shared_tiny_run(tmp_path_factory, run_tiny, "logs-process", "tiny-grpo-process", algo="grpo",
                           supervision="process", steps=3, sampler_dtype="bfloat16", sampler_lag=1)


@pytest.fixture(scope="session")
def tiny_ppo_run(tmp_path_factory, run_tiny):
    """(logs_dir, run_name) of a finished 2-step PPO run: a critic's values, returns and KL rewards per token."""
    return shared_tiny_run(tmp_path_factory, run_tiny, "logs-ppo", "tiny-ppo", algo="ppo", steps=2)
