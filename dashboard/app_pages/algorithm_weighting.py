"""Algorithm weighting: on the same logged tokens, what every algorithm of `engine.objectives.ALGORITHMS` would do.

Every number on this page comes from `engine.objectives.policy_loss` (via dashboard.recompute); the page only
chooses the tokens and the knobs and draws the answers.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pandas as pd
import streamlit as st

from dashboard import charts, common, figures, prefetch, queries, recompute
from engine.algorithms import ALGORITHMS, OBJECTIVES, uses_critic
from engine.algorithms import defaults as algorithm_defaults

MAX_SCATTER_POINTS = 4000
MAX_HEATMAP_ROWS = 48
# The comparison the page opens with: the four objectives side by side, plus the run's own and PPO for a run with a
# critic. The others are a click away: each figure draws a panel per algorithm, and nine panels per figure cost the
# browser about 0.3 s more on every visit than four.
HEADLINE = ("grpo", "dapo", "gspo", "aspo")
OLD_PROBS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.95)

selection = common.require_selection()
logs, run, step = selection.logs_dir, selection.run, selection.step
st.header("Algorithm weighting")
st.caption("The logged log-probs and advantages of one group (or the whole step) are fed to each algorithm's "
           "objective from `engine.objectives`: gradient weight = −∂loss/∂log π per token.")

summary, rollouts = common.train_groups(selection)

# ---------------------------------------------------------------- what to weigh
c1, c2, c3 = st.columns([2, 3, 2])
scope = c1.radio("Tokens of", ["one group", "the whole step"], horizontal=True, key="weigh_scope")
group_id = common.group_picker(c2, summary, "weigh_group") if scope == "one group" else None
common.set_url_value("group", group_id)
chosen = rollouts if group_id is None else rollouts[rollouts["group_id"] == group_id]
rollout_ids = tuple(int(r) for r in chosen["rollout_id"])
updates = common.load("the passes", queries.update_count, logs, run, step, rollout_ids)
update = -1
if updates:
    options = list(range(updates))
    update, _ = common.initial_value("weigh_update", "update", int, options, updates - 1)
    st.session_state["weigh_update"] = update
    update = c3.selectbox(
        "Log-probs at update", options, key="weigh_update", format_func=lambda k: f"epoch {k + 1} of {updates}",
        help="each completion's new log-probs the k-th time an optimisation pass used it (its mini-batch in "
        "epoch k); the first one has ratio 1 unless another mini-batch moved the policy before",
    )
    common.set_url_value("update", update)
else:
    c3.caption("No optimisation pass logged: ratios are 1.")

# ---------------------------------------------------------------- knobs
st.markdown("**Knobs** (edit a cell: every chart below is recomputed at once; start from the authors' defaults)")
# An algorithm with a critic (PPO) takes its advantages from the critic's values: only a run that logged them has any.
whitening = common.load("the whitening", queries.step_whitening, logs, run, step)
has_values = whitening is not None  # only a run with a critic logs its whitening statistics
available = [a for a in ALGORITHMS if has_values or not uses_critic(a)]
if has_values:
    st.caption("This run has a critic: every algorithm sees its logged GAE advantages; PPO sees them whitened with "
               "the step's statistics, as its loss did.")
picked = st.multiselect(
    "Algorithms", available, key="weigh_algorithms",
    default=[a for a in available if a in HEADLINE or a == selection.algorithm or uses_critic(a)],
)
algorithms = [a for a in available if a in picked]  # in the registry's order, whatever the order of the clicks
if not algorithms:
    st.info("Choose at least one algorithm.")
    st.stop()
knob_table = st.data_editor(  # keyed by the choice: edited knobs belong to the rows they were made on
    recompute.author_knobs(algorithms), hide_index=True, disabled=["algorithm"],
    key="weigh_knobs_" + "-".join(algorithms),
    column_config={k: st.column_config.NumberColumn(k, min_value=0.0, max_value=10.0, step=1e-4, format="%.4g")
                   for k in recompute.KNOBS},
)


def read_inputs(logs: str, run: str, step: int, rollout_ids: tuple) -> recompute.StepInputs | None:
    """The tokens, batched (float32: about 100 MB for 256 completions of up to 16k tokens), or None without any."""
    tokens = queries.weighed_tokens(logs, run, step, rollout_ids)
    return None if tokens.empty else recompute.StepInputs(tokens, float32=True)


@st.cache_resource(show_spinner=False)
def held_inputs() -> prefetch.LastInputs:
    """The tokens the page weighed last and those a guess read last (one of each in the whole server, shared, not
    copied: nothing modifies them): editing a knob, adding an algorithm or choosing another update weighs the same
    tokens again, and moving to a guessed view takes the guess's (reading and batching a step of long completions:
    0.2-0.4 s)."""
    return prefetch.LastInputs(ttl=queries.STEP_TTL)


class StepTokens:
    """The objectives' inputs for the chosen tokens (run, step, rollouts, update), asked for only when some answer
    is not cached: the answers (`weighed_tokens`, `weigh_one`) are kilobytes, kept per tokens and knobs; the tokens
    themselves, hundreds of MB for a whole step of long completions, only the last ones (`held_inputs`)."""

    def __init__(self, logs: str, run: str, step: int, rollout_ids: tuple, update: int):
        self.key = (logs, run, step, rollout_ids)
        self.update = update

    @functools.cached_property
    def batch(self):
        """The Batch (engine.logrows) of the tokens at the update, or None without any."""
        inputs = held_inputs().get(self.key, lambda: read_inputs(*self.key))
        return None if inputs is None else inputs.at_update(
            self.update, functools.partial(queries.weighed_passes, *self.key))

    @functools.cached_property
    def sample(self) -> np.ndarray:
        """The flat indices of the tokens every algorithm's scatter shows (the same for all)."""
        return recompute.sample_positions(self.batch.mask.numpy() > 0, MAX_SCATTER_POINTS)


