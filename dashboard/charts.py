"""DataFrame -> plotly Figure. No Streamlit calls here, so every chart can be built and timed outside the app.

Conventions: one colour per run (stable across charts via `run_colours`), diverging scales centred at the neutral
value of their quantity (0 for advantages and weights, 1 for ratios), clip events coloured the same everywhere
(low blue, high red, dual/cap purple, as in the token inspector).
"""

from __future__ import annotations

import functools
import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import get_colorscale, qualitative

from dashboard.tokens import CHANNELS, channel_range, visible_text
from engine.clip_codes import CLIP_CAP, CLIP_COV, CLIP_EVENTS, CLIP_HIGH, CLIP_LOW, CLIP_NAMES, CLIP_NONE

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
    ("value_loss", "value loss (critic)"),  # the two critic curves appear only for runs with a critic (PPO)
    ("explained_variance", "explained variance (critic)"),
]

# Shares of answers: drawn on 0..1 whatever the points (plotly pads a single point to ±1 around it: an accuracy axis
# from -1 to 1), with a margin so points at 0 and 1 are not cut by the frame.
FRACTION_METRICS = {"heldout_accuracy", "accuracy"}
FRACTION_RANGE = [-0.04, 1.04]

CLIP_COLOURS = {CLIP_NONE: "rgba(0,0,0,0)", CLIP_LOW: "#1f77b4", CLIP_HIGH: "#d62728", CLIP_CAP: "#9467bd",
                CLIP_COV: "#ff7f0e"}
UNREACHABLE_COLOUR = "#bdbdbd"  # a region picture's ratios no token can reach from its p_old (DPPO's)
PALETTE = qualitative.Plotly + qualitative.D3


def run_colours(runs: list[str]) -> dict[str, str]:
    """A stable colour for each run: sorted names, so a run keeps its colour when the selection changes."""
    return {run: PALETTE[i % len(PALETTE)] for i, run in enumerate(sorted(runs))}


def _grid(n: int, cols: int = 2) -> tuple[int, int]:
    return max(1, math.ceil(n / cols)), min(cols, max(1, n))


def _scale(name: str) -> list:
    """A named colour scale as explicit stops. Figures here skip plotly's validation, which is also what turns a
    name into stops; plotly.js has its own 'RdBu' running the other way, so names must never reach the browser."""
    return [list(stop) for stop in _stops(name)]  # a new list: a figure may change its own


@functools.lru_cache(maxsize=64)
def _stops(name: str) -> tuple[tuple[float, str], ...]:
    """plotly's lookup takes 4 ms a scale, and a heatmap of the Token inspector's 13 channels asks for 13."""
    return tuple(tuple(stop) for stop in get_colorscale(name))


def _unit(low: float, high: float) -> list[float]:
    """An axis domain inside [0, 1] (float error can put an edge at -5e-17, which plotly refuses)."""
    return [min(1.0, max(0.0, round(low, 6))), min(1.0, max(0.0, round(high, 6)))]


class Subplots:
    """A grid of axes laid out by hand.

    `plotly.subplots.make_subplots` plus validated `add_trace` calls cost ~0.5 s for a 10-panel figure, half the
    page budget on a big run; building plain dicts and skipping validation makes the same figure in a few ms.
    Traces are plotly trace dicts; `ref(i)` gives the (xaxis, yaxis) names of panel i (row-major).
    """

    def __init__(self, rows: int, cols: int, titles: list[str] | None = None, hspace: float = 0.08,
                 vspace: float = 0.1, shared_x: bool = False):
        self.rows, self.cols, self.traces = rows, cols, []
        self.layout: dict = {"annotations": []}
        width = (1 - hspace * (cols - 1)) / cols
        height = (1 - vspace * (rows - 1)) / rows
        for i in range(rows * cols):
            row, col = divmod(i, cols)
            x0 = col * (width + hspace)
            y1 = 1 - row * (height + vspace)
            xname, yname = self.ref(i)
            self.layout["xaxis" + xname[1:]] = {"domain": _unit(x0, x0 + width), "anchor": yname}
            self.layout["yaxis" + yname[1:]] = {"domain": _unit(y1 - height, y1), "anchor": xname}
            if shared_x and i > 0:
                self.layout["xaxis" + xname[1:]]["matches"] = "x"
            if titles and i < len(titles):
                self.layout["annotations"].append({
                    "text": titles[i], "x": x0 + width / 2, "y": y1, "xref": "paper", "yref": "paper",
                    "xanchor": "center", "yanchor": "bottom", "showarrow": False, "font": {"size": 13},
                })

    @staticmethod
    def ref(i: int) -> tuple[str, str]:
        return ("x", "y") if i == 0 else (f"x{i + 1}", f"y{i + 1}")

    def axis(self, i: int, which: str) -> dict:
        """The layout dict of panel i's x or y axis, to set titles, ranges..."""
        name = self.ref(i)[0 if which == "x" else 1]
        return self.layout[("xaxis" if which == "x" else "yaxis") + name[1:]]

    def add(self, i: int, trace: dict) -> None:
        x, y = self.ref(i)
        self.traces.append({**trace, "xaxis": x, "yaxis": y})

    def figure(self, **layout) -> go.Figure:
        return go.Figure(data=self.traces, layout={**self.layout, **layout}, _validate=False)


