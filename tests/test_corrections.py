"""engine.corrections on small tensors worked out by hand (one labelled case per row), the details that are easy to get
wrong (each pinned by a case), and the corrections applied in the loss of every algorithm, checked with autograd.
The comparisons with verl 0.9.1 and TRL 1.16 on random batches are in test_corrections_reference.py."""

from __future__ import annotations

import math

import pytest
import torch

from engine import corrections as C
from engine.correction_settings import (
    REJECT_IS_ZERO,
    REJECT_NONE,
    REJECT_OFF_POLICY,
    REJECT_SEQUENCE,
    REJECT_TOKEN,
    CorrectionConfig,
)
from engine.objectives import ALGORITHMS, OBJECTIVES, aggregation_weights, policy_loss

L2, L3 = math.log(2.0), math.log(3.0)
PAD = 9.0  # what padding holds in these cases: a correct function never reads it


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


IS_CASES = [
    # id, level, threshold, log_ratio, mask, expected weights
    ("TIS token truncates above u only", "token", 2.0, [[L3, math.log(0.25), 0.0]], [[1, 1, 1]], [[2.0, 0.25, 1.0]]),
    ("TIS token is 0 on padding", "token", 2.0, [[math.log(1.5), PAD]], [[1, 0]], [[1.5, 0.0]]),
    ("IcePop keeps its lower bound, zeroes outside", "token", "1.0_3.0", [[0.0, L2, math.log(5.0), -0.1]],
     [[1, 1, 1, 1]], [[1.0, 2.0, 0.0, 0.0]]),
    ("IcePop keeps its upper bound", "token", "0.5_1.0", [[0.0, 0.4]], [[1, 1]], [[1.0, 0.0]]),
    ("sequence weight is the product of the ratios, truncated", "sequence", 3.0, [[L2, L2, PAD]], [[1, 1, 0]],
     [[3.0, 3.0, 0.0]]),
    ("sequence weight below the bound", "sequence", 2.0, [[L2, math.log(0.25)]], [[1, 1]], [[0.5, 0.5]]),
    ("sequence IcePop zeroes the whole row", "sequence", "0.5_3.0", [[L2, L2]], [[1, 1]], [[0.0, 0.0]]),
    ("token log-ratio clamped to +20 before exp", "token", 1e9, [[30.0]], [[1]], [[math.exp(20.0)]]),
    ("sequence: the sum is clamped, not each token", "sequence", 1e9, [[25.0, -10.0]], [[1, 1]],
     [[math.exp(15.0), math.exp(15.0)]]),
    ("a row without response tokens weighs 0", "sequence", 2.0, [[0.3, 0.3]], [[0, 0]], [[0.0, 0.0]]),
]


@pytest.mark.parametrize(("level", "threshold", "log_ratio", "mask", "expected"),
                         [case[1:] for case in IS_CASES], ids=[case[0] for case in IS_CASES])
def test_is_weights_by_hand(level, threshold, log_ratio, mask, expected):
    torch.testing.assert_close(C.is_weights(t(log_ratio), t(mask), level, threshold), t(expected), rtol=1e-12,
                               atol=0)


def test_batch_normalize_by_hand():
    # token level: weights 1 and 3, mean 2
    torch.testing.assert_close(C.is_weights(t([[0.0, L3]]), t([[1, 1]]), "token", 5.0, batch_normalize=True),
                               t([[0.5, 1.5]]))
    # sequence level: row weights 2 and 1 (the empty third row does not count), mean 1.5
    log_ratio, mask = t([[L2, 0.0], [0.0, PAD], [PAD, PAD]]), t([[1, 1], [1, 0], [0, 0]])
    torch.testing.assert_close(C.is_weights(log_ratio, mask, "sequence", 5.0, batch_normalize=True),
                               t([[4 / 3, 4 / 3], [2 / 3, 0.0], [0.0, 0.0]]))


def test_icepop_zeroing_every_weight_gives_zeros_and_ess_0_where_verl_divides_by_zero():
    from verl_reference import import_verl

    helper = import_verl("verl.trainer.ppo.rollout_corr_helper")
    log_ratio, mask = t([[L3, L3], [-L3, PAD]]), t([[1, 1], [1, 0]])
    with pytest.raises(ZeroDivisionError):
        helper.compute_rollout_correction_weights(log_ratio, mask, "token", "0.5_2.0", True)
    weights = C.is_weights(log_ratio, mask, "token", "0.5_2.0", batch_normalize=True)
    assert torch.equal(weights, torch.zeros_like(weights))
    assert C.is_weight_metrics(weights, mask, 2.0) == {"is_weight_mean": 0.0, "is_weight_max": 0.0,
                                                       "is_weight_ess": 0.0}


