"""Corrections for the gap between the sampler's and the trainer's log-probs, as pure tensor functions.

The rollout engine (here: PolicyLens's separate sampler) and the trainer compute different probabilities for the
same tokens (bf16 kernels, top-p/top-k renormalisation, stale weights). Every function takes

    log_ratio = old_logp - sampler_logp     # (B, T) trainer minus sampler: log(pi_trainer / pi_sampler)
    mask                                    # (B, T) 1 on response tokens (bool, int or float 0/1)

and returns detached tensors of the same shape (`offpolicy_metrics` takes old_logp and sampler_logp and returns
floats). What each one equals:

- `is_weights`: verl 0.9.1 `compute_rollout_correction_weights` (verl/trainer/ppo/rollout_corr_helper.py): truncated
  IS (TIS, Yao et al. 2025) for one upper bound, IcePop (zero outside [lower, upper], bounds kept) for "lower_upper",
  per token or per sequence (product of the token ratios), optionally rescaled to mean 1 over the batch;
- `rejection_mask`: verl 0.9.1 `compute_rollout_rejection_mask`: every option, chained by comma;
- `trl_is_ratio`: TRL 1.16's `vllm_importance_sampling_mode` (trl/trainer/grpo_trainer.py,
  `_generate_and_score_completions`): token/sequence x truncate/mask with C_min / C_max;
- `off_policy_mask`: TRL 1.16 `GRPOTrainer.get_off_policy_mask` (DeepSeek-V3.2's off-policy sequence masking);
- `offpolicy_metrics`: verl 0.9.1 `compute_offpolicy_metrics` plus the share of tokens whose ratio leaves
  [0.9, 1.1] and the effective sample size of the token ratios.

Where the references differ from each other, each function follows its own reference, on purpose:
- verl clamps each token's log-ratio to +-SAFETY_BOUND before its rejection statistics (sums, means, maxima of k1,
  k2, k3), and clamps the summed log-ratio (not each token) of a sequence IS weight and of chi2_seq; its kl / k3_kl
  metrics are not clamped. TRL clamps nothing.
- verl's IS weight is 0 on padding; TRL's ratio is exp(0) = 1 there (then clamped / masked like any other), and TRL
  replaces NaN log-ratios by 0. verl-style functions here reject a NaN on a response token with a ValueError (verl
  would return NaN).
- verl's k1 is -log_ratio = log(pi_sampler / pi_trainer): a k1 band "l_u" bounds pi_sampler / pi_trainer, and a single
  k1 value u means [1/u, u]. Its k2 is log_ratio^2 / 2, its k3 is exp(log_ratio) - 1 - log_ratio.
- verl's per-sequence metrics count rows without any response token (as a sequence mean of 0: weight 1, log-prob 0).

Departures from verl, all deliberate and tested:
1. Means divide by the exact token count (verl adds 1e-8 to it): differences of ~1e-8 / n relative, below float32's
   resolution (float32 results are bit-identical to verl's on the tests' batches).
2. When IcePop zeroes every weight, verl's metrics divide by zero (ZeroDivisionError in its ESS); here the weights
   are all 0 and the ESS is 0.
3. A batch without any response token gives NaN metrics (verl raises).

Applying them in the loss, for every algorithm of engine.objectives (`correct_batch` once per batch, `loss_inputs`
in every pass): the IS weight multiplies the token's policy loss, detached, as verl's `pg_losses *
rollout_is_weights`. `policy_loss` has no weight argument; since every surrogate's token loss is positively
homogeneous in the advantage (loss(w A) = w loss(A) for w >= 0, and the closed-form gradient weight likewise), the
weight is applied to the advantage the loss sees. GMPO's loss is one geometric mean per sequence whose clip side
depends on the sign of each token's advantage, so (as verl's geo-mean loss does) its tokens' weights enter as one
weight per sequence, their geometric mean exp(mean_t log(w_t + 1e-10)) > 0 (with per-token advantages, a token the
off-policy mask drops gets advantage 0, which counts on GMPO's A >= 0 clip side). The KL term is not weighted (verl adds
its KL loss apart). A rejected token or sequence (verl rejection) leaves the loss mask, so the normaliser shrinks, as
verl's modified response_mask; the off-policy mask and masking IS modes multiply the loss by 0 (normaliser kept), as
TRL and verl do. Every rejected token stays in the batch and the log, with its reason code
(engine.correction_settings REJECT_*).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from engine.correction_settings import (
    RATIO_BAND,
    REJECT_IS_ZERO,
    REJECT_OFF_POLICY,
    REJECT_SEQUENCE,
    REJECT_TOKEN,
    TOKEN_RS_OPTIONS,
    TRL_IS_MODES,
    VERL_IS_LEVELS,
    CorrectionConfig,
    CorrectionError,
    is_bounds,
    parse_bounds,
    parse_rs_options,
    parse_rs_thresholds,
)

SAFETY_BOUND = 20.0  # verl's clamp of log-ratios before exp and its rejection statistics (exp(20) ~ 4.9e8)
GEO_WEIGHT_EPS = 1e-10  # verl compute_policy_loss_geo_mean: log(w + 1e-10) when folding token weights per sequence


# ----------------------------------------------------------------------------------------------------------------
# Input checks and masked reductions


def _inputs(log_ratio: torch.Tensor, mask: torch.Tensor, nan_ok: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_ratio, bool mask) after checking shapes, dtypes and (unless nan_ok) NaN on response tokens."""
    if not isinstance(log_ratio, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise ValueError("log_ratio and mask must be torch.Tensors of shape (B, T)")
    if log_ratio.dim() != 2 or tuple(mask.shape) != tuple(log_ratio.shape):
        raise ValueError(f"log_ratio {tuple(log_ratio.shape)} and mask {tuple(mask.shape)}: accepted: both (B, T), "
                         "the same shape")
    if not log_ratio.is_floating_point():
        raise ValueError(f"log_ratio has dtype {log_ratio.dtype}; accepted: a floating-point dtype")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):  # a bool mask is 0/1 by type
        raise ValueError("mask contains values other than 0 and 1; accepted: a 0/1 (or bool) mask")
    on = mask.to(device=log_ratio.device).bool()
    if not nan_ok:
        bad = int((torch.isnan(log_ratio) & on).sum())
        if bad:
            raise ValueError(f"log_ratio is NaN on {bad} response token(s) (sampler log-prob unknown?); accepted: "
                             "finite values on every token of the mask (padding may hold anything)")
    return log_ratio.detach(), on


