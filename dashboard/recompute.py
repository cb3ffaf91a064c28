"""Logged tokens -> tensors -> `engine.objectives` / `engine.advantages` -> arrays for the charts.

The dashboard never re-implements an objective: the Algorithm weighting page asks `policy_loss` what each
algorithm would do with the logged log-probs and advantages, and the PRM sandbox asks `process_advantages`.
Long token rows become (B, T) tensors with `engine.logrows.batch_from_tokens`, the inverse of what the trainer
writes. No Streamlit calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from engine.clip_codes import CLIP_NAMES, clip_fractions, count_clip_events
from engine.logrows import LoggedBatch, batch_from_tokens
from engine.objectives import ALGORITHMS, defaults, policy_loss

__all__ = ["KNOBS", "SCHEMES", "Weighting", "advantage_schemes", "author_knobs", "batch_from_tokens",
           "binned", "clip_fraction_row", "clip_region", "process_sandbox", "weigh", "whitened"]

KNOBS = ("eps_low", "eps_high", "beta")


def author_knobs(algorithms=ALGORITHMS) -> pd.DataFrame:
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


def weigh(batch: LoggedBatch, algo: str, overrides: dict) -> Weighting:
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
    shares = clip_fractions(count_clip_events(codes), codes.size)
    return {"algorithm": algo, **{CLIP_NAMES[c]: share for c, share in shares.items()},
            "zero-gradient tokens": float(
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
    PPO schemes are the logged columns of a run with a critic (absent otherwise), binned by DuckDB."""
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

    outcome = group_advantages(rollouts["reward"].to_numpy(dtype=float).copy(), len(ids), scale_by_std=scale_by_std)
    for rid, n, a in zip(ids, lengths, outcome.tolist(), strict=True):
        add("grpo_outcome", rid, np.full(n, a))
    if len(prm_steps):
        steps = prm_steps.sort_values(["rollout_id", "step_index"])
        rewards = [steps[steps["rollout_id"] == r]["reward_raw"].astype(float).tolist() for r in ids]
        ends = [steps[steps["rollout_id"] == r]["last_pos"].astype(int).tolist() for r in ids]
        process = process_advantages(rewards, ends, lengths).numpy()  # (G, max length)
        for i, (rid, n) in enumerate(zip(ids, lengths, strict=True)):
            add("grpo_process", rid, process[i, :n])
    if "value" in token_bins and token_bins["value"].notna().any():
        for scheme, column in LOGGED_SCHEMES.items():
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
