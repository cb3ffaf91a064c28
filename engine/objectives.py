"""Every policy objective PolicyLens trains with, as pure tensor math.

One entry point, used by the trainer and by the dashboard's weighting views:

    out = policy_loss("dapo", logp, old_logp, advantages, mask)
    out.loss.backward()            # scalar, differentiable wrt logp
    out.ratio, out.clip, out.grad_weight, out.token_loss, out.kl   # (B, T) diagnostics, detached
    out.seq_ratio                  # (B,) the ratio of each sequence (sequence-level algorithms), else None

The algorithms themselves (their switches, published defaults, loop settings and papers) are the registry
`engine.algorithms`, re-exported here; this module holds the math of each switch. Adding an algorithm is one
registry entry, plus a function here when it needs a switch that does not exist yet (docs/adding-an-algorithm.md).

Gradient weight. `grad_weight[i, t] = -dLoss/dlogp[i, t]` of the TOTAL loss (policy term + beta * KL), in closed
form (no autograd), 0 on masked tokens. It is the coefficient of grad log pi(o_it) in the update, i.e. what the
dashboard paints on tokens. tests/test_objectives.py checks it against autograd for every algorithm x aggregation.

Clip codes (`clip`, int8, engine.clip_codes): 0 none; 1 low (A < 0 and the ratio fell below the lower bound, or
DPPO's divergence left its bound downwards: zero gradient); 2 high (A > 0, the same upwards: zero gradient);
3 dual (capped with the gradient kept: ASPO's soft dual clip, CISPO's truncated IS weight, DPPO's ratio truncated at
dual_clip, SAPO's gate or VESPO's gamma weight below SOFT_CAP_LEVEL). Tokens with A == 0 are never reported as
clipped (their policy loss and gradient are 0 whatever the ratio). GSPO/GSPO-token: the sequence's code on each of
its tokens. GMPO: the per-token log-space clip (1/2) that removes a token from the geometric mean's gradient.
4 cov: a token Clip-Cov's rule zeroed or KL-Cov's penalised (an unclipped token; KL-Cov has no clip), whatever A.

Departures from the papers (all deliberate, all covered by tests):
1. Score-function losses (CISPO, ASPO's soft cap, GPG, DPPO, DRO, VESPO): the papers and verl/TRL write
   -w * A * log pi with w detached. We use -w * A * exp(log r - sg(log r)): the same gradient (w * A per token),
   but the loss value is -w * A, comparable to the other objectives (the libraries' value depends on the absolute
   log-prob and has no meaning of its own). DRO likewise: -(A - dro_beta/2 (log r)^2) in value.
2. ASPO's four entropy-dependent clip ranges (A<0/A>0 x low/high entropy) are three knobs here: `eps_low` (A < 0)
   and `eps_high` (A > 0) for tokens at or below the response's `entropy_quantile`, `eps_high_entropy` for both
   signs above it. Without `entropy` every token uses eps_low / eps_high.
3. GSPO, GMPO, LUSPO and VESPO are defined for one advantage per sequence. Given (B, T) advantages we apply each
   token's own advantage (its sign picks the clip side or the gamma branch); with a constant advantage per sequence
   this is exactly the paper.
4. The KL term is only added when `ref_logp` is given: without it the policy term alone is returned (`kl` None),
   even for algorithms whose default beta is > 0. With `ref_logp` and beta == 0, `kl` is still reported (worth
   watching) but is not part of the loss or the gradient weight.
5. "seq-mean" (GSPO's per-sequence mean, (1/G) sum_i loss_i) is computed as the mean over sequences of each
   sequence's mean token loss; for sequence-level objectives every token of a sequence carries the sequence's
   loss, so this is the paper's formula. It is numerically the same as "seq-mean-token-mean".
6. Clip-Cov / KL-Cov's covariance and top_entropy_quantile's threshold are taken over the tokens of one
   `policy_loss` call (one mini-batch on one process), as verl (per micro-batch) does; TRL gathers the entropies of
   every process for its threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.algorithms import (
    AGGREGATIONS,
    ALGORITHMS,
    CRITIC_ALGORITHMS,
    OBJECTIVES,
    RATIO_LEVELS,
    SURROGATES,
    Objective,
    defaults,
    loop_defaults,
    objective,
    resolve,
    uses_critic,
)
from engine.clip_codes import CLIP_CAP, CLIP_COV, CLIP_EVENTS, CLIP_HIGH, CLIP_LOW, CLIP_NAMES, CLIP_NONE

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "CLIP_CAP",
    "CLIP_COV",
    "CLIP_EVENTS",
    "CLIP_HIGH",
    "CLIP_LOW",
    "CLIP_NAMES",
    "CLIP_NONE",
    "CRITIC_ALGORITHMS",
    "OBJECTIVES",
    "RATIO_LEVELS",
    "SAPO_SOFT_CAP_LEVEL",
    "SOFT_CAP_LEVEL",
    "SURROGATES",
    "BatchTotals",
    "Objective",
    "PolicyLossOutput",
    "SurrogateOutput",
    "aggregation_weights",
    "defaults",
    "k3_kl",
    "loop_defaults",
    "policy_loss",
    "resolve",
    "surrogate",
    "token_covariance",
    "top_entropy_mask",
    "uses_critic",
    "vespo_log_weight",
]


# A soft rule (SAPO's gate, VESPO's gamma weight) reports a token as capped (code 3) when it has cut the gradient
# weight to less than this fraction of the unweighted one (both weights are 1 at r = 1).
SOFT_CAP_LEVEL = 0.5
SAPO_SOFT_CAP_LEVEL = SOFT_CAP_LEVEL  # the name this constant had when SAPO was the only soft rule

VESPO_LOG_W_RANGE = (math.log(1e-8), 20.0)
"""VESPO's sequence log-ratio is clamped to this range (TRL 1.16 get_gamma_weights: w >= 1e-8, log w <= 20), after
each token's log-ratio is clamped to [-20, 20]."""

