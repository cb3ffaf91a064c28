"""The dashboard pages' queries: `dashboard.data` behind Streamlit's caches.

Every function here calls the function of the same name in `dashboard.data` (where the SQL lives) with the
shared reader of a logs folder; nothing here writes, and nothing outside the pages needs this module
(`policylens report` calls `dashboard.data` directly, without Streamlit).

Caching: `st.cache_resource` holds one reader per logs folder; `st.cache_data` holds query results.
- The list of runs changes while a run trains, so it lives 2 s (the live view polls it).
- Run-wide queries (metric curves, list of steps) take the run's `version` (its last step) as an argument, so a new
  step gives a new cache entry at once, and finished runs stay cached.
- A logged step never changes once visible (the writer renames it into place), so step-level queries keep their
  results for minutes.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from dashboard import data, prefetch, token_data
from engine.algorithms import defaults as algorithm_defaults

LIVE_TTL = 2  # seconds; the live watcher polls every 3 s
RUN_TTL = 60
STEP_TTL = 600


@st.cache_resource(show_spinner=False)
def get_reader(logs_dir: str):
    """One reader per logs folder, shared by all sessions (see `dashboard.data.open_reader`). A page's query does
    not wait for a guess's (`dashboard.prefetch`): it stops it, and the guess is made again later."""
    return data.open_reader(logs_dir, gives_way=prefetch.guessing)


def sql(logs_dir: str, query: str, params: list | dict | None = None) -> pd.DataFrame:
    """Run one query through the shared reader."""
    return get_reader(logs_dir).sql(query, params or [])


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def runs_table(logs_dir: str) -> pd.DataFrame:
    return data.runs_table(get_reader(logs_dir))


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def reader_problems(logs_dir: str) -> list[str]:
    return data.reader_problems(get_reader(logs_dir))


def live_signature(logs_dir: str) -> tuple:
    """What changes when a run makes progress: (run, status, last_step) of every run."""
    table = runs_table(logs_dir)
    return tuple(zip(table["run"], table["status"], table["last_step"].fillna(-1).astype(int), strict=True))


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def run_steps(logs_dir: str, runs: tuple[str, ...], version: tuple) -> pd.DataFrame:
    """(`version` only keys the cache, here and below.)"""
    return data.run_steps(get_reader(logs_dir), runs)


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def step_numbers(logs_dir: str, run: str, version: tuple) -> list[int]:
    return data.step_numbers(get_reader(logs_dir), run)


# ---------------------------------------------------------------- one step


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def step_rollouts(logs_dir: str, run: str, step: int, kind: str | None = None) -> pd.DataFrame:
    return data.step_rollouts(get_reader(logs_dir), run, step, kind)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def step_rollout_previews(logs_dir: str, run: str, step: int, kind: str | None = None,
                          chars: int = data.COMPLETION_PREVIEW_CHARS) -> pd.DataFrame:
    return data.step_rollout_previews(get_reader(logs_dir), run, step, kind, chars)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def groups_matching(logs_dir: str, run: str, step: int, text: str) -> list:
    return data.groups_matching(get_reader(logs_dir), run, step, text)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def rollout_previews(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...]) -> pd.DataFrame:
    return data.rollout_previews(get_reader(logs_dir), run, step, rollout_ids)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def step_rollout_numbers(logs_dir: str, run: str, step: int, kind: str | None = None) -> pd.DataFrame:
    return data.step_rollout_numbers(get_reader(logs_dir), run, step, kind)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def group_summary(logs_dir: str, run: str, step: int) -> pd.DataFrame:
    return data.group_summary(get_reader(logs_dir), run, step)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def rollout_passes(logs_dir: str, run: str, step: int, rollout_id: int) -> list[int]:
    return data.rollout_passes(get_reader(logs_dir), run, step, rollout_id)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def update_count(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...]) -> int:
    return data.update_count(get_reader(logs_dir), run, step, rollout_ids)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def step_pass_summary(logs_dir: str, run: str, step: int) -> pd.DataFrame:
    return data.step_pass_summary(get_reader(logs_dir), run, step)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def rollout_total_weights(logs_dir: str, run: str, step: int) -> pd.DataFrame:
    return data.rollout_total_weights(get_reader(logs_dir), run, step)