def metric_curves(
    steps: pd.DataFrame,
    metrics: list[tuple[str, str]] = CURVE_METRICS,
    upto_step: int | None = None,
    x_range: tuple[float, float] | None = None,
    colours: dict[str, str] | None = None,
    smoothing: float = 0.0,
) -> go.Figure:
    """Small multiples of per-step metrics, one line per run.

    `upto_step` cuts the curves at a step (the Replay page grows them); `x_range` keeps the axis fixed meanwhile.
    Metrics that are entirely missing are skipped. `smoothing` > 0 draws each curve smoothed by `ema_smoothed`
    with that weight over its raw points, drawn faint (0: the raw curves only).
    """
    metrics = [(col, title) for col, title in metrics if col in steps.columns and steps[col].notna().any()]
    rows, cols = _grid(len(metrics))
    grid = Subplots(rows, cols, [t for _, t in metrics], vspace=0.35 / max(rows, 1) / 1.5)
    if upto_step is not None:
        steps = steps[steps["step"] <= upto_step]
    colours = colours or run_colours(list(steps["run"].unique()) if len(steps) else [])
    # Plain numpy per run: pandas indexing in this double loop cost more than drawing the figure.
    runs_column = steps["run"].astype(str).to_numpy()
    step_column = steps["step"].to_numpy()
    # by the span of steps, not their count: 9 evaluated steps spread over 0..75 want plotly's own ticks
    span = float(step_column.max() - step_column.min()) if len(step_column) else 0.0
    few_steps = span <= 10 if x_range is None else x_range[1] - x_range[0] <= 11
    by_run = [(run, runs_column == run) for run in sorted(set(runs_column))]  # (run, row mask)
    for i, (col, _title) in enumerate(metrics):
        values = pd.to_numeric(steps[col], errors="coerce").to_numpy(dtype=float)
        for run, in_run in by_run:
            keep = in_run & np.isfinite(values)
            line = {"type": "scatter", "x": step_column[keep], "y": values[keep], "name": run, "legendgroup": run,
                    "showlegend": i == 0, "mode": "lines+markers" if keep.sum() < 40 else "lines",
                    "line": {"color": colours.get(run)}, "marker": {"size": 4},
                    "hovertemplate": f"{run}<br>step %{{x}}<br>{col} %{{y:.4g}}<extra></extra>"}
            if smoothing > 0:
                faint = {k: v for k, v in line.items() if k != "hovertemplate"}
                grid.add(i, {**faint, "showlegend": False, "opacity": 0.25, "hoverinfo": "skip", "mode": "lines"})
                line.update(y=ema_smoothed(values[keep], smoothing), mode="lines",
                            hovertemplate=f"{run}<br>step %{{x}}<br>{col} (smoothed) %{{y:.4g}}<extra></extra>")
            grid.add(i, line)
        # Steps are integers: with few of them, one tick per step (plotly would otherwise tick at 0.5).
        grid.axis(i, "x").update({"dtick": 1} if few_steps else {}, **({"range": list(x_range)} if x_range else {}))
        if col in FRACTION_METRICS:
            grid.axis(i, "y").update(range=FRACTION_RANGE)
    return grid.figure(height=max(260, 230 * rows), margin={"l": 40, "r": 10, "t": 50, "b": 30},
                       legend={"orientation": "h", "y": 1.0 + 0.1 / rows, "yanchor": "bottom"})


def ema_smoothed(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's (and W&B's) curve smoothing: an exponential moving average with weight `weight` in [0, 1),
    debiased so the first points are not pulled towards 0: s_n = m_n / (1 - weight^n), m_n = weight m_(n-1) +
    (1 - weight) x_n, m_0 = 0 (tensorflow/tensorboard, tensorboard/components/vz_line_chart2/line-chart.ts,
    resmoothDataset, commit 34877f15153e1a2087316b9952c931807a122aa7). `values`: (N,) finite, in step order."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight {weight!r}; accepted: 0 <= weight < 1")
    smoothed, last = np.empty(len(values)), 0.0
    for n, value in enumerate(values, start=1):
        last = weight * last + (1 - weight) * float(value)
        smoothed[n - 1] = last / (1 - weight**n)
    return smoothed


def step_distributions(rollouts: pd.DataFrame, title_suffix: str = "") -> go.Figure:
    """Histograms of total reward and response length of one step's train rollouts."""
    grid = Subplots(1, 2, [f"reward{title_suffix}", f"length (tokens){title_suffix}"], vspace=0)
    if len(rollouts):
        grid.add(0, {"type": "histogram", "x": rollouts["reward"].to_numpy(dtype=float), "name": "reward",
                     "marker": {"color": "#2ca02c"}, "nbinsx": 30})
        grid.add(1, {"type": "histogram", "x": rollouts["length"].to_numpy(dtype=float), "name": "length",
                     "marker": {"color": "#ff7f0e"}, "nbinsx": 30})
    return grid.figure(height=260, showlegend=False, margin={"l": 40, "r": 10, "t": 40, "b": 30}, bargap=0.05)


def token_channel_heatmap(tokens: pd.DataFrame, channel_names: list[str]) -> go.Figure:
    """Token x channel heatmap: one row per channel, each on its own scale (same scales as the token view), one
    column per token at its position."""
    labels = [f"{p}:{_token_label(t)}" for p, t in zip(tokens["position"], tokens["token_text"], strict=True)]
    figure = _channel_rows(tokens, channel_names, tokens["position"].to_numpy(dtype=float), labels,
                           "token %{{customdata}}")
    # Ticks on whole positions only, each centred on its cell (a cell spans position ± 0.5): left to plotly, a short
    # rollout gets ticks at 0, 0.5, 1, 1.5 with cells between them.
    figure.layout.xaxis.update(tickmode="linear", tick0=0, dtick=position_tick_step(len(tokens)))
    return figure


def token_channel_bins(bins: pd.DataFrame, channel_names: list[str]) -> go.Figure:
    """Token x channel heatmap of a long completion at screen resolution: one column per bin of
    `dashboard.data.rollout_token_bins` (the mean of its tokens)."""
    centres = ((bins["first_pos"] + bins["last_pos"]) / 2).to_numpy(dtype=float)
    # no label per cell: 14 rows of them were most of the figure's bytes
    return _channel_rows(bins, channel_names, centres, None, "mean of the {width:g} tokens around %{{x:.0f}}",
                         width=int(bins["tokens"].max()))


def column_runs(centres: np.ndarray, width: float = 1.0) -> list[tuple[slice, dict]]:
    """A heatmap's columns centred at `centres` (increasing; `width`: a column's width when there is only one) as
    plotly's x of one trace or two: [(the columns, their x attributes)]. Evenly spaced columns go as x0 + dx, which
    plotly.js draws as one pixel per cell in an image the browser scales, where an x array that is not evenly spaced
    is drawn cell by cell into an image of the plot's size (a 13 x 1,000 heatmap: 0.07 -> 0.04 s). A last column
    of another width (a completion's last bin, shorter) goes apart with its own, so every cell still spans exactly
    its tokens; columns spaced otherwise keep their x array."""
    x = np.asarray(centres, dtype=float)
    steps = np.diff(x)
    if len(x) < 2 or (steps == steps[0]).all():
        return [(slice(None), {"x0": float(x[0]) if len(x) else 0.0, "dx": float(steps[0]) if len(x) > 1 else width})]
    last_width = 2 * (x[-1] - x[-2] - steps[0] / 2)  # from the end of the column before to the last token's end
    if len(x) > 2 and (steps[:-1] == steps[0]).all() and 0 < last_width < steps[0]:
        return [(slice(0, -1), {"x0": float(x[0]), "dx": float(steps[0])}),
                (slice(-1, None), {"x0": float(x[-1]), "dx": float(last_width)})]
    return [(slice(None), {"x": x.astype(np.float32)})]


