"""The `epochs x minibatches` passes over one sampled batch, shared by the policy update (engine.train.update) and
the critic's (engine.critic.PPOCritic.update), so both cut the batch the same way from the same generator."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MiniBatch:
    """The rows of one optimizer step and how much of the completion width they need."""

    idx: torch.Tensor  # (b,) sorted row indices of the batch, on its device
    width: int  # t_mb: the longest completion among these rows; the right padding beyond it is trimmed


def minibatches(token_mask: torch.Tensor, epochs: int, count: int, generator: torch.Generator,
                device: torch.device | None = None) -> Iterator[MiniBatch]:
    """`epochs` random permutations of the B rows of `token_mask` (B, T), each cut into `count` mini-batches.

    Every rank of a data-parallel run draws the same permutations (same `generator` state), so the k-th
    mini-batch is the union of the ranks' k-th slices. Sorting the rows keeps them in batch order (groups
    contiguous), which the loss's per-group reductions expect."""
    B = token_mask.shape[0]
    for _epoch in range(epochs):
        perm = torch.randperm(B, generator=generator)
        for idx in perm.tensor_split(count):
            idx = idx.sort().values.to(device if device is not None else token_mask.device)
            yield MiniBatch(idx, int(token_mask[idx].sum(-1).max().item()))


def optimizer_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], loss: torch.Tensor,
                   max_grad_norm: float) -> float:
    """Backward `loss`, clip the gradients' global norm to `max_grad_norm` (<= 0: no clip), step; returns the norm
    before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    optimizer.step()
    return grad_norm