def _row_sum(values: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """(B,) sum over each row's response tokens; whatever padding holds (NaN included) is ignored."""
    return torch.where(on, values, torch.zeros_like(values)).sum(-1)


def _row_mean(values: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """(B,) mean over each row's response tokens; 0 for a row without any (verl's masked_mean gives 0/1e-8 = 0)."""
    return _row_sum(values, on) / on.sum(-1).clamp(min=1).to(values.dtype)


def _token_mean(values: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """Scalar mean over every response token of the batch (NaN when there is none); one flat sum, as verl's."""
    return torch.where(on, values, torch.zeros_like(values)).sum() / on.sum().to(values.dtype)


# ----------------------------------------------------------------------------------------------------------------
# verl: IS weights (TIS / IcePop) and rejection


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token", threshold: float | str = 2.0,
               batch_normalize: bool = False) -> torch.Tensor:
    """(B, T) detached IS weights pi_trainer / pi_sampler, 0 on padding: verl 0.9.1 compute_rollout_correction_weights.

    level "token": exp(clamp(log_ratio, +-20)) per token; "sequence": exp(clamp(sum_t log_ratio, +-20)) on every
    token of the row. threshold: a number u (or "u") truncates the weights at u (TIS, no lower bound); "l_u" zeroes
    weights outside [l, u], bounds kept (IcePop). batch_normalize: divide by the batch mean (token level: over tokens;
    sequence level: over rows with a response token), unless that mean is <= 1e-8 (all weights 0: left at 0).
    """
    if level not in VERL_IS_LEVELS:
        raise CorrectionError(f"level = {level!r}; accepted: {', '.join(VERL_IS_LEVELS)}")
    lower, upper = parse_bounds(threshold, "threshold")
    lr, on = _inputs(log_ratio, mask)
    if level == "token":
        raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (B, T)
    else:
        log_seq = _row_sum(lr, on).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B,) clamp the sum, not each token
        raw = torch.exp(log_seq)[:, None].expand_as(lr)  # (B, T)
    raw = torch.where(on, raw, torch.zeros_like(raw))
    if lower is None:
        weights = raw.clamp(max=upper)  # TIS
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))  # IcePop
    if batch_normalize:
        if level == "token":
            mean = _token_mean(weights, on)
        else:
            has_tokens = on.any(-1)
            mean = (_row_mean(weights, on) * has_tokens).sum() / has_tokens.sum().clamp(min=1)
        if bool(mean > 1e-8):
            weights = weights / mean
    return weights


