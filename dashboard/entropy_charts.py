"""The Token statistics page's covariance and KL figures (DataFrame -> plotly Figure, no Streamlit calls): which
tokens carry Cui et al.'s covariance or the KL to the reference over training, and the run's entropy against its
summed covariance (arXiv 2505.22617: the entropy change of a step tracks minus the covariance).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.charts import Subplots, _scale, _token_label


def driver_label(token_text, position_from) -> str:
    """A token text (and its position bucket) as a chart label: whitespace visible, escaped."""
    where = "" if pd.isna(position_from) else f" @{int(position_from)}"
    return _token_label(token_text) + where


def drivers_over_steps(per_step: pd.DataFrame, table: pd.DataFrame, value: str, title: str) -> go.Figure:
    """Steps x the token texts of `table` (`token_data.driver_table`, best first, top to bottom), coloured by `value`
    per step ("covariance_sum" or "kl_sum", from `token_data.covariance_drivers`), on a scale centred at 0."""
    labels = [driver_label(t, p) for t, p in zip(table["token_text"], table["position_from"], strict=True)]
    steps = np.sort(per_step["step"].unique())
    z = np.full((len(table), len(steps)), np.nan)
    column = {s: j for j, s in enumerate(steps)}
    row = {(t, None if pd.isna(p) else int(p)): i
           for i, (t, p) in enumerate(zip(table["token_text"], table["position_from"], strict=True))}
    for t, p, s, v in zip(per_step["token_text"], per_step["position_from"], per_step["step"], per_step[value],
                          strict=True):
        i = row.get((t, None if pd.isna(p) else int(p)))
        if i is not None:
            z[i, column[s]] = v
    finite = z[np.isfinite(z)]
    spread = float(np.abs(finite).max()) if finite.size else 1.0
    trace = {"type": "heatmap", "z": z, "x": steps, "y": labels, "colorscale": _scale("RdBu_r"), "zmid": 0,
             "zmin": -(spread or 1.0), "zmax": spread or 1.0,
             "colorbar": {"title": {"text": title, "side": "right"}, "len": 0.9},
             "hovertemplate": "%{y}<br>step %{x}<br>" + title + " %{z:.4g}<extra></extra>"}
    return go.Figure(data=[trace], layout={
        "height": 60 + 18 * max(4, len(labels)), "margin": {"l": 10, "r": 10, "t": 10, "b": 40},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"autorange": "reversed", "automargin": True, "type": "category", "tickfont": {"size": 11}},
    }, _validate=False)


def entropy_against_covariance(per_step: pd.DataFrame) -> go.Figure:
    """Left: the logged mean entropy and the summed covariance per step (`token_data.covariance_per_step`), each on its
    own axis. Right: each step's entropy change to the next step against its summed covariance, with their
    correlation in the title (Cui et al.: negative)."""
    paired = per_step.dropna(subset=["entropy_change", "covariance_sum"])
    r = (float(np.corrcoef(paired["covariance_sum"], paired["entropy_change"])[0, 1])
         if len(paired) >= 3 and paired["covariance_sum"].std() > 0 and paired["entropy_change"].std() > 0
         else float("nan"))
    right = "entropy change to the next step" + (f" (correlation {r:+.2f})" if np.isfinite(r) else "")
    grid = Subplots(1, 2, ["entropy and summed covariance per step", right], hspace=0.2, vspace=0)
    steps = per_step["step"].to_numpy()
    grid.add(0, {"type": "bar", "x": steps, "y": per_step["covariance_sum"].to_numpy(dtype=float),
                 "name": "summed covariance", "marker": {"color": "#9ecae1"},
                 "hovertemplate": "step %{x}<br>summed covariance %{y:.4g}<extra></extra>"})
    grid.traces.append({"type": "scatter", "x": steps, "y": per_step["entropy"].to_numpy(dtype=float),
                        "mode": "lines+markers", "name": "entropy (mean, at sampling)", "xaxis": "x",
                        "yaxis": "y3", "line": {"color": "#d62728"},
                        "hovertemplate": "step %{x}<br>entropy %{y:.4f}<extra></extra>"})
    grid.layout["yaxis3"] = {"overlaying": "y", "side": "right", "anchor": "x", "showgrid": False,
                             "title": {"text": "entropy"}}
    grid.add(1, {"type": "scatter", "x": paired["covariance_sum"].to_numpy(dtype=float),
                 "y": paired["entropy_change"].to_numpy(dtype=float), "mode": "markers+text",
                 "text": paired["step"].astype(str).tolist(), "textposition": "top center", "showlegend": False,
                 "marker": {"size": 8, "color": "#444"},
                 "hovertemplate": "step %{text}<br>summed covariance %{x:.4g}<br>entropy change %{y:.4g}"
                                  "<extra></extra>"})
    grid.axis(0, "x").update(title={"text": "step"})
    grid.axis(0, "y").update(title={"text": "summed covariance"})
    grid.axis(1, "x").update(title={"text": "summed covariance of the step"})
    grid.axis(1, "y").update(title={"text": "entropy change"}, zeroline=True)
    return grid.figure(height=340, margin={"l": 50, "r": 10, "t": 40, "b": 40},
                       legend={"orientation": "h", "y": -0.25})
