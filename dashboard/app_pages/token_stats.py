"""Token statistics: which tokens get clipped or carry the gradient over a range of steps, per token text (and
position), by entropy quantile within their response (ASPO's entropy-dependent clip), and which carry Cui et al.'s
covariance and the KL to the reference, with the run's entropy against its summed covariance."""

from __future__ import annotations

from urllib.parse import urlencode

import streamlit as st

from dashboard import charts, common, data, entropy_charts, figures, prefetch, queries, token_data
from engine.algorithms import defaults as algorithm_defaults

ASPO = algorithm_defaults("aspo")  # the numbers of the entropy split's caption

BUCKETS = {"no position split": 0, "4 positions": 4, "8 positions": 8, "16 positions": 16, "32 positions": 32}
ENTROPY_BINS = 10
MAX_RUNS = 6
# Rows of the per-token table a page sends: split by position, a run of long responses over a real vocabulary has
# millions of (text, positions) rows, and sending all of them once failed (a 228 MB message, over Streamlit's limit).
TABLE_ROWS = 2_000
ORDERS = {"count": "count", "clip high": "clip_high_rate", "clip low": "clip_low_rate",
          "clip dual": "clip_dual_rate", "mean |grad weight|": "abs_grad_weight_mean",
          "mean |ratio − 1|": "ratio_deviation_mean", "mean entropy": "entropy_mean",
          "mean advantage": "advantage_mean"}

selection = common.require_selection()
logs, run, steps = selection.logs_dir, selection.run, list(selection.steps)
st.header("Token statistics")

left, right = st.columns([3, 2])
if len(steps) > 1:
    # The whole run, unless steps its token summary does not cover hold many tokens (they are read row by row)
    start = steps[0]
    if gaps := common.load("the run's layout", queries.unsummarised_steps, logs, run, selection.version):
        per_step = common.load("the tokens per step", queries.train_tokens_per_step, logs, run, selection.version)
        unsummarised = {s: n for s, n in per_step.items() if any(a <= s <= b for a, b in gaps)}
        start = common.latest_steps_within(steps, unsummarised, queries.STATS_DEFAULT_TOKENS)
    first, last = left.select_slider("Steps", steps, value=(start, steps[-1]), key="stats_steps")
    if start != steps[0]:
        left.caption(f"Opened on the latest steps holding at most {queries.STATS_DEFAULT_TOKENS:,} train tokens "
                     "logged without a token summary (logged before it): those are read token by token, and over "
                     "a whole large run that takes far longer (100M tokens: about a minute).")
else:
    first = last = steps[0]
bucket_name = right.selectbox("Split by position", list(BUCKETS), key="stats_bucket",
                              help=f"from position {token_data.SPLIT_UNTIL:,} on, in doubling ranges "
                              f"({token_data.SPLIT_UNTIL:,}..{2 * token_data.SPLIT_UNTIL - 1:,}, "
                              f"{2 * token_data.SPLIT_UNTIL:,}..{4 * token_data.SPLIT_UNTIL - 1:,}, ...)")
bucket = BUCKETS[bucket_name]

# ---- per token text
stats = common.load("the token statistics", queries.token_stats, logs, run, first, last, bucket, selection.version)
if stats.empty:
    st.info(f"Run {common.md(run)} logged no train tokens in steps {first}..{last} (per-token logging off, or only "
            "evaluations in that range).")
    st.stop()
if bucket:
    stats.insert(stats.columns.get_loc("position_from") + 1, "position_to",
                 token_data.bucket_last(stats["position_from"], bucket))
else:
    stats = stats.drop(columns=["position_from"])
count_column, order_column = st.columns(2)
min_count = count_column.number_input("Hide tokens seen fewer times than", 1, value=1, key="stats_min_count")
order = order_column.selectbox("Order by (highest first)", list(ORDERS), key="stats_order")
kept = stats[stats["count"] >= min_count]  # by count already
if order != "count":
    kept = kept.sort_values(ORDERS[order], ascending=False, na_position="last", kind="stable")
