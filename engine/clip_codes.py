"""The codes of the `token_passes.clip` column: which bound, if any, stopped a token's gradient in a pass.

Apart from `engine.objectives` (which needs torch, 2 s to import) so that the dashboard pages that only read and
label logged clip codes start without torch; `engine.objectives` re-exports them.
"""

CLIP_NONE, CLIP_LOW, CLIP_HIGH, CLIP_CAP = 0, 1, 2, 3
CLIP_EVENTS = (CLIP_LOW, CLIP_HIGH, CLIP_CAP)  # every code but "none"
CLIP_NAMES = {CLIP_NONE: "none", CLIP_LOW: "low", CLIP_HIGH: "high", CLIP_CAP: "dual / cap"}  # short labels