DPPO_LOG_RATIO_CLAMP = 20.0
"""DPPO's truncated ratio is exp(log r clamped to +-20) (verl 0.9.1 compute_policy_loss_dppo_tv/kl)."""


# ----------------------------------------------------------------------------------------------------------------
# The result


@dataclass(frozen=True)
class PolicyLossOutput:
    """What an objective did, per token. Everything but `loss` is detached."""

    loss: torch.Tensor  # () differentiable wrt logp
    ratio: torch.Tensor  # (B, T) the ratio the algorithm used (sequence ratio on every token for GSPO/GMPO/VESPO)
    clip: torch.Tensor  # (B, T) int8 clip code, see module docstring
    grad_weight: torch.Tensor  # (B, T) -dloss/dlogp of the total loss (incl. KL), closed form, 0 when masked
    token_loss: torch.Tensor  # (B, T) policy term + beta * kl per token (what the aggregation averages)
    kl: torch.Tensor | None  # (B, T) k3 KL to the reference (in the loss only when beta > 0), None without ref_logp
    seq_ratio: torch.Tensor | None  # (B,) the sequence ratio the objective used (sequence-level algorithms), else None
    params: dict[str, Any]  # the resolved hyper-parameters used


@dataclass(frozen=True)
class SurrogateOutput:
    """One surrogate on a batch of ratios: per-token loss (differentiable wrt the log ratio), its closed-form weight
    h = -d loss / d log ratio (detached) and the clip codes. Shapes broadcast from the log ratio and advantages."""

    loss: torch.Tensor
    weight: torch.Tensor
    clip: torch.Tensor  # int8


# ----------------------------------------------------------------------------------------------------------------
# Building blocks (pure functions)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (GRPO eq. 4): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


@dataclass(frozen=True)
class BatchTotals:
    """The normalisers of a mini-batch split over several processes (engine.distributed): its row count, loss-token
    count and width over every rank, so each rank's aggregation weights are those of the whole mini-batch."""

    rows: float
    tokens: float
    width: float


