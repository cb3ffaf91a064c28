"""The separate sampler (engine.sampler): truncation equal to transformers' warpers, the lag of its weights, and real
runs whose logged sampler log-probs differ from the trainer's exactly when a mismatch cause is on."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.config import ConfigError
from engine.sampler import PolicySampler, truncated_logprobs, truncation_mask

# ----------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.9), (20, 0.7), (3, 0.5), (0, 0.3)])
def test_truncation_keeps_what_transformers_warpers_keep(top_k, top_p):
    """transformers' TopKLogitsWarper then TopPLogitsWarper (the order generate applies them) as the reference."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 7, 50, generator=torch.Generator().manual_seed(top_k + int(100 * top_p))) * 3
    flat = logits.reshape(-1, 50)
    ref = flat.clone()
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    expected = torch.isfinite(ref).reshape(logits.shape)
    assert torch.equal(truncation_mask(logits, top_k, top_p), expected)


def test_truncated_logprob_is_the_renormalised_one_worked_by_hand():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().reshape(1, 1, 4)
    target = torch.tensor([[1]])
    trunc, full = truncated_logprobs(logits, target, top_k=2)
    assert math.isclose(float(full), math.log(0.3), rel_tol=1e-6)
    assert math.isclose(float(trunc), math.log(0.3 / 0.8), rel_tol=1e-6)
    # top-p 0.6: 0.5 (nothing above), 0.3 (0.5 above < 0.6) stay; 0.15 (0.8 above) goes
    trunc, _ = truncated_logprobs(logits, target, top_p=0.6)
    assert math.isclose(float(trunc), math.log(0.3 / 0.8), rel_tol=1e-6)
    # a drawn token outside the kept set (rounding between generation and recomputation) still counts as kept
    trunc, _ = truncated_logprobs(logits, torch.tensor([[3]]), top_k=2)
    assert math.isclose(float(trunc), math.log(0.05 / 0.85), rel_tol=1e-6)
    trunc, full = truncated_logprobs(logits, target)  # no truncation: the same
    assert float(trunc) == float(full)


# ----------------------------------------------------------------------------- the copy and its lag


def _updates(policy: torch.nn.Module, n: int) -> list[dict]:
    """Weights after each of n fake updates (the first entry: before any)."""
    history = [{k: v.clone() for k, v in policy.state_dict().items()}]
    for _ in range(n):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p))
        history.append({k: v.clone() for k, v in policy.state_dict().items()})
    return history


@pytest.mark.parametrize("dtype, lag", [("bfloat16", 0), ("float32", 1), ("float16", 2), ("bfloat16", 3)])
def test_the_sampler_holds_the_weights_of_lag_updates_ago_in_its_dtype(dtype, lag):
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 3)
    sampler = PolicySampler(policy, dtype, lag)
    assert sampler.model is not policy and sampler.memory_bytes() > 0
    history = _updates(policy, 0)
    for step in range(1, 6):
        history += _updates(policy, 1)[1:]
        sampler.refresh(policy)
        expected = history[max(0, step - lag)]
        for name, value in sampler.model.state_dict().items():
            assert value.dtype == getattr(torch, dtype)
            assert torch.equal(value, expected[name].to(value.dtype)), (step, name)


