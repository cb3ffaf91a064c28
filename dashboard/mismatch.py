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
    binned: bool  # whether `probabilities` holds grid cells (more than MAX_POINTS tokens)
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
                       ) -> tuple[pd.DataFrame, bool]:
    """(trainer_p, sampler_p, tokens) per token, or per non-empty cell of a cells x cells grid over [0, 1]^2 (the
    cell's centre) when there are more than `max_points` tokens; and whether it was binned."""
    trainer = np.exp(tokens["old_logp"].to_numpy(dtype=float))
    sampler = np.exp(tokens["sampler_logp"].to_numpy(dtype=float))
    if len(trainer) <= max_points:
        return pd.DataFrame({"trainer_p": trainer, "sampler_p": sampler, "tokens": 1}), False
    counts, edges, _ = np.histogram2d(trainer, sampler, bins=cells, range=[[0, 1], [0, 1]])
    centres = (edges[:-1] + edges[1:]) / 2
    i, j = np.nonzero(counts)
    return pd.DataFrame({"trainer_p": centres[i], "sampler_p": centres[j], "tokens": counts[i, j].astype(int)}), True


def buckets(tokens: pd.DataFrame) -> pd.DataFrame:
    """Share of tokens outside the band and mean |log-ratio| per bucket of trainer probability, entropy and
    position (`by`), buckets in their natural order (`order`)."""
    lr = tokens["log_ratio"].to_numpy(dtype=float)
    keys = {"probability": (np.exp(tokens["old_logp"].to_numpy(dtype=float)), PROBABILITY_EDGES),
            "entropy": (pd.to_numeric(tokens["entropy"], errors="coerce").to_numpy(dtype=float), ENTROPY_EDGES),
            "position": (tokens["position"].to_numpy(dtype=float), POSITION_EDGES)}
    frames = []
    for by, (values, edges) in keys.items():
        cut = pd.cut(values, list(edges), right=by != "position", include_lowest=True)
        frame = pd.DataFrame({"bucket": cut, "outside": outside_band(lr), "abs": np.abs(lr)})
        grouped = frame.groupby("bucket", observed=True).agg(tokens=("abs", "size"), out_of_band=("outside", "mean"),
                                                               mean_abs_log_ratio=("abs", "mean")).reset_index()
        grouped["order"] = grouped["bucket"].cat.codes
        grouped["bucket"] = [_bucket_label(b, by) for b in grouped["bucket"]]
        frames.append(grouped.assign(by=by))
    return pd.concat(frames, ignore_index=True)[["by", "bucket", "order", "tokens", "out_of_band",
                                                 "mean_abs_log_ratio"]]


def _bucket_label(interval: pd.Interval, by: str) -> str:
    if by == "position":
        high = "" if math.isinf(interval.right) else f"{int(interval.right) - 1}"
        return f"{int(interval.left)}–{high}" if high else f"{int(interval.left)}+"
    if math.isinf(interval.right):
        return f"> {interval.left:g}"
    return f"{max(interval.left, 0):g}–{interval.right:g}"


def by_text(tokens: pd.DataFrame, limit: int = WORST_TEXTS) -> pd.DataFrame:
    """The token texts with the most tokens outside the band (then the largest mean |log-ratio|), each with its
    worst occurrence (the rollout and position of its largest |log-ratio|) for a link to the Token inspector."""
    frame = tokens[["token_text", "rollout_id", "position", "log_ratio"]].assign(
        outside=outside_band(tokens["log_ratio"]), abs=tokens["log_ratio"].abs())
    grouped = frame.groupby("token_text", dropna=False)
    table = grouped.agg(tokens=("abs", "size"), outside=("outside", "sum"), out_of_band=("outside", "mean"),
                        mean_abs_log_ratio=("abs", "mean"))
    worst = frame.loc[grouped["abs"].idxmax().to_numpy()].set_index("token_text")
    table = table.join(worst[["rollout_id", "position", "log_ratio"]].rename(
        columns=lambda c: f"worst_{c}")).reset_index()
    table = table.sort_values(["outside", "mean_abs_log_ratio"], ascending=False, kind="stable")
    return table.head(limit).reset_index(drop=True)


def sequences(tokens: pd.DataFrame, rollouts: pd.DataFrame) -> pd.DataFrame:
    """Per trained rollout: its tokens' mean, summed and largest |log-ratio|, share outside the band, and its
    reward and advantage (from `rollouts`, the step's rollouts)."""
    frame = tokens[["rollout_id", "log_ratio"]].assign(outside=outside_band(tokens["log_ratio"]),
                                                       abs=tokens["log_ratio"].abs())
    per = frame.groupby("rollout_id").agg(tokens=("log_ratio", "size"), mean_log_ratio=("log_ratio", "mean"),
                                          sum_log_ratio=("log_ratio", "sum"), max_abs_log_ratio=("abs", "max"),
                                          out_of_band=("outside", "mean")).reset_index()
    own = rollouts[["rollout_id", "group_id", "reward", "advantage"]].dropna(subset=["rollout_id"])
    return per.merge(own.astype({"rollout_id": per["rollout_id"].dtype}), on="rollout_id", how="left")


def step_mismatch(tokens: pd.DataFrame, rollouts: pd.DataFrame) -> StepMismatch:
    """Everything of the one-step view from the step's sampler tokens and its rollouts."""
    points, binned = probability_points(tokens)
    return StepMismatch(summary=summary(tokens), histogram=histogram(tokens["log_ratio"].to_numpy(dtype=float)),
                        probabilities=points, binned=binned, buckets=buckets(tokens), by_text=by_text(tokens),
                        sequences=sequences(tokens, rollouts))
