"""Replay: scrub or play through a run's steps; curves grow to the step, its distributions and a group redraw,
and an eval prompt's answers are followed across steps and across runs.

Everything below the step slider is redrawn at each step, so its tables are static (`common.static_table`)."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, common, data, figures, queries

SPEEDS = {"0.5 steps/s": 2.0, "1 step/s": 1.0, "2 steps/s": 0.5, "4 steps/s": 0.25}

selection = common.require_selection()
logs, run, steps = selection.logs_dir, selection.run, list(selection.steps)
st.header("Replay")

metrics = common.load("the step metrics", queries.run_steps, logs, (run,), selection.version)
x_range = (steps[0] - 0.5, steps[-1] + 0.5)

at, problem = common.initial_value("replay_step", "at", int, steps, selection.step)
if problem:
    st.warning(f"Step {common.linked('at')} from the link was not logged; starting at step {at}.")
st.session_state["replay_step"] = at

controls = st.columns([1, 2, 5])
# The end of the steps stops the play: asked for by the panel below, done here, before the toggle exists in this run
# (a widget's value cannot be set once the widget is drawn in the same run).
if st.session_state.pop("_replay_reached_end", False):
    st.session_state["replay_playing"] = False
playing = controls[0].toggle("Play", key="replay_playing", disabled=len(steps) < 2)
speed = controls[1].selectbox("Speed", list(SPEEDS), index=1, key="replay_speed", label_visibility="collapsed")


@st.fragment(run_every=SPEEDS[speed] if playing else None)
def replay_panel() -> None:
    """Redrawn on its own at every tick while playing, so the rest of the page stays put."""
    if st.session_state.get("replay_playing"):
        position = steps.index(st.session_state["replay_step"]) if st.session_state["replay_step"] in steps else 0
        if position + 1 < len(steps):
            st.session_state["replay_step"] = steps[position + 1]
        else:  # reached the end: stop the timer (a full rerun redefines the fragment without run_every)
            st.session_state["_replay_reached_end"] = True
            st.rerun()
    step = st.select_slider("Step", steps, key="replay_step") if len(steps) > 1 else steps[0]
    common.set_url_value("at", step)

    figures.show(st, charts.metric_curves(metrics, upto_step=step, x_range=x_range), key="replay_curves")
    # The distributions need none of the completions' text (a reasoning step holds ~15 MB), the group's table the
    # start of its own completions only.
    train = common.load("the rollouts", queries.step_rollout_numbers, logs, run, step, "train")
    figures.show(st, charts.step_distributions(train, f" at step {step}"), key="replay_distributions")

    # One group of this step, redrawn as the step moves (group ids are per step, so pick by position).
    groups = common.load("the groups", queries.group_summary, logs, run, step)
    if not groups.empty:
        group_ids = list(groups["group_id"])
        wanted = st.session_state.get("replay_group_index", 0)
        index = st.number_input("Group of this step (by position)", 0, len(group_ids) - 1,
                                min(wanted, len(group_ids) - 1), key="replay_group_index")
        group = groups.iloc[index]
        st.caption(f"group {common.md(group.group_id)}: {common.md(group.prompt)}  ·  reward mean "
                   f"{common.number(group.reward_mean, '.3f')}, std {common.number(group.reward_std, '.3f')} · "
                   f"{group.outcome}")
        ids = tuple(int(r) for r in data.group_members(train, group.group_id)["rollout_id"].dropna())
        members = common.load("the group's completions", queries.rollout_previews, logs, run, step, ids)
        common.static_table(
            st, members[["index_in_group", "completion", "reward", "advantage", "length", "truncated", "filtered"]])
    follow_eval_prompt(step)


def follow_eval_prompt(step: int) -> None:
    """An eval prompt's answers across the run's steps, and every run's answer to it at this step."""
    st.subheader("Follow an eval prompt")
    prompts = common.load("the eval prompts", queries.eval_prompts, logs, run, selection.version)
    prompts = prompts[prompts["prompt_id"].notna()]  # an eval answer logged without its prompt_id cannot be followed
    if prompts.empty:
        st.caption("This run logged no eval rollouts.")
        return
    ids = [int(p) for p in prompts["prompt_id"]]
    text = dict(zip(ids, prompts["prompt"], strict=True))
    prompt_id, _ = common.initial_value("eval_prompt", "prompt", int, ids, ids[0])
    st.session_state["eval_prompt"] = prompt_id
    prompt_id = st.selectbox("Eval prompt", ids, key="eval_prompt",
                             format_func=lambda i: f"{i}: {common.plain(text[i])}")
    common.set_url_value("prompt", prompt_id)
    st.page_link("app_pages/token_trajectories.py", label="p(token) of this prompt's reference solution over training",
                 icon=":material/timeline:", query_params={"run": run, "prompt": prompt_id, "at": step})
    across_steps, across_runs = st.columns(2)
    history = common.load("the eval history", queries.eval_prompt_history, logs, run, prompt_id, selection.version)
    across_steps.markdown(f"**{common.md(run)}, step by step** (this step marked ▶)")
    common.static_table(
        across_steps,
        history.assign(at=history["step"].map(lambda s: "▶" if s == step else "")).drop(columns=["rollout_id"]))
    others = common.load("other runs", queries.eval_prompt_across_runs, logs, selection.task, prompt_id, step)
    across_runs.markdown(f"**Every {common.md(selection.task)} run at step {step}** (its latest evaluation so far)")
    common.static_table(across_runs, others)
    st.caption(f"Each answer's first {data.EVAL_PREVIEW_CHARS} characters; completion_chars: the whole answer's "
               "length. The whole answer, token by token: the Token inspector at its step.")


replay_panel()
