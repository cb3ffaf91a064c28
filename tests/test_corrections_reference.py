"""engine.corrections against the references it claims to equal, on random batches with padding and empty rows:
verl 0.9.1 (verl/trainer/ppo/rollout_corr_helper.py and core_algos.py, imported through tests/verl_reference.py) and
TRL 1.16 (trl/trainer/grpo_trainer.py: `get_off_policy_mask` called directly, the IS-ratio lines of
`_generate_and_score_completions` reproduced below with their location)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from verl_reference import import_verl

from engine import corrections as C
from engine.correction_settings import RS_OPTIONS, CorrectionConfig
from engine.objectives import policy_loss

TOL = dict(rtol=1e-6, atol=1e-6)
SEEDS = (0, 1, 2, 3)
DTYPES = (torch.float32, torch.float64)


@pytest.fixture(scope="module")
def verl_helper():
    return import_verl("verl.trainer.ppo.rollout_corr_helper")


@pytest.fixture(scope="module")
def trl_grpo():
    import trl
    from trl.trainer.grpo_trainer import GRPOTrainer

    assert trl.__version__ == "1.16.0", "the reproduced TRL lines below are those of TRL 1.16.0"
    return GRPOTrainer


def random_batch(seed: int, dtype=torch.float64, B: int = 16, T: int = 24, bool_mask: bool = False):
    """(old_logp, sampler_logp, mask): ragged rows (row 0 empty, row 1 full), log-ratios mostly small with a heavy
    tail (some beyond verl's +-20 clamp), and garbage on padding that a correct function must ignore."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, T
    on = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    old = -4.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 1e-3
    log_ratio = 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    tail = torch.rand(B, T, generator=g) < 0.05
    log_ratio = torch.where(tail, 12.0 * torch.randn(B, T, generator=g, dtype=torch.float64), log_ratio)
    sampler = old - log_ratio
    garbage = 60.0 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old, sampler = torch.where(on, old, garbage), torch.where(on, sampler, -garbage)
    mask = on if bool_mask else on.to(dtype)
    return old.to(dtype), sampler.to(dtype), mask


IS_THRESHOLDS = (2.0, 1.2, "5.0", "0.5_5.0", "0.8_1.25", "1.0_2.0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", IS_THRESHOLDS)
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_equal_verl(verl_helper, dtype, level, threshold, normalize):
    for seed in SEEDS:
        old, sampler, mask = random_batch(seed, dtype)
        log_ratio = old - sampler
        expected, metrics = verl_helper.compute_rollout_correction_weights(log_ratio, mask, level, threshold,
                                                                           normalize)
        ours = C.is_weights(log_ratio, mask, level, threshold, normalize)
        torch.testing.assert_close(ours, expected, **TOL)
        assert not ours.requires_grad and bool((ours[~mask.bool()] == 0).all())
        upper = float(str(threshold).split("_")[-1])
        unnormalized = C.is_weights(log_ratio, mask, level, threshold)
        ours_metrics = C.is_weight_metrics(unnormalized, mask, upper)
        assert ours_metrics["is_weight_mean"] == pytest.approx(metrics["rollout_is_mean"], rel=1e-6, abs=1e-6)
        assert ours_metrics["is_weight_ess"] == pytest.approx(metrics["rollout_is_eff_sample_size"], rel=1e-6)
        if level == "token":  # verl's sequence-level max is of the raw ratio, not of the applied weight
            assert ours_metrics["is_weight_max"] == pytest.approx(metrics["rollout_is_max"], rel=1e-6)


def test_is_weights_with_a_bool_mask_equal_verl(verl_helper):
    old, sampler, mask = random_batch(7, torch.float32, bool_mask=True)
    for level in ("token", "sequence"):
        expected, _ = verl_helper.compute_rollout_correction_weights(old - sampler, mask, level, "0.5_5.0")
        torch.testing.assert_close(C.is_weights(old - sampler, mask, level, "0.5_5.0"), expected, **TOL)


def rs_cases():
    """Every single option with a shared threshold, then chains (duplicates, one threshold per option, k1 as u)."""
    for option in RS_OPTIONS:
        yield option, ("0.7_1.6" if option.endswith("k1") else "0.05")
        yield option, ("1.5" if option.endswith("k1") else "2.0")
    yield "token_k1,seq_mean_k3", "0.5_2.0,0.02"
    yield "seq_sum_k1,seq_max_k2,token_k3", "0.2_4.0,1.0,0.1"
    yield "token_k1,seq_mean_k3,token_k1", "0.5_2.0,0.02"  # a repeated option counts once
    yield "seq_mean_k1,seq_mean_k2,seq_sum_k3", "1.1"
    yield "token_k2,seq_sum_k2,seq_mean_k2", "0.3"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("options", "thresholds"), list(rs_cases()))
