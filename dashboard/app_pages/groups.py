"""Groups: every group of one step, its G completions side by side with rewards, advantages and filtering marks."""

from __future__ import annotations

import streamlit as st

from dashboard import common, data, group_view, queries

GROUPS_PER_PAGE = 8
COMPLETIONS_PER_PAGE = 64  # fewer groups a page when they are large
# The outcomes `data.group_summary` gives a group: from its correctness column, or from its rewards without one.
OUTCOMES = ("mixed", "all correct", "all wrong", "no signal", "no reward")

selection = common.require_selection()
logs, run, step = selection.logs_dir, selection.run, selection.step
st.header("Groups")

summary = common.load("the groups", queries.group_summary, logs, run, step)
# The completions as previews (a reasoning run's run to 60k characters, 16 a group); the search reads the whole texts.
rollouts = common.load("the rollouts", queries.step_rollout_previews, logs, run, step, "train")
if summary.empty:
    st.info(f"Step {step} of {common.md(run)} has no train groups.")
    st.stop()

# ---------------------------------------------------------------- filter and sort
SORTS = {
    "group id": ("group_id", True), "reward mean (high first)": ("reward_mean", False),
    "reward mean (low first)": ("reward_mean", True), "reward std (high first)": ("reward_std", False),
    "largest |advantage|": ("max_abs_advantage", False), "mean length (long first)": ("length_mean", False),
}
c1, c2, c3, c4 = st.columns([2, 2, 2, 3])
outcomes = c1.multiselect("Outcome", list(OUTCOMES), default=[], placeholder="any outcome")
kept = c2.selectbox("Dynamic sampling", ["all groups", "kept", "filtered"])
sort_by = c3.selectbox("Sort by", list(SORTS))
search = c4.text_input("Search prompts and completions", placeholder="text, e.g. x = 2")

shown = summary
if outcomes:
    shown = shown[shown["outcome"].isin(outcomes)]
if kept != "all groups":
    shown = shown[shown["filtered"].map(common.flag) == (kept == "filtered")]
if search:
    shown = shown[shown["group_id"].isin(common.load("the search", queries.groups_matching, logs, run, step, search))]
column, ascending = SORTS[sort_by]
shown = shown.sort_values([column, "group_id"], ascending=[ascending, True])

filtered_count = int(summary["filtered"].map(common.flag).sum())
reasons = summary["filter_reason"].value_counts().items()
st.caption(
    f"{len(shown)} of {len(summary)} groups shown · {filtered_count} dropped by dynamic sampling at this step"
    + (f" ({', '.join(f'{common.md(reason)}: {count}' for reason, count in reasons)})" if filtered_count else "")
)
if (summary["outcome_from"] == data.OUTCOME_BY_REWARD).any():
    st.caption("Outcome: this run logged no correctness (reward_correct, e.g. a TRL run or an import), so it is "
               "read from the rewards: **no signal** when all of a group's rewards are equal (reward std 0, every "
               "advantage 0: the groups DAPO's dynamic sampling drops), **no reward** when none was logged (a "
               "dump that holds no reward), **mixed** otherwise.")
else:
    st.caption("Outcome: from the logged correctness (reward_correct) of the group's completions.")
st.dataframe(
    common.dashed(shown.drop(columns=["max_abs_advantage", "outcome_from"]), {"accuracy": ".2f"}),
    hide_index=True, key="group_table",
    column_config={
        "reward_mean": st.column_config.NumberColumn("reward mean", format="%.3f"),
        "reward_std": st.column_config.NumberColumn("reward std", format="%.3f"),
        "accuracy": st.column_config.NumberColumn("accuracy", format="%.2f"),
        "length_mean": st.column_config.NumberColumn("mean length", format="%.1f"),
    },
)
if shown.empty:
    st.stop()

# ---------------------------------------------------------------- the groups, one page at a time
per_page = max(1, min(GROUPS_PER_PAGE, COMPLETIONS_PER_PAGE // int(summary["size"].max())))  # groups of 16: 4
pages = max(1, -(-len(shown) // per_page))
page = st.number_input("Page", 1, pages, 1, key="group_page") if pages > 1 else 1
opened = group_view.show(group_view.group_cards(shown.iloc[(page - 1) * per_page: page * per_page], rollouts,
                                                run, step))
if opened is not None:  # a completion's "tokens" link
    st.switch_page("app_pages/token_inspector.py", query_params={"run": run, "step": step, "rollout": opened})
