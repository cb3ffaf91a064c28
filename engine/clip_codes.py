"""The codes of the `token_passes.clip` column: which bound, if any, stopped a token's gradient in a pass.

Apart from `engine.objectives` (which needs torch, 2 s to import) so that the dashboard pages that only read and
label logged clip codes start without torch; `engine.objectives` re-exports them.

One name per code, everywhere: CLIP_NAMES is the label the pages show and the stem of every column about the code
(`steps.clip_<name>_frac`, the dashboard's `clip_<name>_rate`; `fraction_column` / `rate_column`). Code 3 is "dual":
capped with the gradient kept, the dual clip of ASPO and its relatives (CISPO's truncated IS weight, DPPO's
truncated ratio, SAPO's and VESPO's soft weights below engine.objectives.SOFT_CAP_LEVEL). Code 4 is "cov": a token
the covariance rule of Clip-Cov (gradient zeroed) or KL-Cov (|log r| penalty added) selected (arXiv 2505.22617);
it is not one of the clips (CLIP_EVENTS) but a rule's event (RULE_EVENTS).

Clip fractions are computed here and nowhere else on the engine side: `count_clip_events` counts the codes of the
valid tokens, `clip_fractions` divides by the token count (the trainer's `steps` row adds the counts of every pass
and rank first; the dashboard's recomputation counts one algorithm's codes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CLIP_NONE, CLIP_LOW, CLIP_HIGH, CLIP_CAP, CLIP_COV = 0, 1, 2, 3, 4
CLIP_EVENTS = (CLIP_LOW, CLIP_HIGH, CLIP_CAP)  # the clips: every code of a bound but "none"
RULE_EVENTS = (CLIP_COV,)  # a rule's selection of tokens, not a bound: counted apart from the clips
CLIP_NAMES = {CLIP_NONE: "none", CLIP_LOW: "low", CLIP_HIGH: "high", CLIP_CAP: "dual", CLIP_COV: "cov"}


def fraction_column(code: int) -> str:
    """The `steps` column holding the share of a step's loss tokens (all passes) with `code`: clip_low_frac ..."""
    return f"clip_{CLIP_NAMES[code]}_frac"


def rate_column(code: int) -> str:
    """The name of a per-token or per-bin share of passes with `code` in the dashboard's tables: clip_low_rate ..."""
    return f"clip_{CLIP_NAMES[code]}_rate"


def count_clip_events(codes: Any, valid: Any = None, events: tuple[int, ...] = CLIP_EVENTS) -> dict[int, float]:
    """code -> how many of the `valid` tokens carry it, for every code of `events`. `codes` and `valid` are
    same-shaped torch tensors or numpy arrays (valid: bool, default every element)."""
    return {c: float(((codes == c) if valid is None else ((codes == c) & valid)).sum()) for c in events}


def clip_fractions(counts: Mapping[int, float], tokens: float) -> dict[int, float]:
    """code -> counts[code] / tokens for every code counted (0 when there are no tokens)."""
    return {c: float(n) / max(1.0, float(tokens)) for c, n in counts.items()}