def text_width_px(texts, font_size: float) -> int:
    """About how many pixels the widest of `texts` (plain, or as html.escape made them) takes in a sans-serif font
    of `font_size`, a little over: the margin a figure keeps for them, so that plotly need not measure its labels
    and draw the figure a second time to fit them (its `automargin`: twice the time of a heatmap's first draw)."""
    return math.ceil(0.5 * font_size * max((len(html.unescape(str(t))) for t in texts), default=0)) + 8


FIXED_MARGINS = {"automargin": False}
"""An axis whose figure sets margins wide enough for its labels (`text_width_px`): the dashboard's template turns
plotly's automargin on for every other axis."""
COLOURBAR_MARGIN = 90  # pixels right of the panels for a colour bar with its title beside it


def _channel_rows(frame: pd.DataFrame, channel_names: list[str], x: np.ndarray, labels: list[str] | None,
                  hover: str, width: float = 1.0) -> go.Figure:
    """One heatmap row per channel that `frame` has values of, at `x` (columns of `width` tokens), all on one pair
    of axes (a panel per row took twice as long to draw); on hover `hover` (`{width}`: the column's tokens; it may
    show the cell's entry of `labels` as %{customdata}) and the value."""
    channel_names = [c for c in channel_names if CHANNELS[c].column in frame.columns
                     and pd.to_numeric(frame[CHANNELS[c].column], errors="coerce").notna().any()]
    row_labels = [CHANNELS[name].label for name in channel_names]
    runs = column_runs(x, width)
    traces = []
    for row, name in enumerate(channel_names):
        channel = CHANNELS[name]
        values = pd.to_numeric(frame[channel.column], errors="coerce").to_numpy(dtype=float)
        low, high = channel_range(pd.Series(values), channel)
        values = values.astype(np.float32)  # plotly's binary arrays at half the bytes; the hover shows 4 digits
        for columns, at in runs:
            traces.append({
                "type": "heatmap", "z": values[None, columns], **at, "y": [row],
                "zmin": low, "zmax": high, "colorscale": _scale(channel.colorscale), "showscale": False,
                **({"customdata": [labels[columns]]} if labels is not None else {}),
                "hovertemplate": hover.format(width=at.get("dx", width)) + f"<br>{channel.label} %{{z:.4g}}"
                                                                            "<extra></extra>",
            })
    return go.Figure(data=traces, layout={
        "height": 70 + 30 * max(1, len(row_labels)),
        "margin": {"l": 10, "r": text_width_px(row_labels, 11) + 6, "t": 10, "b": 40},
        "yaxis": {"tickmode": "array", "tickvals": list(range(len(row_labels))), "ticktext": row_labels,
                  "range": [len(row_labels) - 0.5, -0.5], "side": "right", "tickfont": {"size": 11},
                  "showgrid": False, "zeroline": False, **FIXED_MARGINS},
        "xaxis": {"title": {"text": "token position"}, **FIXED_MARGINS},
    }, _validate=False)


def _window_outline(window: tuple[int, int]) -> dict:
    """A frame around the positions `window` = (first, last) over a whole figure's height."""
    return {"type": "rect", "xref": "x", "yref": "paper", "x0": window[0] - 0.5, "x1": window[1] + 0.5, "y0": 0,
            "y1": 1, "line": {"color": "#111", "width": 2}, "fillcolor": "rgba(0,0,0,0)"}


# The strip's marks under the channel's colours: each kind of event on its own line, coloured as everywhere.
STRIP_MARKS = [(f"clip_{CLIP_NAMES[code]}", f"clip {CLIP_NAMES[code]}", CLIP_COLOURS[code]) for code in CLIP_EVENTS]
STRIP_MARKS.append(("rejected_tokens", "rejected", "#111"))


def token_overview_strip(bins: pd.DataFrame, channel_name: str, window: tuple[int, int], window_size: int
                         ) -> go.Figure:
    """A whole completion in one strip: a cell per bin of `dashboard.data.rollout_token_bins` coloured by the bin's
    mean of the channel, under it a mark on the line of each event (clip low/high/dual, rejected) the bin holds,
    the window shown in the text outlined. Heatmaps (drawn as images): the same strip as 1,000 bars and markers
    took six times as long to draw in a browser. Over the cells, an invisible point at the middle of each window
    of `window_size` tokens takes the clicks (Streamlit reports a click on a point, not on a heatmap cell)."""
    channel = CHANNELS[channel_name]
    values = pd.to_numeric(bins.get(channel.column, pd.Series(np.nan, index=bins.index)), errors="coerce")
    low, high = channel_range(values, channel)
    first, last = bins["first_pos"].to_numpy(dtype=float), bins["last_pos"].to_numpy(dtype=float)
    centres = (first + last) / 2
    runs = column_runs(centres, float(bins["tokens"].max()))
    grid = Subplots(2, 1, vspace=0.04, shared_x=True)
    values = values.to_numpy(dtype=np.float32)
    for columns, at in runs:
        grid.add(0, {"type": "heatmap", **at, "y": [html.escape(channel.label)], "z": values[None, columns],
                     "zmin": low, "zmax": high, "showscale": False, "colorscale": _scale(channel.colorscale),
                     "hoverinfo": "skip"})
    starts = np.arange(first.min() - first.min() % window_size, last.max() + 1, window_size)
    ends = np.minimum(starts + window_size - 1, last.max())
    grid.add(0, {"type": "scatter", "mode": "markers", "x": (starts + ends) / 2,
                 "y": [html.escape(channel.label)] * len(starts),
                 "customdata": np.stack([starts, ends], axis=-1), "marker": {"size": 24, "opacity": 0},
                 "hovertemplate": "tokens %{customdata[0]}–%{customdata[1]}<extra>click: show them</extra>"})
    # The marks as one heatmap (drawn as an image): thousands of SVG markers took seconds to draw in a browser.
    # Row i holds i + 1 where the bin has that event, NaN (not drawn) elsewhere; each row gets its own colour.
    counts = np.stack([bins[name].to_numpy(dtype=float) if name in bins.columns else np.zeros(len(bins))
                       for name, _, _ in STRIP_MARKS])  # (events, bins)
    marks = np.where(counts > 0, np.arange(1, len(STRIP_MARKS) + 1, dtype=float)[:, None], np.nan).astype(np.float32)
    counts = np.nan_to_num(counts).astype(np.uint32)
    colours = [colour for _, _, colour in STRIP_MARKS]
    for columns, at in runs:
        grid.add(1, {"type": "heatmap", **at, "y": [label for _, label, _ in STRIP_MARKS], "z": marks[:, columns],
                     "customdata": counts[:, columns], "zmin": 0.5, "zmax": len(STRIP_MARKS) + 0.5,
                     "showscale": False, "xgap": 0, "ygap": 2,
                     "colorscale": [[f / len(colours), colour] for i, colour in enumerate(colours) for f in (i, i + 1)],
                     "hovertemplate": "around token %{x:.0f}: %{customdata} %{y}<extra></extra>"})
    grid.axis(0, "y").update(showticklabels=False, fixedrange=True, **FIXED_MARGINS)
    grid.axis(1, "y").update(autorange="reversed", tickfont={"size": 10}, fixedrange=True, side="right",
                             **FIXED_MARGINS)
    grid.axis(0, "x").update(showticklabels=False, range=[first.min() - 0.5, last.max() + 0.5], **FIXED_MARGINS)
    grid.axis(1, "x").update(title={"text": "token position"}, **FIXED_MARGINS)
    grid.layout["yaxis"]["domain"], grid.layout["yaxis2"]["domain"] = [0.62, 1.0], [0.0, 0.58]
    return grid.figure(height=170, margin={"l": 10, "r": text_width_px([label for _, label, _ in STRIP_MARKS], 10) + 10,
                                           "t": 5, "b": 35}, showlegend=False,
                       shapes=[_window_outline(window)], clickmode="event+select", dragmode=False)