def weighed_tokens(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...]) -> pd.DataFrame:
    """`data.weighed_tokens`, not cached: the Algorithm weighting page keeps them batched (`recompute.StepInputs`)
    and caches what it computes from them; a whole step of long completions is hundreds of MB."""
    return data.weighed_tokens(get_reader(logs_dir), run, step, rollout_ids)


def weighed_passes(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...], update: int) -> pd.DataFrame:
    """`data.weighed_passes`, not cached (as `weighed_tokens`)."""
    return data.weighed_passes(get_reader(logs_dir), run, step, rollout_ids, update)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def rollout_tokens(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...], pass_: int | None,
                   positions: tuple[int, int] | None = None) -> pd.DataFrame:
    return data.rollout_tokens(get_reader(logs_dir), run, step, rollout_ids, pass_, positions)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def rollout_token_bins(logs_dir: str, run: str, step: int, rollout_id: int, pass_: int | None, bins: int
                       ) -> pd.DataFrame:
    return data.rollout_token_bins(get_reader(logs_dir), run, step, rollout_id, pass_, bins)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def prm_steps(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...]) -> pd.DataFrame:
    return data.prm_steps(get_reader(logs_dir), run, step, rollout_ids)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def prm_step_bins(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...], bins: int) -> pd.DataFrame:
    return data.prm_step_bins(get_reader(logs_dir), run, step, rollout_ids, bins)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def critic_tokens(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...]) -> pd.DataFrame:
    return data.critic_tokens(get_reader(logs_dir), run, step, rollout_ids)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def critic_token_bins(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...], bins: int) -> pd.DataFrame:
    return data.critic_token_bins(get_reader(logs_dir), run, step, rollout_ids, bins)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def step_whitening(logs_dir: str, run: str, step: int) -> tuple[float, float] | None:
    return data.step_whitening(get_reader(logs_dir), run, step)


# The step range the Token statistics page opens on for a run with steps its token summary does not cover
# (logged before it, `unsummarised_steps`): the latest steps whose unsummarised ones hold at most this many train
# tokens (read row by row, 2M tokens took 0.94 s). Over all 100M tokens of such a run its statistics take 44 s and
# its entropy bins need more memory than the dashboard gives DuckDB; a wider range is one slider move away. A run
# whose steps are all summarised opens on all of them (see docs/benchmarks.md, "Token statistics over a whole run").
STATS_DEFAULT_TOKENS = 1_000_000


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def unsummarised_steps(logs_dir: str, run: str, version: tuple) -> list[tuple[int, int]]:
    return data.unsummarised_steps(get_reader(logs_dir), run)


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def train_tokens_per_step(logs_dir: str, run: str, version: tuple) -> dict[int, int]:
    return data.train_tokens_per_step(get_reader(logs_dir), run)


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def run_has_prm(logs_dir: str, run: str, version: tuple) -> bool:
    return data.run_has_prm(get_reader(logs_dir), run)


# ---------------------------------------------------------------- eval prompts across steps and runs


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def eval_prompts(logs_dir: str, run: str, version: tuple) -> pd.DataFrame:
    return data.eval_prompts(get_reader(logs_dir), run)


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def eval_prompt_history(logs_dir: str, run: str, prompt_id: int, version: tuple) -> pd.DataFrame:
    return data.eval_prompt_history(get_reader(logs_dir), run, prompt_id)


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def eval_prompt_across_runs(logs_dir: str, task: str, prompt_id: int, step: int) -> pd.DataFrame:
    return data.eval_prompt_across_runs(get_reader(logs_dir), task, prompt_id, step)


# ---------------------------------------------------------------- token trajectories


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def ref_prompts(logs_dir: str, run: str, version: tuple) -> pd.DataFrame:
    return data.ref_prompts(get_reader(logs_dir), run)


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def ref_trajectories(logs_dir: str, runs: tuple[str, ...], prompt_id: int, version: tuple) -> pd.DataFrame:
    return data.ref_trajectories(get_reader(logs_dir), runs, prompt_id)


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def ref_class_curves(logs_dir: str, runs: tuple[str, ...], version: tuple) -> pd.DataFrame:
    return data.ref_class_curves(get_reader(logs_dir), runs)