def test_is_weight_metrics_by_hand():
    weights, mask = t([[1.0, 3.0, 7.0], [2.0, 0.0, 0.0]]), t([[1, 1, 0], [1, 0, 0]])
    metrics = C.is_weight_metrics(weights, mask, upper=2.5)
    assert metrics["is_weight_mean"] == pytest.approx(2.0)  # (1 + 3 + 2) / 3, padding's 7 ignored
    assert metrics["is_weight_max"] == 3.0
    # ESS on the weights clamped to [0, 2.5]: (1, 2.5, 2) -> mean 11/6, mean of squares 11.25/3
    assert metrics["is_weight_ess"] == pytest.approx((11 / 6) ** 2 / (11.25 / 3))


def test_is_weights_are_detached():
    log_ratio = t([[0.1, -0.2]]).requires_grad_(True)
    assert not C.is_weights(log_ratio, t([[1, 1]])).requires_grad
    assert not C.trl_is_ratio(log_ratio, t([[1, 1]]), "token_truncate").requires_grad


RS_CASES = [
    # id, options, thresholds, log_ratio, mask, expected kept mask
    ("token_k1 single u=2 is the band [1/2, 2] on pi_sampler/pi_trainer", "token_k1", 2.0,
     [[L3, -math.log(1.5), math.log(1.5), -L3]], [[1, 1, 1, 1]], [[0, 1, 1, 0]]),
    ("token_k1 lower_upper bounds pi_sampler/pi_trainer, not its inverse", "token_k1", "0.9_2.5",
     [[-L2, L2, -L3]], [[1, 1, 1]], [[1, 0, 0]]),
    ("token_k2 is log_ratio^2 / 2", "token_k2", 0.13, [[0.5, -0.7]], [[1, 1]], [[1, 0]]),
    ("token_k3 = r - 1 - log r: 0.307 > 0.3", "token_k3", 0.3, [[L2, 0.0]], [[1, 1]], [[0, 1]]),
    ("token_k3 = r - 1 - log r: 0.307 <= 0.31", "token_k3", 0.31, [[L2]], [[1]], [[1]]),
    ("seq_sum_k3 sums over the row: 0.614 > 0.6", "seq_sum_k3", 0.6, [[L2, L2, PAD]], [[1, 1, 0]], [[0, 0, 0]]),
    ("seq_sum_k3 sums over the row: 0.614 <= 0.62", "seq_sum_k3", 0.62, [[L2, L2, PAD]], [[1, 1, 0]], [[1, 1, 0]]),
    ("seq_mean_k3 averages over the response tokens", "seq_mean_k3", 0.31, [[L2, L2, PAD]], [[1, 1, 0]],
     [[1, 1, 0]]),
    ("seq_max_k2 takes the worst token", "seq_max_k2", 0.4, [[0.1, 1.0], [0.1, PAD]], [[1, 1], [1, 0]],
     [[0, 0], [1, 0]]),
    ("seq_sum_k1: product pi_s/pi_t = 1/4 is outside [1/3, 3]", "seq_sum_k1", 3.0, [[L2, L2]], [[1, 1]], [[0, 0]]),
    ("seq_mean_k1: geometric mean 1/2 is inside [1/3, 3]", "seq_mean_k1", 3.0, [[L2, L2]], [[1, 1]], [[1, 1]]),
    ("sequence statistics use each token's log-ratio clamped to -20", "seq_sum_k3", 25.0, [[-30.0]], [[1]], [[1]]),
    # row 0: token 0 fails token_k1 only (k2 = 0.60 <= 0.7); row 2: token 1 fails both, so token 0 falls with its row
    ("chained options: a token must pass every one", "token_k1,seq_max_k2", "2.0,0.7",
     [[L3, 0.0], [0.1, 0.2], [0.1, 1.2]], [[1, 1], [1, 1], [1, 1]], [[0, 1], [1, 1], [0, 0]]),
    ("a repeated option counts once (one threshold suffices)", "token_k2,token_k2", 0.13, [[0.5, -0.7]], [[1, 1]],
     [[1, 0]]),
]


@pytest.mark.parametrize(("options", "thresholds", "log_ratio", "mask", "expected"),
                         [case[1:] for case in RS_CASES], ids=[case[0] for case in RS_CASES])
