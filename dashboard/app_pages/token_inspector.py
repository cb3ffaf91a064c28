"""Token inspector: one rollout, token by token, coloured by a chosen channel, clip events painted on the tokens."""

from __future__ import annotations

import functools

import streamlit as st

from dashboard import charts, common, data, figures, queries, report, token_view
from dashboard.tokens import CHANNELS, DEFAULT_WINDOW, MISMATCH_CHANNELS, OVERVIEW_BINS
from engine.clip_codes import CLIP_EVENTS, CLIP_NAMES

WINDOW_SIZES = [256, 512, 1024, 2048]

selection = common.require_selection()
logs, run, step = selection.logs_dir, selection.run, selection.step
st.header("Token inspector")

rollouts = common.load("the rollouts", queries.step_rollouts, logs, run, step)
if rollouts.empty:
    st.info(f"Step {step} of {common.md(run)} has no rollouts.")
    st.stop()

identified = rollouts[rollouts["rollout_id"].notna()]
if identified.empty:  # the logger left rollout_id out: its tokens cannot be tied to a completion
    st.info(f"Step {step} of {common.md(run)} logged its rollouts without a rollout_id, so their tokens cannot be "
            "shown.")
    st.stop()
by_id = identified.set_index("rollout_id", drop=False)
rollout_ids = [int(r) for r in identified["rollout_id"]]


def describe(r) -> str:
    """A rollout's label in the picker (`r`: its row)."""
    group = (f"eval prompt {common.plain(r.prompt_id)}" if common.plain(r.kind) == "eval"
             else f"group {common.plain(r.group_id)} #{common.plain(r.index_in_group)}")
    return (f"{int(r.rollout_id)}: {group} · reward {common.number(r.reward)} · "
            f"A {common.number(r.advantage, '+.3g')} · {common.number(r.length, '.0f')} tok")


# Built once from the rows: a format_func that looked each option's row up (`.loc`) took a third of a rerun's CPU
# on a step of 514 rollouts.
labels = {rollout_id: describe(r) for rollout_id, r in zip(rollout_ids, identified.itertuples(index=False),
                                                           strict=True)}


left, middle, right = st.columns([3, 2, 2])
rollout_id, problem = common.initial_value("rollout", "rollout", int, rollout_ids, rollout_ids[0])
if problem:
    st.warning(f"Rollout {common.linked('rollout')} is not in step {step}; showing rollout {rollout_id}.")
st.session_state["rollout"] = rollout_id
rollout_id = left.selectbox("Rollout", rollout_ids, key="rollout", format_func=labels.get)

passes = common.load("the optimisation passes", queries.rollout_passes, logs, run, step, rollout_id)
pass_ = None
if passes:
    pass_, _ = common.initial_value("pass", "pass", int, passes, passes[-1])
    st.session_state["pass"] = pass_
    pass_ = right.selectbox("Optimisation pass", passes, key="pass",
                            help="new log-prob, ratio, clip, gradient weight, token loss and KL as used by this pass")
elif common.imported_lacks(selection.config) is not None:
    right.caption("No optimisation passes: an imported run holds the trainer's per-token values, not its passes.")
else:
    right.caption("No optimisation pass used this rollout (eval rollouts are never trained on).")

# A critic run's loss used its GAE advantages whitened: "advantage" is that one, the logged one is beside it.
whitening = common.load("the whitening", queries.step_whitening, logs, run, step)
# The whole completion at screen resolution (DuckDB bins it): the overview strip, the heatmap, and which channels
# this rollout has at all.
bins = data.as_loss_used(common.load("the token bins", queries.rollout_token_bins, logs, run, step, rollout_id,
                                     pass_, OVERVIEW_BINS), whitening)
absent = [name for name in MISMATCH_CHANNELS if bins.empty or bins[CHANNELS[name].column].isna().all()]
channel_names = [name for name in CHANNELS
                 if (whitening is not None or name != "gae_advantage") and name not in absent]
channel, _ = common.initial_value("channel", "channel", str, channel_names, "advantage")
st.session_state["channel"] = channel
channel = middle.selectbox("Colour by", channel_names, key="channel", format_func=lambda c: CHANNELS[c].label)
if absent:
    middle.caption(", ".join(CHANNELS[name].label for name in absent) + ": not logged for this rollout (they need "
                   "a sampler's log-probs, and IS weights or rejections a mismatch correction).")
for key, value in (("rollout", rollout_id), ("channel", channel), ("pass", pass_)):
    common.set_url_value(key, value)

# Built only when clicked (a callable): the report embeds plotly's JavaScript (1.5 MB, or 4.8 without the cartesian
# bundle: dashboard.plotly_bundle).
build = functools.partial(report.build_report, logs, run, step, rollout_id, channel, reader=queries.get_reader(logs))
st.download_button("Download a report of this step", build, file_name=f"{run}-step{step}.html", mime="text/html",
                   on_click="ignore",
                   icon=":material/download:", help="One HTML file with the run's curves and config, this step's "
                   "groups and this rollout token by token: it opens in any browser, without Python or a network. "
                   "Same as `policylens report RUN --step N --rollout ID`.")

rollout = by_id.loc[rollout_id]