def test_rejection_mask_equal_verl(verl_helper, dtype, options, thresholds):
    for seed in SEEDS:
        old, sampler, mask = random_batch(seed, dtype)
        expected, metrics = verl_helper.compute_rollout_rejection_mask(old - sampler, mask, options, thresholds)
        ours = C.rejection_mask(old - sampler, mask, options, thresholds)
        assert ours.dtype == mask.dtype
        assert torch.equal(ours, expected)
        rates = C.rejection_rates(ours, mask)
        assert rates["rejected_token_share"] == pytest.approx(metrics["rollout_rs_masked_fraction"], abs=1e-6)
        assert rates["rejected_seq_share"] == pytest.approx(metrics["rollout_rs_seq_masked_fraction"], abs=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_offpolicy_metrics_equal_verl(verl_helper, dtype):
    for seed in SEEDS:
        old, sampler, mask = random_batch(seed, dtype)
        expected = verl_helper.compute_offpolicy_metrics(old, sampler, mask)
        ours = C.offpolicy_metrics(old, sampler, mask)
        assert set(expected) <= set(ours)
        for name, value in expected.items():
            assert ours[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


def test_offpolicy_metrics_count_empty_rows_as_verl(verl_helper):
    """Two identical batches but one with 4 more empty rows: the per-sequence metrics move, in verl and here."""
    old, sampler, mask = random_batch(5)
    pad = lambda x: torch.cat([x, torch.zeros(4, x.shape[1], dtype=x.dtype)])  # noqa: E731
    full, padded = C.offpolicy_metrics(old, sampler, mask), C.offpolicy_metrics(pad(old), pad(sampler), pad(mask))
    expected = verl_helper.compute_offpolicy_metrics(pad(old), pad(sampler), pad(mask))
    for name in ("training_ppl", "rollout_ppl", "log_ppl_diff", "ppl_ratio", "chi2_seq"):
        assert padded[name] == pytest.approx(expected[name], rel=1e-6)
        assert padded[name] != pytest.approx(full[name], rel=1e-6), name
    for name in ("kl", "k3_kl", "chi2_token", "out_of_band", "ess"):  # token means: empty rows change nothing
        assert padded[name] == pytest.approx(full[name], rel=1e-12)


# ---- TRL 1.16


def trl_is_ratio_reference(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):
    """TRL 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions (the block after
    "Compute the importance sampling ratio when using vLLM"), with `self.vllm_importance_sampling_*` as arguments."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = (ratio < min_val) | (ratio > max_val)
        ratio = ratio.masked_fill(invalid_mis_mask, value=0.0)
    return ratio


def test_reproduced_trl_lines_are_in_trl(trl_grpo):
    source = inspect.getsource(trl_grpo._generate_and_score_completions)
    for line in ("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
                 "per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)",
                 "per_token_logps_diff.sum(dim=-1, keepdim=True)",
                 "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
                 "invalid_mis_mask, value=0.0"):
        assert line in source


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 2.0), (1.5, None), (0.8, 1.25)])
def test_trl_is_ratio_equals_trl(mode, clip_min, clip_max):
    for seed in SEEDS:
        old, sampler, mask = random_batch(seed, torch.float32)
        sampler = sampler.clone()
        sampler[1, 3] = math.nan  # a token the sampler could not score: TRL counts it as ratio 1
        expected = trl_is_ratio_reference(old, sampler, mask, mode, clip_min, clip_max)
        ours = C.trl_is_ratio(old - sampler, mask, mode, clip_min, clip_max)
        torch.testing.assert_close(ours, expected.expand_as(ours), **TOL)


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.5])
@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_off_policy_mask_equals_trl(trl_grpo, threshold, per_token_advantages):
    for seed in SEEDS:
        logp, sampler, mask = random_batch(seed, torch.float32)
        sampler = sampler.clone()
        sampler[2, 0] = math.nan
        g = torch.Generator().manual_seed(seed)
        shape = mask.shape if per_token_advantages else (mask.shape[0], 1)
        advantages = torch.randn(shape, generator=g)
        advantages[3] = 0.0  # advantage 0 keeps the sequence
        expected = trl_grpo.get_off_policy_mask(advantages, logp, sampler, mask, threshold)
        ours = C.off_policy_mask(logp - sampler, mask, advantages if per_token_advantages else advantages[:, 0],
                                 threshold)
        assert torch.equal(ours, expected.expand_as(ours))


# ---- applied in the loss, as verl applies them


class _ActorConfig(dict):
    """The few fields of verl's ActorConfig that compute_policy_loss_vanilla reads."""

    __getattr__ = dict.__getitem__


@pytest.mark.parametrize(("algo", "aggregation"), [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean")])
def test_corrected_loss_equals_verl_vanilla_ppo_with_rollout_weights(algo, aggregation):
    """verl multiplies each token's PPO loss by the IS weight and drops rejected tokens from response_mask; our
    corrected advantages and loss mask give the same loss and the same gradient (autograd on both sides)."""
    core_algos = import_verl("verl.trainer.ppo.core_algos")
    old, sampler, mask = random_batch(11)
    g = torch.Generator().manual_seed(11)
    logp = (old + 0.2 * torch.randn(old.shape, generator=g, dtype=old.dtype)).requires_grad_(True)
    advantages = torch.randn(old.shape[0], generator=g, dtype=old.dtype)
    config = CorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_rs="seq_mean_k3,token_k1",
                              rollout_rs_threshold="0.2,0.2_5.0")
    batch = C.correct_batch(config, old, sampler, mask)
    assert 0 < int(batch.loss_mask.sum()) < int(mask.sum()) and bool((batch.weight[batch.loss_mask > 0] == 0).any())
    inputs = C.loss_inputs(algo, config, batch, advantages, logp, sampler, mask)
    ours = policy_loss(algo, logp, old, inputs.advantages, inputs.mask, eps_low=0.2, eps_high=0.28,
                       aggregation=aggregation)
    verl_logp = logp.detach().clone().requires_grad_(True)
    settings = _ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9,
                            global_batch_info={"global_batch_size": old.shape[0]} if algo == "grpo" else {})
    on = mask.bool()
    verl_loss, _ = core_algos.compute_policy_loss_vanilla(
        torch.where(on, old, 0.0), torch.where(on, verl_logp, 0.0), advantages[:, None].expand_as(old),
        batch.loss_mask, aggregation, settings, rollout_is_weights=batch.weight)
    close = dict(rtol=1e-7, atol=1e-12)  # verl's seq-mean-token-mean divides by |o_i| + 1e-8
    torch.testing.assert_close(ours.loss, verl_loss, **close)
    (ours_grad,) = torch.autograd.grad(ours.loss, logp)
    (verl_grad,) = torch.autograd.grad(verl_loss, verl_logp)
    torch.testing.assert_close(ours_grad, verl_grad, **close)
    torch.testing.assert_close(-ours_grad, ours.grad_weight, rtol=1e-9, atol=1e-12)
