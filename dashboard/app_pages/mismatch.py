"""Mismatch: where the sampler and the trainer disagree about the same tokens, over training and at one step, and
what each published correction would do to that step's tokens.

Everything above the corrections reads the log only (`dashboard.mismatch`: pandas and numpy); the corrections
need `engine.corrections` (torch, seconds to import in a fresh server), so they are computed last, once the rest
of the page is on screen, as the PRM steps page does with its sandbox."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, common, data, figures, prefetch, queries
from engine.correction_settings import RATIO_BAND

MAX_CURVE_RUNS = 4  # runs drawn side by side by default
LINKED_TEXTS = 8  # worst token texts with a link to their worst rollout

selection = common.require_selection()
logs, run, step = selection.logs_dir, selection.run, selection.step
st.header("Mismatch")
band = f"[{RATIO_BAND[0]:g}, {RATIO_BAND[1]:g}]"

runs_with_metrics = common.load("the runs with mismatch metrics", queries.mismatch_runs, logs)
view = common.load("the step's sampler log-probs", queries.step_mismatch, logs, run, step)
if view is None and run not in runs_with_metrics:
    st.info(
        f"{common.md(run)} logged no sampler log-probs (the tokens' `sampler_logp` is empty), so there is no "
        "mismatch to show: it needs, next to the trainer's log-prob of each sampled token (`old_logp`), the one the "
        "sampler reported when it drew the token. Runs PolicyLens trains log both (`--sampler-dtype bfloat16`, "
        "`--sampler-lag K`, `--top-p` / `--top-k` make them differ); a TRL run logs them on TRL's vLLM path; runs "
        "logged before these columns, and imports of dumps without the sampler's log-probs, have none.")
    for name in runs_with_metrics[:MAX_CURVE_RUNS]:
        st.page_link("app_pages/mismatch.py", label=f"Open {common.md(name)}, which logged them",
                     icon=":material/arrow_forward:", query_params={"run": name})
    st.stop()

# ---------------------------------------------------------------- over training
st.subheader("Over training")
if runs_with_metrics:
    others = [name for name in runs_with_metrics if name != run]
    default = ([run] if run in runs_with_metrics else []) + others[: MAX_CURVE_RUNS - 1]
    chosen = st.multiselect("Runs side by side", runs_with_metrics, default=default, key="mismatch_runs")
    if chosen:
        curves = common.load("the mismatch curves", queries.mismatch_curves, logs, tuple(chosen),
                             queries.live_signature(logs))
        figures.show(st, charts.metric_curves(curves, data.MISMATCH_CURVES), key="mismatch_curves")
        st.caption(f"Per step, over the trained tokens: KL(sampler ‖ trainer) = mean(log π_sampler − log π_trainer), "
                   f"chi-square = mean(ρ²) − 1 with ρ = π_trainer / π_sampler, the share of tokens with ρ outside "
                   f"{band}, the share the rejection left out of the loss and the IS weights' effective sample size "
                   "(the last two only with a correction on), as the trainer logged them (verl's off-policy metrics, "
                   "engine.corrections). Is the gap growing?")
if run not in runs_with_metrics:
    st.caption(f"{common.md(run)} logged no per-step mismatch metrics; its tokens' sampler log-probs are below.")

# ---------------------------------------------------------------- one step
st.subheader(f"At step {step}")
if view is None:
    st.info(f"No trained token of step {step} has a sampler log-prob.")
    st.stop()
numbers = view.summary
columns = st.columns(5)
columns[0].metric("tokens (sequences)", f"{numbers['tokens']} ({numbers['sequences']})")
columns[1].metric("mean log-ratio", common.number(numbers["mean_log_ratio"], ".2e"))
columns[2].metric("mean |log-ratio|", common.number(numbers["mean_abs_log_ratio"], ".2e"))
columns[3].metric(f"outside {band}", common.number(numbers["out_of_band"], ".2%"))
columns[4].metric("truncation's share", common.number(numbers.get("truncation_share"), ".1%"),
                  help="The part of mean |log-ratio| that top-p / top-k truncation adds: 1 − mean|old − "
                       "sampler_full| / mean|old − sampler| (– without sampler_logp_full).")
st.caption("log-ratio = old_logp − sampler_logp = log(π_trainer / π_sampler) of each trained token. A mean near 0 "
           "says little: the tails are where tokens leave the band.")
left, right = st.columns(2)
left.markdown("**Token log-ratios**")
figures.show(left, charts.mismatch_histogram(view.histogram, RATIO_BAND), key="mismatch_histogram")
right.markdown("**Trainer against sampler probability**" + (" (binned)" if view.grid_cells else ""))
figures.show(right, charts.probability_scatter(view.probabilities, view.grid_cells), key="probability_scatter")

st.markdown(f"**Share of tokens outside {band}**")
figures.show(st, charts.mismatch_buckets(view.buckets), key="mismatch_buckets")

st.markdown("**Worst token texts** (most tokens outside the band)")
worst = view.by_text.assign(token_text=view.by_text["token_text"].map(charts.token_as_text))
# Static (20 rows): the page's only interactive grid cost the browser about 0.8 s on every visit to load and draw.
common.static_table(st, worst.rename(columns={"out_of_band": "share outside", "mean_abs_log_ratio": "mean |log-ratio|",
                                              "worst_log_ratio": "worst log-ratio"}),
                    {"share outside": ".2f", "mean |log-ratio|": ".4f", "worst log-ratio": "+.4f"})
links = st.columns(4)
for i, row in enumerate(worst.head(LINKED_TEXTS).itertuples(index=False)):
    links[i % 4].page_link(
        "app_pages/token_inspector.py", icon=":material/text_fields:",
        label=common.md(f"{row.token_text}: rollout {int(row.worst_rollout_id)}, position {int(row.worst_position)}"),
        query_params={"run": run, "step": step, "rollout": int(row.worst_rollout_id)})

st.markdown("**Per sequence: mismatch against reward and advantage**")
figures.show(st, charts.sequence_mismatch(view.sequences), key="sequence_mismatch")


# ---------------------------------------------------------------- corrections
def group_members(rollouts, group_id: int):
    """The train rollouts of one group, in their order in the group."""
    return rollouts[rollouts["group_id"] == group_id].sort_values("index_in_group")


def corrections() -> int | None:
    """Every correction of engine.corrections on this step's logged log-ratios: a table for the whole step and the
    weights of one group's tokens side by side (torch: imported here, after the rest is drawn). The group shown, if
    any."""
    st.subheader("What each correction would do to this step's tokens")
    st.caption("Each correction of engine.corrections applied to the logged log-ratios (old_logp − sampler_logp), "
               "at its reference's default or preset threshold (the rejection options verl gives no preset for "
               "use the bounds in the name, matched to TIS's band [0.5, 2]); the off-policy mask takes the logged "
               "old log-probs as the trainer's current ones (the first pass). Weight 0: out of the loss; 1: "
               "unchanged.")
    if selection.config.get("rollout_is") or selection.config.get("rollout_rs") or selection.config.get(
            "off_policy_mask") is not None:
        used = {k: selection.config.get(k) for k in ("rollout_is", "rollout_is_threshold", "rollout_rs",
                                                     "rollout_rs_threshold", "off_policy_mask")}
        st.caption("This run trained with " + common.md(", ".join(f"{k} {v}" for k, v in used.items()
                                                                  if v is not None)))
    summary, rollouts = common.train_groups(selection)
    try:
        with st.spinner("Loading engine.corrections (torch)…"):
            table = queries.correction_table(logs, run, step)
    except ImportError as error:  # torch missing or broken: the rest of the page is already there
        st.error(f"The corrections need torch (engine.corrections), which could not be imported: {common.md(error)}")
        return None
    common.static_table(st, table, {c: ".3f" for c in table.columns[2:] if c != "sequences touched"})
    group_id = common.group_picker(st, summary, "mismatch_group")
    if group_id is None:
        return None
    common.set_url_value("group", group_id)
    members = group_members(rollouts, group_id)
    ids, weights, positions, width = queries.correction_weights(
        logs, run, step, tuple(int(r) for r in members["rollout_id"]), common.PANEL_BINS)
    if not ids:
        st.caption(f"No token of group {group_id} has a sampler log-prob.")
        return group_id
    index_of = dict(zip(members["rollout_id"].astype(int), members["index_in_group"], strict=True))
    labels = [f"#{common.plain(index_of.get(r))} (rollout {r})" for r in ids]
    figures.show(st, charts.stacked_weight_heatmap(weights, labels, positions=positions, bin_width=width),
                 key="correction_heatmaps")
    return group_id


def mismatch_step_ahead(next_step: int) -> None:
    """What this page asks at `next_step` with the same group, for `dashboard.prefetch`: the answers land in the
    caches the page reads."""
    if queries.step_mismatch(logs, run, next_step) is None:
        return
    prefetch.give_way()  # between the cached calls: a user's script started meanwhile goes first
    queries.group_summary(logs, run, next_step)
    rollouts = queries.step_rollout_numbers(logs, run, next_step, "train")
    queries.correction_table(logs, run, next_step)
    prefetch.give_way()
    members = group_members(rollouts[rollouts["rollout_id"].notna()], shown_group)
    if len(members):  # the page keeps the group when the next step has it
        queries.correction_weights(logs, run, next_step, tuple(int(r) for r in members["rollout_id"]),
                                   common.PANEL_BINS)


shown_group = corrections()
prefetch.ahead(mismatch_step_ahead, prefetch.neighbours(selection.steps, step))