st.markdown("**Prompt**")
st.text(common.plain(rollout.prompt))
metrics = st.columns(7)
metrics[0].metric("reward", common.number(rollout.reward))
metrics[1].metric("correct", common.number(rollout.reward_correct))
metrics[2].metric("process", common.number(rollout.reward_process))  # "–": no process reward
metrics[3].metric("length reward", common.number(rollout.reward_length))
metrics[4].metric("advantage", common.number(rollout.advantage, "+.3g"))
metrics[5].metric("length", common.number(rollout.length, ".0f"))
flags = [name for name, on in (("truncated", rollout.truncated), ("filtered", rollout.filtered)) if common.flag(on)]
metrics[6].metric("flags", ", ".join(flags) or "–")
if common.flag(rollout.filtered):
    st.caption(f"Filtered from the update: {common.md(rollout.filter_reason)}")
st.caption(f"Reference answer: {common.md(rollout.answer)}")
if not common.is_missing(rollout.reward_components):  # one value per reward function (TRL, verl, imported runs)
    st.caption(common.md(common.reward_breakdown(rollout)))

if bins.empty:
    st.info("No tokens logged for this rollout. (A run imported from TRL or verl dumps has tokens only when "
            "imported with --tokenizer, and never log-probs: those dumps hold text and rewards only.)")
    st.stop()
if common.plain(rollout.kind) == "eval":
    st.caption("Eval rollouts are not trained on: only sampling-time channels (log-probs, entropy) exist.")
elif CHANNELS[channel].column in bins.columns and bins[CHANNELS[channel].column].isna().all():
    st.caption(f"{CHANNELS[channel].label} was not logged for this rollout.")


@st.fragment
def text_and_values() -> None:
    """The text by windows, the token x channel heatmap and the values: moving the window reruns only this part
    (the page's pickers, metrics and cached reads above stay as they are)."""
    # A long completion is read by windows of its text: thousands of spans in one block take seconds to draw.
    first_pos, last_pos = int(bins["first_pos"].min()), int(bins["last_pos"].max())
    if int(bins["tokens"].sum()) > DEFAULT_WINDOW:
        size = st.session_state.get("window_size", DEFAULT_WINDOW)
        starts = list(range(first_pos - first_pos % size, last_pos + 1, size))
        start, _ = common.initial_value("window", "window", lambda raw: int(raw) // size * size, starts, starts[0])
        st.session_state["window"] = start

        def jump_to_clicked_bin(x: float) -> None:
            st.session_state["window"] = min(starts[-1], int(x) // size * size)

        choose, how_many = st.columns([5, 1])
        if len(starts) > 1:
            start = choose.select_slider("Tokens shown", starts, key="window",
                                         format_func=lambda s: f"{s}–{min(s + size - 1, last_pos)}",
                                         help="The text is shown a window at a time; click the strip below to jump.")
        how_many.selectbox("Window", WINDOW_SIZES, index=WINDOW_SIZES.index(size), key="window_size",
                           format_func=lambda n: f"{n} tokens")
        window = (max(start, first_pos), min(start + size - 1, last_pos))
        figures.show(st, charts.token_overview_strip(bins, channel, window, size), key="token_strip",
                     on_click=jump_to_clicked_bin, config={"displayModeBar": False})
        common.set_url_value("window", start)
    else:
        window = (first_pos, last_pos)
        common.set_url_value("window", None)
    # The whole completion read once (a 16k-token one in about the time of a window: finding its rows is the cost),
    # then each window cut from it: a move of the window reads nothing.
    completion = common.load("the tokens", queries.rollout_tokens, logs, run, step, (rollout_id,), pass_)
    first, last = completion["position"].to_numpy().searchsorted([window[0], window[1] + 1])  # in position order
    tokens = data.as_loss_used(completion.iloc[first:last].reset_index(drop=True), whitening)

    token_view.show(tokens, channel)
    if whitening is not None and channel in ("advantage", "gae_advantage"):
        mean, std = whitening
        st.caption(f"This run has a critic. advantage: the logged GAE advantage whitened with this step's mean "
                   f"{mean:.4g} and std {std:.4g}, as the PPO loss used it (its clip decisions follow this one); GAE "
                   "advantage before whitening: as logged.")
    clip_counts = {code: int(bins[f"clip_{CLIP_NAMES[code]}"].sum()) for code in CLIP_EVENTS}
    if bins["ratio"].notna().any():  # a pass was logged for this rollout
        st.caption("Clip events in this pass: " + ", ".join(f"{CLIP_NAMES[c]} {n}" for c, n in clip_counts.items())
                   + (f" · rejected tokens {int(bins['rejected_tokens'].sum())}" if "rejected" not in absent else ""))

    whole = window == (first_pos, last_pos)
    if whole:
        st.subheader("Token × channel")
        figures.show(st, charts.token_channel_heatmap(tokens, channel_names), key="token_channel_heatmap")
    # Filled only while open (opening it reruns this fragment): a window's table is 77 kB that every move of the
    # window would otherwise send and the browser parse, for a table most moves never look at.
    values = st.expander("Values" if whole else "Values of the tokens shown", key="token_values_open",
                         on_change="rerun")
    if values.open:
        values.dataframe(tokens.drop(columns=["rollout_id"]), hide_index=True, key="token_values")


text_and_values()
if int(bins["tokens"].sum()) > DEFAULT_WINDOW:
    # Outside the fragment: it shows the whole completion, so moving the window neither rebuilds nor redraws it.
    st.subheader("Token × channel")
    st.caption(f"The whole completion, each column the mean of {int(bins['tokens'].max())} tokens or fewer; the "
               "window's exact values are on each token above and in its table of values.")
    figures.show(st, charts.token_channel_bins(bins, channel_names), key="token_channel_heatmap")
