"""The sampler/trainer mismatch of one step, from the token rows of `data.sampler_tokens`: the numbers behind the
Mismatch page's one-step view and the report's mismatch summary. pandas and numpy only (no Streamlit, no torch),
so the page draws all of it before anything imports torch.

A token's log-ratio is old_logp - sampler_logp = log(pi_trainer / pi_sampler), as in `engine.corrections`; it is
"outside the band" when its ratio leaves `engine.correction_settings.RATIO_BAND`, [0.9, 1.1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from engine.correction_settings import RATIO_BAND

HISTOGRAM_BINS = 81  # odd: one bin is centred on log-ratio 0
MAX_POINTS = 2000  # above this many tokens the probability scatter is binned
GRID_CELLS = 100  # cells per axis of the binned scatter (10,000 at most: fewer than a panel's pixels)
WORST_TEXTS = 20
# Bucket edges: the trainer's probability of the token (rare tokens carry the gap: bf16 rounds small log-probs
# hardest, top-p / top-k cut the tail), its entropy (nats) and its position in the completion.
PROBABILITY_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
ENTROPY_EDGES = (0.0, 0.1, 0.5, 1.0, 2.0, math.inf)
POSITION_EDGES = (0, 4, 8, 16, 32, 64, 128, 256, math.inf)


def outside_band(log_ratio) -> np.ndarray:
    """(N,) True where the ratio exp(log_ratio) leaves RATIO_BAND (bounds inside)."""
    lr = np.asarray(log_ratio, dtype=float)
    return (lr < math.log(RATIO_BAND[0])) | (lr > math.log(RATIO_BAND[1]))


@dataclass(frozen=True)
class StepMismatch:
    """One step's mismatch, ready to draw; every frame is small whatever the step's size."""

    summary: dict  # tokens, sequences, mean_log_ratio, mean_abs_log_ratio, max_abs_log_ratio, out_of_band, ...
    histogram: pd.DataFrame  # left, right, tokens: the log-ratios, the outermost bins holding the tails
    probabilities: pd.DataFrame  # trainer_p, sampler_p, tokens: one row per token, or per cell when binned
    grid_cells: int  # cells per axis when `probabilities` holds grid cells (more than MAX_POINTS tokens), else 0
    buckets: pd.DataFrame  # by, bucket, order, tokens, out_of_band, mean_abs_log_ratio
    by_text: pd.DataFrame  # token_text, tokens, outside, out_of_band, mean_abs_log_ratio, worst_* (worst first)
    sequences: pd.DataFrame  # rollout_id, tokens, mean/sum/max_abs log_ratio, out_of_band, reward, advantage


def summary(tokens: pd.DataFrame) -> dict:
    """Headline numbers over a step's tokens. `truncation_share`: with sampler_logp_full logged, the share of
    mean |log-ratio| that top-p / top-k truncation adds, 1 - mean|old - full| / mean|old - sampler|."""
    lr = tokens["log_ratio"].to_numpy(dtype=float)
    out = {"tokens": len(lr), "sequences": int(tokens["rollout_id"].nunique()),
           "mean_log_ratio": float(lr.mean()) if len(lr) else math.nan,
           "mean_abs_log_ratio": float(np.abs(lr).mean()) if len(lr) else math.nan,
           "max_abs_log_ratio": float(np.abs(lr).max()) if len(lr) else math.nan,
           "out_of_band": float(outside_band(lr).mean()) if len(lr) else math.nan}
    full = pd.to_numeric(tokens["sampler_logp_full"], errors="coerce").to_numpy(dtype=float)
    known = np.isfinite(full)
    if known.any() and out["mean_abs_log_ratio"] > 0:
        untruncated = np.abs(tokens["old_logp"].to_numpy(dtype=float)[known] - full[known]).mean()
        out["truncation_share"] = float(1 - untruncated / np.abs(lr[known]).mean())
    return out


def histogram(log_ratio: np.ndarray, bins: int = HISTOGRAM_BINS) -> pd.DataFrame:
    """Counts of log-ratios on a range symmetric about 0 that holds 99.8% of them (at least ±0.11, past the band);
    the rest are counted in the outermost bins."""
    lr = np.asarray(log_ratio, dtype=float)
    reach = max(0.11, float(np.quantile(np.abs(lr), 0.998))) if len(lr) else 0.11
    counts, edges = np.histogram(np.clip(lr, -reach, reach), bins=bins, range=(-reach, reach))
    return pd.DataFrame({"left": edges[:-1], "right": edges[1:], "tokens": counts})


def probability_points(tokens: pd.DataFrame, max_points: int = MAX_POINTS, cells: int = GRID_CELLS
                       ) -> tuple[pd.DataFrame, int]:
    """(trainer_p, sampler_p, tokens) per token, or per non-empty cell of a cells x cells grid over [0, 1]^2 (the
    cell's centre) when there are more than `max_points` tokens; and the grid's cells per axis (0: not binned)."""
    trainer = np.exp(tokens["old_logp"].to_numpy(dtype=float))
    sampler = np.exp(tokens["sampler_logp"].to_numpy(dtype=float))
    if len(trainer) <= max_points:
        return pd.DataFrame({"trainer_p": trainer, "sampler_p": sampler, "tokens": 1}), 0
    # cell (i, j) holds [i/cells, (i+1)/cells) x [j/cells, (j+1)/cells), probability 1 in the last
    cell = np.clip((trainer * cells).astype(int), 0, cells - 1) * cells + np.clip((sampler * cells).astype(int), 0,
                                                                                  cells - 1)
    counts = np.bincount(cell, minlength=cells * cells)
    filled = np.flatnonzero(counts)
    return pd.DataFrame({"trainer_p": (filled // cells + 0.5) / cells, "sampler_p": (filled % cells + 0.5) / cells,
                         "tokens": counts[filled]}), cells


def _per_group(codes: np.ndarray, log_ratio: np.ndarray, groups: int, rank: np.ndarray | None = None,
               worst: bool = True) -> dict[str, np.ndarray]:
    """Per group code 0..groups-1 (codes outside it are left out): tokens, tokens outside the band, their share,
    mean |log-ratio| and (`worst`) the index of the token with the largest |log-ratio| (-1 for an empty group), a
    tie going to the smallest `rank` (N,) (default: the first row). numpy's bincount rather than a pandas groupby:
    a few ms for a 250k-token step instead of a few hundred."""
    valid = (codes >= 0) & (codes < groups)
    codes, lr, index = codes[valid], log_ratio[valid], np.flatnonzero(valid)
    size = np.bincount(codes, minlength=groups)
    outside = np.bincount(codes, weights=outside_band(lr), minlength=groups)
    abs_sum = np.bincount(codes, weights=np.abs(lr), minlength=groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = {"tokens": size, "outside": outside.astype(int), "out_of_band": outside / size,
                 "mean_abs_log_ratio": abs_sum / size}
    if not worst:  # (the worst token is most of the work: two unbuffered ufunc.at passes)
        return stats
    rank = index if rank is None else np.asarray(rank)[valid]
    largest = np.full(groups, -np.inf)
    np.maximum.at(largest, codes, np.abs(lr))
    tied = np.flatnonzero(np.abs(lr) == largest[codes])  # the tokens at their group's largest |log-ratio|
    first = np.full(groups, np.iinfo(np.int64).max)
    np.minimum.at(first, codes[tied], rank[tied])
    chosen = tied[rank[tied] == first[codes[tied]]]
    stats["worst"] = np.full(groups, -1)
    stats["worst"][codes[chosen]] = index[chosen]
    return stats


def buckets(tokens: pd.DataFrame) -> pd.DataFrame:
    """Share of tokens outside the band and mean |log-ratio| per bucket of trainer probability, entropy and
    position (`by`), buckets in their natural order (`order`); empty buckets left out. Probability and entropy
    buckets are (low, high] (the first includes its low edge), position buckets [low, high)."""
    lr = tokens["log_ratio"].to_numpy(dtype=float)
    keys = {"probability": (np.exp(tokens["old_logp"].to_numpy(dtype=float)), PROBABILITY_EDGES, "left"),
            "entropy": (pd.to_numeric(tokens["entropy"], errors="coerce").to_numpy(dtype=float), ENTROPY_EDGES,
                        "left"),
            "position": (tokens["position"].to_numpy(dtype=float), POSITION_EDGES, "right")}
    frames = []
    for by, (values, edges, side) in keys.items():
        codes = np.searchsorted(np.asarray(edges), values, side=side) - 1
        if side == "left":
            codes[values == edges[0]] = 0  # the lowest edge belongs to the first bucket
        codes[np.isnan(values)] = -1
        stats = _per_group(codes, lr, len(edges) - 1, worst=False)
        kept = np.flatnonzero(stats["tokens"])
        frames.append(pd.DataFrame({
            "by": by, "bucket": [_bucket_label(edges[i], edges[i + 1], by) for i in kept], "order": kept,
            "tokens": stats["tokens"][kept], "out_of_band": stats["out_of_band"][kept],
            "mean_abs_log_ratio": stats["mean_abs_log_ratio"][kept]}))
    return pd.concat(frames, ignore_index=True)


def _bucket_label(low: float, high: float, by: str) -> str:
    if by == "position":
        return f"{int(low)}+" if math.isinf(high) else f"{int(low)}–{int(high) - 1}"
    return f"> {low:g}" if math.isinf(high) else f"{low:g}–{high:g}"


def by_text(tokens: pd.DataFrame, limit: int = WORST_TEXTS) -> pd.DataFrame:
    """The token texts with the most tokens outside the band (then the largest mean |log-ratio|, then by text),
    each with its worst occurrence (the rollout and position of its largest |log-ratio|, the first such token by
    rollout and position) for a link to the Token inspector. The rows may come in any order."""
    codes, texts = pd.factorize(tokens["token_text"], use_na_sentinel=False)
    lr = tokens["log_ratio"].to_numpy(dtype=float)
    rollout, position = (tokens[c].to_numpy(dtype=np.int64) for c in ("rollout_id", "position"))
    stats = _per_group(codes, lr, len(texts), rank=rollout * (int(position.max(initial=0)) + 1) + position)
    worst = stats.pop("worst")
    table = pd.DataFrame({"token_text": np.asarray(texts, dtype=object), **stats, "worst_rollout_id": rollout[worst],
                          "worst_position": position[worst], "worst_log_ratio": lr[worst]})
    table = table.sort_values(["outside", "mean_abs_log_ratio", "token_text"], ascending=[False, False, True],
                              kind="stable")
    return table.head(limit).reset_index(drop=True)


def sequences(tokens: pd.DataFrame, rollouts: pd.DataFrame) -> pd.DataFrame:
    """Per trained rollout: its tokens' mean and summed log-ratio, largest |log-ratio|, share outside the band,
    and its reward and advantage (from `rollouts`, the step's rollouts)."""
    ids, codes = np.unique(tokens["rollout_id"].to_numpy(dtype=np.int64), return_inverse=True)
    lr = tokens["log_ratio"].to_numpy(dtype=float)
    stats = _per_group(codes, lr, len(ids))
    total = np.bincount(codes, weights=lr, minlength=len(ids))
    per = pd.DataFrame({"rollout_id": ids, "tokens": stats["tokens"], "mean_log_ratio": total / stats["tokens"],
                        "sum_log_ratio": total, "max_abs_log_ratio": np.abs(lr[stats["worst"]]),
                        "out_of_band": stats["out_of_band"]})
    own = rollouts[["rollout_id", "group_id", "reward", "advantage"]].dropna(subset=["rollout_id"])
    return per.merge(own.astype({"rollout_id": np.int64}), on="rollout_id", how="left")


def step_mismatch(tokens: pd.DataFrame, rollouts: pd.DataFrame) -> StepMismatch:
    """Everything of the one-step view from the step's sampler tokens and its rollouts."""
    points, grid_cells = probability_points(tokens)
    return StepMismatch(summary=summary(tokens), histogram=histogram(tokens["log_ratio"].to_numpy(dtype=float)),
                        probabilities=points, grid_cells=grid_cells, buckets=buckets(tokens), by_text=by_text(tokens),
                        sequences=sequences(tokens, rollouts))
