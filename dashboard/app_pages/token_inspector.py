"""Token inspector: one rollout, token by token, coloured by a chosen channel, clip events painted on the tokens."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, common, queries
from dashboard.tokens import CHANNELS, CLIP_NAMES, token_heatmap_html

selection = common.require_selection()
logs, run, step = selection.logs_dir, selection.run, selection.step
st.header("Token inspector")

rollouts = common.load("the rollouts", queries.step_rollouts, logs, run, step)
if rollouts.empty:
    st.info(f"Step {step} of {common.md(run)} has no rollouts.")
    st.stop()

by_id = rollouts.set_index("rollout_id", drop=False)
rollout_ids = [int(r) for r in rollouts["rollout_id"]]


def describe(rollout_id: int) -> str:
    r = by_id.loc[rollout_id]
    group = f"group {r.group_id} #{r.index_in_group}" if r.kind == "train" else f"eval prompt {r.prompt_id}"
    return f"{rollout_id}: {group} · reward {r.reward:.3g} · A {r.advantage:+.3g} · {r.length} tok"


left, middle, right = st.columns([3, 2, 2])
rollout_id, problem = common.initial_value("rollout", "rollout", int, rollout_ids, rollout_ids[0])
if problem:
    st.warning(f"Rollout {common.linked('rollout')} is not in step {step}; showing rollout {rollout_id}.")
st.session_state["rollout"] = rollout_id
rollout_id = left.selectbox("Rollout", rollout_ids, key="rollout", format_func=describe)

channel_names = list(CHANNELS)
channel, _ = common.initial_value("channel", "channel", str, channel_names, "advantage")
st.session_state["channel"] = channel
channel = middle.selectbox("Colour by", channel_names, key="channel", format_func=lambda c: CHANNELS[c].label)

passes = common.load("the optimisation passes", queries.rollout_passes, logs, run, step, rollout_id)
pass_ = None
if passes:
    pass_, _ = common.initial_value("pass", "pass", int, passes, passes[-1])
    st.session_state["pass"] = pass_
    pass_ = right.selectbox("Optimisation pass", passes, key="pass",
                            help="new log-prob, ratio, clip, gradient weight, token loss and KL as used by this pass")
else:
    right.caption("No optimisation pass used this rollout (eval rollouts are never trained on).")
for key, value in (("rollout", rollout_id), ("channel", channel), ("pass", pass_)):
    common.set_url_value(key, value)

rollout = by_id.loc[rollout_id]
tokens = common.load("the tokens", queries.rollout_tokens, logs, run, step, (rollout_id,), pass_)

st.markdown("**Prompt**")
st.text(rollout.prompt)
metrics = st.columns(7)
metrics[0].metric("reward", f"{rollout.reward:.3g}")
metrics[1].metric("correct", f"{rollout.reward_correct:.3g}" if queries.known(rollout.reward_correct) else "–")
process = rollout.reward_process
metrics[2].metric("process", "–" if process != process else f"{process:.3g}")  # NaN: no process reward
metrics[3].metric("length reward", f"{rollout.reward_length:.3g}" if queries.known(rollout.reward_length) else "–")
metrics[4].metric("advantage", f"{rollout.advantage:+.3g}")
metrics[5].metric("length", int(rollout.length) if queries.known(rollout.length) else "–")
flags = [name for name, on in (("truncated", rollout.truncated), ("filtered", rollout.filtered)) if queries.is_set(on)]
metrics[6].metric("flags", ", ".join(flags) or "–")
if queries.is_set(rollout.filtered):
    st.caption(f"Filtered from the update: {common.md(rollout.filter_reason)}")
st.caption(f"Reference answer: {common.md(rollout.answer)}")
if queries.known(rollout.reward_components):  # one value per reward function (TRL, verl, imported runs)
    st.caption(common.md(queries.reward_breakdown(rollout)))

if tokens.empty:
    st.info("No tokens logged for this rollout. (A run imported from TRL or verl dumps has tokens only when "
            "imported with --tokenizer, and never log-probs: those dumps hold text and rewards only.)")
    st.stop()
if rollout.kind == "eval":
    st.caption("Eval rollouts are not trained on: only sampling-time channels (log-probs, entropy) exist.")
elif CHANNELS[channel].column in tokens.columns and tokens[CHANNELS[channel].column].isna().all():
    st.caption(f"{CHANNELS[channel].label} was not logged for this rollout.")

st.html(token_heatmap_html(tokens, channel))
if "clip" in tokens.columns and tokens["clip"].notna().any():
    counts = tokens["clip"].fillna(0).astype(int).value_counts()
    st.caption("Clip events in this pass: " + ", ".join(f"{CLIP_NAMES[c]} {counts.get(c, 0)}" for c in (1, 2, 3)))

st.subheader("Token × channel")
st.plotly_chart(charts.token_channel_heatmap(tokens, channel_names), key="token_channel_heatmap")
with st.expander("Values"):
    st.dataframe(tokens.drop(columns=["rollout_id"]), hide_index=True, key="token_values")