shown = common.page_of(st, kept.reset_index(drop=True), TABLE_ROWS, "stats_page")
st.caption(f"{len(kept):,} of {len(stats):,} token texts in steps {first}..{last} of {common.md(run)} (train tokens), "
           f"{TABLE_ROWS:,} a page. Clip rates, |gradient weight| and |ratio − 1| are per token and optimisation "
           "pass. Click a column to sort the page, a row to list the rollouts that hold the token.")
rate = st.column_config.NumberColumn(format="%.3f")
picked = st.dataframe(
    shown.assign(token_text=shown["token_text"].map(charts.token_as_text)), hide_index=True, key="stats_table",
    on_select="rerun", selection_mode="single-row",
    column_config={
        "token_text": st.column_config.TextColumn("token"), "position_from": "from position",
        "position_to": "to position",
        "advantage_mean": st.column_config.NumberColumn("mean advantage", format="%.3f"),
        "clip_low_rate": st.column_config.NumberColumn("clip low", format="%.3f"),
        "clip_high_rate": st.column_config.NumberColumn("clip high", format="%.3f"),
        "clip_dual_rate": st.column_config.NumberColumn("clip dual", format="%.3f"),
        "abs_grad_weight_mean": st.column_config.NumberColumn("mean |grad weight|", format="%.4f"),
        "ratio_deviation_mean": st.column_config.NumberColumn("mean |ratio − 1|", format="%.4f"),
        "entropy_mean": st.column_config.NumberColumn("mean entropy", format="%.3f"),
    },
)
rows = picked.selection.rows if picked is not None else []
if rows and rows[0] < len(shown):
    token = shown.iloc[rows[0]]
    where = f" at positions {token_data.bucket_positions(int(token['position_from']), bucket)}" if bucket else ""
    holders = common.load("the rollouts with this token", queries.rollouts_with_token, logs, run, first, last,
                          str(token["token_text"]), bucket, int(token["position_from"]) if bucket else None)
    st.markdown(f"**Rollouts holding token {common.md(charts.token_as_text(token['token_text']))}{common.md(where)}** "
                f"({len(holders)}{'+' if len(holders) >= 500 else ''})")
    holders = holders.assign(inspect=[
        "tokens?" + urlencode({"run": run, "step": int(s), "rollout": int(r)})
        for s, r in zip(holders["step"], holders["rollout_id"], strict=True)])
    st.dataframe(holders, hide_index=True, key="stats_holders", column_config={
        "inspect": st.column_config.LinkColumn("token inspector", display_text="open"),
        "completion": st.column_config.TextColumn("completion"),
    })

# ---- by entropy quantile, per run
st.subheader("By entropy within the response")
table = common.load("the runs", queries.runs_table, logs)
candidates = data.comparable_runs(table, run)
st.session_state["stats_runs"] = [r for r in st.session_state.get("stats_runs", candidates[:MAX_RUNS])
                                  if r in candidates] or [run]
compared = st.multiselect("Runs", candidates, key="stats_runs", max_selections=MAX_RUNS)
if compared:
    bins = common.load("the entropy bins", queries.entropy_bins, logs, tuple(compared), first, last, ENTROPY_BINS,
                       queries.live_signature(logs))
    st.caption(
        f"Each train token is placed by its entropy (at sampling) among the quantiles of its own response's token "
        f"entropies, in {ENTROPY_BINS} bins. Left: how often tokens of each bin were clipped; right: the bin's share "
        "of the run's total |gradient weight| over the chosen steps. Dashed: ASPO's split at the response's "
        f"{ASPO['entropy_quantile']:.0%} entropy quantile (clip range {ASPO['eps_high_entropy']:g} above it, "
        f"{ASPO['eps_low']:g} below), the same top {1 - ASPO['entropy_quantile']:.0%} of high-entropy 'forking' "
        "tokens that arXiv 2506.01939 finds carry the learning.")
    figures.show(st, charts.entropy_bin_bars(bins, ENTROPY_BINS, queries.ASPO_ENTROPY_QUANTILE), key="stats_entropy")
    st.dataframe(bins, hide_index=True, key="stats_entropy_table")


