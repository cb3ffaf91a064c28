"""Figures of advantages along the token axis (the Advantages and PRM steps pages): plotly figures from DataFrames,
no Streamlit calls. Long completions arrive in bins of positions (`dashboard.data.critic_token_bins`, one token per
bin for short ones), so a figure never holds more points than its panel has pixels."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts import PALETTE, Subplots, position_tick_step, zero_line
from dashboard.tokens import visible_text

# Past this many reasoning steps (a 16k-token completion has ~300) the boundaries of the highlighted completion's
# steps would be more lines than the panel has pixels: only its wrong steps are shaded.
MAX_STEP_LINES = 80
# Past this many reasoning steps their notes ("step 3: r=0.9 → +0.41", ~130 px each) overlap on a ~1,300 px panel:
# the line's hover names each bin's step and its rewards instead.
MAX_STEP_NOTES = 12


def advantage_schemes(schemes: pd.DataFrame, titles: list[tuple[str, str]], labels: dict[int, str],
                      highlight: int, steps: pd.DataFrame, tokens: pd.DataFrame | None) -> go.Figure:
    """One panel per scheme (rows, in `titles` order, schemes without rows skipped) on one token axis, one line per
    completion of the group through the means of its bins; the `highlight`ed completion drawn bold, with the band
    of its bins' min..max when a bin holds more than one token, and its reasoning steps marked on every panel
    (boundaries dotted, steps the verifier scored as wrong shaded red), the others faint.

    schemes: long rows (rollout_id, scheme, first_pos, last_pos, value, low, high) from
    dashboard.recompute.advantage_schemes; steps: the highlighted completion's logged steps (first_pos, last_pos,
    reward_raw); tokens: its tokens (position, token_text) for the hover text of one-token bins, else None."""
    present = [(key, title) for key, title in titles if (schemes["scheme"] == key).any()]
    n = max(1, len(present))
    grid = Subplots(n, 1, [t for _, t in present], vspace=0.3 / n, shared_x=True)
    text = {} if tokens is None else dict(zip(tokens["position"], tokens["token_text"], strict=True))
    rollout_ids = sorted(labels)
    for i, (key, _title) in enumerate(present):
        rows = schemes[schemes["scheme"] == key]
        for j, rid in enumerate(rollout_ids):
            line = rows[rows["rollout_id"] == rid].sort_values("first_pos")
            first, last = line["first_pos"].to_numpy(), line["last_pos"].to_numpy()
            x, colour, bold = (first + last) / 2, PALETTE[j % len(PALETTE)], rid == highlight
            trace = {"type": "scatter", "x": x, "y": line["value"].to_numpy(dtype=float),
                     "mode": "lines+markers" if bold else "lines", "marker": {"size": 5},
                     "line": {"shape": "hv", "width": 3 if bold else 1, "color": colour},
                     "opacity": 1.0 if bold else 0.35, "name": labels[rid], "legendgroup": str(rid),
                     "showlegend": i == 0, "hoverinfo": "skip"}
            if bold and (last > first).any():  # bins of many tokens: their min..max as a band, the range on hover
                low, high = line["low"].to_numpy(dtype=float), line["high"].to_numpy(dtype=float)
                for edge, fill in ((low, "none"), (high, "tonexty")):
                    grid.add(i, {"type": "scatter", "x": x, "y": edge, "mode": "lines", "fill": fill,
                                 "line": {"shape": "hv", "width": 0, "color": colour}, "fillcolor": "rgba(0,0,0,0.12)",
                                 "showlegend": False, "hoverinfo": "skip"})
                trace.update(customdata=np.stack([first, last, low, high], axis=-1), hoverinfo=None,
                             hovertemplate="tokens %{customdata[0]}–%{customdata[1]}: mean %{y:.4g}, min "
                             "%{customdata[2]:.4g}, max %{customdata[3]:.4g}<extra>" + labels[rid] + "</extra>")
            elif bold:
                trace.update(customdata=[visible_text(str(text.get(p, ""))).replace("<br>", "") for p in first],
                             hoverinfo=None, hovertemplate="#%{x} %{customdata}<br>%{y:.4g}<extra>" + labels[rid]
                             + "</extra>")
            grid.add(i, trace)
        grid.axis(i, "y").update(zeroline=True)
    grid.axis(n - 1, "x").update(title={"text": "token position"})
    return grid.figure(height=max(300, 210 * n), shapes=_step_marks(steps, grid, n),
                       margin={"l": 50, "r": 10, "t": 40, "b": 40},
                       legend={"orientation": "h", "y": 1.0 + 0.12 / n, "yanchor": "bottom"})


def _step_marks(steps: pd.DataFrame, grid: Subplots, panels: int) -> list[dict]:
    """On each panel: a dotted line where each reasoning step starts (up to MAX_STEP_LINES steps) and a red band
    over each run of consecutive steps the verifier scored as wrong."""
    steps = steps.sort_values("step_index")
    wrong_runs: list[list[float]] = []  # [first_pos, last_pos] of each run of wrong steps
    for step in steps.itertuples(index=False):
        if float(step.reward_raw) < 0:
            if wrong_runs and wrong_runs[-1][1] + 1 >= step.first_pos:
                wrong_runs[-1][1] = step.last_pos
            else:
                wrong_runs.append([step.first_pos, step.last_pos])
    starts = steps["first_pos"].tolist() if len(steps) <= MAX_STEP_LINES else []
    shapes = []
    for i in range(panels):
        x, y = grid.ref(i)
        shapes += [{"type": "rect", "xref": x, "yref": f"{y} domain", "x0": first - 0.5, "x1": last + 0.5, "y0": 0,
                    "y1": 1, "fillcolor": "#d62728", "opacity": 0.12, "line": {"width": 0}, "layer": "below"}
                   for first, last in wrong_runs]
        shapes += [{"type": "line", "xref": x, "yref": f"{y} domain", "x0": first - 0.5, "x1": first - 0.5, "y0": 0,
                    "y1": 1, "line": {"color": "#888", "width": 1, "dash": "dot"}} for first in starts]
    return shapes


def prm_advantage_line(bins: pd.DataFrame, prm_steps: pd.DataFrame, tokens: pd.DataFrame | None) -> go.Figure:
    """Per-token advantage of one completion as a line through the means of its bins (`dashboard.data.
    critic_token_bins`), its reasoning steps shaded (up to MAX_STEP_LINES steps: past that the staircase itself
    shows them) and their rewards noted above the panel (up to MAX_STEP_NOTES steps) and in the hover of each bin
    (the step of its first token); `tokens` (position, token_text): hover text of one-token bins."""
    ordered = prm_steps.sort_values("step_index")
    labels = [f"step {step.step_index}: r={step.reward_raw:.3g} → {step.reward_norm:+.3g}"
              for step in ordered.itertuples(index=False)]
    shapes, notes = [], []
    if len(ordered) <= MAX_STEP_LINES:
        for i, step in enumerate(ordered.itertuples(index=False)):
            shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": step.first_pos - 0.5,
                           "x1": step.last_pos + 0.5, "y0": 0, "y1": 1, "line": {"width": 0}, "opacity": 0.10,
                           "fillcolor": "#1f77b4" if i % 2 == 0 else "#ff7f0e", "layer": "below"})
    if len(ordered) <= MAX_STEP_NOTES:
        notes = [{"x": start - 0.5, "y": 1, "xref": "x", "yref": "paper", "xanchor": "left", "yanchor": "bottom",
                  "showarrow": False, "font": {"size": 10}, "text": label}
                 for start, label in zip(ordered["first_pos"], labels, strict=True)]
    shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": 0, "y1": 0,
                   "line": {"color": "#888", "width": 1}})
    first, last = bins["first_pos"].to_numpy(), bins["last_pos"].to_numpy()
    line = {"type": "scatter", "x": (first + last) / 2, "y": bins["advantage"].to_numpy(dtype=float),
            "mode": "lines+markers", "line": {"shape": "hv"}, "name": "advantage", "marker": {"size": 4}}
    # The reasoning step holding each bin's first token ("" outside every step, or for a step logged without its
    # positions)
    located = ordered.assign(label=labels).dropna(subset=["first_pos", "last_pos"]).sort_values("first_pos")
    starts, ends = located["first_pos"].to_numpy(dtype=float), located["last_pos"].to_numpy(dtype=float)
    at = np.searchsorted(starts, first, side="right") - 1  # the last step starting at or before the bin
    inside = (at >= 0) & (first <= ends[np.maximum(at, 0)]) if len(starts) else np.zeros(len(first), dtype=bool)
    located_labels = located["label"].tolist()
    step_of_bin = ["<br>" + located_labels[i] if ok else "" for i, ok in zip(at, inside, strict=True)]
    if (last > first).any():
        line.update(customdata=[[int(a), int(b), step] for a, b, step in zip(first, last, step_of_bin, strict=True)],
                    hovertemplate="tokens %{customdata[0]}–%{customdata[1]}<br>mean advantage %{y:.4g}"
                                  "%{customdata[2]}<extra></extra>")
    else:
        text = {} if tokens is None else dict(zip(tokens["position"], tokens["token_text"], strict=True))
        line.update(customdata=[[visible_text(str(text.get(p, ""))).replace("<br>", ""), step]
                                for p, step in zip(first, step_of_bin, strict=True)],
                    hovertemplate="#%{x} %{customdata[0]}<br>advantage %{y:.4g}%{customdata[1]}<extra></extra>")
    return go.Figure(data=[line], layout={
        "height": 300, "margin": {"l": 40, "r": 10, "t": 30, "b": 30}, "shapes": shapes, "annotations": notes,
        "xaxis": {"title": {"text": "token position"}}, "yaxis": {"title": {"text": "advantage"}},
    }, _validate=False)


def group_step_rewards(step_bins: pd.DataFrame) -> go.Figure:
    """All G completions' step rewards of one group: raw and normalized, one colour per completion (raw only for a
    run trained with outcome supervision, which logs no normalized step rewards).

    step_bins: `dashboard.data.prm_step_bins` with a `completion` label: a bar per bin of steps at its centre, its
    min..max on hover when a bin holds more than one step (a bar per step otherwise)."""
    columns = ["reward_raw", "reward_norm"] if step_bins["reward_norm"].notna().any() else ["reward_raw"]
    titles = {"reward_raw": "raw step reward", "reward_norm": "normalized over the group"}
    grid = Subplots(1, len(columns), [titles[c] for c in columns], vspace=0)
    several = bool((step_bins["last_step"] > step_bins["first_step"]).any())
    for i, (label, frame) in enumerate(step_bins.groupby("completion", sort=True)):
        colour = PALETTE[i % len(PALETTE)]
        first, last = frame["first_step"].to_numpy(), frame["last_step"].to_numpy()
        for panel, col in enumerate(columns):
            bars = {"type": "bar", "x": (first + last) / 2, "y": frame[col].to_numpy(dtype=float),
                    "name": str(label), "legendgroup": str(label), "showlegend": panel == 0,
                    "marker": {"color": colour}}
            if several:
                bars.update(customdata=np.stack([first, last, frame[f"{col}_low"].to_numpy(dtype=float),
                                                 frame[f"{col}_high"].to_numpy(dtype=float)], axis=-1),
                            hovertemplate="steps %{customdata[0]}–%{customdata[1]}: mean %{y:.4g}, min "
                            "%{customdata[2]:.4g}, max %{customdata[3]:.4g}<extra>" + str(label) + "</extra>")
            grid.add(panel, bars)
    steps = int(step_bins["last_step"].max()) + 1 if len(step_bins) else 1
    for panel in range(len(columns)):  # a tick per step up to 40 steps (a 16k-token completion has ~300)
        grid.axis(panel, "x").update(title={"text": "step"}, dtick=position_tick_step(steps))
    return grid.figure(height=280, barmode="group", margin={"l": 40, "r": 10, "t": 40, "b": 40})


def sandbox_advantages(advantages: np.ndarray, labels: list[str], lengths: list[int]) -> go.Figure:
    """Per-token advantages computed by the sandbox, one line per completion."""
    # Labels are typed by the user into the sandbox: escaped, since plotly draws <a href>, <b>... in legend names.
    lines = [{"type": "scatter", "x": np.arange(lengths[i]), "y": advantages[i, : lengths[i]],
              "name": html.escape(label), "mode": "lines+markers", "line": {"shape": "hv"}, "marker": {"size": 5}}
             for i, label in enumerate(labels)]
    return go.Figure(data=lines, layout={
        "height": 280, "margin": {"l": 40, "r": 10, "t": 20, "b": 30},
        "xaxis": {"title": {"text": "token position"}}, "yaxis": {"title": {"text": "advantage"}},
        "shapes": [zero_line()],
    }, _validate=False)