# Both keyed by what identifies the tokens rather than by the tokens themselves (`_tokens` is not hashed): hashing a
# step's worth of token rows on every rerun would cost more than the objectives do.
@st.cache_data(ttl=queries.STEP_TTL, show_spinner=False, max_entries=32)
def weighed_tokens(logs: str, run: str, step: int, rollout_ids: tuple, update: int, _tokens: StepTokens):
    """(rollout ids (B,), tokens logged per completion (B,), the sampled tokens' advantages, the largest |advantage|,
    the heatmaps' bin width and centres), or None without tokens."""
    batch = _tokens.batch
    if batch is None:
        return None
    on = batch.mask.numpy() > 0  # (B, T)
    advantage = batch.advantages.numpy()  # (B, T)
    return (batch.rollout_ids, batch.lengths, advantage.reshape(-1)[_tokens.sample],
            float(np.abs(advantage[on]).max()), recompute.column_bins(on.shape[1], common.PANEL_BINS))


@st.cache_data(ttl=queries.STEP_TTL, show_spinner="Asking each objective…", max_entries=128)
def weigh_one(logs: str, run: str, step: int, rollout_ids: tuple, update: int, algo: str, overrides: tuple,
              whitening: tuple | None, _tokens: StepTokens):
    """(WeighedForCharts, None) of one algorithm with its knobs on the tokens, or (None, why it refused them).
    One algorithm a call: adding an algorithm or editing one's knobs asks only that one again."""
    batch = _tokens.batch
    try:
        own = recompute.whitened(batch, *whitening) if whitening and uses_critic(algo) else batch
        weighting = recompute.weigh(own, algo, dict(overrides))
    except ValueError as error:
        return None, str(error)
    return recompute.for_charts(algo, weighting, MAX_HEATMAP_ROWS, common.PANEL_BINS, _tokens.sample), None