def test_rejection_mask_by_hand(options, thresholds, log_ratio, mask, expected):
    assert torch.equal(C.rejection_mask(t(log_ratio), t(mask), options, thresholds), t(expected))


def test_repeated_option_with_one_threshold_per_listed_option_is_refused_as_in_verl():
    with pytest.raises(ValueError, match="2 values for 1 distinct options"):
        C.rejection_mask(t([[0.1]]), t([[1]]), "token_k2,token_k2", "0.1,0.2")


def test_rejection_rates_count_empty_rows_in_the_sequence_share():
    kept, mask = t([[1, 0], [1, 1], [0, 0], [0, 0]]), t([[1, 1], [1, 1], [0, 0], [0, 0]])
    assert C.rejection_rates(kept, mask) == {"rejected_token_share": 0.25, "rejected_seq_share": 0.25}


TRL_CASES = [
    # id, mode, clip_min, clip_max, log_ratio, mask, expected
    ("token_truncate: padding's ratio is 1, then clamped like the rest", "token_truncate", 1.5, 3.0,
     [[math.log(4.0), PAD]], [[1, 0]], [[3.0, 1.5]]),
    ("sequence modes use the sum of the log-ratios (the product)", "sequence_truncate", None, 10.0, [[L2, L2, PAD]],
     [[1, 1, 0]], [[4.0, 4.0, 4.0]]),
    ("token_mask keeps both bounds", "token_mask", 1.0, 3.0, [[0.0, -L2]], [[1, 1]], [[1.0, 0.0]]),
    ("sequence_mask zeroes the whole row", "sequence_mask", None, 3.0, [[L2, L2]], [[1, 1]], [[0.0, 0.0]]),
    ("TRL does not clamp the log-ratio", "token_truncate", None, 1e12, [[25.0]], [[1]], [[math.exp(25.0)]]),
    ("an unscored token (NaN) counts as ratio 1", "token_mask", 0.5, 2.0, [[math.nan, L3]], [[1, 1]], [[1.0, 0.0]]),
]


@pytest.mark.parametrize(("mode", "clip_min", "clip_max", "log_ratio", "mask", "expected"),
                         [case[1:] for case in TRL_CASES], ids=[case[0] for case in TRL_CASES])
def test_trl_is_ratio_by_hand(mode, clip_min, clip_max, log_ratio, mask, expected):
    torch.testing.assert_close(C.trl_is_ratio(t(log_ratio), t(mask), mode, clip_min, clip_max), t(expected),
                               rtol=1e-12, atol=0)


def test_off_policy_mask_by_hand():
    # log_ratio = trainer - sampler, so the mean (sampler - trainer) gap of a row is -mean(log_ratio); delta 0.5
    rows = [
        ([-1.0, -1.0], [1, 1], 1.0, 1.0),  # positive advantage: kept whatever the gap
        ([-1.0, -1.0], [1, 1], 0.0, 1.0),  # advantage 0 counts as >= 0: kept
        ([-1.0, -1.0], [1, 1], -1.0, 0.0),  # negative advantage, gap 1 > 0.5: dropped
        ([-0.5, -0.5], [1, 1], -1.0, 1.0),  # gap exactly 0.5 <= 0.5: kept
        ([-0.2, -50.0], [1, 0], -1.0, 1.0),  # padding ignored: gap 0.2
        ([-1.0, PAD], [1, 0], -1.0, 0.0),  # gap 1 over the one response token: dropped
    ]
    log_ratio, mask = t([r[0] for r in rows]), t([r[1] for r in rows])
    advantages = t([r[2] for r in rows])
    keep = C.off_policy_mask(log_ratio, mask, advantages, 0.5)
    assert torch.equal(keep, t([[r[3]] * 2 for r in rows]))


