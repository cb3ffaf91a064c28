"""Advantage estimators: group-relative outcome (GRPO/DAPO/GSPO/ASPO), Dr. GRPO, process supervision, GAE.

    A = group_advantages(torch.tensor([1., 0., 0., 1.]), group_size=4)           # (N,) one per completion
    A = process_advantages([[0.9, 0.95, 0.8], [0.9, -0.8, -0.9]],                  # PRM score per step
                           [[3, 7, 9], [2, 5, 8]], lengths=[10, 9])              # -> (G, 10) one per token
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)          # PPO baseline

Departures from the papers:
1. All-equal groups get exactly 0 (not (R - mean) / 1e-6, which can be a tiny non-zero from float rounding), and
   so does a group of size 1 (its unbiased std is undefined). Same for process rewards.
2. The GRPO paper writes std without saying which; we use the unbiased (Bessel) std, as verl's
   compute_grpo_outcome_advantage does (torch.std's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from numbers import Integral

import torch

__all__ = [
    "STD_EPS",
    "gae_advantages",
    "group_advantages",
    "masked_mean_std",
    "masked_whiten",
    "normalized_step_rewards",
    "process_advantages",
]

STD_EPS = 1e-6  # added to the std before dividing (verl uses the same constant)


def _is_int(v) -> bool:
    """Python or NumPy integer, not bool."""
    return isinstance(v, Integral) and not isinstance(v, bool)


def _normalize(x: torch.Tensor, scale_by_std: bool = True) -> torch.Tensor:
    """(x - mean) / (std + eps) over the last dim, unbiased std; 0 where all values are equal or n == 1."""
    centred = x - x.mean(-1, keepdim=True)
    if scale_by_std:
        n = x.shape[-1]
        std = x.std(-1, keepdim=True, unbiased=True) if n > 1 else torch.zeros_like(x[..., :1])
        centred = centred / (std + STD_EPS)
    flat = (x.amax(-1, keepdim=True) == x.amin(-1, keepdim=True)).expand_as(x)  # no signal in this group
    return torch.where(flat, torch.zeros_like(centred), centred)


def group_advantages(rewards: torch.Tensor | Sequence[float], group_size: int, scale_by_std: bool = True):
    """Outcome advantage of each completion relative to its group (GRPO, arXiv 2402.03300 Sec. 4.1.2).

    rewards: (N,) ordered group by group (completions 0..G-1 of prompt 0, then prompt 1, ...).
    scale_by_std=True: (R - mean) / (std + 1e-6), unbiased std. False: Dr. GRPO's R - mean (arXiv 2503.20783
    Sec. 3.2). Returns a float (N,) tensor; groups whose rewards are all equal get 0.
    """
    r = torch.as_tensor(rewards)
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    if r.dim() != 1:
        raise ValueError(f"rewards has shape {tuple(r.shape)}; accepted: a 1-d (N,) tensor or list")
    if not _is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size = {group_size!r} is invalid; accepted: an int >= 1")
    N = r.shape[0]
    if N % group_size != 0:
        raise ValueError(f"{N} rewards do not split into groups of {group_size}; accepted: N divisible by group_size")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or inf; accepted: finite values only")
    grouped = r.reshape(N // group_size, group_size)  # (num_groups, G)
    return _normalize(grouped, scale_by_std).reshape(N)  # (N,)


def normalized_step_rewards(step_rewards: Sequence[Sequence[float]]) -> list[list[float]]:
    """The step rewards of one group normalised together (GRPO paper Sec. 4.1.3): (r - mean) / (std + 1e-6) over
    all steps of all completions, unbiased std; all equal (or a single step): 0. Same nesting as `step_rewards`."""
    flat = torch.tensor([float(x) for rs in step_rewards for x in rs], dtype=torch.float64)  # (K,)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("step_rewards contain NaN or inf; accepted: finite values only")
    normed = _normalize(flat[None, :])[0].tolist() if flat.numel() > 0 else []  # (K,)
    out, k = [], 0
    for rs in step_rewards:
        out.append(normed[k : k + len(rs)])
        k += len(rs)
    return out


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    lengths: Sequence[int],
) -> torch.Tensor:
    """Per-token advantages from process (PRM) rewards for one group (GRPO paper Sec. 4.1.3).

    step_rewards[i][j]: PRM score of step j of completion i; step_ends[i][j]: 0-based index of that step's last
    token (increasing); lengths[i]: completion i's token count. All step rewards of the group are normalised
    together (`normalized_step_rewards`: rt = (r - mean) / (std + 1e-6), unbiased std), and token t of
    completion i gets A[i, t] = sum of rt[i][j] over the steps j with step_ends[i][j] >= t: the reward of its own
    step and of every later step. Tokens after the last step end, and padding up to max(lengths), get 0.
    Returns (G, max(lengths)).
    """
    G = len(lengths)
    if G == 0 or len(step_rewards) != G or len(step_ends) != G:
        raise ValueError(
            f"got {len(step_rewards)} step_rewards, {len(step_ends)} step_ends and {G} lengths; accepted: the same "
            "number (>= 1) of completions in all three"
        )
    for i in range(G):
        n, ends = lengths[i], list(step_ends[i])
        if not _is_int(n) or n < 0:
            raise ValueError(f"lengths[{i}] = {n!r} is invalid; accepted: an int >= 0")
        if len(ends) != len(step_rewards[i]):
            raise ValueError(
                f"completion {i} has {len(step_rewards[i])} step rewards but {len(ends)} step ends; accepted: one "
                "end index per step"
            )
        if any(not _is_int(e) or e < 0 or e >= n for e in ends) or any(a >= b for a, b in pairwise(ends)):
            raise ValueError(
                f"step_ends[{i}] = {ends} is invalid for a completion of {n} tokens; accepted: strictly increasing "
                f"ints in [0, {n - 1}]"
            )
    normed = normalized_step_rewards(step_rewards)

    T = int(max(lengths))
    out = torch.zeros(G, T, dtype=torch.float64)  # (G, T)
    for i in range(G):
        for end, reward in zip(step_ends[i], normed[i], strict=True):
            out[i, : int(end) + 1] += reward  # this step's reward reaches every token at or before its end
    return out.to(torch.get_default_dtype())


def masked_mean_std(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, sqrt(var + eps)) of the masked entries of `x` (population variance): the statistics `masked_whiten`
    divides by, for a caller that also wants to record them."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return mean, torch.sqrt(var + eps)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the whole batch (PPO's advantage whitening); 0 outside mask."""
    mean, std = masked_mean_std(x, mask, eps)
    return (x - mean) / std * mask.to(x.dtype)


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation for the PPO baseline (Schulman et al., arXiv 1506.02438, eq. 16).

    rewards, values, mask: (B, T); per-token reward (e.g. -beta * KL plus the score on the last token), value
    head V. delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last completion token,
    A_t = sum_l (gamma lam)^l delta_{t+l}. Returns (advantages, returns = A + V), both 0 on masked tokens.
    verl's defaults gamma = lam = 1. Whiten the advantages with `masked_whiten` before the PPO loss.
    """
    B, T = rewards.shape
    if values.shape != (B, T) or mask.shape != (B, T):
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, mask {tuple(mask.shape)}; accepted: "
            "three tensors of the same (B, T) shape"
        )
    m = mask.to(rewards.dtype)
    r, v = rewards * m, values * m  # (B, T) padding contributes nothing
    adv = torch.zeros_like(r)
    running = torch.zeros(B, dtype=r.dtype, device=r.device)  # (B,)
    next_value = torch.zeros(B, dtype=r.dtype, device=r.device)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]  # (B,)
        # a padded position is skipped: the carry passes through it unchanged (0 after a right-padded end)
        running = torch.where(m[:, t] > 0, delta + gamma * lam * running, running)
        adv[:, t] = running
        next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
    return adv * m, (adv + v) * m
