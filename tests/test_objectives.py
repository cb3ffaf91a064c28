"""Tests of engine/objectives.py: hand-computed cases, closed form vs autograd, invariants, an independent reference.

Expected numbers are written out by hand (with the arithmetic in the case's comment) or computed here from the
paper's formula with `math`; nothing expected is produced by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference_impl import PUBLISHED, reference_grad_weight, reference_loss

from engine.objectives import AGGREGATIONS, ALGORITHMS, defaults, policy_loss

# The algorithms tests/reference_impl.py writes out; the rules added with issue 22 (GPG ... VESPO) are compared
# against verl's and TRL's own code in tests/test_rules.py.
REFERENCED = tuple(a for a in ALGORITHMS if a in PUBLISHED)
# Published defaults of the rules compared in tests/test_rules.py, typed from verl 0.9.1's actor config
# (clip_ratio 0.2, clip_ratio_c 3.0, clip_cov_* , kl_cov_ratio, ppo_kl_coef 0.1) and TRL 1.16's GRPOConfig (vespo_*).
RULES_PUBLISHED = {
    "gpg": {"beta": 0.0, "aggregation": "token-mean"},
    "dppo_tv": {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "aggregation": "token-mean", "dual_clip": 3.0},
    "dppo_kl": {"eps_low": 0.05, "eps_high": 0.05, "beta": 0.0, "aggregation": "token-mean", "dual_clip": 3.0},
    "dro": {"beta": 0.0, "aggregation": "token-mean", "dro_beta": 1.0},
    "clip_cov": {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "aggregation": "token-mean", "clip_cov_ratio": 2e-4,
                 "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"beta": 0.0, "aggregation": "token-mean", "kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1},
    "luspo": {"eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0, "aggregation": "seq-mean-token-sum"},
    "vespo": {"beta": 0.0, "aggregation": "token-mean", "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
              "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0},
}

torch.set_num_threads(1)
F64 = torch.float64


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def batch(ratios, adv, mask=None, garbage=0.0):
    """logp/old_logp with the given per-token ratios (old_logp = log 0.5 everywhere, a realistic value)."""
    r = torch.tensor(ratios, dtype=F64)
    if r.dim() == 1:
        r = r[None, :]
    old = torch.full_like(r, math.log(0.5))
    logp = old + torch.log(r)
    m = torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=F64).reshape(r.shape)
    logp = torch.where(m > 0, logp, torch.full_like(logp, garbage))  # padding may hold anything finite
    return logp, old, torch.tensor(adv, dtype=F64), m


# ----------------------------------------------------------------------------------------------------------------
# Published defaults and the public names


def test_algorithms_and_aggregations_are_the_documented_names():
    assert ALGORITHMS == ("grpo", "dapo", "gspo", "gspo_token", "aspo", "dr_grpo", "cispo", "sapo", "gmpo", "ppo",
                          "gpg", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov", "luspo", "vespo")
    assert set(AGGREGATIONS) == {"seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "seq-mean",
                                 "seq-mean-token-sum"}


@pytest.mark.parametrize("algo", list(PUBLISHED) + list(RULES_PUBLISHED))
def test_defaults_are_the_published_ones(algo):
    published = {**PUBLISHED, **RULES_PUBLISHED}[algo]
    assert defaults(algo) == {**published, "max_len": None, "top_entropy_quantile": 1.0}


# ----------------------------------------------------------------------------------------------------------------
# Hand-computed cases: one labelled row each
# (algo, ratios, advantages, mask, overrides, expected loss, expected grad_weight, expected clip)

S_1 = math.exp(0.0003)  # GSPO sequence ratio of log ratios (0.0004, 0.0002)
S_NOCLIP = math.exp(0.0002)  # (0.002, -0.0016): one token far out, the sequence inside the band
G_UNCLIPPED = math.exp(0.05)  # GMPO mean log ratio (0.2 - 0.1) / 2
G_HIGH = math.exp(0.15)  # (min(0.6, 0.4) - 0.1) / 2
G_LOW = math.exp(-0.15)  # (max(-0.6, -0.4) + 0.1) / 2
SAPO_F2 = 4 * sig(1.0) * (1 - sig(1.0))  # gate derivative factor at r = 2, tau = 1
SAPO_F2N = 4 * sig(1.05) * (1 - sig(1.05))  # at r = 2, tau = 1.05
SAPO_F4 = 4 * sig(3.0) * (1 - sig(3.0))  # at r = 4, tau = 1: below 0.5 -> soft cap

# the rules of issue 22, token-mean over the completion's tokens unless said otherwise; old p = 0.5 everywhere
VESPO_W = math.exp(0.3)  # log ratios 0.1 + 0.2 summed
VESPO_PHI_POS = math.exp(3 + 2 * 0.3 - 3 * VESPO_W)  # k 2, lambda 3 for A >= 0
VESPO_PHI_NEG = math.exp(2 + 3 * 0.3 - 2 * VESPO_W)  # k 3, lambda 2 for A < 0
LUSPO_S = math.exp(0.0003)  # mean of log ratios 0.0002, 0.0004: inside (1 - 3e-4, 1 + 4e-4)
# KL-Cov, three one-token completions, log r (0.1, -0.2, 0), A (1, -1, 0.5): covariances 0.111, 0.194, 0.011 (A's mean
# 1/6, log pi's mean log 0.5 - 1/30): only the second gets 0.1 |log r|
KLCOV_LOSS = (-math.exp(0.1) + math.exp(-0.2) + 0.1 * 0.2 - 0.5) / 3
KLCOV_W = [[math.exp(0.1) / 3], [(-math.exp(-0.2) + 0.1) / 3], [0.5 / 3]]
# binary KL of p = 0.6 from p_old = 0.5: 0.5 log(0.5/0.6) + 0.5 log(0.5/0.4) = 0.0204 < 0.05; p = 0.75: 0.1438 > 0.05

CASES = {
    # GPG: -A log pi; value -A per token (departure 1), weight A / |o|
    "gpg": ("gpg", [2.0, 0.5], [1.0], None, {}, -1.0, [[0.5, 0.5]], [[0, 0]]),
    # DPPO-TV, A > 0: p 0.75 is 0.25 above p_old > 0.2: masked (high); p 0.65 passes with weight r = 1.3
    "dppo-tv-positive": ("dppo_tv", [1.5, 1.3], [1.0], None, {}, -1.3 / 2, [[0.0, 0.65]], [[2, 0]]),
    # A < 0: p 0.25 is 0.25 below: masked (low); p 0.95 rose 0.45, but up is the safe direction for A < 0
    "dppo-tv-negative": ("dppo_tv", [0.5, 1.9], [-1.0], None, {}, 1.9 / 2, [[0.0, -0.95]], [[1, 0]]),
    # A = 0 takes the negative branch: p 0.25 is masked, yet no code (A = 0 is never reported) and no gradient
    "dppo-tv-zero-advantage": ("dppo_tv", [0.5], [0.0], None, {}, 0.0, [[0.0]], [[0]]),
    # DPPO-KL: binary KL 0.0204 passes (weight 1.2), 0.1438 with p above p_old and A > 0 is masked
    "dppo-kl-positive": ("dppo_kl", [1.2, 1.5], [1.0], None, {}, -1.2 / 2, [[0.6, 0.0]], [[0, 2]]),
    # DPPO-KL, A > 0 and p below p_old: always allowed, whatever the divergence (p 0.1: binary KL 0.51)
    "dppo-kl-safe-direction": ("dppo_kl", [0.2], [1.0], None, {}, -0.2, [[0.2]], [[0]]),
    # DRO, dro_beta 1, log r (0.2, -0.1): -(A - (log r)^2 / 2) per token; weight (A - log r) / 2
    "dro": ("dro", [math.exp(0.2), math.exp(-0.1)], [1.0], None, {}, -(0.98 + 0.995) / 2, [[0.4, 0.55]], [[0, 0]]),
    # VESPO, w = exp(0.1 + 0.2): weight phi(w) A on every token, value -phi A
    "vespo-positive": ("vespo", [math.exp(0.1), math.exp(0.2)], [1.0], None, {}, -VESPO_PHI_POS,
                       [[VESPO_PHI_POS / 2, VESPO_PHI_POS / 2]], [[0, 0]]),
    "vespo-negative": ("vespo", [math.exp(0.1), math.exp(0.2)], [-1.0], None, {}, VESPO_PHI_NEG,
                       [[-VESPO_PHI_NEG / 2, -VESPO_PHI_NEG / 2]], [[0, 0]]),
    # LUSPO: the sequence's loss -s A summed over its 2 tokens (one sequence): -2 s; d loss / d logp_t = -s A / 2 * 2
    "luspo-unclipped": ("luspo", [math.exp(0.0002), math.exp(0.0004)], [1.0], None, {}, -2 * LUSPO_S,
                        [[LUSPO_S, LUSPO_S]], [[0, 0]]),
    "luspo-clipped-high": ("luspo", [math.exp(0.001), math.exp(0.001)], [1.0], None, {}, -2 * 1.0004, [[0.0, 0.0]],
                           [[2, 2]]),
    "kl-cov": ("kl_cov", [[math.exp(0.1)], [math.exp(-0.2)], [1.0]], [1.0, -1.0, 0.5], None, {}, KLCOV_LOSS, KLCOV_W,
               [[0], [4], [0]]),
    # Clip-Cov, band (0.15, 5): log r (0.0953, 0, 0), A (3, -3, 0): covariances 0.191, 0.095, 0: only the first is
    # eligible and it is zeroed (count max(1, 2e-4 * 3) = 1), staying in the token-mean's denominator
    "clip-cov": ("clip_cov", [[1.1], [1.0], [1.0]], [3.0, -3.0, 0.0], None, {"clip_cov_lb": 0.15}, 3.0 / 3,
                 [[0.0], [-1.0], [0.0]], [[4], [0], [0]]),
    # GRPO, seq-mean-token-mean over 2 tokens: loss = -(1.1 + 0.9) / 2; w = r * A / 2
    "grpo-unclipped": ("grpo", [1.1, 0.9], [1.0], None, {}, -1.0, [[0.55, 0.45]], [[0, 0]]),
    # r = 1.5 > 1.2 with A > 0: token 0 is worth clip(r) A = 1.2 and gets no gradient
    "grpo-clipped-high": ("grpo", [1.5, 1.1], [1.0], None, {}, -(1.2 + 1.1) / 2, [[0.0, 0.55]], [[2, 0]]),
    # r = 0.5 < 0.8 with A < 0: -min(-0.5, -0.8) = 0.8, no gradient; token 1: 0.9, w = 0.9 * -1 / 2
    "grpo-clipped-low": ("grpo", [0.5, 0.9], [-1.0], None, {}, (0.8 + 0.9) / 2, [[0.0, -0.45]], [[1, 0]]),
    # r below 1 - eps but A > 0: the min picks r A, not clipped
    "grpo-low-ratio-positive-adv": ("grpo", [0.5], [1.0], None, {}, -0.5, [[0.5]], [[0]]),
    # r above 1 + eps but A < 0: the min picks r A (more penalty), not clipped
    "grpo-high-ratio-negative-adv": ("grpo", [1.5], [-1.0], None, {}, 1.5, [[-1.5]], [[0]]),
    # the third token is padding holding a wild ratio: it must change nothing
    "grpo-masked": ("grpo", [1.1, 0.9, 40.0], [1.0], [1, 1, 0], {}, -1.0, [[0.55, 0.45, 0.0]], [[0, 0, 0]]),
    # lengths 1 and 3, r = 1, A = (1, -0.5): (1/2)(-1 + 0.5) ; w = A / (2 |o_i|)
    "grpo-unequal-lengths": (
        "grpo",
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]],
        [1.0, -0.5],
        [[1, 0, 0], [1, 1, 1]],
        {},
        -0.25,
        [[0.5, 0.0, 0.0], [-1 / 12, -1 / 12, -1 / 12]],
        [[0, 0, 0], [0, 0, 0]],
    ),
    # the same batch, DAPO token-mean over 4 tokens: (-1 + 3 * 0.5) / 4 ; w = A / 4
    "dapo-unequal-lengths": (
        "dapo",
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]],
        [1.0, -0.5],
        [[1, 0, 0], [1, 1, 1]],
        {},
        0.125,
        [[0.25, 0.0, 0.0], [-0.125, -0.125, -0.125]],
        [[0, 0, 0], [0, 0, 0]],
    ),
    # Dr. GRPO divides token sums by B * T = 2 * 3: (-1 + 1.5) / 6 ; w = A / 6
    "dr_grpo-unequal-lengths": (
        "dr_grpo",
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]],
        [1.0, -0.5],
        [[1, 0, 0], [1, 1, 1]],
        {},
        1 / 12,
        [[1 / 6, 0.0, 0.0], [-1 / 12, -1 / 12, -1 / 12]],
        [[0, 0, 0], [0, 0, 0]],
    ),
    # ... and by B * max_len = 2 * 10 with the override
    "dr_grpo-max-len": (
        "dr_grpo",
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]],
        [1.0, -0.5],
        [[1, 0, 0], [1, 1, 1]],
        {"max_len": 10},
        0.5 / 20,
        [[1 / 20, 0.0, 0.0], [-0.5 / 20, -0.5 / 20, -0.5 / 20]],
        [[0, 0, 0], [0, 0, 0]],
    ),
    # clip-higher: 1.25 is clipped by GRPO (1.2) but not by DAPO (1.28)
    "dapo-clip-higher-unclipped": ("dapo", [1.25], [1.0], None, {}, -1.25, [[1.25]], [[0]]),
    "dapo-clipped-high": ("dapo", [1.3], [1.0], None, {}, -1.28, [[0.0]], [[2]]),
    "grpo-clipped-high-at-1.25": ("grpo", [1.25], [1.0], None, {}, -1.2, [[0.0]], [[2]]),
    # GSPO: s = exp(mean log r) inside [1 - 3e-4, 1 + 4e-4]; one term -s A; each token gets s A / |o_i|
    "gspo-unclipped": (
        "gspo",
        [math.exp(0.0004), math.exp(0.0002)],
        [1.0],
        None,
        {},
        -S_1,
        [[S_1 / 2, S_1 / 2]],
        [[0, 0]],
    ),
    # s = exp(0.0007) > 1.0004 with A > 0: the whole sequence is clipped, loss -1.0004, no gradient anywhere
    "gspo-sequence-clipped-high": (
        "gspo",
        [math.exp(0.001), math.exp(0.0004)],
        [1.0],
        None,
        {},
        -1.0004,
        [[0.0, 0.0]],
        [[2, 2]],
    ),
    # s = exp(-0.0005) < 0.9997 with A < 0: clipped low, loss -min(-s, -0.9997) = 0.9997
    "gspo-sequence-clipped-low": (
        "gspo",
        [math.exp(-0.001), 1.0],
        [-1.0],
        None,
        {},
        0.9997,
        [[0.0, 0.0]],
        [[1, 1]],
    ),
    # token 0's ratio 1.002 is far outside the band, but the sequence's s = exp(0.0002) is inside: no clipping
    "gspo-token-outlier-sequence-inside": (
        "gspo",
        [math.exp(0.002), math.exp(-0.0016)],
        [1.0],
        None,
        {},
        -S_NOCLIP,
        [[S_NOCLIP / 2, S_NOCLIP / 2]],
        [[0, 0]],
    ),
    # ASPO, one token, token-mean, eps 0.2, c = 3. A > 0: flipped weight 1/r, loss -A / r
    "aspo-flip": ("aspo", [1.1], [1.0], None, {}, -1 / 1.1, [[1 / 1.1]], [[0]]),
    "aspo-flip-low-ratio": ("aspo", [0.5], [1.0], None, {}, -2.0, [[2.0]], [[0]]),
    # A > 0, r = 1.3 > 1.2: hard clip, value -A / 1.2, no gradient
    "aspo-positive-clipped-high": ("aspo", [1.3], [1.0], None, {}, -1 / 1.2, [[0.0]], [[2]]),
    # A > 0, r = 0.25 < 1/3: 1/r = 4 > c, weight capped at c = 3 with the gradient kept (value -A c)
    "aspo-positive-dual-cap": ("aspo", [0.25], [1.0], None, {}, -3.0, [[3.0]], [[3]]),
    # A < 0, usual weight r
    "aspo-negative-unclipped": ("aspo", [1.5], [-1.0], None, {}, 1.5, [[-1.5]], [[0]]),
    # A < 0, r = 0.5 < 0.8: hard clip low, value -A * 0.8, no gradient
    "aspo-negative-clipped-low": ("aspo", [0.5], [-1.0], None, {}, 0.8, [[0.0]], [[1]]),
    # A < 0, r = 4 > c: weight capped at 3, gradient kept
    "aspo-negative-dual-cap": ("aspo", [4.0], [-1.0], None, {}, 3.0, [[-3.0]], [[3]]),
    # just inside / outside the caps: 1/0.3 = 3.33 > 3 is capped, 1/0.35 = 2.86 is not; 3.1 > 3 capped, 2.9 not
    "aspo-positive-just-capped": ("aspo", [0.3], [1.0], None, {}, -3.0, [[3.0]], [[3]]),
    "aspo-positive-just-uncapped": ("aspo", [0.35], [1.0], None, {}, -1 / 0.35, [[1 / 0.35]], [[0]]),
    "aspo-negative-just-capped": ("aspo", [3.1], [-1.0], None, {}, 3.0, [[-3.0]], [[3]]),
    "aspo-negative-just-uncapped": ("aspo", [2.9], [-1.0], None, {}, 2.9, [[-2.9]], [[0]]),
    # the caps move with the dual_clip override: r = 4 < 5 keeps weight r; 1/0.3 < 4 keeps weight 1/r
    "aspo-dual-clip-override": ("aspo", [4.0], [-1.0], None, {"dual_clip": 5.0}, 4.0, [[-4.0]], [[0]]),
    "aspo-dual-clip-override-positive": (
        "aspo",
        [0.3],
        [1.0],
        None,
        {"dual_clip": 4.0},
        -1 / 0.3,
        [[1 / 0.3]],
        [[0]],
    ),
    # CISPO: detached weight clip(r, 0, 1.28); every token keeps a gradient, token-mean over 3
    "cispo-never-zero-positive": (
        "cispo",
        [0.5, 1.0, 2.0],
        [1.0],
        None,
        {},
        -(0.5 + 1.0 + 1.28) / 3,
        [[0.5 / 3, 1.0 / 3, 1.28 / 3]],
        [[0, 0, 3]],
    ),
    "cispo-never-zero-negative": (
        "cispo",
        [0.1, 1.0, 2.0],
        [-1.0],
        None,
        {},
        (0.1 + 1.0 + 1.28) / 3,
        [[-0.1 / 3, -1.0 / 3, -1.28 / 3]],
        [[0, 0, 3]],
    ),
    # SAPO: loss -A sigmoid(tau (r - 1)) 4 / tau, weight A * 4 sig (1 - sig) * r
    "sapo-gate-at-one": ("sapo", [1.0], [1.0], None, {}, -2.0, [[1.0]], [[0]]),
    "sapo-gate-positive": ("sapo", [2.0], [1.0], None, {}, -4 * sig(1.0), [[SAPO_F2 * 2]], [[0]]),
    "sapo-gate-negative": (
        "sapo",
        [2.0],
        [-1.0],
        None,
        {},
        4 * sig(1.05) / 1.05,
        [[-SAPO_F2N * 2]],
        [[0]],
    ),
    "sapo-soft-cap": ("sapo", [4.0], [1.0], None, {}, -4 * sig(3.0), [[SAPO_F4 * 4]], [[3]]),
    # a steeper gate: at tau (r - 1) = 2 the factor 4 sig (1 - sig) = 0.42 is below 0.5 -> soft cap
    "sapo-tau-override": (
        "sapo",
        [2.0],
        [1.0],
        None,
        {"tau_pos": 2.0},
        -4 * sig(2.0) / 2.0,
        [[4 * sig(2.0) * (1 - sig(2.0)) * 2]],
        [[3]],
    ),
    # GMPO: exp(mean of sign-clipped log ratios), one term -A ratio per sequence; a clipped token has no gradient
    "gmpo-unclipped": (
        "gmpo",
        [math.exp(0.2), math.exp(-0.1)],
        [1.0],
        None,
        {},
        -G_UNCLIPPED,
        [[G_UNCLIPPED / 2, G_UNCLIPPED / 2]],
        [[0, 0]],
    ),
    "gmpo-token-clipped-high": (
        "gmpo",
        [math.exp(0.6), math.exp(-0.1)],
        [1.0],
        None,
        {},
        -G_HIGH,
        [[0.0, G_HIGH / 2]],
        [[2, 0]],
    ),
    "gmpo-token-clipped-low": (
        "gmpo",
        [math.exp(-0.6), math.exp(0.1)],
        [-1.0],
        None,
        {},
        G_LOW,
        [[0.0, -G_LOW / 2]],
        [[1, 0]],
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_hand_computed(case):
    algo, ratios, adv, mask, overrides, loss, grad_weight, clip = case
    logp, old, A, m = batch(ratios, adv, mask, garbage=-3.0)
    out = policy_loss(algo, logp.requires_grad_(), old, A, m, **overrides)
    torch.testing.assert_close(out.loss, torch.tensor(loss, dtype=F64), rtol=0, atol=1e-9)
    torch.testing.assert_close(out.grad_weight, torch.tensor(grad_weight, dtype=F64), rtol=0, atol=1e-9)
    assert out.clip.dtype == torch.int8
    assert out.clip.tolist() == clip
    (g,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(-g, torch.tensor(grad_weight, dtype=F64), rtol=0, atol=1e-9)


def test_ratio_is_token_ratio_or_sequence_ratio():
    logp, old, A, m = batch([[math.exp(0.2), math.exp(-0.1), 7.0]], [1.0], [1, 1, 0])
    tok = policy_loss("grpo", logp, old, A, m)
    torch.testing.assert_close(tok.ratio, torch.tensor([[math.exp(0.2), math.exp(-0.1), 1.0]], dtype=F64))
    seq = policy_loss("gspo", logp, old, A, m)
    s = math.exp(0.05)
    torch.testing.assert_close(seq.ratio, torch.tensor([[s, s, 1.0]], dtype=F64))


def test_grpo_kl_term_value_and_gradient():
    # r = 1, ref - logp = 0.1: k3 = e^0.1 - 0.1 - 1; loss = -A + 0.04 k3; w = A + 0.04 (e^0.1 - 1)
    logp = torch.tensor([[math.log(0.5)]], dtype=F64, requires_grad=True)
    ref = logp.detach() + 0.1
    out = policy_loss("grpo", logp, logp.detach(), torch.tensor([1.0], dtype=F64), torch.ones(1, 1), ref_logp=ref)
    k3 = math.exp(0.1) - 0.1 - 1
    torch.testing.assert_close(out.kl, torch.tensor([[k3]], dtype=F64))
    torch.testing.assert_close(out.loss, torch.tensor(-1 + 0.04 * k3, dtype=F64))
    torch.testing.assert_close(out.token_loss, torch.tensor([[-1 + 0.04 * k3]], dtype=F64))
    torch.testing.assert_close(out.grad_weight, torch.tensor([[1 + 0.04 * (math.exp(0.1) - 1)]], dtype=F64))
    # no reference: no KL; beta = 0: the KL is reported (the trainer logs it) but is not in the loss or the weight
    assert policy_loss("grpo", logp, logp.detach(), torch.tensor([1.0], dtype=F64), torch.ones(1, 1)).kl is None
    no_beta = policy_loss("grpo", logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1), ref_logp=ref, beta=0.0)
    torch.testing.assert_close(no_beta.kl, torch.tensor([[k3]], dtype=F64))
    torch.testing.assert_close(no_beta.loss, torch.tensor(-1.0, dtype=F64))
    torch.testing.assert_close(no_beta.token_loss, torch.tensor([[-1.0]], dtype=F64))
    torch.testing.assert_close(no_beta.grad_weight, torch.tensor([[1.0]], dtype=F64))


def test_aspo_entropy_dependent_clip_range():
    # entropies (0.1, 0.2, 0.3, 0.4, 5.0): 80th percentile = 0.4 + 0.2 * (5.0 - 0.4) = 1.32, only token 4 above.
    # r = 1.3, A > 0: tokens 0-3 use eps 0.2 (clipped high, value -1/1.2), token 4 uses 0.4 (flipped, -1/1.3)
    logp, old, A, m = batch([1.3] * 5, [1.0])
    ent = torch.tensor([[0.1, 0.2, 0.3, 0.4, 5.0]], dtype=F64)
    out = policy_loss("aspo", logp, old, A, m, entropy=ent)
    torch.testing.assert_close(out.loss, torch.tensor((4 * (-1 / 1.2) - 1 / 1.3) / 5, dtype=F64))
    torch.testing.assert_close(out.grad_weight, torch.tensor([[0, 0, 0, 0, 1 / 1.3 / 5]], dtype=F64))
    assert out.clip.tolist() == [[2, 2, 2, 2, 0]]
    # without entropy one eps for all: everything clipped
    flat = policy_loss("aspo", logp, old, A, m)
    assert flat.clip.tolist() == [[2, 2, 2, 2, 2]]
    torch.testing.assert_close(flat.loss, torch.tensor(-1 / 1.2, dtype=F64))
    # eps_high_entropy override: 0.25 < 0.3 clips token 4 as well
    tight = policy_loss("aspo", logp, old, A, m, entropy=ent, eps_high_entropy=0.25)
    assert tight.clip.tolist() == [[2, 2, 2, 2, 2]]
    # entropy_quantile override 0.5: median 0.3, tokens 3 and 4 are high-entropy
    half = policy_loss("aspo", logp, old, A, m, entropy=ent, entropy_quantile=0.5)
    assert half.clip.tolist() == [[2, 2, 2, 0, 0]]


def test_aspo_negative_high_entropy_uses_wider_lower_bound():
    # A < 0, r = 0.7: below 1 - 0.2 (clipped) for low-entropy tokens, above 1 - 0.4 for the high-entropy one
    logp, old, A, m = batch([0.7] * 5, [-1.0])
    ent = torch.tensor([[0.1, 0.2, 0.3, 0.4, 5.0]], dtype=F64)
    out = policy_loss("aspo", logp, old, A, m, entropy=ent)
    assert out.clip.tolist() == [[1, 1, 1, 1, 0]]
    torch.testing.assert_close(out.grad_weight, torch.tensor([[0, 0, 0, 0, -0.7 / 5]], dtype=F64))


# ----------------------------------------------------------------------------------------------------------------
# Closed form == autograd, every algorithm x aggregation, random float64 inputs spanning all clip regions


def random_batch(seed: int, B: int = 16, T: int = 7, per_token_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    # per-row scale of the log ratios: tiny rows exercise GSPO's 1e-4 band, wide rows ASPO's caps (r < 1/3, r > 3)
    scales = torch.tensor([1e-4, 4e-4, 1e-3, 0.05, 0.3, 0.8, 1.5, 2.0], dtype=F64).repeat(B // 8 + 1)[:B]
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05  # log-probs in (-3.05, -0.05)
    logp = old + torch.randn(B, T, generator=g, dtype=F64) * scales[:, None]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    logp = torch.where(mask > 0, logp, torch.full_like(logp, 5.0))  # garbage in the padding
    signs = torch.tensor([1.0, -1.0], dtype=F64).repeat(B)[:B]
    adv = signs * (0.2 + torch.rand(B, generator=g, dtype=F64))
    adv[-1] = 0.0  # a zero-advantage row
    if per_token_adv:
        adv = adv[:, None] * (0.5 + torch.rand(B, T, generator=g, dtype=F64))
    ref = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    ent = torch.rand(B, T, generator=g, dtype=F64) * 2
    return logp, old, adv, mask, ref, ent


EXPECTED_CODES = {
    "grpo": {0, 1, 2},
    "dapo": {0, 1, 2},
    "dr_grpo": {0, 1, 2},
    "gspo": {0, 1, 2},
    "gspo_token": {0, 1, 2},
    "aspo": {0, 1, 2, 3},
    "cispo": {0, 3},
    "sapo": {0, 3},
    "gmpo": {0, 1, 2},
    "ppo": {0, 1, 2},
    "gpg": {0},
    "dppo_tv": {0, 1, 2, 3},
    "dppo_kl": {0, 1, 2, 3},
    "dro": {0},
    "clip_cov": {0, 1, 2, 4},
    "kl_cov": {0, 4},
    "luspo": {0, 1, 2},
    "vespo": {0, 3},
}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_closed_form_grad_weight_matches_autograd(algo, aggregation):
    seed = 10 * ALGORITHMS.index(algo) + AGGREGATIONS.index(aggregation)
    seen = set()
    # a second, larger batch so that the rarer regions (DPPO's three, LUSPO's narrow band) are visited too
    batches = [(random_batch(seed=seed), kw) for kw in ({}, {"beta": 0.1, "ref": True}, {"ent": True, "ref": True})]
    batches.append((random_batch(seed=seed + 1000, B=64), {"ent": True, "ref": True}))
    for (logp, old, adv, mask, ref, ent), spec in batches:
        kw = {"beta": spec["beta"]} if "beta" in spec else {}
        kw |= {"ref_logp": ref} if spec.get("ref") else {}
        kw |= {"entropy": ent} if spec.get("ent") else {}
        x = logp.clone().requires_grad_(True)
        out = policy_loss(algo, x, old, adv, mask, aggregation=aggregation, **kw)
        (g,) = torch.autograd.grad(out.loss, x)
        torch.testing.assert_close(out.grad_weight, -g, rtol=0, atol=1e-6)
        assert bool((out.grad_weight[mask == 0] == 0).all())
        seen |= set(out.clip.unique().tolist())
    # the inputs really visit every clip region the algorithm has
    assert seen == EXPECTED_CODES[algo]


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_closed_form_matches_autograd_with_per_token_advantages(algo):
    logp, old, adv, mask, ref, ent = random_batch(seed=7, per_token_adv=True)
    x = logp.clone().requires_grad_(True)
    out = policy_loss(algo, x, old, adv, mask, ref_logp=ref, entropy=ent, beta=0.05)
    (g,) = torch.autograd.grad(out.loss, x)
    torch.testing.assert_close(out.grad_weight, -g, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Invariants


def plain_inputs(B=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 3, 1][:B]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=F64)
    old = -torch.rand(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    return old, adv, mask, lengths


def test_ratio_one_grpo_loss_is_mean_of_sequence_means_of_minus_a():
    old, adv, mask, lengths = plain_inputs()
    expected = sum(sum(-adv[i, t].item() for t in range(n)) / n for i, n in enumerate(lengths)) / len(lengths)
    out = policy_loss("grpo", old.clone(), old, adv, mask)
    torch.testing.assert_close(out.loss, torch.tensor(expected, dtype=F64))


def test_ratio_one_dapo_loss_is_token_mean_of_minus_a():
    old, adv, mask, lengths = plain_inputs()
    expected = sum(-adv[i, t].item() for i, n in enumerate(lengths) for t in range(n)) / sum(lengths)
    out = policy_loss("dapo", old.clone(), old, adv, mask)
    torch.testing.assert_close(out.loss, torch.tensor(expected, dtype=F64))


def test_ratio_one_token_level_weights_are_advantage_times_aggregation():
    old, adv, mask, lengths = plain_inputs()
    for algo in ("grpo", "dapo", "dr_grpo", "cispo", "gspo_token"):
        out = policy_loss(algo, old.clone(), old, adv, mask, aggregation="token-mean")
        torch.testing.assert_close(out.grad_weight, adv * mask / sum(lengths))
        assert bool((out.clip == 0).all())
        torch.testing.assert_close(out.ratio, torch.ones_like(old))


@pytest.mark.parametrize("level", ["gspo", "gspo_token"])
def test_gspo_equals_grpo_when_every_completion_has_one_token(level):
    g = torch.Generator().manual_seed(3)
    B = 12
    old = -torch.rand(B, 1, generator=g, dtype=F64)
    logp = old + torch.randn(B, 1, generator=g, dtype=F64) * 0.4  # ratios on both sides of the band
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = torch.ones(B, 1, dtype=F64)
    same = {"eps_low": 0.2, "eps_high": 0.2, "aggregation": "seq-mean-token-mean"}
    a = policy_loss(level, logp, old, adv, mask, **same)
    b = policy_loss("grpo", logp, old, adv, mask, **same)
    for field in ("loss", "ratio", "grad_weight", "token_loss"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field))
    assert a.clip.tolist() == b.clip.tolist()
    assert {1, 2} <= set(b.clip.flatten().tolist())


def test_gspo_token_equals_gspo_with_sequence_advantages():
    logp, old, adv, mask, _, _ = random_batch(seed=11)
    a = policy_loss("gspo", logp, old, adv, mask, aggregation="seq-mean-token-mean")
    b = policy_loss("gspo_token", logp, old, adv, mask)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.grad_weight, b.grad_weight)
    assert a.clip.tolist() == b.clip.tolist()


def test_seq_mean_equals_seq_mean_token_mean():
    logp, old, adv, mask, ref, _ = random_batch(seed=5)
    for algo in ALGORITHMS:
        draw = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)  # Clip-Cov: the same choice
        a = policy_loss(algo, logp, old, adv, mask, ref_logp=ref, aggregation="seq-mean", generator=draw[0])
        b = policy_loss(algo, logp, old, adv, mask, ref_logp=ref, aggregation="seq-mean-token-mean", generator=draw[1])
        torch.testing.assert_close(a.loss, b.loss)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_masked_tokens_never_get_gradient(algo):
    logp, old, adv, mask, ref, ent = random_batch(seed=2)
    wild = torch.where(mask > 0, logp, torch.full_like(logp, 30.0)).requires_grad_(True)
    same_draw = {"generator": torch.Generator().manual_seed(0)}  # Clip-Cov's random choice, the same in both calls
    out = policy_loss(algo, wild, old, adv, mask, ref_logp=ref, entropy=ent, beta=0.1, **same_draw)
    (g,) = torch.autograd.grad(out.loss, wild)
    assert bool((g[mask == 0] == 0).all())
    assert bool((out.grad_weight[mask == 0] == 0).all())
    assert bool((out.token_loss[mask == 0] == 0).all())
    assert bool((out.clip[mask == 0] == 0).all())
    # and the padding's content does not matter at all
    same_draw = {"generator": torch.Generator().manual_seed(0)}
    tame = policy_loss(algo, logp, old, adv, mask, ref_logp=ref, entropy=ent, beta=0.1, **same_draw)
    torch.testing.assert_close(out.loss.detach(), tame.loss)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_zero_advantage_gives_zero_policy_gradient_and_no_clip(algo):
    logp, old, adv, mask, _, _ = random_batch(seed=4)
    out = policy_loss(algo, logp, old, torch.zeros_like(adv), mask)
    selected = torch.zeros_like(mask, dtype=torch.bool)
    selected[0, 0] = algo == "kl_cov"  # KL-Cov's penalty goes to a token whatever A (code 4 "cov"), nothing else
    assert torch.equal(out.clip == 4, selected) and bool((out.clip[~selected] == 0).all())
    a = mask / mask.sum()  # token-mean
    if algo == "dro":  # its penalty -dro_beta/2 (log r)^2 pulls towards pi_old whatever A: weight -dro_beta log r
        torch.testing.assert_close(out.grad_weight, -a * (logp - old) * mask)
    elif algo == "kl_cov":  # every covariance is 0: the first valid token gets the |log r| penalty, weight -0.1 sign
        expected = torch.zeros_like(logp)
        expected[0, 0] = -0.1 * a[0, 0] * torch.sign(logp - old)[0, 0]
        torch.testing.assert_close(out.grad_weight, expected)
    else:
        assert bool((out.grad_weight == 0).all())


def test_bool_mask_and_float32_inputs_work():
    logp, old, adv, mask, _, _ = random_batch(seed=9)
    a = policy_loss("dapo", logp.float(), old.float(), adv.float(), mask > 0)
    assert a.loss.dtype == torch.float32 and a.grad_weight.dtype == torch.float32
    b = policy_loss("dapo", logp, old, adv, mask)
    torch.testing.assert_close(a.loss.double(), b.loss, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# An independent implementation agrees on values and gradients


@pytest.mark.parametrize("algo", REFERENCED)
def test_matches_independent_reference_implementation(algo):
    for seed in (21, 22):
        logp, old, adv, mask, ref, ent = random_batch(seed=seed, B=16, T=7)
        kw = {"ref_logp": ref}
        if algo == "aspo":
            kw["entropy"] = ent
        x = logp.clone().requires_grad_(True)
        out = policy_loss(algo, x, old, adv, mask, **kw)
        (g,) = torch.autograd.grad(out.loss, x)
        ref_loss, ref_w = reference_grad_weight(algo, logp, old, adv, mask, **kw)
        torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=0, atol=1e-10)
        torch.testing.assert_close(out.grad_weight, ref_w, rtol=0, atol=1e-10)
        torch.testing.assert_close(-g, ref_w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_reference_agrees_under_every_aggregation(aggregation):
    logp, old, adv, mask, ref, ent = random_batch(seed=31, B=8, T=5)
    for algo in REFERENCED:
        kw = {"ref_logp": ref, "aggregation": aggregation, "max_len": 9, "entropy": ent if algo == "aspo" else None}
        out = policy_loss(algo, logp, old, adv, mask, **kw)
        ref_loss, ref_w = reference_grad_weight(algo, logp, old, adv, mask, **kw)
        torch.testing.assert_close(out.loss, ref_loss, rtol=0, atol=1e-10)
        torch.testing.assert_close(out.grad_weight, ref_w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("algo", ["cispo", "aspo"])
def test_paper_value_convention_has_the_same_gradient(algo):
    # departures 1 and 2: the papers write log pi where we write r / sg(r); only the value differs
    logp, old, adv, mask, _, ent = random_batch(seed=41, B=8, T=5)
    kw = {"entropy": ent} if algo == "aspo" else {}
    out = policy_loss(algo, logp, old, adv, mask, **kw)
    _, paper_w = reference_grad_weight(algo, logp, old, adv, mask, value="paper", **kw)
    torch.testing.assert_close(out.grad_weight, paper_w, rtol=0, atol=1e-10)
    paper_loss = reference_loss(algo, logp, old, adv, mask, value="paper", **kw)
    assert not torch.isclose(paper_loss, out.loss)  # the values really are different conventions


# ----------------------------------------------------------------------------------------------------------------
# Validation: what is wrong and what is accepted


def ok_inputs():
    logp, old, A, m = batch([[1.0, 1.1], [0.9, 1.0]], [1.0, -1.0])
    return logp, old, A, m


@pytest.mark.parametrize(
    ("mutate", "overrides", "words"),
    [
        (lambda a: {**a, "algo": "ppo2"}, {}, ["'ppo2'", "grpo", "gmpo"]),
        (None, {"epsilon": 0.2}, ["'epsilon'", "eps_low", "aggregation"]),
        (None, {"tau_pos": 1.0}, ["'tau_pos'", "grpo", "eps_high"]),
        (None, {"aggregation": "sum"}, ["'sum'", "token-mean", "seq-mean-token-sum-norm"]),
        (None, {"eps_low": -0.1}, ["eps_low", "(0, 1]"]),
        (None, {"eps_low": 1.5}, ["eps_low", "(0, 1]"]),
        (None, {"eps_high": 0.0}, ["eps_high", "> 0"]),
        (None, {"eps_high": float("nan")}, ["eps_high", "> 0"]),
        (None, {"beta": -1.0}, ["beta", ">= 0"]),
        (None, {"max_len": 1}, ["max_len", "longest"]),
        (None, {"max_len": 2.5}, ["max_len", "int"]),
        (lambda a: {**a, "old_logp": a["old_logp"][:, :1]}, {}, ["old_logp", "(2, 1)", "(2, 2)"]),
        (lambda a: {**a, "advantages": torch.ones(3)}, {}, ["advantages", "(3,)", "(B,)"]),
        (lambda a: {**a, "mask": torch.ones(2, 3)}, {}, ["mask", "(2, 3)", "(2, 2)"]),
        (lambda a: {**a, "logp": a["logp"][0]}, {}, ["logp", "2-d"]),
        (lambda a: {**a, "logp": a["logp"].masked_fill(torch.eye(2) > 0, float("nan"))}, {}, ["logp", "NaN"]),
        (lambda a: {**a, "old_logp": a["old_logp"] * float("inf")}, {}, ["old_logp", "inf", "finite"]),
        (lambda a: {**a, "advantages": torch.tensor([1.0, float("nan")])}, {}, ["advantages", "NaN"]),
        (lambda a: {**a, "ref_logp": torch.full((2, 2), float("-inf"))}, {}, ["ref_logp", "inf"]),
        (lambda a: {**a, "entropy": torch.tensor([[float("inf"), 1.0], [float("-inf"), 1.0]])}, {},
         ["entropy", "inf", "finite"]),
        (lambda a: {**a, "mask": torch.full((2, 2), 0.5)}, {}, ["mask", "0 and 1"]),
    ],
    ids=[
        "unknown-algorithm",
        "unknown-override",
        "override-of-another-algorithm",
        "unknown-aggregation",
        "negative-eps",
        "eps-low-above-one",
        "zero-eps",
        "nan-eps",
        "negative-beta",
        "max-len-too-short",
        "max-len-not-int",
        "shape-mismatch",
        "advantages-wrong-length",
        "mask-wrong-shape",
        "logp-not-2d",
        "nan-in-logp",
        "inf-in-old-logp",
        "nan-in-advantages",
        "inf-in-ref",
        "inf-and-minus-inf-in-entropy",
        "non-binary-mask",
    ],
)
def test_bad_input_raises_value_error_naming_problem_and_accepted(mutate, overrides, words):
    logp, old, A, m = ok_inputs()
    args = {"algo": "grpo", "logp": logp, "old_logp": old, "advantages": A, "mask": m}
    if mutate is not None:
        args = mutate(args)
    with pytest.raises(ValueError) as err:
        policy_loss(
            args["algo"], args["logp"], args["old_logp"], args["advantages"], args["mask"],
            ref_logp=args.get("ref_logp"), entropy=args.get("entropy"), **overrides,
        )  # fmt: skip
    msg = str(err.value)
    assert "accepted" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_finite_values_whose_sum_overflows_are_accepted():
    """The finiteness check sums a tensor first (a sum is finite when every value is): a sum that overflows from
    finite values must not be taken for an infinite value."""
    logp, old, A, m = ok_inputs()
    huge = torch.full((2, 2), 3e38, dtype=torch.float32)
    assert torch.isinf(huge.sum())
    out = policy_loss("grpo", logp.float(), old.float(), A.float(), m.float(), entropy=huge)
    assert torch.isfinite(out.loss)


def test_algorithm_specific_validation():
    logp, old, A, m = ok_inputs()
    with pytest.raises(ValueError, match=r"dual_clip.*> 1"):
        policy_loss("aspo", logp, old, A, m, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"tau_neg.*> 0"):
        policy_loss("sapo", logp, old, A, m, tau_neg=0.0)
    with pytest.raises(ValueError, match=r"entropy_quantile.*\[0, 1\]"):
        policy_loss("aspo", logp, old, A, m, entropy_quantile=1.5)
    with pytest.raises(ValueError, match=r"'eps_low'.*accepted"):
        policy_loss("sapo", logp, old, A, m, eps_low=0.2)  # SAPO has no clip range
    # GMPO's range is in log space: eps above 1 is fine
    policy_loss("gmpo", logp, old, A, m, eps_low=1.5)


# ---------------------------------------------------------------- the registry


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_seq_ratio_is_reported_exactly_for_sequence_level_objectives(algo):
    from engine.objectives import OBJECTIVES

    d = torch.tensor([[0.2, -0.1, 0.0], [0.05, 0.3, 0.0]], dtype=F64)  # log r
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    old = torch.zeros(2, 3, dtype=F64)
    out = policy_loss(algo, old + d, old, torch.tensor([1.0, -1.0], dtype=F64), m)
    sequence_level = ("gspo", "gspo_token", "gmpo", "luspo", "vespo")
    assert (out.seq_ratio is not None) == OBJECTIVES[algo].sequence_level == (algo in sequence_level)
    if out.seq_ratio is None:
        return
    if algo == "vespo":  # the product of the token ratios, exp(0.1) and exp(0.35)
        torch.testing.assert_close(out.seq_ratio, torch.tensor([math.exp(0.1), math.exp(0.35)], dtype=F64))
        return
    # the ratio the objective used, the same on every token of the sequence
    torch.testing.assert_close(out.ratio[m > 0], out.seq_ratio[:, None].expand(2, 3)[m > 0])
    if algo != "gmpo":  # GSPO: geometric mean of the token ratios, exp(0.05) and exp(0.35 / 3)
        torch.testing.assert_close(out.seq_ratio, torch.tensor([math.exp(0.05), math.exp(0.35 / 3)], dtype=F64))
    else:  # GMPO clips each log ratio to +-0.4 on its advantage's side first: nothing reaches it here
        torch.testing.assert_close(out.seq_ratio, torch.tensor([math.exp(0.05), math.exp(0.35 / 3)], dtype=F64))
        clipped = policy_loss(algo, old + 3 * d, old, torch.tensor([1.0, -1.0], dtype=F64), m)
        # row 0: A > 0, log r (0.6, -0.3) -> (0.4, -0.3); row 1: A < 0, (0.15, 0.9, 0) unclipped below
        torch.testing.assert_close(clipped.seq_ratio, torch.tensor([math.exp(0.05), math.exp(1.05 / 3)], dtype=F64))


def test_resolve_is_the_validation_policy_loss_uses():
    from engine.objectives import resolve

    logp, old, A, m = ok_inputs()
    for algo, bad in (("grpo", {"eps_low": 1.5}), ("aspo", {"dual_clip": 0.5}), ("dapo", {"aggregation": "x"})):
        with pytest.raises(ValueError) as direct:
            resolve(algo, **bad)
        with pytest.raises(ValueError) as via_loss:
            policy_loss(algo, logp, old, A, m, **bad)
        assert str(direct.value) == str(via_loss.value)
    assert resolve("gspo", beta=0.1) == {**defaults("gspo"), "beta": 0.1}