def is_weight_metrics(weights: torch.Tensor, mask: torch.Tensor, upper: float | None = None) -> dict[str, float]:
    """Mean, max and effective sample size of applied IS weights over the response tokens (before any batch
    normalisation), as verl 0.9.1's compute_is_metrics: rollout_is_mean, the token-level rollout_is_max and
    rollout_is_eff_sample_size = 1 / mean((w / (mean(w) + 1e-8))^2) with w clamped to [0, upper], i.e. about
    mean(w)^2 / mean(w^2), in (0, 1]. ESS is 0 when every weight is 0 (verl divides by zero there); every value is
    NaN without any response token."""
    w, on = _inputs(weights, mask)
    if not bool(on.any()):
        return {"is_weight_mean": math.nan, "is_weight_max": math.nan, "is_weight_ess": math.nan}
    clamped = w.clamp(min=0.0, max=math.inf if upper is None else upper)
    normalized = clamped / (_token_mean(clamped, on) + 1e-8)  # verl's guard, kept: it moves ESS by ~2e-8 / mean(w)
    mean_sq = float(_token_mean(normalized.square(), on))
    return {
        "is_weight_mean": float(_token_mean(w, on)),
        "is_weight_max": float(w[on].max()),
        "is_weight_ess": 0.0 if mean_sq == 0 else 1.0 / mean_sq,
    }