# ---- covariance and KL drivers
def driver_section(ranking: str, per_step, title: str, value: str, value_title: str, note: str) -> None:
    """One ranking of `token_data.covariance_drivers` ("covariance" or "kl"): its token texts over steps and its
    table."""
    table = token_data.driver_table(per_step, ranking)
    st.markdown(f"**{title}**")
    if table.empty:
        st.caption(note)
        return
    figures.show(st, entropy_charts.drivers_over_steps(per_step, table, value, value_title),
                 key=f"stats_{ranking}_steps")
    shown = table.assign(token_text=table["token_text"].map(charts.token_as_text))
    unused = ([] if bucket else ["position_from"]) + ([] if (table["cov_rate"] > 0).any() else ["cov_rate"])
    st.dataframe(shown.drop(columns=unused), hide_index=True,
                 key=f"stats_{ranking}_table", column_config={
                     "token_text": st.column_config.TextColumn("token"), "position_from": "from position",
                     "rows": st.column_config.NumberColumn("token × pass rows"),
                     "covariance_sum": st.column_config.NumberColumn("summed covariance", format="%.4g"),
                     "covariance_mean": st.column_config.NumberColumn("mean covariance", format="%.4f"),
                     "kl_share": st.column_config.NumberColumn("share of the KL", format="%.3f"),
                     "kl_vs_mean": st.column_config.NumberColumn("KL ÷ mean token's", format="%.2f"),
                     "cov_rate": st.column_config.NumberColumn("selected by Clip-/KL-Cov", format="%.4f"),
                     "entropy_mean": st.column_config.NumberColumn("mean entropy", format="%.3f"),
                     "entropy_first": st.column_config.NumberColumn("entropy, first step", format="%.3f"),
                     "entropy_last": st.column_config.NumberColumn("entropy, last step", format="%.3f"),
                 })


def drivers_sections() -> None:
    """Which tokens carry the covariance (where the entropy falls) and the KL, and entropy against covariance."""
    st.subheader("Covariance and KL drivers")
    per_step = common.load("the covariance drivers", queries.covariance_drivers, logs, run, first, last, bucket,
                           selection.version)
    if per_step.empty:
        st.info(f"Run {common.md(run)} logged no optimisation passes in steps {first}..{last}.")
        return
    st.caption(
        "Covariance: Cui et al.'s (A − mean A)(log π − mean log π) of each loss token and optimisation pass, the means "
        "over that pass's loss tokens, log π the pass's new log-prob: the tokens Clip-Cov and KL-Cov act on. A "
        "token with a large positive covariance (a likely token with a high advantage, or an unlikely one with a low "
        "advantage) is one where the update takes entropy away (arXiv 2505.22617). KL: the logged k3 KL to the "
        "reference per token and pass; its share of the summed KL, and its mean over the mean of every loss token. "
        f"Steps {first}..{last}; the first and last step's mean entropy (at sampling) of each token text.")
    driver_section("covariance", per_step, f"Highest summed covariance (top {queries.DRIVERS_TOP})",
                   "covariance_sum", "summed covariance", "")
    driver_section("kl", per_step, f"Highest share of the KL to the reference (top {queries.DRIVERS_TOP})",
                   "kl_sum", "summed KL",
                   "No KL to a reference was logged in these steps (a run without a reference model).")
    st.markdown("**Entropy against the summed covariance per step**")
    steps_cov = common.load("the covariance per step", queries.covariance_per_step, logs, run, first, last,
                            selection.version)
    figures.show(st, entropy_charts.entropy_against_covariance(steps_cov), key="stats_entropy_covariance")
    st.caption("Summed covariance: over the step's loss tokens (each token counted once when a step trains in "
               "several epochs). Entropy: the logged mean entropy at sampling (`steps.entropy`). Cui et al. find "
               "the entropy change from one step to the next tracks minus the covariance.")


drivers_sections()


def split_ahead(other: int) -> None:
    """What this page asks for the same steps split by `other` positions, for `dashboard.prefetch`: the answers land
    in the caches the page reads."""
    queries.token_stats(logs, run, first, last, other, selection.version)
    prefetch.give_way()
    queries.covariance_drivers(logs, run, first, last, other, selection.version)


# The other position splits, the neighbours in the picker first: each reads the run's token summary by position
# again (at 100M token rows, 0.7 s alone and twice that beside the browser drawing the page).
splits = list(BUCKETS.values())
prefetch.ahead(split_ahead, sorted(splits, key=lambda b: abs(splits.index(b) - splits.index(bucket)))[1:])