def test_the_default_sampler_is_the_policy_itself():
    policy = torch.nn.Linear(4, 3)
    sampler = PolicySampler(policy)
    assert sampler.model is policy and sampler.memory_bytes() == 0
    sampler.refresh(policy)  # nothing to do


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="fp8"), "float32, bfloat16, float16"), (dict(lag=-1), ">= 0"), (dict(lag=1.5), ">= 0")])
def test_the_sampler_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicySampler(torch.nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize("overrides, message", [
    (dict(sampler_dtype="fp8"), "sampler_dtype must be one of float32, bfloat16, float16"),
    (dict(sampler_lag=-1), "sampler_lag must be an integer >= 0"),
    (dict(top_k=-3), "top_k must be an integer >= 0"),
    (dict(rollout_is="tokens"), "accepted: token, sequence"),
    (dict(rollout_is="token", rollout_is_threshold="2_1"), "lower bound 2.0 is above the upper bound"),
    (dict(rollout_is_threshold="2.0"), "--rollout-is is not"),
    (dict(rollout_rs="token_k9"), "unknown option 'token_k9'"),
    (dict(rollout_rs="token_k2"), "--rollout-rs-threshold is required for token_k2"),
    (dict(off_policy_mask=-0.5), "--off-policy-mask = -0.5 is invalid"),
    (dict(rollout_is_batch_normalize=True, rollout_is="token_mask"), "needs --rollout-is token or sequence"),
    (dict(algo="dro", rollout_is="token"), "dro's loss is not proportional to the advantage"),
])
def test_bad_sampler_and_correction_settings_are_clear_config_errors(overrides, message):
    from conftest import tiny_config

    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_corrections_are_refused_over_several_processes():
    from conftest import tiny_config

    from engine.distributed import check_world

    check_world(tiny_config(sampler_dtype="bfloat16", sampler_lag=2), 2)  # the sampler itself works per rank
    with pytest.raises(ConfigError, match=r"single-process for now \(--nproc 1\)"):
        check_world(tiny_config(rollout_rs="seq_mean_k3"), 2)


def test_the_cli_has_the_new_flags():
    import argparse

    from engine.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--task", "linear", "--sampler-dtype", "bfloat16", "--sampler-lag", "2", "--top-k",
                              "20", "--rollout-is", "token", "--rollout-is-threshold", "0.5_5.0", "--rollout-rs",
                              "seq_mean_k3", "--off-policy-mask", "0.5", "--rollout-is-batch-normalize"])
    cfg = config_from_args(args)
    assert (cfg.sampler_dtype, cfg.sampler_lag, cfg.top_k) == ("bfloat16", 2, 20)
    assert (cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_rs, cfg.off_policy_mask) == (
        "token", "0.5_5.0", "seq_mean_k3", 0.5)
    assert cfg.rollout_is_batch_normalize is True


# ----------------------------------------------------------------------------- real runs


def _tokens(logs_dir, run):
    from engine.runlog import RunReader

    with RunReader(logs_dir) as reader:
        return reader.sql("SELECT t.step, t.rollout_id, t.position, t.old_logp, t.sampler_logp, t.sampler_logp_full, "
                          "r.kind FROM tokens t JOIN rollouts r USING (run, step, rollout_id) WHERE t.run = ? "
                          "ORDER BY t.step, t.rollout_id, t.position", [run])


def test_a_bf16_lagged_top_k_sampler_logs_a_real_mismatch(tmp_path, run_tiny):
    assert run_tiny(tmp_path, "mismatch", steps=3, sampler_dtype="bfloat16", sampler_lag=1, top_k=5) == "finished"
    tokens = _tokens(tmp_path, "mismatch")
    train = tokens[tokens.kind == "train"]
    assert len(train) and train.sampler_logp.notna().all() and train.sampler_logp_full.notna().all()
    assert tokens[tokens.kind == "eval"].sampler_logp.isna().all()  # held-out rollouts: no sampler
    gap = (train.old_logp - train.sampler_logp).abs()
    assert gap.mean() > 1e-2
    precision_and_lag = (train.old_logp - train.sampler_logp_full).abs()
    assert precision_and_lag.mean() > 1e-4  # bf16 + stale weights alone, before the truncation
    # renormalising over the kept tokens can only raise a log-prob
    assert (train.sampler_logp >= train.sampler_logp_full - 1e-6).all()
    assert (train.sampler_logp <= 1e-6).all()


def test_the_default_sampler_reports_the_trainers_log_probs(tmp_path, run_tiny):
    assert run_tiny(tmp_path, "same", steps=2) == "finished"
    train = _tokens(tmp_path, "same").query("kind == 'train'")
    assert len(train) and train.sampler_logp.notna().all()
    np.testing.assert_allclose(train.sampler_logp, train.old_logp, atol=1e-6)
    np.testing.assert_allclose(train.sampler_logp_full, train.old_logp, atol=1e-6)
