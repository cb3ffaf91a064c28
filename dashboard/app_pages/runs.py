"""Runs: every run in the logs folder, their curves overlaid, and how their configs differ."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, common, data, figures, queries

selection = common.require_selection(need_step=False)
logs = selection.logs_dir
st.header("Runs")

table = common.load("the list of runs", queries.runs_table, logs)
STATUS_ICON = {"running": "● running", "finished": "finished", "stopped": "■ stopped", "crashed": "✖ crashed"}
# What tells runs apart comes first, the run name stays pinned while scrolling sideways, and free-form text (a model
# description can be a paragraph) comes last at a bounded width, so it never pushes the accuracy out of sight.
RUNS_COLUMNS = ["run", "status", "algorithm", "task", "heldout_accuracy", "last_step", "steps_logged", "updated_at",
                "created_at", "model"]
st.dataframe(
    table.assign(status=table["status"].map(lambda s: STATUS_ICON.get(s, s))).drop(columns=["config"]),
    hide_index=True,
    key="runs_table",
    column_order=[c for c in RUNS_COLUMNS if c in table.columns],
    column_config={
        "run": st.column_config.TextColumn("run", pinned=True),
        "last_step": "last step", "steps_logged": "steps logged",
        "heldout_accuracy": st.column_config.NumberColumn("held-out accuracy", format="%.3f", width="small"),
        "created_at": st.column_config.DatetimeColumn("created"),
        "updated_at": st.column_config.DatetimeColumn("updated"),
        "model": st.column_config.TextColumn("model", width="medium", help="as logged; hover a cell for all of it"),
    },
)

# Several runs to compare: from the URL, else all runs when there are few, else the selected one.
names = list(table["run"])
from_url = [r for r in (common.url_value("compare") or "").split(",") if r in names]
default = from_url or (names if len(names) <= 6 else [selection.run])
compared = st.multiselect("Overlay runs", names, default=default, key="compare_runs")
common.set_url_value("compare", ",".join(compared) if compared else None)
if not compared:
    st.info("Pick one or more runs to overlay their curves.")
    st.stop()

versions = tuple(queries.live_signature(logs))  # any new step of any run refreshes the curves
steps = common.load("the step metrics", queries.run_steps, logs, tuple(sorted(compared)), versions)
if steps.empty:
    st.info("The selected runs have not logged any step yet.")
else:
    smoothing = st.slider("Smoothing", 0.0, 0.99, 0.0, 0.01, key="run_smoothing",
                          help="exponential moving average of each curve, debiased as in TensorBoard and W&B; 0: off. "
                          "The raw points stay drawn, faint.")
    figures.show(st, charts.metric_curves(steps, colours=charts.run_colours(names), smoothing=smoothing),
                 key="run_curves")

st.subheader("Config differences")
diff = data.config_diff(table[table["run"].isin(compared)])
if len(compared) < 2:
    st.caption("Select at least two runs to see where their configs differ.")
elif diff.empty:
    st.caption("The selected runs have identical configs.")
else:
    st.dataframe(diff.astype(str), key="config_diff")
