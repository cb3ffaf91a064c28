"""Token trajectories: how likely the policy finds each token of a held-out prompt's reference solution, evaluation
after evaluation, for several runs side by side; and the mean log-prob of the reference solutions per answer class."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, common, data, figures, queries

MAX_RUNS = 6
MARKED_TOKENS = 3

selection = common.require_selection()
logs, run = selection.logs_dir, selection.run
st.header("Token trajectories")
st.caption("At every held-out evaluation the trainer also feeds each held-out prompt's reference solution through "
           "the policy (teacher-forced, no sampling) and logs p(token) of every token (table ref_tokens). Here: "
           "those probabilities over training.")

prompts = common.load("the scored reference solutions", queries.ref_prompts, logs, run, selection.version)
if prompts.empty:
    st.info(f"Run {common.md(run)} logged no reference-solution scores: it was trained without per-token logging "
            "(--no-log-tokens), without held-out evaluations, or by a version that did not score them yet.")
    st.stop()

table = common.load("the runs", queries.runs_table, logs)
candidates = data.comparable_runs(table, run)
from_url = [r for r in (common.url_value("compare") or "").split(",") if r in candidates]
default = from_url or candidates[:MAX_RUNS]
st.session_state["traj_runs"] = [r for r in st.session_state.get("traj_runs", default) if r in candidates] or default
compared = st.multiselect("Runs side by side (same task and task seed: the same held-out prompts)", candidates,
                          key="traj_runs", max_selections=MAX_RUNS)
common.set_url_value("compare", ",".join(compared) if compared else None)
if not compared:
    st.info("Choose at least one run.")
    st.stop()
version = queries.live_signature(logs)

# ---- the run-level curve: reference solutions per answer class
st.subheader("Reference solutions by answer class")
curves = common.load("the answer-class curves", queries.ref_class_curves, logs, tuple(compared), version)
st.caption("Mean over the held-out prompts of each class of log p(whole reference solution, EOS included). "
           "A class the warm start gets wrong (for `linear`: negative answers, whose minus sign it drops) starts "
           "low and rises as RL fixes it.")
figures.show(st, charts.ref_class_curves(curves, charts.run_colours(compared)), key="traj_class_curves")

# ---- one prompt, steps x tokens
st.subheader("One prompt, token by token")
ids = [int(p) for p in prompts["prompt_id"]]
by_id = prompts.set_index("prompt_id")
negative = [i for i in ids if by_id.loc[i, "answer_class"] == "negative"]
prompt_id, problem = common.initial_value("traj_prompt", "prompt", int, ids, (negative or ids)[0])
if problem:
    st.warning(f"Held-out prompt {common.linked('prompt')} was not scored in this run; showing {prompt_id}.")
st.session_state["traj_prompt"] = prompt_id


def describe(i: int) -> str:
    row = by_id.loc[i]
    return f"{i}: {str(row['prompt']).strip()} → {row['answer']} ({row['answer_class']})"


left, right = st.columns([3, 2])
prompt_id = left.selectbox("Held-out prompt", ids, key="traj_prompt", format_func=describe)
common.set_url_value("prompt", prompt_id)
trajectories = common.load("the token trajectories", queries.ref_trajectories, logs, tuple(compared), prompt_id,
                           version)
if trajectories.empty:
    st.info("None of the chosen runs scored this prompt's reference solution.")
    st.stop()
steps = sorted(int(s) for s in trajectories["step"].unique())
# A step without an evaluation (from the sidebar or a Replay link) shows the latest evaluation before it.
wanted = common.url_value("at", int, selection.step)
at, _ = common.initial_value("traj_step", "at", int, steps,
                             max((s for s in steps if wanted is not None and s <= wanted), default=steps[-1]))
st.session_state["traj_step"] = at
with right:
    at = st.select_slider("Step (each run at its latest evaluation so far)", steps, key="traj_step") \
        if len(steps) > 1 else steps[0]
common.set_url_value("at", at)

marked = data.most_changed_tokens(trajectories, at, MARKED_TOKENS)
st.caption(f"Colour: p(token) under the policy at each evaluation (rows) for each token of the reference solution "
           f"(columns). Outlined in orange: the evaluation shown at step {at}. Outlined in red, with the change: the "
           f"{MARKED_TOKENS} tokens per run whose probability moved most since the run's first evaluation.")
figures.show(st, charts.ref_trajectory_heatmaps(trajectories, at, marked), key="traj_heatmap")
figures.show(st, charts.marked_token_lines(trajectories[trajectories["step"] <= at], marked,
                                           charts.run_colours(compared)), key="traj_marked_lines")
marked_table = marked.assign(token_text=marked["token_text"].map(charts.token_as_text))
st.dataframe(marked_table.rename(columns={"token_text": "token", "p_first": "p at first eval", "p_now": "p now"}),
             hide_index=True, key="traj_marked")