def _rejection_failures(log_ratio: torch.Tensor, on: torch.Tensor, options: tuple[str, ...],
                        bounds: dict[str, tuple[float | None, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_failed, sequence_failed): (B, T) bool, a response token rejected by a token / a sequence option."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # verl clamps each token before every statistic
    statistic = {"k1": lambda: -safe, "k2": lambda: 0.5 * safe**2, "k3": lambda: torch.exp(safe) - 1.0 - safe}
    stats = {kind: statistic[kind]() for kind in {option[-2:] for option in options}}  # (B, T) each, those used
    token_failed = torch.zeros_like(on)
    seq_failed = torch.zeros_like(on)
    for option in options:
        lower, upper = bounds[option]
        kind = option[-2:]
        per_token = stats[kind]
        if option in TOKEN_RS_OPTIONS:
            value = per_token  # (B, T)
        elif option.startswith("seq_sum"):
            value = _row_sum(per_token, on)[:, None]  # (B, 1)
        elif option.startswith("seq_mean"):
            value = _row_mean(per_token, on)[:, None]
        else:  # seq_max: 0 for a row without tokens, as verl
            masked = per_token.masked_fill(~on, -math.inf).max(-1).values
            value = torch.where(masked == -math.inf, torch.zeros_like(masked), masked)[:, None]
        # k1: a band on log(pi_sampler / pi_trainer), both bounds kept; k2, k3: an upper bound, kept
        keep = (value >= math.log(lower)) & (value <= math.log(upper)) if kind == "k1" else value <= upper
        failed = (~keep).expand_as(on) & on
        if option in TOKEN_RS_OPTIONS:
            token_failed |= failed
        else:
            seq_failed |= failed
    return token_failed, seq_failed


def _rejection_setup(options: str, thresholds: float | str | None) -> tuple[tuple[str, ...], dict]:
    names = parse_rs_options(options)
    return names, parse_rs_thresholds(names, thresholds)


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, options: str = "token_k1",
                   thresholds: float | str | None = None) -> torch.Tensor:
    """`mask` (same dtype) with every token rejected by one of `options` set to 0: verl 0.9.1
    compute_rollout_rejection_mask. options: comma separated (token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3,
    seq_max_k2/k3), each counted once, all must pass; thresholds: one shared or one per distinct option (k1: "l_u" or u
    meaning [1/u, u]; others: an upper bound), None for verl's presets (engine.correction_settings)."""
    names, bounds = _rejection_setup(options, thresholds)
    lr, on = _inputs(log_ratio, mask)
    token_failed, seq_failed = _rejection_failures(lr, on, names, bounds)
    rejected = token_failed | seq_failed
    return torch.where(rejected.to(mask.device), torch.zeros_like(mask), mask)


def rejection_rates(kept: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Share of response tokens rejected (verl rollout_rs_masked_fraction) and share of rows with a rejected token,
    over all rows, empty ones included (verl rollout_rs_seq_masked_fraction). `kept`: the mask after rejection."""
    on = mask.bool()
    lost = on & ~kept.bool()
    return {
        "rejected_token_share": float(lost.sum() / on.sum()) if bool(on.any()) else math.nan,
        "rejected_seq_share": float(lost.any(-1).float().mean()),
    }


# ----------------------------------------------------------------------------------------------------------------
# TRL: vllm_importance_sampling_mode and the off-policy sequence mask


def trl_is_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str = "sequence_mask",
                 clip_min: float | None = None, clip_max: float | None = 3.0) -> torch.Tensor:
    """(B, T) detached IS ratio of TRL 1.16's `vllm_importance_sampling_mode` (grpo_trainer.py,
    _generate_and_score_completions; defaults: mode "sequence_mask", C_min None, C_max 3.0).

    r = exp(d) with d = nan_to_num(log_ratio * mask) per token (token_*: 1 on padding) or summed over the row
    (sequence_*: no clamp; broadcast over the row, TRL keeps it (B, 1)); *_truncate clamps r to [C_min, C_max],
    *_mask sets r to 0 outside [C_min, C_max] (a missing bound is no bound).
    """
    if mode not in TRL_IS_MODES:
        raise CorrectionError(f"mode = {mode!r}; accepted: {', '.join(TRL_IS_MODES)}")
    if clip_min is None and clip_max is None and mode.endswith("truncate"):
        raise CorrectionError(f"{mode} needs clip_min or clip_max (TRL's torch.clamp needs one); got neither")
    lr, on = _inputs(log_ratio, mask, nan_ok=True)
    diff = torch.nan_to_num(lr * on.to(lr.dtype), nan=0.0)  # (B, T) NaN (unscored token) -> ratio 1, as TRL
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # (B, 1)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio.expand_as(lr)


def off_policy_mask(log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """(B, T) 1.0 = keep, 0.0 = drop: TRL 1.16 GRPOTrainer.get_off_policy_mask (DeepSeek-V3.2, Eq. 9).

    log_ratio: trainer - sampler log-probs with the trainer's CURRENT log-probs (TRL evaluates the mask inside the
    loss, on every pass). A row is kept if its advantage >= 0 or its mean (sampler - trainer) log-prob, i.e.
    -mean_t log_ratio over the response tokens (NaN counted as 0, the count clamped to >= 1), is <= threshold.
    advantages: (B,) per sequence or (B, T) per token (then the sign test is per token). Output dtype: log_ratio's.
    """
    lr, on = _inputs(log_ratio, mask, nan_ok=True)
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not math.isfinite(threshold):
        raise CorrectionError(f"threshold = {threshold!r}; accepted: a finite number (e.g. 0.5)")
    m = on.to(lr.dtype)
    kl = torch.nan_to_num(-lr, nan=0.0)  # sampler - trainer
    mean_kl = (kl * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    adv = advantages.detach().to(lr.device)
    if adv.dim() == 1:
        adv = adv[:, None]
    if adv.dim() != 2 or adv.shape[0] != lr.shape[0] or adv.shape[1] not in (1, lr.shape[1]):
        raise ValueError(f"advantages {tuple(advantages.shape)}; accepted: (B,) or (B, T) with (B, T) = "
                         f"{tuple(lr.shape)}")
    keep = (adv >= 0) | (mean_kl <= threshold)
    return keep.to(lr.dtype).expand_as(lr)


# ----------------------------------------------------------------------------------------------------------------
# Diagnostics


def offpolicy_metrics(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl 0.9.1 compute_offpolicy_metrics (same names) plus three: `out_of_band` (share of response tokens whose
    ratio pi_trainer / pi_sampler leaves RATIO_BAND), `ess` (mean(r)^2 / mean(r^2) over tokens, r the token ratio
    clamped as chi2_token's) and `mean_abs_log_ratio`. Per-sequence metrics (PPLs, log_ppl_diff*, ppl_ratio,
    chi2_seq) average over ALL rows, as verl: a row without response tokens counts with mean log-prob 0.
    NaN everywhere when the batch has no response token."""
    if not isinstance(old_logp, torch.Tensor) or not isinstance(sampler_logp, torch.Tensor):
        raise ValueError("old_logp and sampler_logp must be torch.Tensors of shape (B, T)")
    if tuple(old_logp.shape) != tuple(sampler_logp.shape):
        raise ValueError(f"old_logp {tuple(old_logp.shape)} and sampler_logp {tuple(sampler_logp.shape)} differ; "
                         "accepted: the same (B, T)")
    old, on = _inputs(old_logp, mask)
    sampler, _ = _inputs(sampler_logp.to(old.dtype), mask)
    names = ("training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
             "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
             "out_of_band", "ess", "mean_abs_log_ratio")
    if not bool(on.any()):
        return dict.fromkeys(names, math.nan)
    lr = old - sampler  # (B, T)
    old_mean, sampler_mean = _row_mean(old, on), _row_mean(sampler, on)  # (B,) 0 for empty rows
    log_ppl_diff = sampler_mean - old_mean  # (B,) = log(training PPL / rollout PPL)
    rho = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (B, T)
    log_seq = _row_sum(lr, on).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B,) sum first, then clamp (verl)
    ratio = torch.exp(lr)
    outside = (ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])
    mean_rho = _token_mean(rho, on)
    values = {
        "training_ppl": torch.exp(-old_mean).mean(),
        "training_log_ppl": (-old_mean).mean(),
        "kl": _token_mean(-lr, on),  # KL(pi_sampler || pi_trainer), direct estimator
        "k3_kl": _token_mean(torch.exp(lr) - lr - 1.0, on),  # not clamped (verl)
        "rollout_ppl": torch.exp(-sampler_mean).mean(),
        "rollout_log_ppl": (-sampler_mean).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": _token_mean(rho.square(), on) - 1.0,
        "chi2_seq": torch.exp(2.0 * log_seq).mean() - 1.0,
        "out_of_band": _token_mean(outside.to(lr.dtype), on),
        "ess": mean_rho.square() / _token_mean(rho.square(), on),
        "mean_abs_log_ratio": _token_mean(lr.abs(), on),
    }
    return {name: float(values[name]) for name in names}


