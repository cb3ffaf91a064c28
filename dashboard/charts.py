"""DataFrame -> plotly Figure. No Streamlit calls here, so every chart can be built and timed outside the app.

Conventions: one colour per run (stable across charts via `run_colours`), diverging scales centred at the neutral
value of their quantity (0 for advantages and weights, 1 for ratios), clip events coloured the same everywhere
(low blue, high red, dual/cap purple, as in the token inspector).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from dashboard.tokens import CHANNELS, channel_range, visible_text

# Metric curves shown on the Runs and Replay pages: (column of the `steps` view, title).
CURVE_METRICS: list[tuple[str, str]] = [
    ("reward_mean", "reward (mean)"),
    ("heldout_accuracy", "held-out accuracy (greedy)"),
    ("accuracy", "train accuracy"),
    ("entropy", "entropy"),
    ("kl", "KL to reference"),
    ("clip_low_frac", "clip low fraction"),
    ("clip_high_frac", "clip high fraction"),
    ("response_len_mean", "response length (mean)"),
    ("truncated_frac", "truncated fraction"),
    ("groups_filtered", "filtered groups"),
]

CLIP_COLOURS = {0: "rgba(0,0,0,0)", 1: "#1f77b4", 2: "#d62728", 3: "#9467bd"}
CLIP_LABELS = {0: "none", 1: "low", 2: "high", 3: "dual / cap"}
PALETTE = qualitative.Plotly + qualitative.D3


def run_colours(runs: list[str]) -> dict[str, str]:
    """A stable colour for each run: sorted names, so a run keeps its colour when the selection changes."""
    return {run: PALETTE[i % len(PALETTE)] for i, run in enumerate(sorted(runs))}


def _grid(n: int, cols: int = 2) -> tuple[int, int]:
    return max(1, math.ceil(n / cols)), min(cols, max(1, n))


def metric_curves(
    steps: pd.DataFrame,
    metrics: list[tuple[str, str]] = CURVE_METRICS,
    upto_step: int | None = None,
    x_range: tuple[float, float] | None = None,
    colours: dict[str, str] | None = None,
) -> go.Figure:
    """Small multiples of per-step metrics, one line per run.

    `upto_step` cuts the curves at a step (the Replay page grows them); `x_range` keeps the axis fixed meanwhile.
    Metrics that are entirely missing are skipped.
    """
    metrics = [(col, title) for col, title in metrics if col in steps.columns and steps[col].notna().any()]
    rows, cols = _grid(len(metrics))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[t for _, t in metrics] or None,
                        vertical_spacing=0.12 / max(1, rows / 3), horizontal_spacing=0.08)
    if upto_step is not None:
        steps = steps[steps["step"] <= upto_step]
    colours = colours or run_colours(list(steps["run"].unique()) if len(steps) else [])
    for i, (col, _title) in enumerate(metrics):
        row, column = i // cols + 1, i % cols + 1
        for run, frame in steps.groupby("run", sort=True):
            frame = frame[["step", col]].dropna()
            fig.add_trace(
                go.Scatter(
                    x=frame["step"], y=frame[col], name=str(run), legendgroup=str(run), showlegend=i == 0,
                    mode="lines+markers" if len(frame) < 40 else "lines",
                    line={"color": colours.get(run)}, marker={"size": 4},
                    hovertemplate=f"{run}<br>step %{{x}}<br>{col} %{{y:.4g}}<extra></extra>",
                ),
                row=row, col=column,
            )
        if x_range is not None:
            fig.update_xaxes(range=list(x_range), row=row, col=column)
    fig.update_layout(height=max(260, 230 * rows), margin={"l": 40, "r": 10, "t": 40, "b": 30},
                      legend={"orientation": "h", "y": 1.02 + 0.08 / rows, "yanchor": "bottom"})
    return fig


def step_distributions(rollouts: pd.DataFrame, title_suffix: str = "") -> go.Figure:
    """Histograms of total reward and response length of one step's train rollouts."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=[f"reward{title_suffix}", f"length (tokens){title_suffix}"])
    if len(rollouts):
        fig.add_trace(go.Histogram(x=rollouts["reward"], name="reward", marker_color="#2ca02c", nbinsx=30), 1, 1)
        fig.add_trace(go.Histogram(x=rollouts["length"], name="length", marker_color="#ff7f0e", nbinsx=30), 1, 2)
    fig.update_layout(height=260, showlegend=False, margin={"l": 40, "r": 10, "t": 40, "b": 30}, bargap=0.05)
    return fig


