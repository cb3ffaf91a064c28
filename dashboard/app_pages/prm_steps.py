"""PRM steps: a process-supervised completion split into its reasoning steps, the per-token advantage they give,
the whole group's step rewards, and a sandbox to edit step rewards and watch the advantages change.

Only the sandbox's numbers need torch (`engine.advantages`, seconds to import in a fresh server): it is imported
there, after the logged view and the sandbox's table are drawn, so the page's first paint never waits for it."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import advantage_charts, common, data, figures, queries
from dashboard.tokens import reasoning_steps_html

# The worked PRM example: two solutions of 2x + 3 = 7 scored step by step, one right, one wrong from step 2 on.
WORKED_EXAMPLE = pd.DataFrame(
    {
        "completion": ["2x = 7 - 3 → 2x = 4 → x = 2 (right)", "2x = 7 + 3 → 2x = 10 → x = 5 (wrong)"],
        "step 1 reward": [0.9, 0.9], "step 2 reward": [0.95, -0.8], "step 3 reward": [0.8, -0.9],
        "step 1 tokens": [4, 4], "step 2 tokens": [4, 4], "step 3 tokens": [3, 3],
    }
)
STEP_COLUMNS = 3
STEPS_PER_PAGE = 40  # reasoning steps of the text drawn at once
TABLE_ROWS = 200  # rows of the group's step table sent at once
# Bars of the group's step rewards per panel: a half-width panel (~650 px) holds about this many bars with gaps
# (a 16k-token completion has ~300 steps: with G = 16 that is ~5,000 bars unbinned).
STEP_REWARD_BARS = 240

selection = common.require_selection()
logs, run, step = selection.logs_dir, selection.run, selection.step
st.header("PRM steps")


def process_supervised_runs() -> list[str]:
    """The runs of the logs folder whose config says they were trained with process supervision."""
    table = common.load("the list of runs", queries.runs_table, logs)
    return [name for name in data.process_supervised_runs(table) if name != run]


def offer_process_supervised_runs() -> None:
    """Links to the runs whose advantages do come from step rewards, if the folder has any."""
    for name in process_supervised_runs():
        st.page_link("app_pages/prm_steps.py", label=f"Open {common.md(name)}, trained with process supervision",
                     icon=":material/arrow_forward:", query_params={"run": name})


def logged_view() -> None:
    """The logged process-supervised rollouts of this step."""
    if not common.load("the PRM steps", queries.run_has_prm, logs, run, selection.version):
        st.info(f"{common.md(run)} logged no reasoning steps (no step verifier scored its completions). The "
                "sandbox below works for any run.")
        offer_process_supervised_runs()
        return
    rollouts = common.load("the rollouts", queries.step_rollouts, logs, run, step, "train")
    rollouts = rollouts[rollouts["rollout_id"].notna()]  # without an id a rollout's steps cannot be found
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
        format_func=lambda r: f"{r}: group {common.plain(by_id.loc[r].group_id)} "
        f"#{common.plain(by_id.loc[r].index_in_group)} · reward {common.number(by_id.loc[r].reward)}",
    )
    common.set_url_value("rollout", rollout_id)
    rollout = by_id.loc[rollout_id]
    # A rollout logged without a group_id is a group of its own.
    key, value = ("group_id", rollout.group_id) if pd.notna(rollout.group_id) else ("rollout_id", rollout_id)
    group = rollouts[(rollouts[key] == value).fillna(False).astype(bool)]
    group_ids = tuple(int(r) for r in group["rollout_id"])
    steps = common.load("the PRM steps", queries.prm_steps, logs, run, step, group_ids)
    own = steps[steps["rollout_id"] == rollout_id]
    uses_step_rewards = bool(steps["reward_norm"].notna().any())
    if not steps.empty and not uses_step_rewards:
        st.info(f"{common.md(run)} was trained with outcome supervision: its advantages do not use these step "
                "rewards (every token of a completion gets the completion's advantage). Shown below: the step "
                "verifier's raw reward for each reasoning step, as logged.")
        offer_process_supervised_runs()
    st.text(common.plain(rollout.prompt))
    if own.empty:
        st.caption("No reasoning steps were logged for this completion.")
    else:
        tokens = reasoning_text(rollout_id, own)
        if uses_step_rewards:  # with outcome supervision the advantage is one flat line: nothing to show per step
            bins = common.load("the token bins", queries.critic_token_bins, logs, run, step, (rollout_id,),
                               common.SCREEN_BINS)
            figures.show(st, advantage_charts.prm_advantage_line(bins, own, tokens), key="prm_advantage_line")
    st.markdown(f"**All {len(group)} completions of group {common.md(rollout.group_id)}: step rewards**")
    label = {r: f"#{common.plain(i)}" for r, i in zip(group["rollout_id"], group["index_in_group"], strict=True)}
    # G bars a bin: the bins of steps widen as the group grows, so a panel holds at most STEP_REWARD_BARS bars.
    step_bins = common.load("the step rewards", queries.prm_step_bins, logs, run, step, group_ids,
                            max(1, STEP_REWARD_BARS // len(group)))
    step_bins = step_bins.assign(completion=step_bins["rollout_id"].map(label))
    figures.show(st, advantage_charts.group_step_rewards(step_bins), key="group_step_rewards")
    labelled = steps.assign(completion=steps["rollout_id"].map(label))
    table = labelled[["completion", "step_index", "text", "reward_raw", "reward_norm"]]
    st.dataframe(common.page_of(st, table, TABLE_ROWS, f"prm_table_page_{rollout_id}"), hide_index=True,
                 key="prm_table")


def reasoning_text(rollout_id: int, own: pd.DataFrame) -> pd.DataFrame:
    """The completion's text step by step, STEPS_PER_PAGE steps at a time (a 16k-token completion has ~300): only
    the page's tokens are read (from position 0 on the first page, to the end on the last, so tokens outside every
    step are shown as before). Returns those tokens."""
    own = own[own["first_pos"].notna() & own["last_pos"].notna()].sort_values("step_index")  # others are not drawn
    shown = common.page_of(st, own, STEPS_PER_PAGE, f"prm_text_page_{rollout_id}")
    first = 0 if shown.empty or shown.index[0] == own.index[0] else int(shown["first_pos"].min())
    last = None if shown.empty or shown.index[-1] == own.index[-1] else int(shown["last_pos"].max())
    tokens = common.load("the tokens", queries.rollout_tokens, logs, run, step, (rollout_id,), None, (first, last))
    st.html(reasoning_steps_html(tokens, shown))
    return tokens


def sandbox() -> None:
    """Edit a group's step rewards; advantages come from engine.advantages.process_advantages."""
    st.subheader("Sandbox: step rewards → normalized rewards → per-token advantages")
    st.caption("Prefilled with the worked PRM example: two solutions of 2x + 3 = 7 scored step by step, one right "
               "and one wrong from its second step on. Add rows for more completions; leave a step's reward empty "
               "for shorter solutions.")
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
        with st.spinner("Loading engine.advantages (torch)…"):
            from dashboard import recompute  # torch: imported once the rest of the page is on screen

            advantages, normalized = recompute.process_sandbox(step_rewards, step_lengths)
    except ImportError as error:  # torch missing or broken: the rest of the page is already there
        st.error(f"The sandbox needs torch (engine.advantages), which could not be imported: {common.md(error)}")
        return
    except ValueError as error:
        st.error(f"process_advantages refused these rewards: {common.md(error)}")
        return
    st.dataframe(
        pd.DataFrame([{"completion": label, **{f"step {j + 1} normalized": v for j, v in enumerate(values)}}
                      for label, values in zip(labels, normalized, strict=True)]),
        hide_index=True, key="prm_sandbox_normalized",
    )
    figures.show(st, advantage_charts.sandbox_advantages(advantages, labels, [sum(n) for n in step_lengths]),
                 key="prm_sandbox_chart")


logged_view()
sandbox()
