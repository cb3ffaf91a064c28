"""Shared fixtures: real tiny training runs made by the engine, for the engine's and the dashboard's tests.

    def test_something(tiny_run):
        logs_dir, run_name = tiny_run          # a finished 3-step GRPO run (outcome supervision)
    def test_prm(tiny_process_run):
        logs_dir, run_name = tiny_process_run  # a finished 3-step GRPO run with process supervision
    def test_critic(tiny_ppo_run):
        logs_dir, run_name = tiny_ppo_run      # a finished 2-step PPO run (critic, GAE)

The tiny warm start (a ~90k-parameter model, a short SFT) is cached in pytest's cache folder (.pytest_cache), so it
is trained once per checkout, not once per test session.
"""

from __future__ import annotations

import threading

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


def tiny_config(**overrides):
    from engine.config import TrainConfig

    return TrainConfig(**{**TINY, **overrides})


def settle_run_logs() -> None:
    """Wait until the folders that the last merges of closed runs replaced are deleted (`RunWriter.close` leaves
    that to a thread, after a grace period): tests that read the Parquet files directly then see each row once."""
    for thread in threading.enumerate():
        if thread.name.startswith("runlog-delete-"):
            thread.join()


@pytest.fixture(scope="session")
def warm_cache(request, tmp_path_factory):
    """Folder of cached warm-started models, persistent across sessions when pytest's cache is enabled."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return cache.mkdir("policylens-warmstart")
    return tmp_path_factory.mktemp("warmstart")


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


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, run_tiny):
    """(logs_dir, run_name) of a finished 3-step GRPO run on `linear`, group size 4, evaluated at steps 0 and 2-3."""
    logs_dir = tmp_path_factory.mktemp("logs")
    run_tiny(logs_dir, "tiny-grpo", algo="grpo", steps=3)
    return logs_dir, "tiny-grpo"


@pytest.fixture(scope="session")
def tiny_process_run(tmp_path_factory, run_tiny):
    """(logs_dir, run_name) of a finished 3-step GRPO run with process supervision (PRM step rewards), sampled by a
    bfloat16 copy of the policy one update behind, so its sampler and trainer log-probs really differ (the Mismatch
    page has data)."""
    logs_dir = tmp_path_factory.mktemp("logs-process")
    run_tiny(logs_dir, "tiny-grpo-process", algo="grpo", supervision="process", steps=3, sampler_dtype="bfloat16",
             sampler_lag=1)
    return logs_dir, "tiny-grpo-process"


@pytest.fixture(scope="session")
def tiny_ppo_run(tmp_path_factory, run_tiny):
    """(logs_dir, run_name) of a finished 2-step PPO run: a critic's values, returns and KL rewards per token."""
    logs_dir = tmp_path_factory.mktemp("logs-ppo")
    run_tiny(logs_dir, "tiny-ppo", algo="ppo", steps=2)
    return logs_dir, "tiny-ppo"