def token_channel_heatmap(tokens: pd.DataFrame, channel_names: list[str]) -> go.Figure:
    """Token x channel heatmap: one row per channel, each on its own scale (same scales as the token view)."""
    channel_names = [c for c in channel_names if CHANNELS[c].column in tokens.columns
                     and pd.to_numeric(tokens[CHANNELS[c].column], errors="coerce").notna().any()]
    n = max(1, len(channel_names))
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=0.02,
                        row_titles=[CHANNELS[c].label for c in channel_names] or None)
    labels = [
        f"{p}:{visible_text(str(t)).replace('<br>', '')}"
        for p, t in zip(tokens["position"], tokens["token_text"], strict=True)
    ]
    for i, name in enumerate(channel_names):
        channel = CHANNELS[name]
        values = pd.to_numeric(tokens[channel.column], errors="coerce").to_numpy(dtype=float)
        low, high = channel_range(pd.Series(values), channel)
        fig.add_trace(
            go.Heatmap(
                z=[values], x=list(range(len(values))), y=[channel.label], zmin=low, zmax=high,
                colorscale=channel.colorscale, showscale=False, customdata=[labels],
                hovertemplate="token %{customdata}<br>" + channel.label + " %{z:.4g}<extra></extra>",
            ),
            row=i + 1, col=1,
        )
        fig.update_yaxes(showticklabels=False, row=i + 1, col=1)
    fig.update_annotations(textangle=0, xanchor="left", x=1.0, font={"size": 11})
    fig.update_layout(height=60 + 34 * n, margin={"l": 10, "r": 140, "t": 10, "b": 30})
    fig.update_xaxes(title_text="token position", row=n, col=1)
    return fig


def prm_advantage_line(tokens: pd.DataFrame, prm_steps: pd.DataFrame) -> go.Figure:
    """Per-token advantage of one completion as a line, its reasoning steps shaded, normalized step rewards noted."""
    fig = go.Figure()
    for i, step in enumerate(prm_steps.sort_values("step_index").itertuples(index=False)):
        fig.add_vrect(x0=step.first_pos - 0.5, x1=step.last_pos + 0.5, line_width=0,
                      fillcolor="#1f77b4" if i % 2 == 0 else "#ff7f0e", opacity=0.10,
                      annotation_text=f"step {step.step_index}: r={step.reward_raw:.3g} → {step.reward_norm:+.3g}",
                      annotation_position="top left", annotation_font_size=10)
    hover = [visible_text(str(t)).replace("<br>", "") for t in tokens["token_text"]]
    fig.add_trace(go.Scatter(x=tokens["position"], y=tokens["advantage"], mode="lines+markers", line_shape="hv",
                             name="advantage", customdata=hover, marker={"size": 4},
                             hovertemplate="#%{x} %{customdata}<br>advantage %{y:.4g}<extra></extra>"))
    fig.add_hline(y=0, line_color="#888", line_width=1)
    fig.update_layout(height=300, margin={"l": 40, "r": 10, "t": 30, "b": 30},
                      xaxis_title="token position", yaxis_title="advantage")
    return fig