def aggregation_weights(mask: torch.Tensor, aggregation: str, max_len: int | None = None,
                        totals: BatchTotals | None = None) -> torch.Tensor:
    """a[i, t] such that loss = sum(a * token_loss). Constants (no gradient), 0 on masked tokens.

    seq-mean-token-mean / seq-mean: 1 / (B * |o_i|); token-mean: 1 / sum_i |o_i|;
    seq-mean-token-sum-norm: 1 / (B * max_len), max_len defaulting to T; seq-mean-token-sum (LUSPO): 1 / B.
    `totals`: B, sum_i |o_i| and T of the whole mini-batch when `mask` is one rank's part of it (default: `mask`'s).
    """
    B, T = mask.shape
    m = mask.to(torch.get_default_dtype()) if not mask.is_floating_point() else mask
    rows = B if totals is None else totals.rows
    width = T if totals is None else totals.width
    lengths = m.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1) empty rows contribute 0, still count in B
    if aggregation in ("seq-mean-token-mean", "seq-mean"):
        return m / (rows * lengths)  # (B, T)
    if aggregation == "token-mean":
        return m / (m.sum().clamp(min=1.0) if totals is None else max(totals.tokens, 1.0))  # (B, T)
    if aggregation == "seq-mean-token-sum-norm":
        return m / (rows * (width if max_len is None else max_len))  # (B, T)
    if aggregation == "seq-mean-token-sum":
        return m / rows  # (B, T)
    raise ValueError(f"unknown aggregation {aggregation!r}; accepted: {', '.join(AGGREGATIONS)}")