@st.cache_data(ttl=queries.STEP_TTL, show_spinner=False, max_entries=32)
def regions_for(knobs: tuple, ratio_max: float, adv_max: float, old_prob: float) -> tuple[dict, dict]:
    """(algorithm -> its clip region, algorithm -> its weight curves) on single-token grids."""
    regions, curves = {}, {}
    for algo, overrides in knobs:
        with contextlib.suppress(ValueError):  # refused knobs are already reported above
            regions[algo] = recompute.clip_region(algo, dict(overrides), ratio_max, adv_max, old_prob=old_prob)
            curves[algo] = recompute.weight_curves(algo, dict(overrides), ratio_max, old_prob=old_prob)
    return regions, curves


knobs = tuple(
    (row["algorithm"], tuple((k, float(row[k])) for k in recompute.KNOBS if pd.notna(row[k])))
    for _, row in knob_table.iterrows()
)
step_tokens = StepTokens(logs, run, step, rollout_ids, update)
weighed = common.load("the tokens", weighed_tokens, logs, run, step, rollout_ids, update, step_tokens)
if weighed is None:
    st.info("No tokens logged for these rollouts.")
    st.stop()
batch_ids, lengths, sampled_advantage, advantage_max, (width, positions) = weighed
results = {}
for algo, overrides in knobs:
    result, refusal = common.load("the objectives", weigh_one, logs, run, step, rollout_ids, update, algo, overrides,
                                  whitening, step_tokens)
    if refusal is None:
        results[algo] = result
    else:
        st.error(f"{algo}: {common.md(refusal)}")
if not results:
    st.stop()


def weigh_ahead(guess: tuple[int, int | None, int]) -> None:
    """What this page asks for the tokens of `guess` = (step, group id or None for the whole step, update) with the
    same algorithms and knobs, for `dashboard.prefetch`: the answers land in the caches the page reads."""
    at_step, group, wanted_update = guess
    numbers = queries.step_rollout_numbers(logs, run, at_step, "train")
    queries.group_summary(logs, run, at_step)
    numbers = numbers[numbers["rollout_id"].notna()]
    if group is not None:  # the page keeps the group when the step has it
        numbers = numbers[numbers["group_id"] == group]
    ids = tuple(int(r) for r in numbers["rollout_id"])
    if not ids:
        return
    passes = queries.update_count(logs, run, at_step, ids)
    at = wanted_update if 0 <= wanted_update < passes else passes - 1  # as the update picker: kept while it exists
    whitened_by = queries.step_whitening(logs, run, at_step)
    tokens = StepTokens(logs, run, at_step, ids, at)
    prefetch.give_way()
    if weighed_tokens(logs, run, at_step, ids, at, tokens) is not None:
        for algo, overrides in knobs:
            prefetch.give_way()  # each algorithm of a whole step of long completions is ~0.1 s of a core
            weigh_one(logs, run, at_step, ids, at, algo, overrides, whitened_by, tokens)


# The same tokens at the updates next to this one (the picker above: a whole step of long completions takes ~0.5 s
# to read that update's log-probs and weigh again), the next and the previous step as shown, then, from one group,
# this step's whole (the other choice of "Tokens of").
prefetch.ahead(weigh_ahead, [(step, group_id, u) for u in (update + 1, update - 1) if 0 <= u < updates]
               + [(s, group_id, update) for s in prefetch.neighbours(selection.steps, step)]
               + ([(step, None, update)] if group_id is not None else []))

info = chosen.set_index("rollout_id").loc[batch_ids]
logged_advantage = pd.to_numeric(info["advantage"], errors="coerce").to_numpy(dtype=float)  # NaN: not logged
labels = [f"r{rid} g{common.plain(g)}#{common.plain(i)} A={common.number(a, '+.2f')}" for rid, g, i, a in
          zip(batch_ids, info["group_id"], info["index_in_group"], logged_advantage, strict=True)]

# ---------------------------------------------------------------- charts
st.subheader("Gradient weight per token")
if len(labels) > MAX_HEATMAP_ROWS:  # more rows are unreadable and slow to ship to the browser
    st.caption(f"The first {MAX_HEATMAP_ROWS} of {len(labels)} completions; totals and clip fractions use all.")