def position_tick_step(positions: int, max_ticks: int = 40) -> int:
    """The spacing of token-position ticks: every position when at most `max_ticks` fit, else the smallest of
    2, 5, 10, 20, 50, ... that keeps the ticks within `max_ticks` (always whole positions)."""
    step, factors = 1, (2, 2.5, 2)  # 1 -> 2 -> 5 -> 10 -> 20 -> 50 -> ...
    while positions > step * max_ticks:
        step = round(step * factors[0])
        factors = factors[1:] + factors[:1]
    return step


def zero_line() -> dict:
    return {"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": 0, "y1": 0,
            "line": {"color": "#888", "width": 1}}


def _bin_hover(bin_width: int) -> str:
    """The hover's words for a heatmap column: a token, or a bin of `bin_width` tokens around %{x}."""
    return "token %{x}" if bin_width == 1 else f"tokens %{{x}} ± {(bin_width - 1) / 2:g} (mean of the bin)"


def _spread(arrays, centre: float) -> float:
    """How far the finite values of `arrays` reach from `centre` (1 when none do): a scale centred at `centre`."""
    finite = [a[np.isfinite(a)].ravel() for a in arrays]
    finite = np.concatenate(finite) if finite else np.zeros(0)
    return (float(np.abs(finite - centre).max()) if finite.size else 0.0) or 1.0


def weight_heatmaps(weights: dict[str, np.ndarray], row_labels: list[str], centre: float = 0.0,
                    label: str = "grad weight", positions: np.ndarray | None = None, bin_width: int = 1
                    ) -> go.Figure:
    """Side-by-side heatmaps of a weight (B, T) per algorithm or correction on one shared scale centred at
    `centre` (0 for gradient weights, 1 for IS weights and masks). Long completions come binned
    (`dashboard.recompute.binned_columns`): `positions`, the centre of each column's bin of `bin_width` tokens."""
    names = list(weights)
    rows, cols = _grid(len(names), cols=3)
    spread = _spread(weights.values(), centre)
    row_height = 40 + 16 * len(row_labels)  # pixels per panel, so labels stay readable for any B
    height = rows * (row_height + 70) + 40
    grid = Subplots(rows, cols, names, hspace=0.02, vspace=70 / height)
    width = next(iter(weights.values())).shape[1] if names else 0
    runs = column_runs(np.arange(width, dtype=float) if positions is None else positions, bin_width)
    for i, name in enumerate(names):
        # float32: half the bytes of a whole step's heatmaps (the hover shows 3 digits); NaN (padding) travels as
        # NaN in plotly's binary arrays and leaves the cell blank.
        z = np.asarray(weights[name], dtype=np.float32)
        for k, (columns, at) in enumerate(runs):
            grid.add(i, {
                "type": "heatmap", "z": z[:, columns], "y": row_labels, **at,
                "colorscale": _scale("RdBu"), "zmid": centre, "zmin": centre - spread, "zmax": centre + spread,
                "showscale": i == 0 and k == 0, "colorbar": {"title": {"text": label, "side": "right"}, "len": 0.8},
                "hovertemplate": _name(name) + f"<br>%{{y}} {_bin_hover(at.get('dx', bin_width))}"
                                               "<br>weight %{z:.3g}<extra></extra>",
            })
        grid.axis(i, "y").update(autorange="reversed", tickfont={"size": 10}, showticklabels=i % cols == 0,
                                 **FIXED_MARGINS)
        grid.axis(i, "x").update(tickfont={"size": 10}, **FIXED_MARGINS)
    return grid.figure(height=height, margin={"l": text_width_px(row_labels, 10) + 10, "r": COLOURBAR_MARGIN,
                                              "t": 30, "b": 20})


