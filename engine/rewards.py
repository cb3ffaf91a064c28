"""Reward shaping shared by the tasks and the trainer: DAPO's soft overlong punishment.

    overlong_penalty(length=19, max_len=20, cache_len=4)    # -> -0.75, added to the correctness reward
    overlong_penalty_tensor(lengths, max_len=20, cache_len=4)  # the same for a (N,) tensor of lengths

DAPO (arXiv 2503.14476), Sec. 3.4, eq. 13, with L_max = max_len and L_cache = cache_len:
    R_len(y) = 0                                   if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                  if |y| > L_max
The paper uses L_max = 20480, L_cache = 4096. No departures.
"""

from __future__ import annotations

from numbers import Integral

import torch

__all__ = ["overlong_penalty", "overlong_penalty_tensor"]


def _is_int(v) -> bool:
    """Python or NumPy integer, not bool."""
    return isinstance(v, Integral) and not isinstance(v, bool)


def _check(max_len: int, cache_len: int) -> None:
    for name, v in (("max_len", max_len), ("cache_len", cache_len)):
        if not _is_int(v) or v <= 0:
            raise ValueError(f"{name} = {v!r} is invalid; accepted: an int > 0")
    if cache_len > max_len:
        raise ValueError(f"cache_len = {cache_len} exceeds max_len = {max_len}; accepted: 0 < cache_len <= max_len")


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    """DAPO's soft overlong punishment (eq. 13) for a completion of `length` tokens: 0, a linear ramp to -1, -1."""
    _check(max_len, cache_len)
    if not _is_int(length) or length < 0:
        raise ValueError(f"length = {length!r} is invalid; accepted: an int >= 0")
    start = max_len - cache_len  # the last length that is never punished
    if length <= start:
        return 0.0
    if length <= max_len:
        return float(start - length) / cache_len
    return -1.0


def overlong_penalty_tensor(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """Vectorised `overlong_penalty`: (N,) integer lengths -> (N,) float penalties (default dtype)."""
    _check(max_len, cache_len)
    n = torch.as_tensor(lengths)
    if n.is_floating_point() or bool((n < 0).any()):
        raise ValueError("lengths must be integers >= 0; accepted: an integer tensor of token counts")
    start = max_len - cache_len
    x = n.to(torch.get_default_dtype())
    ramp = (start - x) / cache_len  # (N,)
    return torch.where(x <= start, torch.zeros_like(x), torch.where(x <= max_len, ramp, torch.full_like(x, -1.0)))
