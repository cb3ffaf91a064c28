"""The sampler: the copy of the policy that generates the rollouts, as a rollout engine (vLLM, SGLang) does.

    sampler = PolicySampler(policy, dtype="bfloat16", lag=1)
    batch = collect_batch(policy, ref, tokenizer, task, prompts, cfg, sampler_model=sampler.model)
    ... update the policy ...
    sampler.refresh(policy)          # the weight sync after each update

In asynchronous RL frameworks the rollout engine and the trainer compute different probabilities for the same tokens;
the sampler reproduces the three causes of that gap on a CPU (issue threads: TRL 3867 and 6789, verl 2953 and 3694):
- precision: its weights and kernels run in `dtype` (bfloat16: the bf16 rollout engine next to an fp32 trainer);
- staleness: its weights are those of `lag` updates ago (asynchronous RL; lag 0: synced after every update);
- truncation: it reports the log-prob of the top-k / top-p truncated, renormalised distribution it sampled from, as
  vLLM does (`truncated_logprobs`); the untruncated one is kept too, so the truncation's share of the gap shows.

With float32 and lag 0 (the defaults) the sampler is the policy itself: no copy, no refresh, no extra forward.
"""

from __future__ import annotations

import copy
from collections import deque

import torch
import torch.nn.functional as F

from engine.config import SAMPLER_DTYPES as SAMPLER_DTYPE_NAMES

SAMPLER_DTYPES = {name: getattr(torch, name) for name in SAMPLER_DTYPE_NAMES}  # float32, bfloat16, float16


class PolicySampler:
    """The rollout model: the policy itself (float32, lag 0), or its own copy in `dtype` holding the trainer's
    weights of `lag` updates ago, refreshed by `refresh` after every update."""

    def __init__(self, policy: torch.nn.Module, dtype: str = "float32", lag: int = 0):
        if dtype not in SAMPLER_DTYPES:
            raise ValueError(f"sampler dtype {dtype!r} is invalid; accepted: {', '.join(SAMPLER_DTYPES)}")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ValueError(f"sampler lag {lag!r} is invalid; accepted: an integer >= 0 (updates behind)")
        self.dtype, self.lag = SAMPLER_DTYPES[dtype], lag
        self.separate = dtype != "float32" or lag > 0
        if not self.separate:
            self.model = policy
            return
        self.model = copy.deepcopy(policy).to(self.dtype).eval().requires_grad_(False)
        # the weights of the last lag + 1 updates, oldest first: the sampler loads the oldest
        self.snapshots: deque[dict[str, torch.Tensor]] = deque([self._snapshot(policy)], maxlen=lag + 1)

    def _snapshot(self, policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {name: value.detach().to(self.dtype if value.is_floating_point() else value.dtype, copy=True)
                for name, value in policy.state_dict().items()}

    @torch.no_grad()
    def refresh(self, policy: torch.nn.Module) -> None:
        """The weight sync after an update: load the trainer's weights of `lag` updates ago (cast to `dtype`)."""
        if not self.separate:
            return
        if self.lag:
            self.snapshots.append(self._snapshot(policy))
            self.model.load_state_dict(self.snapshots[0])
        else:
            self.model.load_state_dict(policy.state_dict())  # copy_ casts to the sampler's dtype

    def state_dict(self) -> dict | None:
        """What a checkpoint needs to continue sampling with the same stale weights: the lag window's snapshots
        (None without a lag: the sampler is then rebuilt from the restored policy)."""
        return {"snapshots": list(self.snapshots)} if self.separate and self.lag else None

    @torch.no_grad()
    def restart(self, policy: torch.nn.Module, state: dict | None = None) -> None:
        """After a checkpoint was restored into `policy`: the checkpoint's lag window (`state_dict`), or for a
        checkpoint without one (lag 0, or written before lag windows were saved) the restored weights."""
        if not self.separate:
            return
        snapshots = state["snapshots"] if state else [self._snapshot(policy)]
        self.snapshots = deque(snapshots, maxlen=self.lag + 1)
        self.model.load_state_dict(self.snapshots[0])

    def memory_bytes(self) -> int:
        """Bytes the sampler adds: its copy's weights and buffers plus the lag snapshots (0: it is the policy)."""
        if not self.separate:
            return 0
        model = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        return model + sum(t.numel() * t.element_size() for snap in self.snapshots for t in snap.values())


def truncation_mask(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(N, T, V) bool: the tokens top-k then top-p keep, as transformers' TopKLogitsWarper then TopPLogitsWarper
    (and vLLM's top-k-then-top-p sampler) do: top-k keeps the k largest logits (ties at the k-th value kept), top-p
    keeps the smallest set of largest-probability tokens, renormalised after top-k, whose mass reaches top_p (a
    token stays when the mass strictly above it is below top_p; the most likely token always stays).
    `logits`: (N, T, V) at the sampling temperature."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (N, T, 1)
        keep = logits >= kth
    if top_p < 1.0:
        masked = logits.masked_fill(~keep, float("-inf"))
        probs, order = torch.sort(F.softmax(masked, dim=-1), dim=-1, descending=True)  # (N, T, V)
        mass_above = probs.cumsum(-1) - probs  # (N, T, V) exclusive cumulative mass
        keep_sorted = mass_above < top_p
        keep_sorted[..., 0] = True
        keep = keep & torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


def truncated_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_k: int = 0,
                       top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated, full), both (N, T): the log-prob of each target token under the top-k / top-p truncated and
    renormalised distribution (what vLLM reports for the sampled token) and under the full one.

    `logits`: (N, T, V) float at the sampling temperature; `targets`: (N, T) long. The target is always counted in
    the kept set: a token the sampler drew was kept at sampling time, and a recomputation that differs from the
    generation's own by rounding must not give it -inf."""
    full_all = F.log_softmax(logits, dim=-1)  # (N, T, V)
    full = full_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N, T)
    if not top_k and top_p >= 1.0:
        return full, full
    keep = truncation_mask(logits, top_k, top_p).scatter(-1, targets.unsqueeze(-1), True)  # (N, T, V)
    kept_mass = torch.logsumexp(full_all.masked_fill(~keep, float("-inf")), dim=-1)  # (N, T) log of kept mass
    return full - kept_mass, full