def stacked_weight_heatmap(weights: dict[str, np.ndarray], row_labels: list[str], centre: float = 1.0,
                           label: str = "loss weight", positions: np.ndarray | None = None, bin_width: int = 1
                           ) -> go.Figure:
    """The weights (B, T) of many corrections as one heatmap of their bands stacked top to bottom (band k: the B
    rows of the k-th correction, labelled "<correction> · <row label>"), on one scale centred at `centre`.
    One trace (two with a shorter last bin: `column_runs`) instead of a panel each: a browser draws twenty panels in
    0.4-0.8 s, this in 0.04 s (benchmarks/bench_heatmaps.py). Sent as float32 (a weight needs no more digits than the
    hover's three); NaN (padding) leaves the cell blank."""
    names, rows = list(weights), len(row_labels)
    z = np.concatenate([np.asarray(weights[name], dtype=np.float32) for name in names])  # (C * B, T)
    spread = _spread([z], centre)
    y = [f"{name} · {row}" for name in names for row in row_labels]  # (C * B,) one category per row
    row_px = max(5, min(16, 120 // max(rows, 1)))
    runs = column_runs(np.arange(z.shape[1], dtype=float) if positions is None else positions, bin_width)
    return go.Figure(
        data=[{
            "type": "heatmap", "z": z[:, columns], "y": y, **at,
            "colorscale": _scale("RdBu"), "zmid": centre, "zmin": centre - spread, "zmax": centre + spread,
            "showscale": k == 0, "colorbar": {"title": {"text": label, "side": "right"}, "len": 0.5},
            "hovertemplate": f"%{{y}}<br>{_bin_hover(at.get('dx', bin_width))}<br>weight %{{z:.3g}}<extra></extra>"}
            for k, (columns, at) in enumerate(runs)],
        layout={
            "height": len(y) * row_px + 60,
            "margin": {"l": text_width_px(names, 11) + 10, "r": COLOURBAR_MARGIN, "t": 20, "b": 40},
            "yaxis": {"autorange": "reversed", "tickfont": {"size": 11}, **FIXED_MARGINS,
                      "tickmode": "array", "tickvals": y[rows // 2::rows], "ticktext": names},
            "xaxis": {"tickfont": {"size": 10}, "title": {"text": "token position"}, **FIXED_MARGINS},
            # a line between two corrections' bands (categories sit at 0, 1, ... on the axis)
            "shapes": [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": k * rows - 0.5,
                        "y1": k * rows - 0.5, "line": {"color": "#333", "width": 1}} for k in range(1, len(names))],
        }, _validate=False)


def total_weight_vs_length(totals: pd.DataFrame) -> go.Figure:
    """Per-completion summed gradient weight against its length, one series per algorithm (length bias)."""
    traces = []
    for i, (algo, frame) in enumerate(totals.groupby("algorithm", sort=False)):
        frame = frame.sort_values("length")
        traces.append({"type": "scatter", "x": frame["length"].to_numpy(), "y": frame["total_weight"].to_numpy(),
                       "mode": "markers+lines", "name": _name(algo),
                       "marker": {"size": 7, "color": PALETTE[i % len(PALETTE)]},
                       "line": {"color": PALETTE[i % len(PALETTE)]},
                       "customdata": frame[["completion", "advantage"]].to_numpy(),
                       "hovertemplate": "%{fullData.name}<br>%{customdata[0]} (A=%{customdata[1]:.3g})<br>length %{x}"
                       "<br>total weight %{y:.4g}<extra></extra>"})
    return go.Figure(data=traces, layout={
        "height": 330, "margin": {"l": 40, "r": 10, "t": 20, "b": 30}, "shapes": [zero_line()],
        "xaxis": {"title": {"text": "completion length (tokens)"}},
        "yaxis": {"title": {"text": "sum of gradient weights"}},
    }, _validate=False)


def clip_fractions(fractions: pd.DataFrame) -> go.Figure:
    """Fraction of tokens each algorithm clips low / high / with its dual cap."""
    bars = [{"type": "bar", "x": fractions["algorithm"].tolist(),
             "y": fractions[CLIP_NAMES[code]].to_numpy(dtype=float), "name": f"clip {CLIP_NAMES[code]}",
             "marker": {"color": CLIP_COLOURS[code]}}
            for code in CLIP_EVENTS]
    return go.Figure(data=bars, layout={
        "height": 280, "barmode": "group", "margin": {"l": 40, "r": 10, "t": 20, "b": 30},
        "yaxis": {"title": {"text": "fraction of tokens"}, "tickformat": ".0%"},
    }, _validate=False)


def clip_regions(regions: dict[str, dict], scatter: dict[str, pd.DataFrame]) -> go.Figure:
    """Ratio x advantage plane per algorithm: where it clips (coloured) and where the batch's tokens sit (dots).

    `regions[algo]` = {"ratio": (R,), "advantage": (A,), "clip": (A, R) int codes} computed by the objective itself
    on a grid; `scatter[algo]` has the logged tokens' `ratio` and `advantage` as that algorithm sees them.
    The regions are drawn as the few rectangles of equal decision the grid falls into (`code_rectangles`) and the
    tokens as one dot per pixel they cover: nine heatmaps and thousands of WebGL points took the browser about
    0.9 s to draw on every visit, these a fraction of it.
    """
    names = list(regions)
    rows, cols = _grid(len(names), cols=3)
    height = 320 * rows
    grid = Subplots(rows, cols, names, hspace=0.05, vspace=120 / height)
    shapes = []
    for i, name in enumerate(names):
        region = regions[name]
        ratio, advantage = np.asarray(region["ratio"], dtype=float), np.asarray(region["advantage"], dtype=float)
        xref, yref = grid.ref(i)
        shapes += [{"type": "rect", "xref": xref, "yref": yref, "x0": x0, "x1": x1, "y0": y0, "y1": y1,
                    "fillcolor": CLIP_COLOURS.get(code, UNREACHABLE_COLOUR), "opacity": 0.55, "line": {"width": 0},
                    "layer": "below"}
                   for x0, x1, y0, y1, code in code_rectangles(ratio, advantage, region["clip"]) if code != CLIP_NONE]
        x_range = [float(ratio[0]), float(ratio[-1])]
        y_range = [float(advantage[0]), float(advantage[-1])]
        points = scatter.get(name)
        if points is not None and len(points):
            x, y = _one_per_pixel(points["ratio"].to_numpy(dtype=float), points["advantage"].to_numpy(dtype=float),
                                  x_range, y_range)
            grid.add(i, {"type": "scatter", "x": x, "y": y, "mode": "markers", "showlegend": False,
                         "marker": {"size": 4, "color": "#222", "opacity": 0.6},
                         "hovertemplate": "token<br>ratio %{x:.3f}<br>A %{y:.3f}<extra></extra>"})
        grid.axis(i, "x").update(title={"text": "ratio"}, range=x_range)
        grid.axis(i, "y").update(range=y_range, **({"title": {"text": "advantage"}} if i % cols == 0 else {}))
    return grid.figure(height=height, margin={"l": 40, "r": 10, "t": 40, "b": 40}, showlegend=False, shapes=shapes,
                       plot_bgcolor="#f5f5f5")


def weight_curves(curves: dict[str, dict]) -> go.Figure:
    """Per algorithm, its gradient weight per unit advantage against the ratio at A > 0 and A < 0 (`curves[algo]`
    = {"ratio": (R,), "positive": (R,), "negative": (R,)}, from `recompute.weight_curves`), with 1 (the plain
    policy gradient) dotted."""
    names = list(curves)
    rows, cols = _grid(len(names), cols=3)
    height = 260 * rows
    grid = Subplots(rows, cols, names, hspace=0.05, vspace=110 / height)
    shapes = []
    for i, name in enumerate(names):
        curve = curves[name]
        ratio = np.asarray(curve["ratio"], dtype=float)
        for side, colour, label in (("positive", CLIP_COLOURS[CLIP_HIGH], "A > 0"),
                                    ("negative", CLIP_COLOURS[CLIP_LOW], "A < 0")):
            grid.add(i, {"type": "scatter", "x": ratio, "y": np.asarray(curve[side], dtype=float), "mode": "lines",
                         "name": _name(label), "legendgroup": side, "showlegend": i == 0, "line": {"color": colour},
                         "hovertemplate": f"{_name(name)} {_name(label)}<br>ratio %{{x:.3f}}<br>weight / A %{{y:.3f}}"
                                          "<extra></extra>"})
        xref, yref = grid.ref(i)
        shapes.append({"type": "line", "xref": f"{xref} domain", "yref": yref, "x0": 0, "x1": 1, "y0": 1, "y1": 1,
                       "line": {"color": "#888", "dash": "dot", "width": 1}})
        grid.axis(i, "x").update(title={"text": "ratio"}, range=[float(ratio[0]), float(ratio[-1])])
        if i % cols == 0:
            grid.axis(i, "y").update(title={"text": "weight ÷ A"})
    return grid.figure(height=height, margin={"l": 50, "r": 10, "t": 40, "b": 40}, shapes=shapes,
                       legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1, "xanchor": "right"})


def code_rectangles(x: np.ndarray, y: np.ndarray, codes: np.ndarray) -> list[tuple[float, float, float, float, int]]:
    """Cover a grid of codes (len(y), len(x)) sampled at the points x (increasing) and y (increasing) with
    rectangles (x0, x1, y0, y1, code) of one code each: a cell reaches halfway to its neighbours (the outer
    cells end at the grid's edge), runs of equal codes along x are merged, and so are consecutive rows with the
    same runs."""
    codes = np.asarray(codes)
    x_edges = np.concatenate([[x[0]], (x[1:] + x[:-1]) / 2, [x[-1]]])
    y_edges = np.concatenate([[y[0]], (y[1:] + y[:-1]) / 2, [y[-1]]])

    def runs(row: np.ndarray) -> tuple:
        starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
        ends = np.concatenate([starts[1:], [len(row)]])
        return tuple((int(a), int(b), int(row[a])) for a, b in zip(starts, ends, strict=True))

    out, band_start, band = [], 0, runs(codes[0])
    for j in range(1, len(y) + 1):
        this = runs(codes[j]) if j < len(y) else None
        if this != band:
            out += [(float(x_edges[a]), float(x_edges[b]), float(y_edges[band_start]), float(y_edges[j]), code)
                    for a, b, code in band]
            band_start, band = j, this
    return out


def _one_per_pixel(x: np.ndarray, y: np.ndarray, x_range: list[float], y_range: list[float],
                   pixels: tuple[int, int] = (500, 300)) -> tuple[np.ndarray, np.ndarray]:
    """The points (x, y) with at most one per cell of a pixel-sized grid over the ranges (a panel is smaller
    than 500 x 300 pixels, and a dot is 4 pixels wide: the dropped points were drawn on top of a kept one)."""
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    cell_x = np.floor((x - x_range[0]) / ((x_range[1] - x_range[0]) / pixels[0] or 1.0))
    cell_y = np.floor((y - y_range[0]) / ((y_range[1] - y_range[0]) / pixels[1] or 1.0))
    _, first = np.unique(np.stack([cell_x, cell_y], axis=1), axis=0, return_index=True)
    first.sort()
    return x[first], y[first]


# ---------------------------------------------------------------- token trajectories and token statistics


def _token_label(text: str) -> str:
    """A token's text for a plotly label: escaped (plotly renders a subset of HTML in labels), whitespace visible."""
    return visible_text(str(text)).replace("<br>", "")


def _name(text: str) -> str:
    """A logged name (run, algorithm, answer class) for a plotly legend or title: escaped, never markup. Hover
    templates refer to it as %{fullData.name}, so a '%{...}' in it is never substituted either."""
    return html.escape(str(text), quote=True)


def token_as_text(text: str) -> str:
    """A token's text for a table cell (shown as text, never markup) with its whitespace made visible, as in the
    token views: `·` space, `↵` newline, `→` tab."""
    return str(text).replace(" ", "·").replace("\t", "→").replace("\r", "␍").replace("\n", "↵")


def ref_class_curves(curves: pd.DataFrame, colours: dict[str, str] | None = None) -> go.Figure:
    """Mean log-prob of a whole reference solution per evaluation step, one colour per run, one dash per answer
    class (`data.ref_class_curves`)."""
    colours = colours or run_colours(list(curves["run"].unique()))
    dashes = ["solid", "dot", "dash", "dashdot", "longdash"]
    classes = sorted(curves["answer_class"].astype(str).unique())
    traces = []
    for (run, answer_class), frame in curves.groupby(["run", "answer_class"], sort=True):
        dash = dashes[classes.index(str(answer_class)) % len(dashes)]
        traces.append({
            "type": "scatter", "x": frame["step"].to_numpy(), "y": frame["solution_logp"].to_numpy(dtype=float),
            "mode": "lines+markers", "name": _name(f"{run} · {answer_class}"),
            "line": {"color": colours.get(run), "dash": dash},
            "marker": {"size": 5}, "customdata": frame[["token_logp", "prompts"]].to_numpy(dtype=float),
            "hovertemplate": "%{fullData.name}<br>step %{x}<br>"
                             "log p(solution) %{y:.3f}<br>per token %{customdata[0]:.3f}<br>"
                             "%{customdata[1]} prompts<extra></extra>",
        })
    return go.Figure(data=traces, layout={
        "height": 320, "margin": {"l": 50, "r": 10, "t": 30, "b": 40},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": "mean log p(reference solution)"}},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom"},
    }, _validate=False)


def ref_trajectory_heatmaps(trajectories: pd.DataFrame, at_step: int, marked: pd.DataFrame) -> go.Figure:
    """One panel per run: evaluation steps x tokens of one reference solution, coloured by p(token).

    The row of the latest evaluation at or before `at_step` is outlined; the columns of `marked`
    (`data.most_changed_tokens`) are outlined in red and noted with their change of probability.
    """
    runs = sorted(trajectories["run"].unique())
    heights = [len(trajectories.loc[trajectories["run"] == run, "step"].unique()) for run in runs]
    panel = [40 + 22 * h for h in heights]  # pixels: rows stay readable whatever the number of evaluations
    gap = 70
    total = sum(panel) + gap * len(runs) + 40
    traces, shapes, notes, layout = [], [], [], {}
    top = 1.0
    for i, run in enumerate(runs):
        frame = trajectories[trajectories["run"] == run]
        grid = frame.pivot(index="step", columns="position", values="p").sort_index()  # (steps, positions)
        texts = frame.drop_duplicates("position").set_index("position")["token_text"].reindex(grid.columns)
        labels = [_token_label(t) for t in texts]
        steps = [int(s) for s in grid.index]
        y_labels = [str(s) for s in steps]
        xname, yname = Subplots.ref(i)
        height = panel[i] / total
        top -= gap / total
        layout["xaxis" + xname[1:]] = {"anchor": yname, "domain": [0, 1], "tickmode": "array",
                                       "tickvals": list(grid.columns), "ticktext": labels, "tickangle": 0,
                                       "tickfont": {"family": "monospace", "size": 13}}
        layout["yaxis" + yname[1:]] = {"anchor": xname, "domain": _unit(top - height, top), "type": "category",
                                       "title": {"text": f"{_name(run)}<br>step"}, "autorange": "reversed"}
        traces.append({
            "type": "heatmap", "z": grid.to_numpy(dtype=float), "x": list(grid.columns), "y": y_labels,
            "xaxis": xname, "yaxis": yname, "zmin": 0, "zmax": 1, "colorscale": _scale("Viridis"),
            "showscale": i == 0, "colorbar": {"title": {"text": "p(token)", "side": "right"}, "len": 0.6},
            "customdata": [labels] * len(steps),
            "hovertemplate": "step %{y} · token #%{x} %{customdata}<br>p %{z:.3f}<extra></extra>",
        })
        now = max((s for s in steps if s <= at_step), default=steps[0])
        shapes.append({"type": "rect", "xref": f"{xname} domain", "yref": yname, "x0": 0, "x1": 1,
                       "y0": steps.index(now) - 0.5, "y1": steps.index(now) + 0.5,
                       "line": {"color": "#ff7f0e", "width": 3}})
        for mark in marked[marked["run"] == run].itertuples(index=False):
            shapes.append({"type": "rect", "xref": xname, "yref": f"{yname} domain", "x0": mark.position - 0.5,
                           "x1": mark.position + 0.5, "y0": 0, "y1": 1, "line": {"color": "#d62728", "width": 2}})
            notes.append({"text": f"{mark.change:+.2f}", "x": mark.position, "y": 1, "xref": xname,
                          "yref": f"{yname} domain", "yanchor": "bottom", "showarrow": False,
                          "font": {"size": 11, "color": "#d62728"}})
        top -= height
    layout.update(height=total, margin={"l": 50, "r": 10, "t": 10, "b": 30}, shapes=shapes, annotations=notes)
    return go.Figure(data=traces, layout=layout, _validate=False)


def marked_token_lines(trajectories: pd.DataFrame, marked: pd.DataFrame, colours: dict[str, str] | None = None
                       ) -> go.Figure:
    """p(token) across evaluation steps for the tokens of `marked`, one line each (colour per run)."""
    colours = colours or run_colours(list(trajectories["run"].unique()))
    traces = []
    rank = marked.groupby("run").cumcount().to_numpy()  # the run's 1st, 2nd ... token: solid, dot, dash ...
    for mark, k in zip(marked.itertuples(index=False), rank, strict=True):
        frame = trajectories[(trajectories["run"] == mark.run) & (trajectories["position"] == mark.position)]
        name = f"{_name(mark.run)} · #{mark.position} {_token_label(mark.token_text)}"
        traces.append({"type": "scatter", "x": frame["step"].to_numpy(), "y": frame["p"].to_numpy(dtype=float),
                       "mode": "lines+markers", "name": name,
                       "line": {"color": colours.get(mark.run), "dash": ["solid", "dot", "dash", "dashdot"][k % 4]},
                       "marker": {"size": 5}, "hovertemplate": "%{fullData.name}<br>step %{x}<br>p %{y:.3f}"
                                                               "<extra></extra>"})
    return go.Figure(data=traces, layout={
        "height": 280, "margin": {"l": 50, "r": 10, "t": 20, "b": 40}, "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": "p(token)"}, "range": [0, 1.02]},
    }, _validate=False)