# ---------------------------------------------------------------- token statistics over a step range


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def token_stats(logs_dir: str, run: str, first: int, last: int, bucket: int, version: tuple) -> pd.DataFrame:
    return token_data.token_stats(get_reader(logs_dir), run, first, last, bucket)


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def rollouts_with_token(logs_dir: str, run: str, first: int, last: int, token_text: str, bucket: int,
                        position_from: int | None, limit: int = 500) -> pd.DataFrame:
    return token_data.rollouts_with_token(get_reader(logs_dir), run, first, last, token_text, bucket, position_from,
                                          limit)


ASPO_ENTROPY_QUANTILE = algorithm_defaults("aspo")["entropy_quantile"]
"""ASPO (arXiv 2510.06062, Archer2.0 code) widens the clip range of a response's tokens above this entropy quantile
of the response (engine.algorithms); the high-entropy "forking" tokens of arXiv 2506.01939 are the same top share."""


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def entropy_bins(logs_dir: str, runs: tuple[str, ...], first: int, last: int, bins: int, version: tuple
                 ) -> pd.DataFrame:
    return token_data.entropy_bins(get_reader(logs_dir), runs, first, last, bins)


# ---------------------------------------------------------------- covariance and KL drivers

DRIVERS_TOP = 20  # token texts (per position bucket) shown by summed covariance and by summed KL


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def covariance_drivers(logs_dir: str, run: str, first: int, last: int, bucket: int, version: tuple
                       ) -> pd.DataFrame:
    return token_data.covariance_drivers(get_reader(logs_dir), run, first, last, bucket, DRIVERS_TOP)


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def covariance_per_step(logs_dir: str, run: str, first: int, last: int, version: tuple) -> pd.DataFrame:
    return token_data.covariance_per_step(get_reader(logs_dir), run, first, last)


# ---------------------------------------------------------------- sampler/trainer mismatch


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def mismatch_runs(logs_dir: str) -> list[str]:
    return data.mismatch_runs(get_reader(logs_dir))


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def mismatch_curves(logs_dir: str, runs: tuple[str, ...], version: tuple) -> pd.DataFrame:
    return data.mismatch_curves(get_reader(logs_dir), runs)


@st.cache_resource(ttl=60, max_entries=2, show_spinner=False)
def _step_sampler_tokens(logs_dir: str, run: str, step: int) -> pd.DataFrame:
    """A step's `data.sampler_tokens`, read once for the Mismatch page's two uses of it in the same visit (its
    numbers, then the corrections); shared, not copied (`cache_resource`): readers must not modify it."""
    return data.sampler_tokens(get_reader(logs_dir), run, step)


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def step_mismatch(logs_dir: str, run: str, step: int):
    """`dashboard.mismatch.StepMismatch` of the step (its small frames only are cached), None when no token of
    the step has a sampler log-prob."""
    from dashboard import mismatch

    tokens = _step_sampler_tokens(logs_dir, run, step)
    if tokens.empty:
        return None
    return mismatch.step_mismatch(tokens, data.step_rollouts(get_reader(logs_dir), run, step, "train"))


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def correction_table(logs_dir: str, run: str, step: int) -> pd.DataFrame:
    """Every correction on the whole step (`dashboard.recompute.correction_table`; imports torch), chunk by chunk:
    a guess computing it ahead stops between two chunks when a user's script starts (`prefetch.giving_way`)."""
    from dashboard import recompute

    chunks = recompute.chunked_effects(_step_sampler_tokens(logs_dir, run, step))
    return recompute.correction_table(prefetch.giving_way(chunks))


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def correction_weights(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...], bins: int
                       ) -> tuple[list[int], dict, np.ndarray, int]:
    """(rollout ids, {correction: (B, columns) weight}, the columns' centre positions, their width in tokens) for
    some rollouts of the step: every correction works row by row, so these rows' weights are those of the whole
    step's (imports torch). Each row's tokens come in `recompute.binned_columns` of at most `bins` columns (the
    mean weight of each bin's tokens), so a 16k-token group is not sent token by token."""
    from dashboard import recompute

    ids, effects = recompute.correction_effects(data.sampler_tokens(get_reader(logs_dir), run, step, rollout_ids,
                                                                    everything=False))
    binned = {effect.name: recompute.binned_columns(effect.weight, bins) for effect in effects}
    _, positions, width = next(iter(binned.values()))  # every correction has the same (B, T)
    return ids, {name: means for name, (means, _, _) in binned.items()}, positions, width