figures.show(st, charts.weight_heatmaps({a: w.heatmap for a, w in results.items()}, labels[:MAX_HEATMAP_ROWS],
                                        positions=positions, bin_width=width), key="weight_heatmaps")

left, right = st.columns(2)
totals = pd.DataFrame([  # length: the tokens the objective saw (the logged `length` column may be left out)
    {"algorithm": algo, "completion": label, "length": int(n), "advantage": float(a), "total_weight": float(t)}
    for algo, w in results.items()
    for label, n, a, t in zip(labels, lengths, logged_advantage, w.total_weight, strict=True)
])
left.markdown("**Total weight of each completion against its length** (length bias)")
figures.show(left, charts.total_weight_vs_length(totals), key="total_weight_vs_length")
fractions = pd.DataFrame([w.clip_fractions for w in results.values()])
right.markdown("**Clip decisions** (fraction of tokens)")
figures.show(right, charts.clip_fractions(fractions), key="clip_fractions")
common.static_table(right, fractions, {c: ".3f" for c in fractions.columns[1:]})

st.subheader("Where each algorithm clips: ratio × advantage")
# Past ASPO's dual cap at least, so that it is on the chart.
largest_ratios = [w.ratio_max for w in results.values() if np.isfinite(w.ratio_max)]
ratio_max = float(max(algorithm_defaults("aspo")["dual_clip"] + 0.5,
                      1.1 * max(largest_ratios) if largest_ratios else 2.0))
adv_max = float(max(1.0, 1.1 * advantage_max))
scatter = {a: pd.DataFrame({"ratio": w.ratio_sample, "advantage": sampled_advantage}) for a, w in results.items()}
old_prob = 0.5  # p_old of the pictures of the rules that bound the probability itself (DPPO)
if any(OBJECTIVES[a].surrogate.startswith("dppo") for a in algorithms):
    old_prob = st.select_slider(
        "p_old of DPPO's pictures", OLD_PROBS, value=0.5, key="weigh_old_prob",
        help="DPPO bounds p − p_old (TV) or the binary KL, not the ratio: where it masks depends on the token's "
        "probability before the update; ratios above 1 / p_old are out of reach (grey)")
regions, curves = regions_for(knobs, round(ratio_max, 2), round(adv_max, 2), old_prob)
figures.show(st, charts.clip_regions(regions, scatter), key="clip_regions")
st.caption("Shaded: the objective's decision for a single token at that ratio and advantage (blue: clipped low, "
           "zero gradient; red: clipped high, zero gradient; purple: capped with the gradient kept; grey: a ratio "
           f"no token with p_old = {old_prob:g} can reach, for DPPO). Dots: this batch's tokens at the ratio each "
           "algorithm uses (GSPO, LUSPO, VESPO: the sequence ratio). Clip-Cov and KL-Cov are drawn as their "
           "surrogate: which tokens their rule picks depends on the whole batch's covariance, not on one token.")
st.subheader("Gradient weight against the ratio")
figures.show(st, charts.weight_curves(curves), key="weight_curves")
st.caption("Each objective's gradient weight per unit advantage for a single token at that ratio (the sequence "
           "ratio for sequence-level rules), positive A red, negative A blue; 1 (dotted) is the plain policy "
           "gradient: GPG is flat at 1, PPO's clip drops to 0, DPPO truncates the ratio at its cap and masks outside "
           "its trust region (at the p_old above), VESPO follows its gamma weight e^λ w^k e^(−λw) of the sequence "
           "ratio w. DRO adds −dro_beta · log r / A, so its curve for a negative A rises with the ratio.")
with st.expander("Resolved hyper-parameters"):
    params = pd.DataFrame({a: {k: str(v) for k, v in w.params.items()} for a, w in results.items()})
    common.static_table(st, params.rename_axis("parameter").reset_index())
