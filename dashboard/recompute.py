"""Logged tokens -> tensors -> `engine.objectives` / `engine.advantages` -> arrays for the charts.

The dashboard never re-implements an objective: the Algorithm weighting page asks `policy_loss` what each
algorithm would do with the logged log-probs and advantages, and the PRM sandbox asks `process_advantages`.
Long token rows become (B, T) tensors with `engine.logrows.batch_from_tokens`, the inverse of what the trainer
writes. No Streamlit calls.

torch (seconds to import in a fresh server) is imported by the functions that compute, not by this module: the
Algorithm weighting page draws its pickers and knob table (`author_knobs`) before its first objective is asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from engine.algorithms import ALGORITHMS, defaults, objective, resolve
from engine.clip_codes import CLIP_NAMES, clip_fractions, count_clip_events

if TYPE_CHECKING:
    import torch

    from engine.logrows import LoggedBatch

__all__ = ["IMPOSSIBLE", "KNOBS", "SCHEMES", "CorrectionEffect", "StepInputs", "WeighedForCharts", "Weighting",
           "advantage_schemes", "author_knobs", "batch_from_tokens", "binned", "binned_columns", "chunked_effects",
           "clip_fraction_row", "clip_region", "column_bins", "correction_effects", "correction_table", "for_charts",
           "length_chunks", "process_sandbox", "row_local", "sample_positions", "weigh", "weight_curves", "whitened"]

KNOBS = ("eps_low", "eps_high", "beta")


def author_knobs(algorithms=ALGORITHMS) -> pd.DataFrame:
    """eps_low / eps_high / beta of each algorithm as published (engine.objectives.defaults)."""
    return pd.DataFrame([{"algorithm": a, **{k: defaults(a).get(k) for k in KNOBS}} for a in algorithms])


@dataclass
class Weighting:
    """What one algorithm does to a batch."""

    grad_weight: np.ndarray  # (B, T) in the batch's dtype, NaN on padding
    clip: np.ndarray  # (B, T) int8 codes, -1 on padding
    ratio: np.ndarray  # (B, T) the ratio the algorithm used, in the batch's dtype, NaN on padding
    total_weight: np.ndarray  # (B,) sum of a completion's gradient weights
    params: dict


def batch_from_tokens(tokens: pd.DataFrame, float32: bool = False) -> LoggedBatch:
    """`engine.logrows.batch_from_tokens`: long token rows (one pass's values) as (B, T) tensors, float64 unless
    `float32` (what the trainer computed in; half the memory on a step of long completions)."""
    import torch

    from engine.logrows import batch_from_tokens as as_batch

    return as_batch(tokens, torch.float32 if float32 else torch.float64)


class StepInputs:
    """The objectives' inputs for some rollouts of a step at any update: the tokens (`data.weighed_tokens`) batched
    once, each update's new log-probs put in a (B, T) grid the first time it is asked for and kept (another update
    of a whole step of long completions: ~0.1 s, where reading and batching the tokens again took ~0.35 s). Safe to
    share between threads: two asking for the same new update at once compute the same grid."""

    def __init__(self, tokens: pd.DataFrame, float32: bool = False):
        self.tokens = batch_from_tokens(tokens, float32)  # its logp is the old log-prob: the tokens before any pass
        self._ids = np.asarray(self.tokens.rollout_ids, dtype=np.int64)
        self._old_unknown = None  # (B, T) where no old log-prob was logged: new = old + ln(ratio) is unknown there
        if tokens["old_logp"].isna().any():
            lacking = tokens[tokens["old_logp"].isna()]
            self._old_unknown = np.zeros(self.tokens.mask.shape, dtype=bool)
            self._old_unknown[np.searchsorted(self._ids, lacking["rollout_id"].to_numpy(dtype=np.int64)),
                              lacking["position"].to_numpy(dtype=np.int64)] = True
        self._logp: dict[int, torch.Tensor] = {}

    def at_update(self, update: int, passes: Callable[[int], pd.DataFrame]) -> LoggedBatch:
        """The batch at `update`: `passes(update)` (`data.weighed_passes`) read the first time."""
        if update not in self._logp:
            self._logp[update] = self.logp_of(passes(update))
        return replace(self.tokens, logp=self._logp[update])

    def logp_of(self, passes: pd.DataFrame) -> torch.Tensor:
        """(B, T) new log-probs of the pass rows `passes` (rollout_id, position, new_logp, ratio); the old log-prob
        of a token without a row (its rollout was not in that pass: the policy has not moved for it), as
        `engine.logrows.batch_from_tokens` reads `data.tokens_at_update`."""
        import torch

        old = self.tokens.old_logp.numpy()  # (B, T)
        logged_ids = passes["rollout_id"].to_numpy(dtype=np.int64)
        rows = np.minimum(np.searchsorted(self._ids, logged_ids), len(self._ids) - 1)
        positions = passes["position"].to_numpy(dtype=np.int64)
        on = (self._ids[rows] == logged_ids) & (positions >= 0) & (positions < old.shape[1])
        on[on] = self.tokens.mask.numpy()[rows[on], positions[on]] > 0  # a pass row of a logged token only
        rows, positions = rows[on], positions[on]
        stored = pd.to_numeric(passes["new_logp"], errors="coerce").to_numpy(dtype=float, na_value=np.nan)[on]
        ratio = pd.to_numeric(passes["ratio"], errors="coerce").to_numpy(dtype=float, na_value=np.nan)[on]
        with np.errstate(divide="ignore", invalid="ignore"):
            derived = old[rows, positions] + np.log(ratio)
        if self._old_unknown is not None:
            derived[self._old_unknown[rows, positions]] = np.nan
        new = np.where(np.isnan(stored), derived, stored)
        logp = old.copy()
        logp[rows, positions] = np.where(np.isnan(new), old[rows, positions], np.nan_to_num(new))
        return torch.from_numpy(logp)


def row_local(algo: str, overrides: dict) -> bool:
    """Whether `algo`'s per-token weights depend on nothing but their own completion once the batch's normalisers
    are given (`engine.objectives.BatchTotals`): every objective but the covariance rules (Clip-Cov, KL-Cov select
    by the whole batch's covariance) and a `top_entropy_quantile` below 1 (the batch's entropy quantile)."""
    return objective(algo).covariance is None and resolve(algo, **overrides)["top_entropy_quantile"] >= 1.0


PADDING_CELLS = 2048
PADDING_SHARE = 0.05
"""`length_chunks`' padding allowance: a chunk of completions grows while its padding stays within the larger of
these (cells, share of its tokens). Each call has a fixed cost of a few thousand cells' worth; on a step of 256 long
completions, five objectives took 0.39 s in 8 chunks of 32 (1.39 cells per token), 0.27 s in 32 chunks of 8 (1.07)
and 0.22 s in the 23 chunks of this allowance (1.06) (docs/benchmarks.md)."""


def length_chunks(lengths: np.ndarray, padding_cells: int = PADDING_CELLS, padding_share: float = PADDING_SHARE
                  ) -> list[np.ndarray]:
    """The rows of a ragged batch (`lengths` (B,): each row's extent) in chunks to be computed apart, shortest first,
    each padded to its own longest row: a chunk grows while rows x its longest - its tokens (its padding) stays
    within max(`padding_cells`, `padding_share` x its tokens); (0, 0): only rows of one length share a chunk."""
    order = np.argsort(lengths, kind="stable")
    chunks, start, tokens = [], 0, 0
    for end, row in enumerate(order):
        longest, tokens = int(lengths[row]), tokens + int(lengths[row])  # sorted: the newest row is the longest
        if (end - start + 1) * longest - tokens > max(padding_cells, padding_share * tokens):
            chunks.append(order[start:end])
            start, tokens = end, longest
    return [*chunks, order[start:]] if len(order) else []


def weigh(batch: LoggedBatch, algo: str, overrides: dict, padding_cells: int = PADDING_CELLS,
          padding_share: float = PADDING_SHARE) -> Weighting:
    """Call policy_loss for one algorithm and keep its per-token diagnostics.

    A row-local objective (`row_local`) is asked a few completions at a time (`length_chunks`, with the padding
    allowance given), each chunk cut to its own longest completion and given the whole batch's normalisers: the
    same weights as one call on the whole batch, without computing the padding (a step of long completions is mostly
    padding: 256 x 16k cells for 0.8M tokens). Any other is asked once, on every completion.
    """
    import torch

    from engine.objectives import BatchTotals, policy_loss

    on = batch.mask.numpy() > 0  # (B, T)
    B, T = on.shape
    dtype = batch.logp.numpy().dtype  # float32 on the page: a step of long completions is 256 x 16k cells
    grad_weight, ratio = np.full((B, T), np.nan, dtype), np.full((B, T), np.nan, dtype)
    clip, total_weight = np.full((B, T), -1, np.int8), np.zeros(B)
    params = {}
    extent = np.where(on.any(1), T - np.argmax(on[:, ::-1], axis=1), 1)  # (B,) last token's position + 1
    chunks = length_chunks(extent, padding_cells, padding_share) if row_local(algo, overrides) else [np.arange(B)]
    totals = BatchTotals(rows=float(B), tokens=float(on.sum()), width=float(T))  # the whole batch's, in every call
    for chunk in chunks:
        width = int(extent[chunk].max())
        index = torch.from_numpy(chunk)
        logp, old_logp, advantages, mask, ref_logp, entropy = (
            None if x is None else x[index, :width]
            for x in (batch.logp, batch.old_logp, batch.advantages, batch.mask, batch.ref_logp, batch.entropy))
        out = policy_loss(algo, logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=entropy, totals=totals,
                          **overrides)
        part_on = on[chunk, :width]
        grad_weight[chunk, :width] = np.where(part_on, out.grad_weight.numpy(), np.nan)
        ratio[chunk, :width] = np.where(part_on, out.ratio.numpy(), np.nan)
        clip[chunk, :width] = np.where(part_on, out.clip.numpy(), -1)
        total_weight[chunk] = out.grad_weight.sum(-1, dtype=torch.float64).numpy()  # 0 on padding
        params = out.params
    return Weighting(grad_weight=grad_weight, clip=clip, ratio=ratio, total_weight=total_weight, params=params)


def clip_fraction_row(algo: str, weighting: Weighting) -> dict:
    codes = weighting.clip[weighting.clip >= 0]
    shares = clip_fractions(count_clip_events(codes), codes.size)
    return {"algorithm": algo, **{CLIP_NAMES[c]: share for c, share in shares.items()},
            "zero-gradient tokens": float(
                np.isclose(weighting.grad_weight[weighting.clip >= 0], 0).mean()) if codes.size else 0.0}


@dataclass
class WeighedForCharts:
    """What the Algorithm weighting page draws of one algorithm's Weighting: its (B, T) arrays reduced as they are
    computed, so that a whole step of long completions (256 x 16k tokens: 34 MB per array) is neither kept nor cached
    token by token."""

    heatmap: np.ndarray  # (rows shown, bins) mean gradient weight per bin of positions (`binned_columns`)
    total_weight: np.ndarray  # (B,)
    clip_fractions: dict  # `clip_fraction_row`
    ratio_sample: np.ndarray  # (S,) the ratio of the sampled tokens (`sample_positions`)
    ratio_max: float  # the largest ratio of any token, NaN without tokens
    params: dict


def sample_positions(mask: np.ndarray, size: int, seed: int = 0) -> np.ndarray:
    """Flat indices of at most `size` of the tokens (mask (B, T) > 0), in order, the same for every algorithm so that
    their scatter plots show the same tokens."""
    tokens = np.flatnonzero(mask > 0)
    if len(tokens) <= size:
        return tokens
    return np.sort(np.random.default_rng(seed).choice(tokens, size, replace=False))


def for_charts(algo: str, weighting: Weighting, shown_rows: int, bins: int, sample: np.ndarray) -> WeighedForCharts:
    """`weighting` reduced to what the page draws: the first `shown_rows` completions' gradient weights in `bins`
    columns, each completion's total, the clip fractions and the ratios of the `sample` tokens (flat indices)."""
    finite = weighting.ratio[np.isfinite(weighting.ratio)]
    return WeighedForCharts(
        heatmap=binned_columns(weighting.grad_weight[:shown_rows], bins)[0],
        total_weight=weighting.total_weight,
        clip_fractions=clip_fraction_row(algo, weighting),
        ratio_sample=weighting.ratio.reshape(-1)[sample],
        ratio_max=float(finite.max()) if finite.size else math.nan,
        params=weighting.params,
    )


IMPOSSIBLE = -1
"""The code `clip_region` gives the ratios a token cannot reach from its p_old (p = r p_old > 1), drawn for the
rules that bound the probability itself (DPPO)."""


def _single_tokens(algo: str, overrides: dict, ratios: np.ndarray, advantages: np.ndarray, old_prob: float):
    """The objective's clip codes and gradient weight per unit advantage (weight / A, the multiplier of A's
    gradient) for single-token completions at each (advantage, ratio) pair (flat arrays), p_old = `old_prob`.

    With one token per completion a sequence ratio is the token ratio and every aggregation weighs each completion
    1/N, so every algorithm is drawn on the same axes. Entropy is not given, so ASPO uses its ordinary (not
    high-entropy) ranges. Clip-Cov's and KL-Cov's selections depend on the whole batch's covariance (a 2e-4 share
    of it), not on one token's ratio and advantage: their picture is that of their surrogate alone."""
    import torch

    from engine.objectives import policy_loss, surrogate

    old_logp = torch.full((len(ratios), 1), float(np.log(old_prob)), dtype=torch.float64)  # (N, 1)
    logp = old_logp + torch.tensor(np.log(ratios)).reshape(-1, 1)  # (N, 1)
    adv = torch.tensor(advantages, dtype=torch.float64)  # (N,)
    obj = objective(algo)
    if obj.covariance is None:
        out = policy_loss(algo, logp, old_logp, adv, torch.ones_like(logp), **overrides)
        codes, weight = out.clip.numpy()[:, 0], out.grad_weight.numpy()[:, 0] * len(ratios)  # undo the 1/N
    else:
        p = resolve(algo, **overrides)
        eps_low, eps_high = p.pop("eps_low", 0.0), p.pop("eps_high", 0.0)
        out = surrogate(obj.surrogate, logp - old_logp, adv[:, None], eps_low, eps_high, old_logp, **p)
        codes, weight = out.clip.numpy()[:, 0], out.weight.numpy()[:, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_advantage = np.where(advantages != 0, weight / advantages, np.nan)
    return codes.astype(int), per_advantage


def _bounds_probability(algo: str) -> bool:
    return objective(algo).surrogate.startswith("dppo")


def clip_region(algo: str, overrides: dict, ratio_max: float, adv_max: float, n_ratio: int = 121,
                n_adv: int = 41, old_prob: float = 0.5) -> dict:
    """The objective's clip decision on a (advantage x ratio) grid of single-token completions (`_single_tokens`).
    For a rule that bounds the probability itself (DPPO) the decision depends on p_old (`old_prob`), and the
    ratios above 1 / p_old, which no token can reach, are coded IMPOSSIBLE."""
    ratios = np.linspace(1e-3, ratio_max, n_ratio)
    advs = np.linspace(-adv_max, adv_max, n_adv)
    rr, aa = np.meshgrid(ratios, advs)  # (A, R)
    codes, _ = _single_tokens(algo, overrides, rr.reshape(-1), aa.reshape(-1), old_prob)
    codes = codes.reshape(rr.shape)
    if _bounds_probability(algo):
        codes = np.where(rr * old_prob > 1.0, IMPOSSIBLE, codes)
    return {"ratio": ratios, "advantage": advs, "clip": codes}


def weight_curves(algo: str, overrides: dict, ratio_max: float, n_ratio: int = 241, old_prob: float = 0.5) -> dict:
    """The gradient weight per unit advantage against the ratio (the sequence ratio for sequence-level rules) at
    A = +1 and A = -1, single-token completions (`_single_tokens`): GPG's flat 1, PPO's r cut to 0 where it
    clips, VESPO's gamma curve, DPPO's truncated ratio and its mask at p_old = `old_prob` (NaN where no token can
    be). {"ratio": (R,), "positive": (R,), "negative": (R,)}."""
    ratios = np.linspace(1e-3, ratio_max, n_ratio)
    _, positive = _single_tokens(algo, overrides, ratios, np.ones_like(ratios), old_prob)
    _, negative = _single_tokens(algo, overrides, ratios, -np.ones_like(ratios), old_prob)
    if _bounds_probability(algo):
        reachable = ratios * old_prob <= 1.0
        positive, negative = np.where(reachable, positive, np.nan), np.where(reachable, negative, np.nan)
    return {"ratio": ratios, "positive": positive, "negative": negative}


def process_sandbox(step_rewards: list[list[float]], step_lengths: list[list[int]]) -> tuple[np.ndarray, list]:
    """Per-token advantages (G, maxlen) from `engine.advantages.process_advantages` and each step's normalized
    reward (`engine.advantages.normalized_step_rewards`, the same numbers the trainer logs)."""
    from engine.advantages import normalized_step_rewards, process_advantages

    step_ends = [[int(e) for e in np.cumsum(lengths) - 1] for lengths in step_lengths]
    lengths = [int(sum(lengths)) for lengths in step_lengths]
    advantages = process_advantages(step_rewards, step_ends, lengths)
    return advantages.detach().numpy(), normalized_step_rewards(step_rewards)  # (G, maxlen), per step


# The per-token advantage schemes of the Advantages page, in the order they are drawn: (key, title).
SCHEMES = (
    ("grpo_outcome", "GRPO outcome advantage: one number for every token of a completion"),
    ("grpo_process", "GRPO process advantage: sum of the normalized step rewards from the token's step on"),
    ("ppo_gae", "PPO GAE advantage (before whitening)"),
    ("ppo_value", "PPO critic's value V(token)"),
    ("ppo_kl_reward", "PPO KL part of the reward: −kl_coef · (log π_old − log π_ref)"),
    ("logged_advantage", "The advantage the trainer logged per token (rewards not logged: GRPO's not recomputed)"),
)


def binned(values: np.ndarray, width: int) -> dict[str, np.ndarray]:
    """A completion's per-token `values` (T,) in bins of `width` consecutive positions (the last bin may be
    shorter), as `dashboard.data.critic_token_bins` bins logged tokens: each bin's first_pos, last_pos, mean (value),
    low (min) and high (max), all (ceil(T / width),)."""
    starts = np.arange(0, len(values), width)
    if not len(starts):
        return {name: np.zeros(0) for name in ("first_pos", "last_pos", "value", "low", "high")}
    counts = np.minimum(width, len(values) - starts)
    return {"first_pos": starts, "last_pos": starts + counts - 1, "value": np.add.reduceat(values, starts) / counts,
            "low": np.minimum.reduceat(values, starts), "high": np.maximum.reduceat(values, starts)}


def column_bins(length: int, bins: int) -> tuple[int, np.ndarray]:
    """Positions 0..length-1 in bins of `width` = ceil(length / bins) consecutive positions (1 when length <= bins):
    (width, the bins' centre positions (ceil(length / width),))."""
    width = max(1, math.ceil(length / bins))
    starts = np.arange(math.ceil(length / width)) * width
    return width, (starts + np.minimum(starts + width, length) - 1) / 2


def binned_columns(matrix: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A per-token matrix (B, T) (NaN: padding past a completion's end) in the `column_bins` of its T positions, one
    width for every row, so a heatmap of 16k-token completions has no more columns than its panel has pixels: (the
    mean of each bin's tokens (B, ceil(T / width)), NaN where it holds only padding; the bins' centre positions
    (ceil(T / width),); width)."""
    rows, length = matrix.shape
    width, centres = column_bins(length, bins)
    padded = np.full((rows, len(centres) * width), np.nan)
    padded[:, :length] = matrix
    cells = padded.reshape(rows, len(centres), width)  # (B, bins, width)
    tokens = np.isfinite(cells).sum(axis=-1)
    sums = np.where(np.isfinite(cells), cells, 0.0).sum(axis=-1)
    means = np.divide(sums, tokens, out=np.full(sums.shape, np.nan), where=tokens > 0)
    return means, centres, width


# The PPO schemes: the logged column of `dashboard.data.critic_token_bins` each one draws.
LOGGED_SCHEMES = {"ppo_gae": "advantage", "ppo_value": "value", "ppo_kl_reward": "kl_reward"}


def advantage_schemes(rollouts: pd.DataFrame, token_bins: pd.DataFrame, prm_steps: pd.DataFrame,
                      scale_by_std: bool = True) -> pd.DataFrame:
    """Every scheme's per-token values for one group, in the bins of `token_bins`, long form: rollout_id, scheme (a
    SCHEMES key), first_pos, last_pos, value (the bin's mean), low, high (its min and max; all three the token's
    value in bins of one token).

    rollouts: the group's rollouts (rollout_id, reward, length or NULL); token_bins: their logged tokens binned
    (queries.critic_token_bins, one width for the group); prm_steps: their logged reasoning steps (rollout_id,
    last_pos, reward_raw). The GRPO schemes are recomputed per token from the logged rewards with
    `engine.advantages` whatever the run trained with (outcome: `group_advantages` over the group's rewards;
    process: `process_advantages` over its raw step scores, absent without steps), then binned the same way; the
    PPO schemes are the logged columns of a run with a critic (absent otherwise), binned by DuckDB. A group with a
    completion whose reward was not logged (an imported dump without rewards) has no outcome scheme: without a
    critic, its logged per-token advantage is shown instead ("logged_advantage")."""
    from engine.advantages import group_advantages, process_advantages

    rollouts = rollouts.sort_values("rollout_id")
    ids = [int(r) for r in rollouts["rollout_id"]]
    width = int(token_bins["width"].iloc[0]) if len(token_bins) else 1
    logged_tokens = token_bins.groupby("rollout_id")["tokens"].sum()
    # A completion's length as logged, else its logged tokens (the public API accepts rollouts without `length`).
    lengths = [int(logged_tokens.get(r, 0)) if pd.isna(n) else int(n) for r, n in zip(ids, rollouts["length"],
                                                                                       strict=True)]
    parts = []

    def add(scheme: str, rollout_id: int, values: np.ndarray) -> None:
        parts.append(pd.DataFrame({"rollout_id": rollout_id, "scheme": scheme, **binned(values, width)}))

    rewards = pd.to_numeric(rollouts["reward"], errors="coerce").to_numpy(dtype=float)  # (G,) NaN: not logged
    rewards_logged = bool(np.isfinite(rewards).all())
    if rewards_logged:
        outcome = group_advantages(rewards.copy(), len(ids), scale_by_std=scale_by_std)
        for rid, n, a in zip(ids, lengths, outcome.tolist(), strict=True):
            add("grpo_outcome", rid, np.full(n, a))
    if len(prm_steps):
        steps = prm_steps.sort_values(["rollout_id", "step_index"])
        step_rewards = [steps[steps["rollout_id"] == r]["reward_raw"].astype(float).tolist() for r in ids]
        ends = [steps[steps["rollout_id"] == r]["last_pos"].astype(int).tolist() for r in ids]
        process = process_advantages(step_rewards, ends, lengths).numpy()  # (G, max length)
        for i, (rid, n) in enumerate(zip(ids, lengths, strict=True)):
            add("grpo_process", rid, process[i, :n])
    if "value" in token_bins and token_bins["value"].notna().any():  # a critic: its advantage is PPO's GAE one
        logged = LOGGED_SCHEMES
    elif not rewards_logged and "advantage" in token_bins and token_bins["advantage"].notna().any():
        logged = {"logged_advantage": "advantage"}
    else:
        logged = {}
    for scheme, column in logged.items():
        parts.append(pd.DataFrame({
            "rollout_id": token_bins["rollout_id"], "scheme": scheme, "first_pos": token_bins["first_pos"],
            "last_pos": token_bins["last_pos"],
            **{name: pd.to_numeric(token_bins[column + suffix], errors="coerce").to_numpy(dtype=float)
               for name, suffix in (("value", ""), ("low", "_low"), ("high", "_high"))}}))
    if not parts:
        return pd.DataFrame(columns=["rollout_id", "scheme", "first_pos", "last_pos", "value", "low", "high"])
    return pd.concat(parts, ignore_index=True)


def whitened(batch: LoggedBatch, mean: float, std: float) -> LoggedBatch:
    """`batch` with its logged GAE advantages whitened by the step's statistics: what a critic run's loss used."""
    from dataclasses import replace

    return replace(batch, advantages=(batch.advantages - mean) / std * batch.mask)


# ---------------------------------------------------------------- mismatch corrections on a step's tokens

# Thresholds of each verl rejection option in the Mismatch page's comparison: verl 0.9.1's presets where it has one
# (engine.correction_settings.RS_PRESET_THRESHOLDS), else chosen here to match TIS's band [0.5, 2]: k1 "0.5_2.0";
# k2 = (log 2)^2 / 2 ~ 0.24 and k3 = 2 - 1 - log 2 ~ 0.31, the values at ratio 2, for the per-token and max options;
# the per-sequence means and sums, 0.01 (verl's seq_mean_k3 preset) and 0.5.
REJECTION_THRESHOLDS = {
    "token_k1": "0.5_2.0", "token_k2": "0.24", "token_k3": "0.31",
    "seq_sum_k1": None, "seq_sum_k2": "0.5", "seq_sum_k3": "0.5",
    "seq_mean_k1": None, "seq_mean_k2": "0.01", "seq_mean_k3": None,
    "seq_max_k2": "0.24", "seq_max_k3": "0.31",
}
OFF_POLICY_DELTA = 0.5  # TRL's documented example for off_policy_mask_threshold
UNCHANGED = 1e-9  # a weight within this of 1 leaves its token as it was


@dataclass
class CorrectionEffect:
    """What one correction does to a step's tokens: its (B, T) loss weight (0 = out of the loss, NaN on padding)."""

    name: str
    source: str
    weight: np.ndarray  # (B, T)


def _token_grid(tokens: pd.DataFrame) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rollout ids, log_ratio, mask, advantages), each (B, T), float32 (as the trainer's tensors) but the mask (bool:
    no correction has to check that it is 0/1), from `data.sampler_tokens` rows."""
    import torch

    ids, rows = np.unique(tokens["rollout_id"].to_numpy(dtype=np.int64), return_inverse=True)
    cols = tokens["position"].to_numpy(dtype=np.int64)
    shape = (len(ids), int(cols.max()) + 1 if len(cols) else 1)
    grids = []
    for column in ("log_ratio", "advantage"):
        grid = np.zeros(shape, dtype=np.float32)  # (B, T)
        grid[rows, cols] = np.nan_to_num(pd.to_numeric(tokens[column], errors="coerce").to_numpy(dtype=float))
        grids.append(torch.from_numpy(grid))
    mask = np.zeros(shape, dtype=bool)
    mask[rows, cols] = True
    return [int(i) for i in ids], grids[0], torch.from_numpy(mask), grids[1]


def correction_effects(tokens: pd.DataFrame) -> tuple[list[int], Iterator[CorrectionEffect]]:
    """Every correction of `engine.corrections` applied to a step's logged log-ratios (old_logp - sampler_logp):
    verl's TIS and IcePop at token and sequence level, each verl rejection option (REJECTION_THRESHOLDS), TRL's four
    IS modes (C_max 3.0, its default) and the off-policy mask (delta OFF_POLICY_DELTA, with the logged old log-probs
    as the trainer's current ones: the first pass). Returns the rows' rollout ids and one effect per correction,
    computed as it is asked for: a whole step of long completions holds one correction's (B, T) weights at a time
    (twenty at once took gigabytes)."""
    from engine import corrections as c
    from engine.correction_settings import RS_PRESET_THRESHOLDS, TRL_IS_CLIP_MAX, VERL_IS_THRESHOLD

    ids, lr, mask, advantages = _token_grid(tokens)
    verl = "verl 0.9.1"
    made = [  # (name, source, the weights when called)
        (f"TIS token (≤ {VERL_IS_THRESHOLD:g})", verl, lambda: c.is_weights(lr, mask, "token", VERL_IS_THRESHOLD)),
        (f"TIS sequence (≤ {VERL_IS_THRESHOLD:g})", verl,
         lambda: c.is_weights(lr, mask, "sequence", VERL_IS_THRESHOLD)),
        ("IcePop token [0.5, 5]", verl, lambda: c.is_weights(lr, mask, "token", "0.5_5.0")),
        ("IcePop sequence [0.5, 5]", verl, lambda: c.is_weights(lr, mask, "sequence", "0.5_5.0")),
    ]
    for option, threshold in REJECTION_THRESHOLDS.items():
        shown = threshold or RS_PRESET_THRESHOLDS[option]
        source = f"{verl}{' preset' if threshold is None else ''}"
        made.append((f"reject {option} ({shown})", source,
                     lambda option=option, threshold=threshold: c.rejection_mask(lr, mask, option, threshold)))
    for mode in c.TRL_IS_MODES:
        made.append((f"TRL {mode} (C_max {TRL_IS_CLIP_MAX:g})", "TRL 1.16",
                     lambda mode=mode: c.trl_is_ratio(lr, mask, mode, None, TRL_IS_CLIP_MAX)))
    made.append((f"off-policy mask (δ {OFF_POLICY_DELTA:g})", "TRL 1.16 / DeepSeek-V3.2",
                 lambda: c.off_policy_mask(lr, mask, advantages, OFF_POLICY_DELTA)))
    on = mask.numpy() > 0
    return ids, (CorrectionEffect(name, source, np.where(on, weigh().numpy(), np.nan)) for name, source, weigh in made)


def chunked_effects(tokens: pd.DataFrame, padding_cells: int = PADDING_CELLS, padding_share: float = PADDING_SHARE
                    ) -> Iterator[CorrectionEffect]:
    """`correction_effects` of a step's tokens taken a few rollouts at a time (`length_chunks`): every correction
    works row by row, so each chunk's weights are the whole step's, and a chunk is padded to its own longest row
    instead of the step's (256 responses of up to 16k tokens: 4.2M cells for 0.7M tokens). Several effects per
    correction, one per chunk: `correction_table` adds them up."""
    extent = tokens.groupby("rollout_id")["position"].max() + 1  # (B,)
    chunk_of = pd.Series(0, index=extent.index)
    for number, rows in enumerate(length_chunks(extent.to_numpy(), padding_cells, padding_share)):
        chunk_of.iloc[rows] = number
    for _, part in tokens.groupby(tokens["rollout_id"].map(chunk_of), sort=True):
        yield from correction_effects(part)[1]


def correction_table(effects: Iterable[CorrectionEffect]) -> pd.DataFrame:
    """One row per correction: the share of the step's tokens it drops (weight 0) and reweights (weight other than
    0 and 1), the sequences it touches, its weights' mean, min and max, and their effective sample size
    mean(w)^2 / mean(w^2) (1: every token counts alike; NaN when every weight is 0). Effects of one name (the same
    correction on other rows, `chunked_effects`) add up to one row, in the order the names first come."""
    totals: dict[str, dict] = {}
    for effect in effects:
        w = effect.weight[np.isfinite(effect.weight)].astype(np.float64)
        touched = (np.abs(effect.weight - 1) > UNCHANGED).any(axis=1)  # (B,) padding (NaN) compares False
        total = totals.setdefault(effect.name, {"source": effect.source, "tokens": 0, "dropped": 0, "reweighted": 0,
                                                "touched": 0, "sum": 0.0, "sum_sq": 0.0, "min": math.inf,
                                                "max": -math.inf})
        total["tokens"] += w.size
        total["dropped"] += int((w == 0).sum())
        total["reweighted"] += int(((w != 0) & (np.abs(w - 1) > UNCHANGED)).sum())
        total["touched"] += int(touched.sum())
        total["sum"] += float(w.sum())
        total["sum_sq"] += float((w**2).sum())
        if w.size:
            total["min"], total["max"] = min(total["min"], float(w.min())), max(total["max"], float(w.max()))
    rows = []
    for name, t in totals.items():
        n = t["tokens"]
        mean, mean_sq = (t["sum"] / n, t["sum_sq"] / n) if n else (math.nan, math.nan)
        rows.append({"correction": name, "source": t["source"], "tokens dropped": t["dropped"] / n if n else math.nan,
                     "tokens reweighted": t["reweighted"] / n if n else math.nan, "sequences touched": t["touched"],
                     "weight mean": mean, "weight min": t["min"] if n else math.nan,
                     "weight max": t["max"] if n else math.nan,
                     "ESS": mean**2 / mean_sq if mean_sq > 0 else math.nan})
    return pd.DataFrame(rows)