def entropy_bin_bars(bins: pd.DataFrame, n_bins: int, split: float) -> go.Figure:
    """Clip rate and share of |gradient weight| per within-response entropy-quantile bin, bars per run, with the
    quantile `split` (ASPO's 80th percentile) drawn on both panels (`data.entropy_bins`)."""
    grid = Subplots(1, 2, ["clip rate (any clip, per token x pass)", "share of total |gradient weight|"],
                    hspace=0.08, vspace=0)
    colours = run_colours(list(bins["run"].unique()))
    for run, frame in bins.groupby("run", sort=True):
        name = _name(f"{frame['algorithm'].iloc[0]} · {run}")
        for panel, column in enumerate(("clip_rate", "weight_share")):
            grid.add(panel, {
                "type": "bar", "x": frame["quantile_mid"].to_numpy(dtype=float),
                "y": frame[column].to_numpy(dtype=float), "name": name, "legendgroup": run,
                "showlegend": panel == 0, "marker": {"color": colours[run]},
                "hovertemplate": "%{fullData.name}<br>entropy quantile bin %{x:.2f}<br>" + column
                                 + " %{y:.4f}<extra></extra>",
            })
    shapes = []
    for panel in (0, 1):
        xname, yname = Subplots.ref(panel)
        grid.axis(panel, "x").update(title={"text": "entropy quantile within the response"}, range=[0, 1],
                                     dtick=1 / n_bins if n_bins <= 10 else 0.1)
        shapes.append({"type": "line", "xref": xname, "yref": f"{yname} domain", "x0": split, "x1": split,
                       "y0": 0, "y1": 1, "line": {"color": "#444", "dash": "dash", "width": 2}})
    grid.layout["annotations"].append({"x": split, "y": 0.98, "xref": "x", "yref": "y domain", "yanchor": "top",
                                       "xanchor": "right", "text": f"ASPO split: {split:.0%} quantile ",
                                       "showarrow": False, "font": {"size": 11}})
    return grid.figure(height=340, barmode="group", bargap=0.15, margin={"l": 50, "r": 10, "t": 40, "b": 40},
                       legend={"orientation": "h", "y": -0.25}, shapes=shapes)