def test_offpolicy_metrics_by_hand():
    old = t([[-1.0, -2.0]])
    sampler = old - t([[L2, 0.0]])  # the trainer gives the first token twice the sampler's probability
    m = C.offpolicy_metrics(old, sampler, t([[1, 1]]))
    expected = {
        "kl": -L2 / 2, "k3_kl": (1 - L2) / 2, "training_log_ppl": 1.5, "training_ppl": math.exp(1.5),
        "rollout_log_ppl": 1.5 + L2 / 2, "rollout_ppl": math.exp(1.5 + L2 / 2), "log_ppl_diff": -L2 / 2,
        "log_ppl_abs_diff": L2 / 2, "ppl_ratio": 2 ** -0.5, "chi2_token": (4 + 1) / 2 - 1, "chi2_seq": 4 - 1,
        "out_of_band": 0.5, "ess": 1.5**2 / 2.5, "mean_abs_log_ratio": L2 / 2,
    }
    for name, value in expected.items():
        assert m[name] == pytest.approx(value, rel=1e-12), name
    # an empty row counts in the per-sequence metrics (mean log-prob 0, weight 1), not in the token means
    m2 = C.offpolicy_metrics(torch.cat([old, t([[PAD, PAD]])]), torch.cat([sampler, t([[PAD, PAD]])]),
                             t([[1, 1], [0, 0]]))
    assert m2["training_ppl"] == pytest.approx((math.exp(1.5) + 1) / 2)
    assert m2["chi2_seq"] == pytest.approx((4 + 1) / 2 - 1)
    assert m2["kl"] == pytest.approx(-L2 / 2) and m2["out_of_band"] == 0.5


def test_metrics_of_a_batch_without_response_tokens_are_nan():
    m = C.offpolicy_metrics(t([[-1.0]]), t([[-1.0]]), t([[0]]))
    assert all(math.isnan(v) for v in m.values())


def test_nan_on_a_response_token_is_a_clear_error_nan_on_padding_is_ignored():
    with pytest.raises(ValueError, match=r"NaN on 1 response token"):
        C.is_weights(t([[math.nan, 0.0]]), t([[1, 1]]))
    assert torch.equal(C.is_weights(t([[0.0, math.nan]]), t([[1, 0]])), t([[1.0, 0.0]]))
    with pytest.raises(ValueError, match="same shape"):
        C.rejection_mask(t([[0.0, 0.0]]), t([[1]]), "token_k2", 0.1)
    with pytest.raises(ValueError, match="other than 0 and 1"):
        C.is_weights(t([[0.0]]), t([[0.5]]))


# ---- applied in the loss


def loss_batch(seed=0, B=8, T=10):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
    sampler = old - 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    ref = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64)
    return logp, old, sampler, advantages, mask, ref, entropy


CONFIGS = {
    "token IcePop + rejection + off-policy mask": CorrectionConfig(
        rollout_is="token", rollout_is_threshold="0.6_1.6", rollout_rs="token_k1,seq_mean_k3",
        rollout_rs_threshold="0.4_2.5,0.25", off_policy_mask=0.05),
    "sequence TIS": CorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0),
    "TRL token_mask": CorrectionConfig(rollout_is="token_mask", rollout_is_threshold="0.7_1.4"),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_gradient_weight_stays_exact_with_corrections(algo, config_name):
    """Through policy_loss with the corrected advantages and mask: the closed-form gradient weight equals autograd's
    (KL term included), and the policy loss is sum(a * w * token_loss), the weight times each token's loss."""
    config = CONFIGS[config_name]
    logp, old, sampler, advantages, mask, ref, entropy = loss_batch()
    batch = C.correct_batch(config, old, sampler, mask)
    if not OBJECTIVES[algo].loss_scales_with_advantage:  # DRO, Clip-Cov, KL-Cov: a weight on A is not on the loss
        with pytest.raises(ValueError, match=f"{algo}'s loss is not proportional"):
            C.loss_inputs(algo, config, batch, advantages, logp, sampler, mask)
        config = CorrectionConfig(rollout_rs=config.rollout_rs or "token_k1", rollout_rs_threshold=(
            config.rollout_rs_threshold or "0.6_1.6"))  # rejection alone works with every algorithm
        batch = C.correct_batch(config, old, sampler, mask)
    inputs = C.loss_inputs(algo, config, batch, advantages, logp, sampler, mask)
    out = policy_loss(algo, logp, old, inputs.advantages, inputs.mask, ref_logp=ref, entropy=entropy)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(-grad, out.grad_weight, rtol=1e-9, atol=1e-12)

    weighted = policy_loss(algo, logp, old, inputs.advantages, inputs.mask, entropy=entropy)
    plain = policy_loss(algo, logp, old, advantages, inputs.mask, entropy=entropy)
    a = aggregation_weights(inputs.mask, weighted.params["aggregation"], weighted.params["max_len"])
    torch.testing.assert_close(weighted.loss, (a * inputs.weight * plain.token_loss).sum(), rtol=1e-9, atol=1e-12)
    if OBJECTIVES[algo].ratio_level in ("token", "sequence-token"):  # token-local gradients: scaled token by token
        torch.testing.assert_close(weighted.grad_weight, inputs.weight * plain.grad_weight, rtol=1e-9, atol=1e-12)
        # a token whose loss the weight zeroes gets no gradient (sequence-level ratios spread the row's over it)
        assert bool((weighted.grad_weight[(mask > 0) & (inputs.weight == 0)] == 0).all())
    assert bool((out.grad_weight[inputs.mask == 0] == 0).all())  # a rejected token is out of the loss