def group_step_rewards(prm_steps: pd.DataFrame) -> go.Figure:
    """All G completions' step rewards of one group: raw and normalized, one colour per completion."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["raw step reward", "normalized over the group"])
    for i, (label, frame) in enumerate(prm_steps.groupby("completion", sort=True)):
        colour = PALETTE[i % len(PALETTE)]
        for col, column in (("reward_raw", 1), ("reward_norm", 2)):
            fig.add_trace(go.Bar(x=frame["step_index"], y=frame[col], name=str(label), legendgroup=str(label),
                                 showlegend=column == 1, marker_color=colour), 1, column)
    fig.update_layout(height=280, barmode="group", margin={"l": 40, "r": 10, "t": 40, "b": 30})
    fig.update_xaxes(title_text="step", dtick=1)
    return fig


def sandbox_advantages(advantages: np.ndarray, labels: list[str], lengths: list[int]) -> go.Figure:
    """Per-token advantages computed by the sandbox, one line per completion."""
    fig = go.Figure()
    for i, label in enumerate(labels):
        n = lengths[i]
        fig.add_trace(go.Scatter(x=list(range(n)), y=advantages[i, :n], mode="lines+markers", line_shape="hv",
                                 name=label, marker={"size": 5}))
    fig.add_hline(y=0, line_color="#888", line_width=1)
    fig.update_layout(height=280, margin={"l": 40, "r": 10, "t": 20, "b": 30},
                      xaxis_title="token position", yaxis_title="advantage")
    return fig


def weight_heatmaps(weights: dict[str, np.ndarray], row_labels: list[str]) -> go.Figure:
    """Side-by-side heatmaps of gradient weight (B, T) per algorithm on one shared scale centred at 0."""
    names = list(weights)
    rows, cols = _grid(len(names), cols=3)
    finite = np.concatenate([w[np.isfinite(w)].ravel() for w in weights.values()] or [np.zeros(1)])
    spread = float(np.abs(finite).max()) if finite.size else 1.0
    spread = spread or 1.0
    row_height = 40 + 16 * len(row_labels)  # pixels per subplot row, so labels stay readable for any B
    height = rows * (row_height + 70) + 40
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=names, vertical_spacing=70 / height,
                        horizontal_spacing=0.03, shared_yaxes=True)
    for i, name in enumerate(names):
        fig.add_trace(
            go.Heatmap(z=weights[name], y=row_labels, colorscale="RdBu", zmid=0, zmin=-spread, zmax=spread,
                       showscale=i == 0, colorbar={"title": {"text": "grad weight", "side": "right"}, "len": 0.8},
                       hovertemplate=name + "<br>%{y} token %{x}<br>weight %{z:.3g}<extra></extra>"),
            row=i // cols + 1, col=i % cols + 1,
        )
    fig.update_yaxes(autorange="reversed", tickfont={"size": 10}, automargin=True)
    fig.update_xaxes(tickfont={"size": 10})
    fig.update_layout(height=height, margin={"l": 10, "r": 10, "t": 30, "b": 20})
    return fig


def total_weight_vs_length(totals: pd.DataFrame) -> go.Figure:
    """Per-completion summed gradient weight against its length, one series per algorithm (length bias)."""
    fig = go.Figure()
    for i, (algo, frame) in enumerate(totals.groupby("algorithm", sort=False)):
        frame = frame.sort_values("length")
        fig.add_trace(go.Scatter(x=frame["length"], y=frame["total_weight"], mode="markers+lines", name=algo,
                                 marker={"size": 7, "color": PALETTE[i % len(PALETTE)]},
                                 customdata=frame[["completion", "advantage"]],
                                 hovertemplate=algo + "<br>%{customdata[0]} (A=%{customdata[1]:.3g})<br>length %{x}"
                                 "<br>total weight %{y:.4g}<extra></extra>"))
    fig.add_hline(y=0, line_color="#888", line_width=1)
    fig.update_layout(height=330, margin={"l": 40, "r": 10, "t": 20, "b": 30},
                      xaxis_title="completion length (tokens)", yaxis_title="sum of gradient weights")
    return fig


def clip_fractions(fractions: pd.DataFrame) -> go.Figure:
    """Fraction of tokens each algorithm clips low / high / with its dual cap."""
    fig = go.Figure()
    for code, column in ((1, "low"), (2, "high"), (3, "dual / cap")):
        fig.add_trace(go.Bar(x=fractions["algorithm"], y=fractions[column], name=f"clip {column}",
                             marker_color=CLIP_COLOURS[code]))
    fig.update_layout(height=280, barmode="group", margin={"l": 40, "r": 10, "t": 20, "b": 30},
                      yaxis_title="fraction of tokens", yaxis_tickformat=".0%")
    return fig


def clip_regions(regions: dict[str, dict], scatter: dict[str, pd.DataFrame]) -> go.Figure:
    """Ratio x advantage plane per algorithm: where it clips (coloured) and where the batch's tokens sit (dots).

    `regions[algo]` = {"ratio": (R,), "advantage": (A,), "clip": (A, R) int codes} computed by the objective itself
    on a grid; `scatter[algo]` has the logged tokens' `ratio` and `advantage` as that algorithm sees them.
    """
    names = list(regions)
    rows, cols = _grid(len(names), cols=3)
    height = 320 * rows
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=names, vertical_spacing=90 / height,
                        horizontal_spacing=0.05)
    # A discrete colour scale over the codes 0..3.
    scale = []
    for code in range(4):
        colour = CLIP_COLOURS[code] if code else "#f5f5f5"
        scale += [[code / 4, colour], [(code + 1) / 4, colour]]
    for i, name in enumerate(names):
        region, row, col = regions[name], i // cols + 1, i % cols + 1
        labels = np.vectorize(CLIP_LABELS.get)(region["clip"])
        fig.add_trace(go.Heatmap(x=region["ratio"], y=region["advantage"], z=region["clip"], zmin=0, zmax=4,
                                 colorscale=scale, showscale=False, opacity=0.55, customdata=labels,
                                 hovertemplate="ratio %{x:.3f}<br>A %{y:.3f}<br>clip %{customdata}<extra></extra>"),
                      row=row, col=col)
        points = scatter.get(name)
        if points is not None and len(points):
            fig.add_trace(go.Scattergl(x=points["ratio"], y=points["advantage"], mode="markers",
                                       marker={"size": 4, "color": "#222", "opacity": 0.6}, showlegend=False,
                                       hovertemplate="token<br>ratio %{x:.4f}<br>A %{y:.3f}<extra></extra>"),
                          row=row, col=col)
        fig.update_xaxes(title_text="ratio", row=row, col=col)
        fig.update_yaxes(title_text="advantage" if col == 1 else None, row=row, col=col)
    fig.update_layout(height=height, margin={"l": 40, "r": 10, "t": 40, "b": 30}, showlegend=False)
    return fig
