"""The registry of algorithms: each one's switches, its published defaults and loop settings, with the paper.

Torch-free (the dashboard's pages, the config and the CLI read it without importing torch); the tensor math of every
switch lives in `engine.objectives`, whose `policy_loss(algo, ...)` resolves its hyper-parameters here.

An algorithm is a point in a small space of orthogonal switches (`Objective`, one frozen dataclass per algorithm):

- ratio level: `token` r = exp(logp - old_logp); `sequence` s_i = exp(mean_t log r) with the gradient spread over
  the sequence (GSPO); `sequence-token` value s_i but token-local gradient (GSPO-token); `geometric` exp(mean_t of
  log r clipped per token in log space) (GMPO); `sequence-sum` w_i = exp(sum_t log r), clamped, value only, the
  gradient token-local (VESPO);
- surrogate (clip and weight rule): `ppo-clip` -min(rA, clip(r)A); `cispo` -sg(clip(r))A (gradient always kept);
  `aspo` flipped weight 1/r for A > 0 and soft dual clip; `sapo` sigmoid soft gate; `linear` -rA; `gpg` -A (no
  ratio); `dppo-tv` / `dppo-kl` a truncated ratio on the tokens inside a binary-divergence trust region; `dro` a
  quadratic log-ratio penalty; `vespo` a gamma weight of the sequence ratio;
- covariance rule (Cui et al. 2025): `clip` zeroes a random share of the tokens whose advantage x log-prob
  covariance is in a band; `kl` adds |log r| to the top share by covariance;
- aggregation: how token losses become one number (AGGREGATIONS);
- beta: weight of the k3 KL to the reference policy, added to every token's loss.

Every algorithm also takes `top_entropy_quantile` (arXiv 2506.01939, TRL's option of that name): the share of the
batch's tokens, highest entropy first, whose policy term is kept (1.0: all).

`defaults_table()` renders the published defaults as the table of docs/algorithms.md; `TrainConfig`'s help lists
each knob's preset per algorithm from here (`presets(name)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "COMMON_KNOBS",
    "COVARIANCE_RULES",
    "CRITIC_ALGORITHMS",
    "OBJECTIVES",
    "RATIO_LEVELS",
    "SURROGATES",
    "Objective",
    "defaults",
    "defaults_table",
    "loop_defaults",
    "objective",
    "presets",
    "resolve",
    "uses_critic",
]

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "seq-mean", "seq-mean-token-sum")
RATIO_LEVELS = ("token", "sequence", "sequence-token", "geometric", "sequence-sum")
SURROGATES = ("ppo-clip", "cispo", "aspo", "sapo", "linear", "gpg", "dppo-tv", "dppo-kl", "dro", "vespo")
COVARIANCE_RULES = ("clip", "kl")

COMMON_KNOBS: dict[str, Any] = {"max_len": None, "top_entropy_quantile": 1.0}
"""Knobs every algorithm accepts: Dr. GRPO's constant normaliser (None = T) and the top-entropy token share (1.0 =
every token; arXiv 2506.01939 trains on the top 0.2)."""


@dataclass(frozen=True)
class Objective:
    """One policy objective as a combination of switches plus its published hyper-parameters.

    `extra` holds the algorithm-specific knobs (name, default). Every name returned by `defaults()` is an accepted
    override of `policy_loss`; COMMON_KNOBS are accepted by all. `loop` holds the training-loop settings the paper
    prescribes (names of engine.config.TrainConfig fields); a setting not listed takes engine.config.LOOP_DEFAULTS.
    `critic`: the algorithm trains a value model next to the policy and its advantages are GAE over that model's
    values (engine.critic), not group-relative. `covariance`: one of COVARIANCE_RULES or None.
    """

    name: str
    doc: str  # paper, section, where the defaults come from
    ratio_level: str
    surrogate: str
    aggregation: str
    eps_low: float | None  # None: the surrogate has no clip range (SAPO, GPG, DRO, KL-Cov, VESPO)
    eps_high: float | None
    beta: float
    extra: tuple[tuple[str, float], ...] = ()
    loop: tuple[tuple[str, Any], ...] = ()
    critic: bool = False
    covariance: str | None = None

    @property
    def loss_scales_with_advantage(self) -> bool:
        """Whether each token's loss (value and gradient) is proportional to its advantage, so that a detached
        weight on the advantage weighs the token's loss (the mismatch corrections, engine.corrections). Not DRO's
        (its (log r)^2 penalty does not depend on the advantage), nor Clip-Cov's and KL-Cov's (which tokens they
        select depends on the advantage through the covariance; verl weighs the loss after the selection)."""
        return self.surrogate != "dro" and self.covariance is None

    @property
    def sequence_level(self) -> bool:
        """One ratio per sequence (GSPO, GSPO-token, GMPO, LUSPO, VESPO): `policy_loss` reports it as `seq_ratio`."""
        return self.ratio_level != "token"

    def defaults(self) -> dict[str, Any]:
        eps = {} if self.eps_low is None else {"eps_low": self.eps_low, "eps_high": self.eps_high}
        return {**eps, "beta": self.beta, "aggregation": self.aggregation, **COMMON_KNOBS, **dict(self.extra)}


def _entry(name, doc, ratio_level, surrogate, aggregation, eps, beta=0.0, **more) -> Objective:
    return Objective(name=name, doc=doc, ratio_level=ratio_level, surrogate=surrogate, aggregation=aggregation,
                     eps_low=eps[0], eps_high=eps[1], beta=beta, **more)


_GSPO_EPS = (3e-4, 4e-4)  # GSPO (arXiv 2507.18071) Sec. 5.1, on the sequence ratio
_VERL_EPS = (0.2, 0.2)  # verl 0.9.1 actor config clip_ratio
_VESPO_GAMMA = (("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0), ("vespo_k_neg", 3.0), ("vespo_lambda_neg", 2.0))

_ENTRIES = (
    _entry("grpo", "GRPO, DeepSeekMath (arXiv 2402.03300), Sec. 4.1.1 eq. 3: token ratio, PPO clip eps = 0.2, "
           "per-response token mean then mean over the group, k3 KL in the loss with beta = 0.04 (Sec. 4.2).",
           "token", "ppo-clip", "seq-mean-token-mean", (0.2, 0.2), beta=0.04),
    _entry("dapo", "DAPO (arXiv 2503.14476): Clip-Higher eps_low = 0.2, eps_high = 0.28 (Sec. 3.1), token-level "
           "policy gradient loss = token-mean over the batch (Sec. 3.3), no KL term (Sec. 2.3); in the loop, dynamic "
           "sampling (Sec. 3.2) and the soft overlong punishment (Sec. 3.4, eq. 13).",
           "token", "ppo-clip", "token-mean", (0.2, 0.28),
           loop=(("dynamic_sampling", True), ("overlong_shaping", True))),
    _entry("gspo", "GSPO (arXiv 2507.18071), Sec. 4.1: sequence ratio s_i = exp(mean_t log r), clipped per sequence, "
           "one term per sequence; clip range 3e-4 / 4e-4 from Sec. 5.1; no KL; each rollout batch split into 4 "
           "mini-batches (Sec. 5.1).",
           "sequence", "ppo-clip", "seq-mean", _GSPO_EPS, loop=(("minibatches", 4),)),
    _entry("gspo_token", "GSPO-token (arXiv 2507.18071), Sec. 4.3: s_it = sg(s_i) * pi/sg(pi), allows token-level "
           "advantages; identical to GSPO when A is constant in a sequence. Defaults (and 4 mini-batches) as GSPO.",
           "sequence-token", "ppo-clip", "seq-mean-token-mean", _GSPO_EPS, loop=(("minibatches", 4),)),
    _entry("aspo", "ASPO (arXiv 2510.06062), method section and the official compute_policy_loss_archer: flipped "
           "weight 1/r for A > 0, soft dual clip c = 3 keeping the gradient, eps 0.2 below the response's 80th "
           "entropy percentile and 0.4 above it, token-mean, k3 KL with beta = 0.001; 3 update epochs per batch "
           "(Archer2.0).",
           "token", "aspo", "token-mean", (0.2, 0.2), beta=0.001,
           extra=(("dual_clip", 3.0), ("eps_high_entropy", 0.4), ("entropy_quantile", 0.8)), loop=(("epochs", 3),)),
    _entry("dr_grpo", "Dr. GRPO (arXiv 2503.20783), Sec. 3.2: GRPO without the 1/|o_i| length normalisation: token "
           "sums divided by a constant (B * max generation length), no KL; advantages R - mean, not divided by the "
           "group's std (engine.advantages).",
           "token", "ppo-clip", "seq-mean-token-sum-norm", (0.2, 0.2), loop=(("scale_adv_by_std", False),)),
    _entry("cispo", "CISPO, MiniMax-M1 (arXiv 2506.13585), Sec. 3.1: REINFORCE with a detached, clipped IS weight, "
           "every token keeps its gradient; no lower bound (eps_low = 1.0), eps_high not published (0.28 here, "
           "DAPO's clip-higher), token-mean.",
           "token", "cispo", "token-mean", (1.0, 0.28)),
    _entry("sapo", "SAPO (arXiv 2511.20347), the SAPO objective and gate definition: f(r) = sigmoid(tau (r - 1)) * 4 "
           "/ tau, tau_pos = 1.0 for A > 0, tau_neg = 1.05 otherwise, per-response token mean; no hard clip.",
           "token", "sapo", "seq-mean-token-mean", (None, None), extra=(("tau_pos", 1.0), ("tau_neg", 1.05))),
    _entry("gmpo", "GMPO (arXiv 2507.20673), the objective in the method section and the official code: geometric "
           "mean of token ratios, each token's log ratio clipped (sign-aware, like PPO) to [-0.4, 0.4] before the "
           "mean; one term -A_i * ratio_i per sequence (verl 0.9.1 `geo_mean`).",
           "geometric", "linear", "seq-mean", (0.4, 0.4)),
    _entry("ppo", "PPO for language models as the GRPO paper (arXiv 2402.03300, Sec. 4.1.1 eq. 1) states it, after "
           "Ziegler et al. 2019 (arXiv 1909.08593) and Ouyang et al. 2022 (arXiv 2203.02155): clipped surrogate eps = "
           "0.2 on token ratios, advantages by GAE over a critic's values, the KL to pi_ref inside the per-token "
           "reward (so no KL term in the loss). Loop (Ziegler et al.'s defaults, also those of the 'N implementation "
           "details of RLHF with PPO' write-up by Huang et al. and of TRL's PPO trainer): gamma = 1, lambda = 0.95, "
           "value clip 0.2, value coefficient 0.1, advantages whitened over the batch, token-mean loss; KL reward "
           "coefficient 0.05 (TRL; InstructGPT used 0.02).",
           "token", "ppo-clip", "token-mean", (0.2, 0.2), critic=True,
           loop=(("kl_coef", 0.05), ("gae_gamma", 1.0), ("gae_lambda", 0.95), ("whiten_advantages", True),
                 ("value_clip", 0.2), ("value_coef", 0.1))),
    _entry("gpg", "GPG (arXiv 2504.02546; verl 0.9.1 `gpg`): plain policy gradient -A log pi, no ratio, no clip, no "
           "KL; token-mean (verl's default loss_agg_mode).",
           "token", "gpg", "token-mean", (None, None)),
    _entry("dppo_tv", "DPPO-Binary-TV (arXiv 2602.04879; verl 0.9.1 `dppo_tv`): a token is masked when p - p_old "
           "leaves [-eps_low, eps_high] in the direction its advantage pushes (A = 0 takes the A < 0 side); the rest "
           "weighed by the ratio truncated at dual_clip = 3 (verl's clip_ratio_c config value), gradient kept. "
           "Bounds 0.2 (verl's clip_ratio, used by DPPO as the TV bound); token-mean.",
           "token", "dppo-tv", "token-mean", (0.2, 0.2), extra=(("dual_clip", 3.0),)),
    _entry("dppo_kl", "DPPO-Binary-KL (arXiv 2602.04879; verl 0.9.1 `dppo_kl`): as DPPO-TV with the binary KL "
           "p_old log(p_old/p) + (1-p_old) log((1-p_old)/(1-p)) bounded instead, moving towards p_old always "
           "allowed; bound 0.05 (SkyRL's DPPO experiments, NovaSky-AI/SkyRL#1037; the paper's recipe is not "
           "restated in verl); ratio truncated at dual_clip = 3; token-mean.",
           "token", "dppo-kl", "token-mean", (0.05, 0.05), extra=(("dual_clip", 3.0),)),
    _entry("dro", "DRO (verl 0.9.1 `dro`, after Richemond et al. 2024, arXiv 2405.19107): -(A log pi - dro_beta/2 "
           "(log r)^2), a quadratic penalty on log(pi / pi_old) with its own coefficient (not beta, the k3 KL "
           "weight). verl has no default (dro_beta is required); 1.0 here. Token-mean.",
           "token", "dro", "token-mean", (None, None), extra=(("dro_beta", 1.0),)),
    _entry("clip_cov", "Clip-Cov (Cui et al. 2025, arXiv 2505.22617; verl 0.9.1 `clip_cov`): PPO clip 0.2, and the "
           "gradient of a random clip_cov_ratio = 2e-4 share of the unclipped tokens whose covariance (A - mean A)"
           "(log pi - mean log pi) lies strictly in (1, 5) is zeroed (they stay in the denominator). Token-mean.",
           "token", "ppo-clip", "token-mean", _VERL_EPS, covariance="clip",
           extra=(("clip_cov_ratio", 2e-4), ("clip_cov_lb", 1.0), ("clip_cov_ub", 5.0))),
    _entry("kl_cov", "KL-Cov (Cui et al. 2025, arXiv 2505.22617; verl 0.9.1 `kl_cov`): -rA without a clip, plus "
           "kl_cov_coef * |log r| on the top kl_cov_ratio = 2e-4 share of tokens by covariance; coefficient 0.1 "
           "(verl's ppo_kl_coef config value, not the function's fallback 1.0). Token-mean.",
           "token", "linear", "token-mean", (None, None), covariance="kl",
           extra=(("kl_cov_ratio", 2e-4), ("kl_cov_coef", 0.1))),
    _entry("luspo", "LUSPO (arXiv 2602.05261; TRL 1.16 loss_type='luspo' at importance_sampling_level='sequence'): "
           "GSPO's clipped sequence ratio, each sequence's loss scaled by its length: token SUM per sequence, mean "
           "over all sequences. Clip range and 4 mini-batches as GSPO, which it modifies.",
           "sequence", "ppo-clip", "seq-mean-token-sum", _GSPO_EPS, loop=(("minibatches", 4),)),
    _entry("vespo", "VESPO (arXiv 2602.10693; TRL 1.16 loss_type='vespo', get_gamma_weights): no clip; each token's "
           "gradient A grad log pi weighed by the detached gamma weight phi(w) = e^lambda w^k e^(-lambda w) of the "
           "sequence ratio w = exp(sum_t log r) (clamped to [1e-8, e^20]); k, lambda = 2, 3 for A >= 0 and 3, 2 "
           "for A < 0 (TRL's defaults). Token-mean (TRL normalises vespo like dapo).",
           "sequence-sum", "vespo", "token-mean", (None, None), extra=_VESPO_GAMMA),
)

OBJECTIVES: dict[str, Objective] = {o.name: o for o in _ENTRIES}
ALGORITHMS: tuple[str, ...] = tuple(OBJECTIVES)
CRITIC_ALGORITHMS: tuple[str, ...] = tuple(name for name, o in OBJECTIVES.items() if o.critic)


def objective(algo: str) -> Objective:
    """The registry entry of `algo`; ValueError naming the accepted algorithms otherwise."""
    if algo not in OBJECTIVES:
        raise ValueError(f"unknown algorithm {algo!r}; accepted: {', '.join(ALGORITHMS)}")
    return OBJECTIVES[algo]


def defaults(algo: str) -> dict[str, Any]:
    """The resolved hyper-parameters of `algo` (its published defaults); every key is an accepted override."""
    return objective(algo).defaults()


def uses_critic(algo: str) -> bool:
    """`algo` trains a critic and takes its advantages from GAE (engine.critic) rather than from its group."""
    return objective(algo).critic


def loop_defaults(algo: str) -> dict[str, Any]:
    """The training-loop settings `algo`'s paper prescribes (engine.config.TrainConfig field -> value)."""
    return dict(objective(algo).loop)