# ---------------------------------------------------------------- sampler/trainer mismatch (dashboard.mismatch)


def _band_lines(axis: str, values: tuple[float, float]) -> list[dict]:
    """Dotted lines at the band's edges along one axis ("x": vertical lines)."""
    other = "y" if axis == "x" else "x"
    return [{"type": "line", "xref": "x" if axis == "x" else "paper", "yref": "paper" if axis == "x" else "y",
             f"{axis}0": v, f"{axis}1": v, f"{other}0": 0, f"{other}1": 1,
             "line": {"color": "#888", "width": 1, "dash": "dot"}} for v in values]


def mismatch_histogram(histogram: pd.DataFrame, band: tuple[float, float]) -> go.Figure:
    """Token log-ratios log(pi_trainer / pi_sampler) of one step (`dashboard.mismatch.histogram`), log count axis,
    dotted lines at the band's edges."""
    centres = ((histogram["left"] + histogram["right"]) / 2).to_numpy(dtype=float)
    width = float((histogram["right"] - histogram["left"]).iloc[0]) if len(histogram) else 1.0
    bars = {"type": "bar", "x": centres, "y": histogram["tokens"].to_numpy(dtype=float), "width": width,
            "marker": {"color": "#1f77b4"}, "hovertemplate": "log-ratio %{x:.3g}<br>%{y} tokens<extra></extra>"}
    return go.Figure(data=[bars], layout={
        "height": 300, "margin": {"l": 50, "r": 10, "t": 30, "b": 40}, "bargap": 0,
        "xaxis": {"title": {"text": "log π_trainer − log π_sampler (outermost bins hold the tails)"}},
        "yaxis": {"type": "log", "title": {"text": "tokens"}},
        "shapes": _band_lines("x", tuple(math.log(b) for b in band))}, _validate=False)


