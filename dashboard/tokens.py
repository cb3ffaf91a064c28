"""One rollout's tokens coloured by a channel, clip events painted on them, as plain data (`token_spans`), which
`token_spans.js` draws as text in the Token inspector (`dashboard.token_view`) and in the report: a completion that
contains `<img src=x onerror=alert(1)>` is shown as those characters, never as an element. Token texts that other
figures show as markup (plotly's hover labels) go through `html.escape` first (`visible_text`). Whitespace is made
visible (`·` for a space, `→` for a tab, `↵` for a newline followed by a real line break) because for a tokenizer a
leading space or a newline is a token like any other and users need to see where it went.

No Streamlit calls here.
"""

from __future__ import annotations

import functools
import html
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from plotly.colors import sample_colorscale

from engine.clip_codes import CLIP_CAP, CLIP_COV, CLIP_HIGH, CLIP_LOW, CLIP_NAMES
from engine.correction_settings import REJECT_NAMES


@dataclass(frozen=True)
class Channel:
    """How one per-token quantity is coloured."""

    column: str
    label: str
    center: float | None  # diverging scale centred here; None: sequential scale from min to max
    colorscale: str
    fixed_range: tuple[float, float] | None = None  # the scale's ends whatever the values (a share, a yes/no)


# Diverging scales are centred where the quantity is neutral: an advantage, KL, gradient weight or token loss of 0
# pushes nothing; a ratio of 1 means the policy has not moved. Log-probs and entropy have no neutral point, so they
# get a sequential scale.
CHANNELS: dict[str, Channel] = {
    # A critic run logs its GAE advantages before whitening, while its loss (and so every clip decision) used them
    # whitened: `dashboard.data.as_loss_used` puts the whitened ones in `advantage` and the logged ones beside them.
    "advantage": Channel("advantage", "advantage (as the loss used it)", 0.0, "RdBu"),
    "gae_advantage": Channel("gae_advantage", "GAE advantage before whitening", 0.0, "RdBu"),
    "ratio": Channel("ratio", "ratio π/π_old", 1.0, "PuOr_r"),
    "new_logp": Channel("new_logp", "new log-prob", None, "Viridis"),
    "old_logp": Channel("old_logp", "old log-prob", None, "Viridis"),
    "ref_logp": Channel("ref_logp", "reference log-prob", None, "Viridis"),
    "entropy": Channel("entropy", "entropy", None, "Magma_r"),
    "kl": Channel("kl", "KL to reference (k3)", 0.0, "RdBu_r"),
    "grad_weight": Channel("grad_weight", "gradient weight", 0.0, "RdBu"),
    "token_loss": Channel("token_loss", "token loss", 0.0, "RdBu_r"),
    # The sampler/trainer mismatch (runs with a sampler's log-probs) and its corrections (runs with one on).
    "sampler_logp": Channel("sampler_logp", "sampler log-prob", None, "Viridis"),
    "mismatch": Channel("mismatch", "mismatch (old - sampler log-prob)", 0.0, "PiYG"),
    "is_weight": Channel("is_weight", "IS weight", 1.0, "PuOr_r"),
    # A rejection code (engine.correction_settings) per token, its share over a bin: any code is "rejected".
    "rejected": Channel("rejected", "rejected (left the loss)", None, "Reds", fixed_range=(0.0, 1.0)),
}
# Channels that only runs with a sampler's log-probs, or with a mismatch correction on, have: hidden when absent.
MISMATCH_CHANNELS = ("sampler_logp", "mismatch", "is_weight", "rejected")

# Low and high clipping must be told apart at a glance and without relying on colour alone: low is a thick line
# under the token, high a thick line over it, the dual/soft cap a dashed outline.
CLIP_STYLES = {
    CLIP_LOW: "border-bottom:4px solid #1f77b4;",
    CLIP_HIGH: "border-top:4px solid #d62728;",
    CLIP_CAP: "outline:2px dashed #9467bd;outline-offset:-1px;",
    CLIP_COV: "outline:2px dotted #ff7f0e;outline-offset:-1px;",
}
# A token the mismatch corrections took out of the loss is struck through (it is still shown: it stays logged).
REJECTED_STYLE = "text-decoration:line-through;text-decoration-thickness:2px;"
OVERVIEW_BINS = 1000
"""Columns of a long completion's overview strip and token x channel heatmap (`dashboard.data.rollout_token_bins`):
about a pixel each on a laptop's wide page."""
DEFAULT_WINDOW = 512
"""A completion up to this long is shown whole (its text as one block, its heatmap token by token); a longer one by
windows of this many tokens, its heatmap in `OVERVIEW_BINS` columns."""