def test_the_first_config_really_rejects_and_weighs():
    logp, old, sampler, advantages, mask, _, _ = loss_batch()
    config = CONFIGS["token IcePop + rejection + off-policy mask"]
    batch = C.correct_batch(config, old, sampler, mask)
    inputs = C.loss_inputs("grpo", config, batch, advantages, logp, sampler, mask)
    codes = set(inputs.rejected[mask > 0].tolist())
    assert {REJECT_NONE, REJECT_TOKEN, REJECT_SEQUENCE, REJECT_OFF_POLICY, REJECT_IS_ZERO} <= codes
    assert bool(((inputs.weight != 1) & (inputs.weight != 0) & (mask > 0)).any())


def test_a_rejected_sequence_stays_in_the_batch_with_mask_0():
    old, mask = t([[-1.0, -1.0], [-1.0, -1.0]]), t([[1, 1], [1, 0]])
    sampler = old - t([[1.5, 1.5], [0.0, PAD]])  # row 0: seq_mean_k3 = e^1.5 - 2.5 = 1.98
    config = CorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.5)
    batch = C.correct_batch(config, old, sampler, mask)
    assert batch.loss_mask.shape == mask.shape
    assert torch.equal(batch.loss_mask, t([[0, 0], [1, 0]]))
    assert batch.rejected.tolist() == [[REJECT_SEQUENCE, REJECT_SEQUENCE], [REJECT_NONE, REJECT_NONE]]
    assert batch.metrics["rejected_seq_share"] == 0.5 and batch.metrics["rejected_token_share"] == pytest.approx(2 / 3)


def test_the_token_reason_wins_over_the_sequence_reason():
    old, mask = t([[-1.0, -1.0, -1.0]]), t([[1, 1, 1]])
    sampler = old - t([[3.0, 0.0, 0.0]])  # token 0 fails token_k1 (band [1/2, 2]), the row fails seq_max_k3
    config = CorrectionConfig(rollout_rs="seq_max_k3,token_k1", rollout_rs_threshold="1.0,2.0")
    assert C.correct_batch(config, old, sampler, mask).rejected.tolist() == [[REJECT_TOKEN, REJECT_SEQUENCE,
                                                                              REJECT_SEQUENCE]]


def test_gmpo_takes_one_positive_weight_per_sequence_as_verl():
    logp, old, sampler, advantages, mask, _, _ = loss_batch(3)
    config = CorrectionConfig(rollout_is="token", rollout_is_threshold="0.8_1.2")  # IcePop zeroes some tokens
    batch = C.correct_batch(config, old, sampler, mask)
    assert bool((batch.weight[mask > 0] == 0).any())
    inputs = C.loss_inputs("gmpo", config, batch, advantages, logp, sampler, mask)
    on = mask > 0
    log_w = (torch.log(batch.weight + 1e-10) * mask).sum(-1) / (mask.sum(-1) + 1e-8)  # verl's geo-mean weight
    torch.testing.assert_close(inputs.weight, torch.where(on, torch.exp(log_w)[:, None].expand_as(mask), 0.0))
    signs = torch.sign(inputs.advantages[on]) == torch.sign(advantages[:, None].expand_as(mask)[on])
    assert bool(signs.all())


def test_the_docs_example_runs_as_written():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "mismatch.md").read_text(encoding="utf-8")
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "correct_batch" in block]
    logp, old, sampler, advantages, mask, _, _ = loss_batch()
    names = dict(config=CONFIGS["token IcePop + rejection + off-policy mask"], old_logp=old, sampler_logp=sampler,
                 mask=mask, minibatches=[slice(0, 4), slice(4, 8)], algo="dapo", advantages=advantages,
                 policy_logp=lambda rows: logp.detach()[rows].clone().requires_grad_(True))
    exec(example, names)
    assert torch.isfinite(names["out"].loss) and names["logp"].grad is not None
    assert names["inp"].rejected.shape == names["out"].clip.shape == (4, mask.shape[1])