def probability_scatter(points: pd.DataFrame, grid_cells: int = 0) -> go.Figure:
    """Trainer against sampler probability of each token (`dashboard.mismatch.probability_points`). Binned
    (`grid_cells` per axis): a heatmap of the grid, each cell coloured by how many tokens it holds (an image: 10,000
    cells cost the browser what one does, where as many WebGL markers took a third of a second to draw)."""
    counts = points["tokens"].to_numpy(dtype=np.int64)
    if grid_cells:
        def cell(probability: pd.Series) -> np.ndarray:  # the grid index of each cell centre
            return np.clip((probability.to_numpy(dtype=float) * grid_cells).astype(int), 0, grid_cells - 1)

        tokens = np.zeros((grid_cells, grid_cells), dtype=np.uint32)  # (sampler cell, trainer cell): rows are y
        tokens[cell(points["sampler_p"]), cell(points["trainer_p"])] = counts
        with np.errstate(divide="ignore"):
            shade = np.where(tokens > 0, np.log10(tokens), np.nan).astype(np.float32)  # NaN: an empty cell, blank
        centres = (np.arange(grid_cells) + 0.5) / grid_cells
        dots = {"type": "heatmap", "x": centres, "y": centres, "z": shade, "customdata": tokens,
                "colorscale": _scale("Viridis"), "hoverongaps": False,
                "colorbar": {"title": {"text": "log10 tokens"}},
                "hovertemplate": "trainer %{x:.3f}<br>sampler %{y:.3f}<br>%{customdata} tokens<extra></extra>"}
    else:
        dots = {"type": "scatter", "mode": "markers", "x": points["trainer_p"].to_numpy(dtype=float),
                "y": points["sampler_p"].to_numpy(dtype=float), "marker": {"size": 4, "color": "#1f77b4",
                                                                          "opacity": 0.6},
                "hovertemplate": "trainer %{x:.3f}<br>sampler %{y:.3f}<extra></extra>"}
    diagonal = {"type": "scatter", "mode": "lines", "x": [0, 1], "y": [0, 1], "hoverinfo": "skip",
                "line": {"color": "#888", "width": 1, "dash": "dot"}}
    return go.Figure(data=[dots, diagonal], layout={
        "height": 360, "showlegend": False, "margin": {"l": 50, "r": 10, "t": 30, "b": 40},
        "xaxis": {"title": {"text": "trainer probability (old_logp)"}, "range": [-0.02, 1.02]},
        "yaxis": {"title": {"text": "sampler probability"}, "range": [-0.02, 1.02], "scaleanchor": "x"}},
        _validate=False)


def mismatch_buckets(buckets: pd.DataFrame) -> go.Figure:
    """Share of tokens outside the band per bucket (`dashboard.mismatch.buckets`), one panel per bucketing."""
    kinds = list(dict.fromkeys(buckets["by"]))
    titles = {"probability": "by trainer probability", "entropy": "by entropy (nats)", "position": "by position"}
    grid = Subplots(1, max(1, len(kinds)), [titles.get(k, k) for k in kinds], hspace=0.06)
    for i, kind in enumerate(kinds):
        part = buckets[buckets["by"] == kind].sort_values("order")
        grid.add(i, {"type": "bar", "x": part["bucket"].astype(str).tolist(),
                     "y": part["out_of_band"].to_numpy(dtype=float), "customdata": part["tokens"].to_numpy(),
                     "marker": {"color": "#d62728"}, "showlegend": False,
                     "hovertemplate": "%{x}<br>outside the band %{y:.1%}<br>%{customdata} tokens<extra></extra>"})
        grid.axis(i, "x").update(type="category")
        grid.axis(i, "y").update(tickformat=".0%", rangemode="tozero")
    return grid.figure(height=300, margin={"l": 50, "r": 10, "t": 40, "b": 40})


def sequence_mismatch(sequences: pd.DataFrame) -> go.Figure:
    """Per sequence: its summed log-ratio (the log of its sequence IS ratio) against its reward and its advantage."""
    grid = Subplots(1, 2, ["reward", "advantage"], hspace=0.08)
    x = sequences["sum_log_ratio"].to_numpy(dtype=float)
    for i, column in enumerate(("reward", "advantage")):
        grid.add(i, {"type": "scatter", "mode": "markers", "x": x,
                     "y": pd.to_numeric(sequences[column], errors="coerce").to_numpy(dtype=float),
                     "customdata": np.stack([sequences["rollout_id"].to_numpy(dtype=float),
                                             sequences["out_of_band"].to_numpy(dtype=float)], axis=-1),
                     "marker": {"size": 6, "color": sequences["out_of_band"].to_numpy(dtype=float),
                                "colorscale": _scale("Reds"), "cmin": 0, "showscale": i == 0,
                                "colorbar": {"title": {"text": "outside band"}}},
                     "showlegend": False,
                     "hovertemplate": f"rollout %{{customdata[0]}}<br>Σ log-ratio %{{x:.3g}}<br>{column} %{{y:.3g}}"
                                      "<br>outside the band %{customdata[1]:.1%}<extra></extra>"})
        grid.axis(i, "x").update(title={"text": "Σ_t log-ratio of the sequence"})
    return grid.figure(height=320, margin={"l": 50, "r": 10, "t": 40, "b": 50})
