"""Logged tokens -> tensors -> `engine.objectives` / `engine.advantages` -> arrays for the charts.

The dashboard never re-implements an objective: the Algorithm weighting page asks `policy_loss` what each
algorithm would do with the logged log-probs and advantages, and the PRM sandbox asks `process_advantages`.
This module only reshapes data (long token rows <-> (B, T) tensors). No Streamlit calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from engine.objectives import defaults, policy_loss

WEIGHTING_ALGORITHMS = ("grpo", "dapo", "gspo", "aspo", "dr_grpo", "cispo")
KNOBS = ("eps_low", "eps_high", "beta")


@dataclass
class Batch:
    """Logged tokens of B completions as padded (B, T) tensors."""

    rollout_ids: list[int]
    logp: torch.Tensor  # (B, T) new log-prob of the chosen pass (old log-prob where no pass was logged)
    old_logp: torch.Tensor  # (B, T)
    ref_logp: torch.Tensor | None  # (B, T) or None when the run logged no reference
    entropy: torch.Tensor | None  # (B, T)
    advantages: torch.Tensor  # (B, T) per-token advantage as logged (constant per row for outcome rewards)
    mask: torch.Tensor  # (B, T) 1 on completion tokens
    lengths: np.ndarray  # (B,)


def batch_from_tokens(tokens: pd.DataFrame) -> Batch:
    """Pivot token rows (rollout_id, position, new_logp, old_logp, ref_logp, entropy, advantage) into a Batch."""
    rollout_ids = sorted(int(r) for r in tokens["rollout_id"].unique())
    row_of = {r: i for i, r in enumerate(rollout_ids)}
    rows = tokens["rollout_id"].map(row_of).to_numpy()
    cols = tokens["position"].to_numpy(dtype=int)
    B, T = len(rollout_ids), int(cols.max()) + 1 if len(cols) else 1

    def grid(column: str, fill: float = 0.0) -> np.ndarray:
        out = np.full((B, T), fill, dtype=np.float64)  # (B, T)
        out[rows, cols] = pd.to_numeric(tokens[column], errors="coerce").to_numpy(dtype=float)
        return np.nan_to_num(out, nan=fill)

    mask = np.zeros((B, T))
    mask[rows, cols] = 1.0
    old = grid("old_logp")
    # Eval rollouts or steps without passes: the policy has not moved, so the new log-prob is the old one.
    new = np.where(np.isnan(grid("new_logp", np.nan)), old, grid("new_logp")) if "new_logp" in tokens else old
    has_ref = "ref_logp" in tokens and tokens["ref_logp"].notna().any()
    has_entropy = "entropy" in tokens and tokens["entropy"].notna().any()
    return Batch(
        rollout_ids=rollout_ids,
        logp=torch.tensor(new),
        old_logp=torch.tensor(old),
        ref_logp=torch.tensor(np.where(mask > 0, grid("ref_logp"), new)) if has_ref else None,
        entropy=torch.tensor(grid("entropy")) if has_entropy else None,
        advantages=torch.tensor(grid("advantage")),
        mask=torch.tensor(mask),
        lengths=mask.sum(1).astype(int),
    )


def author_knobs(algorithms=WEIGHTING_ALGORITHMS) -> pd.DataFrame:
    """eps_low / eps_high / beta of each algorithm as published (engine.objectives.defaults)."""
    return pd.DataFrame([{"algorithm": a, **{k: defaults(a).get(k) for k in KNOBS}} for a in algorithms])


@dataclass
class Weighting:
    """What one algorithm does to a batch."""

    grad_weight: np.ndarray  # (B, T), NaN on padding
    clip: np.ndarray  # (B, T) int codes, -1 on padding
    ratio: np.ndarray  # (B, T) the ratio the algorithm used, NaN on padding
    total_weight: np.ndarray  # (B,) sum of a completion's gradient weights
    params: dict


def weigh(batch: Batch, algo: str, overrides: dict) -> Weighting:
    """Call policy_loss for one algorithm and keep its per-token diagnostics."""
    out = policy_loss(algo, batch.logp, batch.old_logp, batch.advantages, batch.mask, ref_logp=batch.ref_logp,
                      entropy=batch.entropy, **overrides)
    on = batch.mask.numpy() > 0
    weight = out.grad_weight.numpy()
    return Weighting(
        grad_weight=np.where(on, weight, np.nan),
        clip=np.where(on, out.clip.numpy().astype(int), -1),
        ratio=np.where(on, out.ratio.numpy(), np.nan),
        total_weight=weight.sum(1),
        params=out.params,
    )


def clip_fraction_row(algo: str, weighting: Weighting) -> dict:
    codes = weighting.clip[weighting.clip >= 0]
    n = max(1, codes.size)
    return {"algorithm": algo, "low": (codes == 1).sum() / n, "high": (codes == 2).sum() / n,
            "dual / cap": (codes == 3).sum() / n, "zero-gradient tokens": float(
                np.isclose(weighting.grad_weight[weighting.clip >= 0], 0).mean()) if codes.size else 0.0}


def clip_region(algo: str, overrides: dict, ratio_max: float, adv_max: float, n_ratio: int = 121,
                n_adv: int = 41) -> dict:
    """The objective's clip decision on a (advantage x ratio) grid: one single-token completion per grid point.

    With one token per completion, GSPO's sequence ratio is the token ratio, so every algorithm is drawn on the
    same axes. Entropy is not given, so ASPO uses its ordinary (not high-entropy) ranges.
    """
    ratios = np.linspace(1e-3, ratio_max, n_ratio)
    advs = np.linspace(-adv_max, adv_max, n_adv)
    rr, aa = np.meshgrid(ratios, advs)  # (A, R)
    logp = torch.tensor(np.log(rr).reshape(-1, 1))  # (A*R, 1)
    zeros = torch.zeros_like(logp)
    out = policy_loss(algo, logp, zeros, torch.tensor(aa.reshape(-1)), torch.ones_like(logp), **overrides)
    return {"ratio": ratios, "advantage": advs, "clip": out.clip.numpy().reshape(rr.shape).astype(int)}


def process_sandbox(step_rewards: list[list[float]], step_lengths: list[list[int]]) -> tuple[np.ndarray, list]:
    """Per-token advantages (G, maxlen) from `engine.advantages.process_advantages`, and each step's normalized
    reward read back from them: A at a step's last token minus A at the next token is that step's own term."""
    from engine.advantages import process_advantages

    step_ends = [list(np.cumsum(lengths) - 1) for lengths in step_lengths]
    lengths = [int(sum(lengths)) for lengths in step_lengths]
    advantages = process_advantages(step_rewards, [[int(e) for e in ends] for ends in step_ends], lengths)
    adv = advantages.detach().numpy()  # (G, maxlen)
    padded = np.concatenate([adv, np.zeros((adv.shape[0], 1))], axis=1)
    normalized = [[float(padded[i, e] - padded[i, e + 1]) for e in ends] for i, ends in enumerate(step_ends)]
    return adv, normalized