# ----------------------------------------------------------------------------------------------------------------
# Applying them in the loss


@dataclass(frozen=True)
class BatchCorrection:
    """What the corrections do to one batch, computed once from old_logp and sampler_logp (verl and TRL both do)."""

    weight: torch.Tensor | None  # (B, T) detached IS weight, 0 on padding; None when IS is off
    loss_mask: torch.Tensor  # (B, T) the mask without the tokens verl's rejection options removed (mask's dtype)
    rejected: torch.Tensor  # (B, T) int8 reason codes (REJECT_TOKEN / REJECT_SEQUENCE / REJECT_IS_ZERO), 0 padding
    metrics: dict[str, float]  # offpolicy_metrics + rejection rates + IS weight mean / max / ESS

    def rows(self, index: torch.Tensor | slice) -> BatchCorrection:
        """The same correction restricted to some rows (a mini-batch); the metrics stay the batch's."""
        return replace(self, weight=None if self.weight is None else self.weight[index],
                       loss_mask=self.loss_mask[index], rejected=self.rejected[index])


def correct_batch(config: CorrectionConfig, old_logp: torch.Tensor, sampler_logp: torch.Tensor,
                  mask: torch.Tensor) -> BatchCorrection:
    """IS weights and rejection of `config` on a batch, with the step's metrics. old_logp: the trainer's log-probs
    of the sampled tokens before the update (B, T); sampler_logp: the sampler's (B, T); mask: response tokens."""
    metrics = offpolicy_metrics(old_logp, sampler_logp, mask)
    log_ratio, on = _inputs(old_logp.detach() - sampler_logp.detach().to(old_logp.dtype), mask)
    rejected = torch.zeros(on.shape, dtype=torch.int8, device=on.device)
    weight = None
    if config.rollout_is is not None:
        lower, upper = is_bounds(config.rollout_is, config.rollout_is_threshold)
        if config.rollout_is in VERL_IS_LEVELS:
            spec = upper if lower is None else f"{lower!r}_{upper!r}"
            weight = is_weights(log_ratio, mask, config.rollout_is, spec)
            masking = lower is not None
        else:
            weight = trl_is_ratio(log_ratio, mask, config.rollout_is, lower, upper)
            masking = config.rollout_is.endswith("mask")
        metrics.update(is_weight_metrics(weight, mask, upper))
        if config.rollout_is_batch_normalize:
            weight = is_weights(log_ratio, mask, config.rollout_is, spec, batch_normalize=True)
        if masking:
            rejected[on & (weight == 0)] = REJECT_IS_ZERO
    loss_mask = mask
    if config.rollout_rs is not None:
        names, bounds = _rejection_setup(config.rollout_rs, config.rollout_rs_threshold)
        token_failed, seq_failed = _rejection_failures(log_ratio, on, names, bounds)
        rejected[seq_failed] = REJECT_SEQUENCE
        rejected[token_failed] = REJECT_TOKEN  # the more specific reason wins
        loss_mask = torch.where((token_failed | seq_failed).to(mask.device), torch.zeros_like(mask), mask)
        metrics.update(rejection_rates(loss_mask, mask))
    return BatchCorrection(weight=weight, loss_mask=loss_mask, rejected=rejected, metrics=metrics)