def token_covariance(advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cui et al.'s per-token covariance term (A - mean A)(log pi - mean log pi), means over the valid tokens of the
    batch; (B, T), detached, 0 on masked tokens. Clip-Cov and KL-Cov select tokens by it (arXiv 2505.22617)."""
    on = mask > 0
    n = on.sum().clamp(min=1)
    adv, lp = advantages.detach(), logp.detach()
    adv_mean = torch.where(on, adv, torch.zeros_like(adv)).sum() / n
    lp_mean = torch.where(on, lp, torch.zeros_like(lp)).sum() / n
    return torch.where(on, (adv - adv_mean) * (lp - lp_mean), torch.zeros_like(lp))  # (B, T)


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, keep_share: float) -> torch.Tensor:
    """The tokens among the top `keep_share` by entropy (arXiv 2506.01939, TRL's top_entropy_quantile): entropy at
    or above the (1 - keep_share) quantile of the batch's valid tokens; (B, T) bool, False on masked tokens."""
    on = mask > 0
    valid = entropy.detach()[on]
    if valid.numel() == 0:
        return torch.zeros_like(on)
    threshold = torch.quantile(valid, 1.0 - keep_share)
    return (entropy.detach() * on.to(entropy.dtype) >= threshold) & on  # (B, T)


def vespo_log_weight(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """VESPO's sequence log weight log w_i = sum_t log r_it, each token's clamped to [-20, 20], the sum to
    VESPO_LOG_W_RANGE (TRL 1.16 get_gamma_weights); (B, T) -> (B, 1), detached."""
    return (log_ratio.detach().clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(*VESPO_LOG_W_RANGE)


def _ratio_level(level, d, mask, adv, eps_low, eps_high):
    """Log of the ratio each token's surrogate sees, with the graph wrt d = logp - old_logp.

    Returns (log_rho (B, T) differentiable, spread (B, T) or None, clip codes (B, T) or None).
    `spread` is None for token-local gradients; otherwise d log_rho_i / d logp_it = spread[i, t] for every
    token of sequence i (so grad_weight_it = spread_it * sum_t' a_it' h_it').
    """
    lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    if level == "token":
        return d, None, None
    if level in ("sequence", "sequence-token"):
        log_s = (d * mask).sum(-1, keepdim=True) / lengths  # (B, 1) log of the geometric-mean ratio
        if level == "sequence":
            return log_s.expand_as(d), mask / lengths, None
        # GSPO-token: value log s_i, gradient of a single token's log-prob (GSPO Sec. 4.3)
        return log_s.detach() + d - d.detach(), None, None
    if level == "sequence-sum":  # VESPO: value log w_i, gradient token-local (w is detached)
        return vespo_log_weight(d, mask) + d - d.detach(), None, None
    if level == "geometric":
        # GMPO: clip each token's log ratio on the side its advantage pushes (PPO's rule in log space),
        # then average in log space; A == 0 counts as positive, as in the official code.
        pos = adv >= 0
        clipped = torch.where(pos, d.clamp(max=eps_high), d.clamp(min=-eps_low))  # (B, T)
        cut = (pos & (d > eps_high)) | (~pos & (d < -eps_low))  # (B, T) constant: out of the gradient
        log_rho = ((clipped * mask).sum(-1, keepdim=True) / lengths).expand_as(d)  # (B, T)
        low, high = (adv < 0) & (d < -eps_low), (adv > 0) & (d > eps_high)  # reported only when A != 0
        codes = torch.where(low, CLIP_LOW, torch.where(high, CLIP_HIGH, CLIP_NONE))
        return log_rho, (~cut).to(d.dtype) * mask / lengths, codes
    raise ValueError(f"unknown ratio level {level!r}; accepted: {', '.join(RATIO_LEVELS)}")


# ----------------------------------------------------------------------------------------------------------------
# The surrogates: (log_rho, adv, params, eps_low, eps_high, old_logp) -> (loss, h = -dloss/dlog_rho, codes)
# eps_low / eps_high are floats or (B, T) tensors (ASPO's entropy-dependent ranges).


def _unit(log_rho):
    """Value 1, d/dlog_rho = 1: carries a detached weight's gradient (departure 1)."""
    return torch.exp(log_rho - log_rho.detach())


def _codes(low, high, cap=None):
    codes = torch.where(low, CLIP_LOW, torch.where(high, CLIP_HIGH, CLIP_NONE))
    return (codes if cap is None else torch.where(cap, CLIP_CAP, codes)).to(torch.int8)


def _ppo_clip(log_rho, adv, p, eps_low, eps_high, old):
    rho = torch.exp(log_rho)
    r = rho.detach()
    clipped_rho = torch.clamp(rho, min=1.0 - eps_low, max=1.0 + eps_high)  # (B, T)
    loss = torch.maximum(-adv * rho, -adv * clipped_rho)  # (B, T) = -min(rA, clip(r)A)
    low, high = (adv < 0) & (r < 1.0 - eps_low), (adv > 0) & (r > 1.0 + eps_high)
    return loss, torch.where(low | high, torch.zeros_like(r), r * adv), _codes(low, high)


def _cispo(log_rho, adv, p, eps_low, eps_high, old):
    r = torch.exp(log_rho.detach())
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    w = torch.clamp(r, min=lo, max=hi)  # (B, T) detached IS weight
    capped = (adv != 0) & ((r < lo) | (r > hi))
    none = torch.zeros_like(capped)
    return -adv * w * _unit(log_rho), w * adv, _codes(none, none, capped)


def _aspo(log_rho, adv, p, eps_low, eps_high, old):
    rho = torch.exp(log_rho)
    r = rho.detach()
    c, lo, hi = p["dual_clip"], 1.0 - eps_low, 1.0 + eps_high
    neg, pos = adv < 0, adv > 0
    # A < 0: hard clip below at 1 - eps (zero gradient), weight r, soft cap at c (weight c, gradient kept)
    neg_low, neg_cap = neg & (r < lo), neg & (r > c)
    # A >= 0: hard clip above at 1 + eps (zero gradient), flipped weight 1/r, soft cap when 1/r > c
    pos_high, pos_cap = ~neg & (r > hi), ~neg & (r < 1.0 / c)
    p_pos = torch.clamp(rho, max=hi)  # min(r, 1 + eps)
    loss_pos = -adv * p_pos / p_pos.detach() / p_pos.detach()  # value -A/p, d/dlog_rho = -A/r
    loss_neg = -adv * torch.clamp(rho, min=lo)  # -A max(r, 1 - eps)
    loss_cap = -adv * c * _unit(log_rho)  # departure 1
    loss = torch.where(neg_cap | pos_cap, loss_cap, torch.where(neg, loss_neg, loss_pos))
    h = torch.where(neg, r * adv, adv / r)
    h = torch.where(neg_low | pos_high, torch.zeros_like(r), h)
    h = torch.where(neg_cap | pos_cap, c * adv, h)
    return loss, h, _codes(neg_low, pos_high & pos, neg_cap | (pos_cap & pos))


def _sapo(log_rho, adv, p, eps_low, eps_high, old):
    rho = torch.exp(log_rho)
    r = rho.detach()
    # build tau in r's dtype: torch.where on Python floats would round 1.05 through float32
    tau = torch.where(adv > 0, torch.full_like(r, p["tau_pos"]), torch.full_like(r, p["tau_neg"]))  # (B, T)
    gate = torch.sigmoid(tau * (rho - 1.0))  # (B, T)
    g = gate.detach()
    factor = 4.0 * g * (1.0 - g)  # f'(r): 1 at r = 1, decays on both sides
    capped = (adv != 0) & (factor < SOFT_CAP_LEVEL)
    none = torch.zeros_like(capped)
    return -adv * gate * 4.0 / tau, factor * r * adv, _codes(none, none, capped)


def _linear(log_rho, adv, p, eps_low, eps_high, old):
    rho = torch.exp(log_rho)
    none = torch.zeros_like(adv, dtype=torch.bool)
    return -adv * rho, rho.detach() * adv, _codes(none, none)


def _gpg(log_rho, adv, p, eps_low, eps_high, old):
    none = torch.zeros_like(adv, dtype=torch.bool)
    return -adv * _unit(log_rho), adv.expand_as(log_rho).clone(), _codes(none, none)


def _dppo(log_rho, adv, p, eps_low, eps_high, old, divergence):
    """DPPO (arXiv 2602.04879; verl 0.9.1 dppo_tv / dppo_kl): mask by the binary divergence in the direction of A
    (A > 0: upwards; A <= 0: downwards; moving towards p_old always passes), weight the ratio truncated at c."""
    d = log_rho.detach()
    w = torch.exp(d.clamp(-DPPO_LOG_RATIO_CLAMP, DPPO_LOG_RATIO_CLAMP)).clamp(max=p["dual_clip"])  # (B, T)
    logp = old + d
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if divergence == "tv":
        up_ok, down_ok = prob - old_prob <= eps_high, prob - old_prob >= -eps_low
    else:  # binary KL between Bernoulli(p_old) and Bernoulli(p), with verl's 1e-8 guards
        kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        up_ok, down_ok = (kl <= eps_high) | (prob <= old_prob), (kl <= eps_low) | (prob >= old_prob)
    pos = adv > 0
    valid = torch.where(pos, up_ok, down_ok)  # (B, T) bool
    weight = torch.where(valid, w, torch.zeros_like(w))
    truncated = valid & (adv != 0) & (torch.exp(d.clamp(max=DPPO_LOG_RATIO_CLAMP)) > p["dual_clip"])
    return (-adv * weight * _unit(log_rho), weight * adv,
            _codes(~valid & (adv < 0), ~valid & pos, truncated))


def _dro(log_rho, adv, p, eps_low, eps_high, old):
    none = torch.zeros_like(adv, dtype=torch.bool)
    beta = p["dro_beta"]
    loss = -(adv * _unit(log_rho) - 0.5 * beta * log_rho**2)  # departure 1: value -(A - beta/2 (log r)^2)
    return loss, adv - beta * log_rho.detach(), _codes(none, none)


def _vespo(log_rho, adv, p, eps_low, eps_high, old):
    """VESPO's gamma weight phi(w) = exp(lambda + k log w - lambda w), detached, k / lambda by A >= 0 (TRL 1.16
    get_gamma_weights); log_rho's value is log w (ratio level `sequence-sum`)."""
    log_w = log_rho.detach()
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(log_w, p["vespo_k_pos"]), torch.full_like(log_w, p["vespo_k_neg"]))
    lam = torch.where(nonneg, torch.full_like(log_w, p["vespo_lambda_pos"]),
                      torch.full_like(log_w, p["vespo_lambda_neg"])).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    capped = (adv != 0) & (phi < SOFT_CAP_LEVEL)
    none = torch.zeros_like(capped)
    return -phi * adv * _unit(log_rho), phi * adv, _codes(none, none, capped)


_SURROGATE_MATH = {
    "ppo-clip": _ppo_clip, "cispo": _cispo, "aspo": _aspo, "sapo": _sapo, "linear": _linear, "gpg": _gpg,
    "dppo-tv": lambda *args: _dppo(*args, divergence="tv"), "dppo-kl": lambda *args: _dppo(*args, divergence="kl"),
    "dro": _dro, "vespo": _vespo,
}


def surrogate(kind: str, log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: Any = 0.0,
              eps_high: Any = 0.0, old_logp: torch.Tensor | None = None, **params: Any) -> SurrogateOutput:
    """The per-token surrogate `kind` (one of SURROGATES) on log ratios, as policy_loss uses it.

    log_ratio: log r, (B, T) or (B, 1) (a sequence ratio); advantages broadcastable to it. params: the knobs the
    surrogate reads (dual_clip, tau_pos / tau_neg, dro_beta, vespo_*). old_logp: DPPO's p_old (broadcastable).
    Used by the TRL adapter to compute TRL's losses with the engine's own code.
    """
    if kind not in _SURROGATE_MATH:
        raise ValueError(f"unknown surrogate {kind!r}; accepted: {', '.join(SURROGATES)}")
    if kind.startswith("dppo") and old_logp is None:
        raise ValueError(f"surrogate {kind!r} needs old_logp (it bounds p - p_old, not the ratio)")
    loss, weight, codes = _SURROGATE_MATH[kind](log_ratio, advantages, params, eps_low, eps_high, old_logp)
    return SurrogateOutput(loss=loss, weight=weight, clip=codes)


# ----------------------------------------------------------------------------------------------------------------
# The covariance rules of Clip-Cov and KL-Cov (Cui et al. 2025, verl 0.9.1 clip_cov / kl_cov)


def _clip_cov(loss, h, codes, cov, on, p, generator):
    """Zero loss and weight of a random clip_cov_ratio share (at least one) of the unclipped tokens with covariance
    strictly in (clip_cov_lb, clip_cov_ub): a permutation over the eligible tokens in row-major order."""
    clipped = (codes == CLIP_LOW) | (codes == CLIP_HIGH)
    eligible = on & ~clipped & (cov > p["clip_cov_lb"]) & (cov < p["clip_cov_ub"])  # (B, T)
    idx = torch.nonzero(eligible)  # (n, 2) row-major
    count = max(int(p["clip_cov_ratio"] * on.sum().item()), 1)
    keep = torch.ones_like(loss.detach())
    if len(idx):
        device = generator.device if generator is not None else torch.device("cpu")
        perm = torch.randperm(len(idx), generator=generator, device=device).to(idx.device)
        chosen = idx[perm[:count]]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    return loss * keep, h * keep, keep == 0


def _kl_cov(loss, h, log_rho, cov, on, p):
    """Add kl_cov_coef * |log r| to the top kl_cov_ratio share (at least one) of the valid tokens by covariance."""
    valid_cov = cov[on]  # row-major, as verl's flattened valid tokens
    if valid_cov.numel() == 0:
        return loss, h, torch.zeros_like(on)
    top = torch.topk(valid_cov.cpu(), max(1, int(valid_cov.numel() * p["kl_cov_ratio"])), largest=True).indices
    flat = torch.nonzero(on.reshape(-1), as_tuple=True)[0][top.to(on.device)]
    chosen = torch.zeros(on.numel(), dtype=torch.bool, device=on.device)
    chosen[flat] = True
    chosen = chosen.view_as(on)  # (B, T)
    coef = p["kl_cov_coef"]
    loss = torch.where(chosen, loss + coef * log_rho.abs(), loss)
    h = torch.where(chosen, h - coef * torch.sign(log_rho.detach()), h)
    return loss, h, chosen


# ----------------------------------------------------------------------------------------------------------------
# Validation


def _check_tensor(name: str, x: Any, shape: tuple[int, ...] | None, allow_1d: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, T), got {type(x).__name__}")
    if shape is not None:
        ok = tuple(x.shape) == shape or (allow_1d and tuple(x.shape) == shape[:1])
        if not ok:
            want = f"(B,) = {shape[:1]} or (B, T) = {shape}" if allow_1d else f"(B, T) = {shape}"
            raise ValueError(f"{name} has shape {tuple(x.shape)}; accepted: {want} (B, T taken from logp)")
    # A sum is finite exactly when every value is, unless it overflows (then the values decide): one reduction,
    # where isfinite() builds a (B, T) tensor first (on the CPU 10-40 times as long; it is called for every tensor
    # of every call, and the dashboard calls once per chunk of completions per algorithm).
    if x.is_floating_point() and not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        bad = "NaN" if bool(torch.isnan(x).any()) else "inf"
        raise ValueError(f"{name} contains {bad}; accepted: finite values only (pad masked positions with 0)")
    return x


def _check_inputs(logp, old_logp, advantages, mask, ref_logp, entropy) -> None:
    _check_tensor("logp", logp, None)
    if logp.dim() != 2:
        raise ValueError(f"logp has shape {tuple(logp.shape)}; accepted: a 2-d (B, T) tensor")
    B, T = logp.shape
    if B == 0 or T == 0:
        raise ValueError(f"logp has shape {(B, T)}; accepted: B >= 1 and T >= 1")
    if not logp.is_floating_point():
        raise ValueError(f"logp has dtype {logp.dtype}; accepted: a floating-point dtype")
    _check_tensor("old_logp", old_logp, (B, T))
    _check_tensor("advantages", advantages, (B, T), allow_1d=True)
    _check_tensor("mask", mask, (B, T))
    if ref_logp is not None:
        _check_tensor("ref_logp", ref_logp, (B, T))
    if entropy is not None:
        _check_tensor("entropy", entropy, (B, T))
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask contains values other than 0 and 1; accepted: a 0/1 (or bool) mask")


# ----------------------------------------------------------------------------------------------------------------
# The entry point


def _aspo_ranges(p, entropy, on, d, eps_low, eps_high):
    """ASPO: looser range for the response's high-entropy tokens (above its entropy_quantile, per row)."""
    ent = torch.where(on, entropy.detach().to(dtype=d.dtype, device=d.device), torch.full_like(d, float("nan")))
    q = torch.nanquantile(ent, float(p["entropy_quantile"]), dim=-1, keepdim=True)  # (B, 1), NaN if empty
    high_ent = ent > q  # (B, T) NaN compares False
    eps_e = float(p["eps_high_entropy"])
    return (torch.where(high_ent, torch.full_like(d, eps_e), torch.full_like(d, eps_low)),  # (B, T)
            torch.where(high_ent, torch.full_like(d, eps_e), torch.full_like(d, eps_high)))


def _policy_term(obj, p, logp, old, d, adv, m, entropy, generator):
    """The policy term per token: (loss (B, T), h (B, T), codes (B, T), log_rho, spread) before aggregation."""
    on = m > 0
    eps_low, eps_high = float(p.get("eps_low", 0.0)), float(p.get("eps_high", 0.0))  # unused without a clip
    log_rho, spread, level_codes = _ratio_level(obj.ratio_level, d, m, adv, eps_low, eps_high)
    if obj.surrogate == "aspo" and entropy is not None:
        eps_low, eps_high = _aspo_ranges(p, entropy, on, d, eps_low, eps_high)
    loss, h, codes = _SURROGATE_MATH[obj.surrogate](log_rho, adv, p, eps_low, eps_high, old)
    if level_codes is not None:
        codes = level_codes.to(torch.int8)
    if obj.covariance is not None:
        cov = token_covariance(adv, logp, m)
        if obj.covariance == "clip":
            loss, h, selected = _clip_cov(loss, h, codes, cov, on, p, generator)
        else:
            loss, h, selected = _kl_cov(loss, h, log_rho, cov, on, p)
        codes = torch.where(selected, torch.full_like(codes, CLIP_COV), codes)  # never a clipped token (see rules)
    if p["top_entropy_quantile"] < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the tokens' entropy; accepted: pass entropy=(B, T)")
        keep = top_entropy_mask(entropy.to(device=d.device), m, float(p["top_entropy_quantile"])).to(d.dtype)
        loss, h = loss * keep, h * keep  # only the policy term; the KL term and the denominators are unchanged
    return loss, h, codes, log_rho, spread


def policy_loss(
    algo: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    totals: BatchTotals | None = None,
    generator: torch.Generator | None = None,
    **overrides: Any,
) -> PolicyLossOutput:
    """Loss and per-token diagnostics of `algo` (one of ALGORITHMS) on a batch of completions.

    logp, old_logp, ref_logp, mask, entropy: (B, T); advantages: (B,) per sequence or (B, T) per token.
    mask is 1 on completion tokens (bool, int or float 0/1). entropy matters for ASPO's clip ranges and for
    top_entropy_quantile < 1. totals: the whole mini-batch's normalisers when this is one rank's part of it
    (aggregation_weights). generator: the random source of Clip-Cov's choice (default: torch's global one).
    overrides: any key of `defaults(algo)` (eps_low, eps_high, beta, aggregation, max_len, top_entropy_quantile, and
    per algorithm its own knobs, engine.algorithms). Raises ValueError on bad input.
    """
    obj = objective(algo)
    _check_inputs(logp, old_logp, advantages, mask, ref_logp, entropy)
    p = resolve(algo, **overrides)
    B, T = logp.shape
    dtype, dev = logp.dtype, logp.device
    m = mask.to(dtype=dtype, device=dev)  # (B, T)
    on = m > 0
    lengths = m.sum(-1)  # (B,)
    if p["max_len"] is not None and p["max_len"] < int(lengths.max().item()):
        raise ValueError(
            f"max_len = {p['max_len']} is shorter than the longest completion ({int(lengths.max().item())} "
            "tokens); accepted: an int >= every completion length (the generation budget)"
        )
    adv = advantages.detach().to(dtype=dtype, device=dev)
    adv = adv[:, None].expand(B, T) if adv.dim() == 1 else adv  # (B, T)
    adv = torch.where(on, adv, torch.zeros_like(adv))  # masked tokens carry no signal
    old = torch.where(on, old_logp.detach().to(dtype=dtype, device=dev), torch.zeros_like(logp))  # (B, T)
    # d = log r; padding can hold anything finite, zero it so exp() cannot overflow there
    d = torch.where(on, logp - old, torch.zeros_like(logp))  # (B, T)

    pg_loss, h, codes, log_rho, spread = _policy_term(obj, p, logp, old, d, adv, m, entropy, generator)
    a = aggregation_weights(m, p["aggregation"], p["max_len"], totals)  # (B, T)

    token_loss = pg_loss  # (B, T)
    kl = None
    kl_weight = torch.zeros_like(d)
    if ref_logp is not None:
        ref = ref_logp.detach().to(dtype=dtype, device=dev)
        ref = torch.where(on, ref, logp.detach())  # padding: KL 0
        kl = k3_kl(logp, ref)  # (B, T)
        if p["beta"] > 0:
            token_loss = token_loss + p["beta"] * kl
            # -d(beta * kl)/dlogp = beta * (exp(ref - logp) - 1)
            kl_weight = p["beta"] * (torch.exp(ref - logp.detach()) - 1.0)  # (B, T)
    token_loss = torch.where(on, token_loss, torch.zeros_like(token_loss))
    loss = (a * token_loss).sum()

    # ---- closed-form gradient weight: chain rule through the ratio level
    with torch.no_grad():
        # token-local: a * h; sequence-level: every token of i shares sum_t' a h, spread by d log rho_i / d logp_it
        grad_weight = a * h if spread is None else spread * (a * h).sum(-1, keepdim=True)  # (B, T)
        grad_weight = (grad_weight + a * kl_weight) * m

    return PolicyLossOutput(
        loss=loss,
        ratio=torch.where(on, torch.exp(log_rho.detach()), torch.ones_like(d)),
        clip=torch.where(on, codes, torch.zeros_like(codes)).to(torch.int8),
        grad_weight=grad_weight,
        token_loss=token_loss.detach(),
        kl=None if kl is None else torch.where(on, kl.detach(), torch.zeros_like(d)),
        # a sequence-level log ratio has the same value on every token of its row (padding included)
        seq_ratio=torch.exp(log_rho.detach()[:, 0]) if obj.sequence_level else None,
        params=p,
    )
