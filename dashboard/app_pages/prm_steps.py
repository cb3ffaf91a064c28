"""PRM steps: a process-supervised completion split into its reasoning steps, the per-token advantage they give,
the whole group's step rewards, and a sandbox to edit step rewards and watch the advantages change."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, common, queries, recompute
from dashboard.tokens import reasoning_steps_html

# A worked example: two solutions of 2x + 3 = 7 scored step by step by a PRM (the second goes wrong at step 2).
WORKED_EXAMPLE = pd.DataFrame(
    {
        "completion": ["2x = 7 - 3 → 2x = 4 → x = 2 (right)", "2x = 7 + 3 → 2x = 10 → x = 5 (wrong)"],
        "step 1 reward": [0.9, 0.9], "step 2 reward": [0.95, -0.8], "step 3 reward": [0.8, -0.9],
        "step 1 tokens": [4, 4], "step 2 tokens": [4, 4], "step 3 tokens": [3, 3],
    }
)
STEP_COLUMNS = 3

selection = common.require_selection()
logs, run, step = selection.logs_dir, selection.run, selection.step
st.header("PRM steps")


def logged_view() -> None:
    """The logged process-supervised rollouts of this step."""
    if not common.load("the PRM steps", queries.run_has_prm, logs, run, selection.version):
        st.info(f"{common.md(run)} was not trained with process supervision (no PRM steps logged). The sandbox "
                "below works for any run.")
        return
    rollouts = common.load("the rollouts", queries.step_rollouts, logs, run, step, "train")
    if rollouts.empty:
        st.info(f"Step {step} has no train rollouts.")
        return
    ids = [int(r) for r in rollouts["rollout_id"]]
    by_id = rollouts.set_index("rollout_id", drop=False)
    rollout_id, problem = common.initial_value("prm_rollout", "rollout", int, ids, ids[0])
    if problem:
        st.warning(f"Rollout {common.linked('rollout')} is not in step {step}; showing {rollout_id}.")
    st.session_state["prm_rollout"] = rollout_id
    rollout_id = st.selectbox(
        "Rollout", ids, key="prm_rollout",
        format_func=lambda r: f"{r}: group {by_id.loc[r].group_id} #{by_id.loc[r].index_in_group} · reward "
        f"{by_id.loc[r].reward:.3g}",
    )
    common.set_url_value("rollout", rollout_id)
    rollout = by_id.loc[rollout_id]
    group = rollouts[rollouts["group_id"] == rollout.group_id]
    group_ids = tuple(int(r) for r in group["rollout_id"])
    steps = common.load("the PRM steps", queries.prm_steps, logs, run, step, group_ids)
    tokens = common.load("the tokens", queries.rollout_tokens, logs, run, step, (rollout_id,), None)
    own = steps[steps["rollout_id"] == rollout_id]
    st.text(rollout.prompt)
    if own.empty:
        st.caption("No reasoning steps were logged for this completion.")
    else:
        st.html(reasoning_steps_html(tokens, own))
        st.plotly_chart(charts.prm_advantage_line(tokens, own), key="prm_advantage_line")
    st.markdown(f"**All {len(group)} completions of group {rollout.group_id}: step rewards**")
    index_of = dict(zip(group["rollout_id"], group["index_in_group"], strict=True))
    labelled = steps.assign(completion=steps["rollout_id"].map(lambda r: f"#{index_of[r]}"))
    st.plotly_chart(charts.group_step_rewards(labelled), key="group_step_rewards")
    st.dataframe(labelled[["completion", "step_index", "text", "reward_raw", "reward_norm"]], hide_index=True,
                 key="prm_table")


def sandbox() -> None:
    """Edit a group's step rewards; advantages come from engine.advantages.process_advantages."""
    st.subheader("Sandbox: step rewards → normalized rewards → per-token advantages")
    st.caption("Prefilled with two worked solutions of 2x + 3 = 7. Add rows for more completions; leave a "
               "step's reward empty for shorter solutions.")
    table = st.data_editor(WORKED_EXAMPLE, num_rows="dynamic", hide_index=True, key="prm_sandbox")
    step_rewards, step_lengths, labels = [], [], []
    for i, row in table.reset_index(drop=True).iterrows():
        rewards, lengths = [], []
        for j in range(1, STEP_COLUMNS + 1):
            reward, n = row.get(f"step {j} reward"), row.get(f"step {j} tokens")
            if pd.notna(reward) and pd.notna(n) and int(n) > 0:
                rewards.append(float(reward))
                lengths.append(int(n))
        if rewards:
            step_rewards.append(rewards)
            step_lengths.append(lengths)
            labels.append(f"#{i} {row.get('completion') or ''}"[:40])
    if not step_rewards:
        st.info("Enter at least one step reward and its token count.")
        return
    try:
        advantages, normalized = recompute.process_sandbox(step_rewards, step_lengths)
    except (ValueError, ImportError) as error:
        st.error(f"process_advantages refused these rewards: {common.md(error)}")
        return
    st.dataframe(
        pd.DataFrame([{"completion": label, **{f"step {j + 1} normalized": v for j, v in enumerate(values)}}
                      for label, values in zip(labels, normalized, strict=True)]),
        hide_index=True, key="prm_sandbox_normalized",
    )
    st.plotly_chart(charts.sandbox_advantages(advantages, labels, [sum(n) for n in step_lengths]),
                    key="prm_sandbox_chart")


logged_view()
sandbox()