def presets(knob: str, fallback: dict[str, Any] | None = None) -> dict[str, Any]:
    """algorithm -> its preset for `knob` (an objective hyper-parameter or a loop setting), for the algorithms that
    have one; `fallback` holds loop settings that apply when an algorithm's paper prescribes none."""
    out = {}
    for name, o in OBJECTIVES.items():
        own = {**(fallback or {}), **dict(o.loop), **o.defaults()}
        if knob in own and knob not in COMMON_KNOBS:
            out[name] = own[knob]
    return out


def defaults_table() -> str:
    """The published defaults of every algorithm as a Markdown table (docs/algorithms.md holds this very text)."""
    rows = ["| algo | ratio level | surrogate | covariance rule | eps_low / eps_high | beta | aggregation "
            "| other knobs | loop settings |", "|---|---|---|---|---|---|---|---|---|"]
    for o in OBJECTIVES.values():
        eps = "-" if o.eps_low is None else f"{o.eps_low:g} / {o.eps_high:g}"
        other = ", ".join(f"{k} {v:g}" for k, v in o.extra) or "-"
        loop = ", ".join(f"{k} {v}" for k, v in o.loop) + (", critic" if o.critic else "") or "-"
        rows.append(f"| {o.name} | {o.ratio_level} | {o.surrogate} | {o.covariance or '-'} | {eps} | {o.beta:g} | "
                    f"{o.aggregation} | {other} | {loop.lstrip(', ')} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------------------
# Validation


def _is_number(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)


# knob -> (test, what is accepted); checked when the knob is one of the algorithm's
_RULES: dict[str, tuple[Any, str]] = {
    "dual_clip": (lambda v: v > 1, "a finite number > 1"),
    "entropy_quantile": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "top_entropy_quantile": (lambda v: 0 < v <= 1, "a number in (0, 1], the share of tokens kept (1: all)"),
    "tau_pos": (lambda v: v > 0, "a finite number > 0"),
    "tau_neg": (lambda v: v > 0, "a finite number > 0"),
    "dro_beta": (lambda v: v > 0, "a finite number > 0"),
    "clip_cov_ratio": (lambda v: 0 < v <= 1, "a share in (0, 1]"),
    "kl_cov_ratio": (lambda v: 0 < v <= 1, "a share in (0, 1]"),
    "clip_cov_lb": (lambda v: True, "a finite number"),
    "clip_cov_ub": (lambda v: True, "a finite number"),
    "kl_cov_coef": (lambda v: v >= 0, "a finite number >= 0"),
    "vespo_k_pos": (lambda v: v >= 0, "a finite number >= 0"),
    "vespo_k_neg": (lambda v: v >= 0, "a finite number >= 0"),
    "vespo_lambda_pos": (lambda v: v > 0, "a finite number > 0"),
    "vespo_lambda_neg": (lambda v: v > 0, "a finite number > 0"),
}


def _check_eps(obj: Objective, p: dict[str, Any]) -> None:
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


def resolve(algo: str, **overrides: Any) -> dict[str, Any]:
    """`algo`'s published hyper-parameters with `overrides` applied, validated (the checks `policy_loss` makes).

    Raises ValueError naming the bad value and what is accepted.
    """
    obj = objective(algo)
    p = obj.defaults()
    unknown = sorted(set(overrides) - set(p))
    if unknown:
        raise ValueError(
            f"unknown override {', '.join(map(repr, unknown))}: not a hyper-parameter of {obj.name!r}; accepted: "
            f"{', '.join(p)}"
        )
    p.update(overrides)
    _check_eps(obj, p)
    if not (_is_number(p["beta"]) and p["beta"] >= 0):
        raise ValueError(f"beta (KL weight) = {p['beta']!r} is invalid; accepted: a finite number >= 0")
    if p["aggregation"] not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {p['aggregation']!r}; accepted: {', '.join(AGGREGATIONS)}")
    if p["max_len"] is not None and not (
        isinstance(p["max_len"], Integral) and not isinstance(p["max_len"], bool) and p["max_len"] > 0
    ):
        raise ValueError(f"max_len = {p['max_len']!r} is invalid; accepted: None (= T) or an int > 0")
    for key, (ok, accepted) in _RULES.items():
        if key in p and not (_is_number(p[key]) and ok(p[key])):
            raise ValueError(f"{key} = {p[key]!r} is invalid; accepted: {accepted}")
    if "clip_cov_lb" in p and not p["clip_cov_lb"] < p["clip_cov_ub"]:
        raise ValueError(f"clip_cov_lb = {p['clip_cov_lb']!r} must be below clip_cov_ub = {p['clip_cov_ub']!r}: "
                         "the covariance band (lb, ub) of Clip-Cov would be empty")
    return p
