"""Every policy objective PolicyLens trains with, as pure tensor math.

One entry point, used by the trainer and by the dashboard's weighting views:

    out = policy_loss("dapo", logp, old_logp, advantages, mask)
    out.loss.backward()            # scalar, differentiable wrt logp
    out.ratio, out.clip, out.grad_weight, out.token_loss, out.kl   # (B, T) diagnostics, detached
    out.seq_ratio                  # (B,) the ratio of each sequence (sequence-level algorithms), else None

This module is the one registry of algorithms: `OBJECTIVES` holds each one's switches, its published
hyper-parameters and the training-loop settings its paper prescribes (`Objective.loop`); the trainer's config, the
run log and the dashboard derive their lists from it.

An algorithm is not a branch of one big function but a point in a small space of orthogonal switches
(`Objective`, one frozen dataclass per algorithm):

- ratio level: `token` r = exp(logp - old_logp); `sequence` s_i = exp(mean_t log r) with the gradient spread
  over the sequence (GSPO); `sequence-token` value s_i but token-local gradient (GSPO-token); `geometric`
  exp(mean_t of log r clipped per token in log space) (GMPO);
- surrogate (clip and weight rule): `ppo-clip` -min(rA, clip(r)A); `cispo` -sg(clip(r))A (gradient always
  kept); `aspo` flipped weight 1/r for A > 0 and soft dual clip; `sapo` sigmoid soft gate; `linear` -rA;
- aggregation: how token losses become one number (AGGREGATIONS);
- beta: weight of the k3 KL to the reference policy, added to every token's loss.

Published defaults (each entry's `doc` names the paper and section they come from):

| algo       | ratio level    | surrogate | eps_low / eps_high     | beta  | aggregation             |
|------------|----------------|-----------|------------------------|-------|-------------------------|
| grpo       | token          | ppo-clip  | 0.2 / 0.2              | 0.04  | seq-mean-token-mean     |
| dapo       | token          | ppo-clip  | 0.2 / 0.28             | 0     | token-mean              |
| gspo       | sequence       | ppo-clip  | 3e-4 / 4e-4            | 0     | seq-mean                |
| gspo_token | sequence-token | ppo-clip  | 3e-4 / 4e-4            | 0     | seq-mean-token-mean     |
| aspo       | token          | aspo      | 0.2 / 0.2 (0.4 hi-ent) | 0.001 | token-mean              |
| dr_grpo    | token          | ppo-clip  | 0.2 / 0.2              | 0     | seq-mean-token-sum-norm |
| cispo      | token          | cispo     | 1.0 / 0.28             | 0     | token-mean              |
| sapo       | token          | sapo      | (tau 1.0 / 1.05)       | 0     | seq-mean-token-mean     |
| gmpo       | geometric      | linear    | 0.4 / 0.4 (log space)  | 0     | seq-mean                |
| ppo        | token          | ppo-clip  | 0.2 / 0.2              | 0 (*) | token-mean              |

(*) PPO puts the KL to pi_ref inside the per-token reward (`kl_coef`, engine.critic), not into the loss, and takes
its advantages from a critic and GAE (`Objective.critic`): the objective itself is only the clipped surrogate.

Gradient weight. `grad_weight[i, t] = -dLoss/dlogp[i, t]` of the TOTAL loss (policy term + beta * KL), in closed
form (no autograd), 0 on masked tokens. It is the coefficient of grad log pi(o_it) in the update, i.e. what the
dashboard paints on tokens. tests/test_objectives.py checks it against autograd for every algorithm x aggregation.

Clip codes (`clip`, int8): 0 none; 1 clipped low (A < 0 and the ratio fell below the lower bound: zero gradient);
2 clipped high (A > 0 and the ratio rose above the upper bound: zero gradient); 3 capped with the gradient kept
(ASPO's soft dual clip, CISPO's truncated IS weight, SAPO's gate below SAPO_SOFT_CAP_LEVEL). Tokens with A == 0
are never reported as clipped (their loss and gradient are 0 whatever the ratio). GSPO/GSPO-token: the
sequence's code on each of its tokens. GMPO: the per-token log-space clip (1/2) that removes a token from the
geometric mean's gradient.

Departures from the papers (all deliberate, all covered by tests):
1. CISPO's paper loss is -sg(clip(r)) * A * log pi. We use -sg(clip(r)) * A * exp(log r - sg(log r)): the same
   gradient (clip(r) * A per token), but the loss value is -clip(r) * A, comparable to the other objectives
   (the paper's value depends on the absolute log-prob and has no meaning of its own).
2. ASPO's soft dual clip, likewise: the official code uses -A * c * log pi; we use -A * c * exp(log r - sg(log r))
   (value -A * c, same gradient A * c).
3. ASPO's four entropy-dependent clip ranges (A<0/A>0 x low/high entropy) are three knobs here: `eps_low` (A < 0)
   and `eps_high` (A > 0) for tokens at or below the response's `entropy_quantile`, `eps_high_entropy` for both
   signs above it. Without `entropy` every token uses eps_low / eps_high.
4. GSPO and GMPO are defined for one advantage per sequence. Given (B, T) advantages we apply each token's own
   advantage (its sign picks the clip side); with a constant advantage per sequence this is exactly the paper.
5. The KL term is only added when `ref_logp` is given: without it the policy term alone is returned (`kl` None),
   even for algorithms whose default beta is > 0. With `ref_logp` and beta == 0, `kl` is still reported (worth
   watching) but is not part of the loss or the gradient weight.
6. "seq-mean" (GSPO's per-sequence mean, (1/G) sum_i loss_i) is computed as the mean over sequences of each
   sequence's mean token loss; for sequence-level objectives every token of a sequence carries the sequence's
   loss, so this is the paper's formula. It is numerically the same as "seq-mean-token-mean".
7. CISPO does not publish eps_high; we use 0.28 (DAPO's clip-higher, also Trinity-RFT's CISPO default) and
   eps_low = 1.0, i.e. a lower bound of 0 ("we did not impose a lower bound on the IS weight").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch

from engine.clip_codes import CLIP_CAP, CLIP_EVENTS, CLIP_HIGH, CLIP_LOW, CLIP_NAMES, CLIP_NONE

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "CLIP_CAP",
    "CLIP_EVENTS",
    "CLIP_HIGH",
    "CLIP_LOW",
    "CLIP_NAMES",
    "CLIP_NONE",
    "CRITIC_ALGORITHMS",
    "OBJECTIVES",
    "RATIO_LEVELS",
    "SAPO_SOFT_CAP_LEVEL",
    "SURROGATES",
    "BatchTotals",
    "Objective",
    "PolicyLossOutput",
    "aggregation_weights",
    "defaults",
    "k3_kl",
    "loop_defaults",
    "policy_loss",
    "resolve",
    "uses_critic",
]

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "seq-mean")
RATIO_LEVELS = ("token", "sequence", "sequence-token", "geometric")
SURROGATES = ("ppo-clip", "cispo", "aspo", "sapo", "linear")


# SAPO has no hard clip: a token is reported as soft-capped (code 3) when its gate has cut the gradient weight to
# less than this fraction of the ungated weight r * A (the gate factor 4 sigma (1 - sigma) is 1 at r = 1).
SAPO_SOFT_CAP_LEVEL = 0.5


# ----------------------------------------------------------------------------------------------------------------
# The algorithms: one frozen dataclass each


@dataclass(frozen=True)
class Objective:
    """One policy objective as a combination of switches plus its published hyper-parameters.

    `extra` holds the algorithm-specific knobs (name, default). Every name returned by `defaults()` is an
    accepted override of `policy_loss`; `max_len` (Dr. GRPO's constant, default None = T) is accepted by all.
    `loop` holds the training-loop settings the paper prescribes (names of engine.config.TrainConfig fields);
    a setting not listed takes engine.config.LOOP_DEFAULTS. `critic`: the algorithm trains a value model next to
    the policy and its advantages are GAE over that model's values (engine.critic), not group-relative.
    """

    name: str
    doc: str  # paper, section, where the defaults come from
    ratio_level: str
    surrogate: str
    aggregation: str
    eps_low: float | None  # None: the surrogate has no clip range (SAPO)
    eps_high: float | None
    beta: float
    extra: tuple[tuple[str, float], ...] = ()
    loop: tuple[tuple[str, Any], ...] = ()
    critic: bool = False

    @property
    def sequence_level(self) -> bool:
        """One ratio per sequence (GSPO, GSPO-token, GMPO): `policy_loss` reports it as `seq_ratio`."""
        return self.ratio_level != "token"

    def defaults(self) -> dict[str, Any]:
        eps = {} if self.eps_low is None else {"eps_low": self.eps_low, "eps_high": self.eps_high}
        return {
            **eps,
            "beta": self.beta,
            "aggregation": self.aggregation,
            "max_len": None,
            **dict(self.extra),
        }


GRPO = Objective(
    name="grpo",
    doc="GRPO, DeepSeekMath (arXiv 2402.03300), Sec. 4.1.1 eq. 3: token ratio, PPO clip eps = 0.2, per-response "
    "token mean then mean over the group, k3 KL in the loss with beta = 0.04 (Sec. 4.2).",
    ratio_level="token",
    surrogate="ppo-clip",
    aggregation="seq-mean-token-mean",
    eps_low=0.2,
    eps_high=0.2,
    beta=0.04,
)
DAPO = Objective(
    name="dapo",
    doc="DAPO (arXiv 2503.14476): Clip-Higher eps_low = 0.2, eps_high = 0.28 (Sec. 3.1), token-level policy "
    "gradient loss = token-mean over the batch (Sec. 3.3), no KL term (Sec. 2.3); in the loop, dynamic sampling "
    "(Sec. 3.2) and the soft overlong punishment (Sec. 3.4, eq. 13).",
    ratio_level="token",
    surrogate="ppo-clip",
    aggregation="token-mean",
    eps_low=0.2,
    eps_high=0.28,
    beta=0.0,
    loop=(("dynamic_sampling", True), ("overlong_shaping", True)),
)
GSPO = Objective(
    name="gspo",
    doc="GSPO (arXiv 2507.18071), Sec. 4.1: sequence ratio s_i = exp(mean_t log r), clipped per "
    "sequence, one term per sequence; clip range 3e-4 / 4e-4 from Sec. 5.1; no KL; each rollout batch split "
    "into 4 mini-batches (Sec. 5.1).",
    ratio_level="sequence",
    surrogate="ppo-clip",
    aggregation="seq-mean",
    eps_low=3e-4,
    eps_high=4e-4,
    beta=0.0,
    loop=(("minibatches", 4),),
)
GSPO_TOKEN = Objective(
    name="gspo_token",
    doc="GSPO-token (arXiv 2507.18071), Sec. 4.3: s_it = sg(s_i) * pi/sg(pi), allows token-level "
    "advantages; identical to GSPO when A is constant in a sequence. Defaults (and 4 mini-batches) as GSPO.",
    ratio_level="sequence-token",
    surrogate="ppo-clip",
    aggregation="seq-mean-token-mean",
    eps_low=3e-4,
    eps_high=4e-4,
    beta=0.0,
    loop=(("minibatches", 4),),
)
ASPO = Objective(
    name="aspo",
    doc="ASPO (arXiv 2510.06062), method section and the official compute_policy_loss_archer: flipped weight 1/r "
    "for A > 0, soft dual clip c = 3 keeping the gradient, eps 0.2 below the response's 80th entropy "
    "percentile and 0.4 above it, token-mean, k3 KL with beta = 0.001; 3 update epochs per batch (Archer2.0).",
    ratio_level="token",
    surrogate="aspo",
    aggregation="token-mean",
    eps_low=0.2,
    eps_high=0.2,
    beta=0.001,
    extra=(("dual_clip", 3.0), ("eps_high_entropy", 0.4), ("entropy_quantile", 0.8)),
    loop=(("epochs", 3),),
)
DR_GRPO = Objective(
    name="dr_grpo",
    doc="Dr. GRPO (arXiv 2503.20783), Sec. 3.2: GRPO without the 1/|o_i| length normalisation: token sums "
    "divided by a constant (B * max generation length), no KL; advantages R - mean, not divided by the group's "
    "std (engine.advantages).",
    ratio_level="token",
    surrogate="ppo-clip",
    aggregation="seq-mean-token-sum-norm",
    eps_low=0.2,
    eps_high=0.2,
    beta=0.0,
    loop=(("scale_adv_by_std", False),),
)
CISPO = Objective(
    name="cispo",
    doc="CISPO, MiniMax-M1 (arXiv 2506.13585), Sec. 3.1: REINFORCE with a detached, clipped IS weight, every "
    "token keeps its gradient; no lower bound (eps_low = 1.0), eps_high not published (0.28 here), token-mean.",
    ratio_level="token",
    surrogate="cispo",
    aggregation="token-mean",
    eps_low=1.0,
    eps_high=0.28,
    beta=0.0,
)
SAPO = Objective(
    name="sapo",
    doc="SAPO (arXiv 2511.20347), the SAPO objective and gate definition: f(r) = sigmoid(tau (r - 1)) * 4 / tau, "
    "tau_pos = 1.0 for A > 0, tau_neg = 1.05 otherwise, per-response token mean; no hard clip (eps unused).",
    ratio_level="token",
    surrogate="sapo",
    aggregation="seq-mean-token-mean",
    eps_low=None,
    eps_high=None,
    beta=0.0,
    extra=(("tau_pos", 1.0), ("tau_neg", 1.05)),
)
GMPO = Objective(
    name="gmpo",
    doc="GMPO (arXiv 2507.20673), the objective in the method section and the official code: geometric mean of "
    "token ratios, each token's log ratio clipped (sign-aware, like PPO) to [-0.4, 0.4] before the mean; one term "
    "-A_i * ratio_i per sequence.",
    ratio_level="geometric",
    surrogate="linear",
    aggregation="seq-mean",
    eps_low=0.4,
    eps_high=0.4,
    beta=0.0,
)

PPO = Objective(
    name="ppo",
    doc="PPO for language models as the GRPO paper (arXiv 2402.03300, Sec. 4.1.1 eq. 1) states it, after Ziegler et "
    "al. 2019 (arXiv 1909.08593) and Ouyang et al. 2022 (arXiv 2203.02155): clipped surrogate eps = 0.2 on token "
    "ratios, advantages by GAE over a critic's values, the KL to pi_ref inside the per-token reward (so no KL term "
    "in the loss). Loop (Ziegler et al.'s defaults, also those of the 'N implementation details of RLHF with PPO' "
    "write-up by Huang et al. and of TRL's PPO trainer): gamma = 1, lambda = 0.95, value clip 0.2, value "
    "coefficient 0.1, advantages whitened over the batch, token-mean loss; KL reward coefficient 0.05 (TRL; "
    "InstructGPT used 0.02).",
    ratio_level="token",
    surrogate="ppo-clip",
    aggregation="token-mean",
    eps_low=0.2,
    eps_high=0.2,
    beta=0.0,
    loop=(("kl_coef", 0.05), ("gae_gamma", 1.0), ("gae_lambda", 0.95), ("whiten_advantages", True),
          ("value_clip", 0.2), ("value_coef", 0.1)),
    critic=True,
)

OBJECTIVES: dict[str, Objective] = {
    o.name: o for o in (GRPO, DAPO, GSPO, GSPO_TOKEN, ASPO, DR_GRPO, CISPO, SAPO, GMPO, PPO)
}
ALGORITHMS: tuple[str, ...] = tuple(OBJECTIVES)
CRITIC_ALGORITHMS: tuple[str, ...] = tuple(name for name, o in OBJECTIVES.items() if o.critic)


def defaults(algo: str) -> dict[str, Any]:
    """The resolved hyper-parameters of `algo` (its published defaults); every key is an accepted override."""
    return _objective(algo).defaults()


def uses_critic(algo: str) -> bool:
    """`algo` trains a critic and takes its advantages from GAE (engine.critic) rather than from its group."""
    return _objective(algo).critic


def loop_defaults(algo: str) -> dict[str, Any]:
    """The training-loop settings `algo`'s paper prescribes (engine.config.TrainConfig field -> value)."""
    return dict(_objective(algo).loop)


def _objective(algo: str) -> Objective:
    if algo not in OBJECTIVES:
        raise ValueError(f"unknown algorithm {algo!r}; accepted: {', '.join(ALGORITHMS)}")
    return OBJECTIVES[algo]


# ----------------------------------------------------------------------------------------------------------------
# The result


@dataclass(frozen=True)
class PolicyLossOutput:
    """What an objective did, per token. Everything but `loss` is detached."""

    loss: torch.Tensor  # () differentiable wrt logp
    ratio: torch.Tensor  # (B, T) the ratio the algorithm used (sequence ratio on every token for GSPO/GMPO)
    clip: torch.Tensor  # (B, T) int8 clip code, see module docstring
    grad_weight: torch.Tensor  # (B, T) -dloss/dlogp of the total loss (incl. KL), closed form, 0 when masked
    token_loss: torch.Tensor  # (B, T) policy term + beta * kl per token (what the aggregation averages)
    kl: torch.Tensor | None  # (B, T) k3 KL to the reference (in the loss only when beta > 0), None without ref_logp
    seq_ratio: torch.Tensor | None  # (B,) the sequence ratio the objective used (sequence-level algorithms), else None
    params: dict[str, Any]  # the resolved hyper-parameters used


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
    seq-mean-token-sum-norm: 1 / (B * max_len), max_len defaulting to T.
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
    raise ValueError(f"unknown aggregation {aggregation!r}; accepted: {', '.join(AGGREGATIONS)}")


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


def _surrogate(kind, log_rho, adv, p, eps_low, eps_high):
    """Per-token policy loss and its closed-form weight h = -d loss_t / d log_rho_t.

    Returns (loss (B, T) differentiable, h (B, T) detached, clip codes (B, T)).
    eps_low / eps_high are floats or (B, T) tensors (ASPO's entropy-dependent ranges).
    """
    rho = torch.exp(log_rho)  # (B, T)
    r = rho.detach()
    lr = log_rho
    unit = torch.exp(lr - lr.detach())  # value 1, d/dlog_rho = 1: carries a detached weight's gradient
    zero = torch.zeros_like(r, dtype=torch.int8)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    neg, pos = adv < 0, adv > 0

    if kind == "ppo-clip":
        clipped_rho = torch.clamp(rho, min=lo, max=hi)  # (B, T)
        loss = torch.maximum(-adv * rho, -adv * clipped_rho)  # (B, T) = -min(rA, clip(r)A)
        low, high = neg & (r < lo), pos & (r > hi)
        h = torch.where(low | high, torch.zeros_like(r), r * adv)
        codes = torch.where(low, CLIP_LOW, torch.where(high, CLIP_HIGH, CLIP_NONE))
        return loss, h, codes.to(torch.int8)

    if kind == "cispo":
        w = torch.clamp(r, min=lo, max=hi)  # (B, T) detached IS weight
        loss = -adv * w * unit  # value -clip(r) A, gradient clip(r) A (departure 1)
        capped = (adv != 0) & ((r < lo) | (r > hi))
        return loss, w * adv, torch.where(capped, CLIP_CAP, CLIP_NONE).to(torch.int8)

    if kind == "aspo":
        c = p["dual_clip"]
        # A < 0: hard clip below at 1 - eps (zero gradient), weight r, soft cap at c (weight c, gradient kept)
        neg_low, neg_cap = neg & (r < lo), neg & (r > c)
        # A >= 0: hard clip above at 1 + eps (zero gradient), flipped weight 1/r, soft cap when 1/r > c
        pos_high, pos_cap = ~neg & (r > hi), ~neg & (r < 1.0 / c)
        p_pos = torch.clamp(rho, max=hi)  # min(r, 1 + eps)
        loss_pos = -adv * p_pos / p_pos.detach() / p_pos.detach()  # value -A/p, d/dlog_rho = -A/r
        loss_neg = -adv * torch.clamp(rho, min=lo)  # -A max(r, 1 - eps)
        loss_cap = -adv * c * unit  # departure 2
        loss = torch.where(neg_cap | pos_cap, loss_cap, torch.where(neg, loss_neg, loss_pos))
        h = torch.where(neg, r * adv, adv / r)
        h = torch.where(neg_low | pos_high, torch.zeros_like(r), h)
        h = torch.where(neg_cap | pos_cap, c * adv, h)
        codes = torch.where(neg_low, CLIP_LOW, torch.where(pos_high & pos, CLIP_HIGH, CLIP_NONE))
        codes = torch.where((neg_cap | (pos_cap & pos)), CLIP_CAP, codes)
        return loss, h, codes.to(torch.int8)

    if kind == "sapo":
        # build tau in r's dtype: torch.where on Python floats would round 1.05 through float32
        tau = torch.where(pos, torch.full_like(r, p["tau_pos"]), torch.full_like(r, p["tau_neg"]))  # (B, T)
        gate = torch.sigmoid(tau * (rho - 1.0))  # (B, T)
        loss = -adv * gate * 4.0 / tau  # -A f(r)
        g = gate.detach()
        factor = 4.0 * g * (1.0 - g)  # f'(r): 1 at r = 1, decays on both sides
        capped = (adv != 0) & (factor < SAPO_SOFT_CAP_LEVEL)
        return loss, factor * r * adv, torch.where(capped, CLIP_CAP, CLIP_NONE).to(torch.int8)

    if kind == "linear":
        return -adv * rho, r * adv, zero
    raise ValueError(f"unknown surrogate {kind!r}; accepted: {', '.join(SURROGATES)}")


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
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = "NaN" if bool(torch.isnan(x).any()) else "inf"
        raise ValueError(f"{name} contains {bad}; accepted: finite values only (pad masked positions with 0)")
    return x


def _is_number(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)


def resolve(algo: str, **overrides: Any) -> dict[str, Any]:
    """`algo`'s published hyper-parameters with `overrides` applied, validated (the checks `policy_loss` makes).

    Raises ValueError naming the bad value and what is accepted.
    """
    obj = _objective(algo)
    p = obj.defaults()
    unknown = sorted(set(overrides) - set(p))
    if unknown:
        raise ValueError(
            f"unknown override {', '.join(map(repr, unknown))}: not a hyper-parameter of {obj.name!r}; accepted: "
            f"{', '.join(p)}"
        )
    p.update(overrides)
    log_space = obj.ratio_level == "geometric"
    for key in ("eps_low", "eps_high", "eps_high_entropy"):
        if key not in p:
            continue
        # a bound 1 - eps must stay >= 0 (eps_high_entropy also sets ASPO's lower bound); GMPO's are log-space
        at_most_one = not log_space and key != "eps_high"
        v = p[key]
        if not (_is_number(v) and v > 0 and (not at_most_one or v <= 1)):
            rule = (f"a number in (0, 1] (the lower clip bound 1 - {key} cannot be negative)" if at_most_one
                    else "a finite number > 0")
            raise ValueError(f"{key} = {v!r} for {obj.name!r} is invalid; accepted: {rule}")
    if not (_is_number(p["beta"]) and p["beta"] >= 0):
        raise ValueError(f"beta (KL weight) = {p['beta']!r} is invalid; accepted: a finite number >= 0")
    if p["aggregation"] not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {p['aggregation']!r}; accepted: {', '.join(AGGREGATIONS)}")
    if p["max_len"] is not None and not (
        isinstance(p["max_len"], Integral) and not isinstance(p["max_len"], bool) and p["max_len"] > 0
    ):
        raise ValueError(f"max_len = {p['max_len']!r} is invalid; accepted: None (= T) or an int > 0")
    if "dual_clip" in p and not (_is_number(p["dual_clip"]) and p["dual_clip"] > 1):
        raise ValueError(f"dual_clip = {p['dual_clip']!r} is invalid; accepted: a finite number > 1")
    if "entropy_quantile" in p and not (_is_number(p["entropy_quantile"]) and 0 <= p["entropy_quantile"] <= 1):
        raise ValueError(f"entropy_quantile = {p['entropy_quantile']!r} is invalid; accepted: a number in [0, 1]")
    for key in ("tau_pos", "tau_neg"):
        if key in p and not (_is_number(p[key]) and p[key] > 0):
            raise ValueError(f"{key} = {p[key]!r} is invalid; accepted: a finite number > 0")
    return p


# ----------------------------------------------------------------------------------------------------------------
# The entry point


def policy_loss(
    algo: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    totals: BatchTotals | None = None,
    **overrides: Any,
) -> PolicyLossOutput:
    """Loss and per-token diagnostics of `algo` (one of ALGORITHMS) on a batch of completions.

    logp, old_logp, ref_logp, mask, entropy: (B, T); advantages: (B,) per sequence or (B, T) per token.
    mask is 1 on completion tokens (bool, int or float 0/1). entropy only matters for ASPO's clip ranges.
    totals: the whole mini-batch's normalisers when this is one rank's part of it (aggregation_weights).
    overrides: any key of `defaults(algo)` (eps_low, eps_high, beta, aggregation, max_len, and per algorithm
    dual_clip, eps_high_entropy, entropy_quantile, tau_pos, tau_neg). Raises ValueError on bad input.
    """
    obj = _objective(algo)
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
    p = resolve(algo, **overrides)

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
    # d = log r; padding can hold anything finite, zero it so exp() cannot overflow there
    d = torch.where(on, logp - old_logp.detach().to(dtype=dtype, device=dev), torch.zeros_like(logp))  # (B, T)

    eps_low, eps_high = float(p.get("eps_low", 0.0)), float(p.get("eps_high", 0.0))  # SAPO: unused
    if obj.surrogate == "aspo" and entropy is not None:
        # ASPO: looser range for the response's high-entropy tokens (above its entropy_quantile, per row)
        ent = torch.where(on, entropy.detach().to(dtype=dtype, device=dev), torch.full_like(d, float("nan")))
        q = torch.nanquantile(ent, float(p["entropy_quantile"]), dim=-1, keepdim=True)  # (B, 1), NaN if empty
        high_ent = ent > q  # (B, T) NaN compares False
        eps_e = float(p["eps_high_entropy"])
        eps_low = torch.where(high_ent, torch.full_like(d, eps_e), torch.full_like(d, eps_low))  # (B, T)
        eps_high = torch.where(high_ent, torch.full_like(d, eps_e), torch.full_like(d, eps_high))  # (B, T)

    # ---- ratio -> surrogate -> aggregation
    log_rho, spread, level_codes = _ratio_level(
        obj.ratio_level, d, m, adv, float(p.get("eps_low", 0.0)), float(p.get("eps_high", 0.0))
    )
    pg_loss, h, codes = _surrogate(obj.surrogate, log_rho, adv, p, eps_low, eps_high)
    if level_codes is not None:
        codes = level_codes.to(torch.int8)
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