@dataclass(frozen=True)
class LossInputs:
    """What to hand `engine.objectives.policy_loss` in one pass, and what to log for it."""

    advantages: torch.Tensor  # (B, T) the advantages times the detached weight (0 where the loss drops the token)
    mask: torch.Tensor  # (B, T) the loss mask (verl rejections removed)
    rejected: torch.Tensor  # (B, T) int8 reason codes of this pass (REJECT_*)
    weight: torch.Tensor  # (B, T) the factor each token's policy loss is multiplied by (1 without corrections)


def loss_inputs(algo: str, config: CorrectionConfig, batch: BatchCorrection, advantages: torch.Tensor,
                logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> LossInputs:
    """The corrected advantages and loss mask of one pass; then `policy_loss(algo, logp, old_logp,
    out.advantages, out.mask, ...)`. logp: the trainer's current log-probs (for the off-policy mask, detached here)."""
    from engine.objectives import OBJECTIVES

    if algo not in OBJECTIVES:
        raise ValueError(f"unknown algo {algo!r}; accepted: {', '.join(OBJECTIVES)}")
    weighs = batch.weight is not None or config.off_policy_mask is not None
    if weighs and not OBJECTIVES[algo].loss_scales_with_advantage:
        accepted = ", ".join(name for name, entry in OBJECTIVES.items() if entry.loss_scales_with_advantage)
        raise ValueError(f"importance weights and the off-policy mask weigh a token's loss through its advantage, "
                         f"and {algo}'s loss is not proportional to the advantage; rejection "
                         f"(--rollout-rs) works with every algorithm, weights with: {accepted}")
    on = mask.bool()
    adv = advantages.detach().to(logp.dtype)
    adv = adv[:, None].expand(on.shape) if adv.dim() == 1 else adv  # (B, T)
    weight = torch.ones_like(adv) if batch.weight is None else batch.weight.to(adv.dtype)
    if OBJECTIVES[algo].ratio_level == "geometric" and batch.weight is not None:
        # one positive weight per sequence (verl compute_policy_loss_geo_mean), so no advantage changes sign
        m = batch.loss_mask.bool().to(adv.dtype)
        log_w = (torch.log(weight + GEO_WEIGHT_EPS) * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True) + 1e-8)
        weight = torch.exp(log_w).expand_as(adv)
    rejected = batch.rejected.clone()
    if config.off_policy_mask is not None:
        current = logp.detach() - sampler_logp.detach().to(logp.dtype)
        keep = off_policy_mask(current, mask, advantages, config.off_policy_mask)  # (B, T)
        dropped = on & (keep == 0)
        rejected[dropped & (rejected != REJECT_TOKEN) & (rejected != REJECT_SEQUENCE)] = REJECT_OFF_POLICY
        weight = weight * keep  # TRL: per_token_loss * off_policy_mask
    weight = torch.where(on, weight, torch.zeros_like(weight))
    return LossInputs(advantages=adv * weight, mask=batch.loss_mask, rejected=rejected, weight=weight)