TOKEN_STYLE = "padding:1px 2px;margin:1px 1px;border-radius:2px;"  # every token's box
TOKENS_STYLE = ("font-family:ui-monospace,Menlo,Consolas,monospace;font-size:16px;line-height:2.0;white-space:normal;"
                "word-break:break-all;")  # the block of a completion's tokens


def visible_whitespace(text: str) -> str:
    """A token's text with its whitespace made visible; a newline keeps its line break after the `↵`."""
    return text.replace(" ", "·").replace("\t", "→").replace("\r", "␍").replace("\n", "↵\n")


def visible_text(text: str) -> str:
    """Escape a token's text for HTML and make its whitespace visible, its newlines real line breaks."""
    return html.escape(visible_whitespace(text), quote=True).replace("\n", "<br>")


def channel_range(values: pd.Series, channel: Channel) -> tuple[float, float]:
    """(low, high) of the colour scale; diverging scales are symmetric around their centre."""
    if channel.fixed_range is not None:
        return channel.fixed_range
    numbers = pd.to_numeric(values, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    finite = numbers[np.isfinite(numbers)]
    if not finite.size:
        return (-1.0, 1.0) if channel.center is None else (channel.center - 1.0, channel.center + 1.0)
    if channel.center is not None:
        spread = float(np.abs(finite - channel.center).max()) or 1.0
        return channel.center - spread, channel.center + spread
    low, high = float(finite.min()), float(finite.max())
    return (low, high) if high > low else (low - 1.0, high + 1.0)


@functools.lru_cache(maxsize=32)
def _palette(colorscale: str, levels: int = 256) -> tuple[tuple[str, str], ...]:
    """(background, text colour) at `levels` evenly spaced points of a colour scale, computed once per scale:
    sampling the scale for every token took a quarter of a second on a long completion."""
    out = []
    for rgb in sample_colorscale(colorscale, [i / (levels - 1) for i in range(levels)]):
        r, g, b = (float(c) for c in rgb[rgb.index("(") + 1 : -1].split(","))
        # Dark text on light cells and vice versa (relative luminance, sRGB weights).
        out.append((rgb, "#111" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 140 else "#fff"))
    return tuple(out)


def _colour(value, low: float, high: float, colorscale: str) -> tuple[str, str]:
    """(background, text colour) for one value; missing values are left uncoloured."""
    if is_missing(value) or not math.isfinite(float(value)):
        return "transparent", "inherit"
    palette = _palette(colorscale)
    position = min(1.0, max(0.0, (float(value) - low) / (high - low)))
    return palette[round(position * (len(palette) - 1))]


def is_missing(value) -> bool:
    """None, NaN or pandas' NA: how a column the logger left out (stored as NULL) comes back."""
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # a list or an array is a value, not a missing one
        return False


def plain(value) -> str:
    """A logged string for `st.text`, `st.code` or a widget's option label (which show text as it is), "–" when
    it was not logged."""
    return "–" if is_missing(value) else str(value)


def number(value, spec: str = ".3g") -> str:
    """A logged number formatted with `spec`, or "–" when it was not logged (NULL/NaN)."""
    return "–" if is_missing(value) else format(value, spec)


def _text(value) -> str:
    """A logged token text; a NULL one is shown as nothing rather than as "None"."""
    return "" if is_missing(value) else str(value)


def _format(value) -> str:
    if is_missing(value):
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _formatted(values: pd.Series) -> list[str]:
    """`_format` of every value of a column; a float column at once."""
    if pd.api.types.is_float_dtype(values.dtype):
        floats = values.to_numpy(dtype=float, na_value=np.nan).tolist()  # Python floats: formatted 5x faster
        return ["–" if value != value else f"{value:.4g}" for value in floats]
    return [_format(value) for value in values.tolist()]


def _format_signed(value) -> str:
    return "–" if is_missing(value) else f"{float(value):+.3g}"


def token_spans(tokens: pd.DataFrame, channel_name: str, hover_columns: list[str] | None = None) -> dict:
    """How each token is drawn, as plain data: what `token_spans.js` builds its spans from (as text, never as
    markup), in the Token inspector's component (`dashboard/token_view.js`) and in the report.

    `tokens` has one row per completion token in order, with `position`, `token_text`, the channel's column and
    optionally `clip` (the engine.clip_codes clip code) and `rejected` (engine.correction_settings). Returns
    `token_marks` (what does not depend on the channel) and `token_colours` (what does) in one dict.
    """
    return token_marks(tokens, hover_columns) | token_colours(tokens, channel_name)


def token_marks(tokens: pd.DataFrame, hover_columns: list[str] | None = None) -> dict:
    """The part of `token_spans` that is the same for every channel: lists with one entry per token, `position`
    (int or None), `text` (whitespace made visible, a newline kept after its `↵`), `clip`, `rejected`, `heading`
    (the hover text's first line: position and the token as a Python string literal); `hover`, the rest of the
    hover text by column ({"names": ..., "values": one list of formatted values per name}: every column in
    `hover_columns`, by default every channel's logged), `clip_names` (clip code -> name, empty when no clip was
    logged: no clip line), `reject_names` (the rejected tokens' line) and `styles` (CSS by clip code, and
    "rejected"). token_spans.js writes each token's hover text from these: a name per column, not per token (a
    16,384-token rollout's report was 4.2 MB of hover texts, 13 names on each)."""
    hover_columns = hover_columns or [c.column for c in CHANNELS.values()  # the rejection by name, below
                                      if c.column in tokens.columns and c.column != "rejected"]
    codes = {name: tokens[name].fillna(0).astype(int).tolist() if name in tokens.columns else [0] * len(tokens)
             for name in ("clip", "rejected")}
    texts = tokens["token_text"].astype(object).fillna("").astype(str).tolist()
    positions = tokens["position"].astype(object).where(tokens["position"].notna(), None).tolist()
    headings = [f"#{'' if position is None else position}  {text!r}" for position, text in zip(positions, texts,
                                                                                              strict=True)]
    return {"position": positions, "text": [visible_whitespace(t) for t in texts], "clip": codes["clip"],
            "rejected": codes["rejected"], "heading": headings,
            "hover": {"names": hover_columns, "values": [_formatted(tokens[name]) for name in hover_columns]},
            "clip_names": {str(code): name for code, name in CLIP_NAMES.items()} if "clip" in tokens.columns else {},
            "reject_names": {str(code): name for code, name in REJECT_NAMES.items()},
            "styles": {**{str(code): style for code, style in CLIP_STYLES.items()}, "rejected": REJECTED_STYLE}}


def token_colours(tokens: pd.DataFrame, channel_name: str) -> dict:
    """The part of `token_spans` that depends on the channel: `colour` (by token, an index into `palette`, -1: not
    coloured), `palette` ([background, text colour] pairs), `low` and `high` (the colour scale's ends)."""
    channel = CHANNELS[channel_name]
    values = tokens[channel.column] if channel.column in tokens.columns else pd.Series(np.nan, index=tokens.index)
    low, high = channel_range(values, channel)
    palette = _palette(channel.colorscale)
    # Whole columns at once (a window of a long completion is 512 tokens and a dozen hover values each); as
    # `_colour`: the nearest of the palette's colours (round half to even, as Python's round), -1 when missing.
    scaled = pd.to_numeric(values, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    colour = np.rint(np.clip((scaled - low) / (high - low), 0.0, 1.0) * (len(palette) - 1))
    colour = np.where(np.isfinite(scaled), colour, -1).astype(int)
    return {"colour": colour.tolist(), "palette": [list(pair) for pair in palette], "low": low, "high": high}


@functools.lru_cache(maxsize=32)
def _legend_stops(colorscale: str) -> tuple[str, ...]:
    """Five colours along a scale, sampled once per scale."""
    return tuple(sample_colorscale(colorscale, [0.0, 0.25, 0.5, 0.75, 1.0]))


def colour_legend_html(channel: Channel, low: float, high: float) -> str:
    """A small legend: the colour scale's ends and the clip markers."""
    gradient = ", ".join(_legend_stops(channel.colorscale))
    middle = f" · {channel.center:g} in the middle" if channel.center is not None else ""
    return (
        '<div style="font-size:12px;margin-top:6px;display:flex;gap:14px;align-items:center;flex-wrap:wrap;">'
        f"<span>{html.escape(channel.label)}: {low:.3g}</span>"
        f'<span style="display:inline-block;width:160px;height:10px;background:linear-gradient(90deg, {gradient});'
        'border:1px solid #ccc;"></span>'
        f"<span>{high:.3g}{html.escape(middle)}</span>"
        f'<span style="{CLIP_STYLES[CLIP_LOW]}padding:0 4px;">clip low</span>'
        f'<span style="{CLIP_STYLES[CLIP_HIGH]}padding:0 4px;">clip high</span>'
        f'<span style="{CLIP_STYLES[CLIP_CAP]}padding:0 4px;">dual clip / cap</span>'
        f'<span style="{REJECTED_STYLE}padding:0 4px;">rejected</span>'
        "<span>· space ↵ newline → tab</span>"
        "</div>"
    )


def reasoning_steps_html(tokens: pd.DataFrame, steps: pd.DataFrame) -> str:
    """A completion split into its reasoning steps: one block per step with its raw and normalized reward.

    `tokens` has position and token_text; `steps` has step_index, first_pos, last_pos, reward_raw, reward_norm.
    Blocks are coloured by the normalized reward; a run trained with outcome supervision logs the verifier's raw
    step rewards but no normalized ones (its advantages do not use them), and its blocks are coloured by the raw
    reward and say so. Tokens outside every step (e.g. after the last one) are shown greyed at the end.
    """
    text_at = {int(p): _text(t) for p, t in zip(tokens["position"], tokens["token_text"], strict=True)
               if not is_missing(p)}
    steps = steps[steps["first_pos"].notna() & steps["last_pos"].notna()].sort_values("step_index")
    uses_step_rewards = bool(steps["reward_norm"].notna().any())
    coloured_by = steps["reward_norm" if uses_step_rewards else "reward_raw"]
    spread = float(pd.to_numeric(coloured_by, errors="coerce").abs().max()) if coloured_by.notna().any() else 0.0
    spread = spread or 1.0
    covered: set[int] = set()
    blocks = []
    for step, value in zip(steps.itertuples(index=False), coloured_by, strict=True):
        positions = range(int(step.first_pos), int(step.last_pos) + 1)
        covered.update(positions)
        text = "".join(visible_text(text_at.get(p, "")) for p in positions)
        background, colour = _colour(value, -spread, spread, "RdBu")
        norm = f"norm {_format_signed(step.reward_norm)}" if uses_step_rewards else "not used by the advantages"
        blocks.append(
            '<div class="pl-step" style="display:flex;gap:10px;align-items:flex-start;margin:4px 0;">'
            f'<div style="min-width:170px;padding:2px 6px;border-radius:4px;background:{background};color:{colour};'
            f'font-size:12px;">step {_format(step.step_index)} · raw {_format(step.reward_raw)} · {norm}</div>'
            f'<div style="font-family:ui-monospace,Menlo,Consolas,monospace;font-size:14px;">{text}</div></div>'
        )
    rest = [p for p in sorted(text_at) if p not in covered]
    if rest:
        text = "".join(visible_text(text_at[p]) for p in rest)
        note = "outside any step (advantage 0)" if uses_step_rewards else "outside any step"
        blocks.append(
            '<div style="display:flex;gap:10px;margin:4px 0;color:#888;"><div style="min-width:170px;font-size:12px;">'
            f'{note}</div>'
            f'<div style="font-family:ui-monospace,Menlo,Consolas,monospace;font-size:14px;">{text}</div></div>'
        )
    return "".join(blocks)
