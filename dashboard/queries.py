"""Every SQL query of the dashboard, with bound parameters, cached.

The dashboard reads runs through `engine.runlog.RunReader`, which exposes the run-log tables (runs, steps, rollouts,
tokens, token_passes, prm_steps) as DuckDB views over the Parquet files the trainer writes. Nothing here writes.

Caching: `st.cache_resource` holds one reader per logs folder; `st.cache_data` holds query results.
- The list of runs changes while a run trains, so it lives 2 s (the live view polls it).
- Run-wide queries (metric curves, list of steps) take the run's `version` (its last step) as an argument, so a new
  step gives a new cache entry at once, and finished runs stay cached.
- A logged step never changes once visible (the writer renames it into place), so step-level queries keep their
  results for minutes.
"""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from engine.clip_codes import CLIP_CAP, CLIP_HIGH, CLIP_LOW

LIVE_TTL = 2  # seconds; the live watcher polls every 3 s
RUN_TTL = 60
STEP_TTL = 600
# DuckDB's memory for the dashboard's queries (they read one step or one run's metrics; the largest, a whole
# step's token passes, needs well under this), so a dashboard left open stays within a small machine's means.
READER_MEMORY_LIMIT = "1GB"


@st.cache_resource(show_spinner=False)
def get_reader(logs_dir: str):
    """One reader per logs folder, shared by all sessions: read-only (reading statements only, no file outside
    the logs folder, see `engine.runlog.RunReader`)."""
    from engine.runlog import RunReader

    return RunReader(logs_dir, memory_limit=READER_MEMORY_LIMIT)


def sql(logs_dir: str, query: str, params: list | None = None) -> pd.DataFrame:
    """Run one query through the shared reader."""
    return get_reader(logs_dir).sql(query, params or [])


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def runs_table(logs_dir: str) -> pd.DataFrame:
    """Every run with its status, algorithm, task, number of steps and latest held-out accuracy (and its step)."""
    return get_reader(logs_dir).runs_overview()


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def reader_problems(logs_dir: str) -> list[str]:
    """Files and runs the reader had to leave out (damaged Parquet, unreadable run.json, ...), as messages."""
    reader = get_reader(logs_dir)
    reader.refresh()
    return list(reader.problems)


def live_signature(logs_dir: str) -> tuple:
    """What changes when a run makes progress: (run, status, last_step) of every run."""
    table = runs_table(logs_dir)
    return tuple(zip(table["run"], table["status"], table["last_step"].fillna(-1).astype(int), strict=True))


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def run_steps(logs_dir: str, runs: tuple[str, ...], version: tuple) -> pd.DataFrame:
    """All per-step metrics of the given runs (`version` only keys the cache)."""
    return sql(logs_dir, "SELECT * FROM steps WHERE list_contains(?, run) ORDER BY run, step", [list(runs)])


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def step_numbers(logs_dir: str, run: str, version: tuple) -> list[int]:
    """The steps logged for a run, ascending."""
    frame = sql(logs_dir, "SELECT DISTINCT step FROM steps WHERE run = ? ORDER BY step", [run])
    return [int(s) for s in frame["step"]]


def config_diff(table: pd.DataFrame) -> pd.DataFrame:
    """Config keys whose values differ between the given runs (nested keys flattened with dots)."""
    flat = {}
    for run, config in zip(table["run"], table["config"], strict=True):
        try:
            parsed = json.loads(config) if isinstance(config, str) else dict(config or {})
        except (TypeError, ValueError):
            parsed = {"config": "(unreadable)"}
        flat[run] = pd.json_normalize(parsed, sep=".").iloc[0].to_dict() if parsed else {}
    frame = pd.DataFrame(flat)
    if frame.empty or frame.shape[1] < 2:
        return frame
    differs = frame.astype(str).nunique(axis=1) > 1
    return frame[differs].sort_index()


# ---------------------------------------------------------------- one step


def id_range(rollout_ids: tuple[int, ...]) -> tuple[int | None, int | None]:
    """The smallest and largest of some rollout ids, for `rollout_id BETWEEN ? AND ?` next to `list_contains`:
    DuckDB checks a range against each row group's min/max statistics (files are sorted by step, rollout id),
    so a query for one rollout decodes its one or two row groups instead of the whole step (171 -> ~20 ms at
    100M token rows); `list_contains` alone is not pushed into the scan."""
    return (min(rollout_ids), max(rollout_ids)) if rollout_ids else (None, None)


ROLLOUT_COLUMNS = """rollout_id, group_id, index_in_group, kind, prompt_id, prompt, completion, answer, reward,
    reward_correct, reward_process, reward_length, advantage, length, truncated, filtered, filter_reason"""


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def step_rollouts(logs_dir: str, run: str, step: int, kind: str | None = None) -> pd.DataFrame:
    """The rollouts of one step (train and eval unless `kind` says which)."""
    return sql(
        logs_dir,
        f"""SELECT {ROLLOUT_COLUMNS} FROM rollouts
            WHERE run = ? AND step = ? AND (? IS NULL OR kind = ?)
            ORDER BY kind DESC, group_id, index_in_group""",
        [run, step, kind, kind],
    )


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def group_summary(logs_dir: str, run: str, step: int) -> pd.DataFrame:
    """One row per train group of a step: its prompt, reward mean/std, outcome mix, filtering."""
    return sql(
        logs_dir,
        """
        SELECT group_id, any_value(prompt) AS prompt, any_value(answer) AS answer, count(*) AS size,
               avg(reward) AS reward_mean, coalesce(stddev_samp(reward), 0) AS reward_std,
               avg(reward_correct) AS accuracy, avg(length) AS length_mean,
               max(abs(advantage)) AS max_abs_advantage,
               bool_or(filtered) AS filtered, any_value(filter_reason) FILTER (WHERE filtered) AS filter_reason,
               sum(truncated::INT) AS truncated,
               CASE WHEN min(reward_correct) > 0 THEN 'all correct'
                    WHEN max(reward_correct) <= 0 THEN 'all wrong' ELSE 'mixed' END AS outcome
        FROM rollouts WHERE run = ? AND step = ? AND kind = 'train'
        GROUP BY group_id ORDER BY group_id
        """,
        [run, step],
    )


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def rollout_passes(logs_dir: str, run: str, step: int, rollout_id: int) -> list[int]:
    """The optimisation passes that used a rollout. With mini-batches a rollout is in one pass per epoch, not in
    every pass of the step."""
    frame = sql(
        logs_dir,
        'SELECT DISTINCT "pass" FROM token_passes WHERE run = ? AND step = ? AND rollout_id = ? ORDER BY 1',
        [run, step, rollout_id],
    )
    return [int(p) for p in frame["pass"]]


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def update_count(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...]) -> int:
    """How many optimisation passes used each of these rollouts (the number of epochs; 0 if none was logged)."""
    frame = sql(
        logs_dir,
        """SELECT coalesce(max(n), 0) AS n FROM (
               SELECT rollout_id, count(DISTINCT "pass") AS n FROM token_passes
               WHERE run = ? AND step = ? AND rollout_id BETWEEN ? AND ? AND list_contains(?, rollout_id)
               GROUP BY rollout_id)""",
        [run, step, *id_range(rollout_ids), list(rollout_ids)],
    )
    return int(frame["n"].iloc[0])


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def step_pass_summary(logs_dir: str, run: str, step: int) -> pd.DataFrame:
    """One row per optimisation pass of a step: tokens trained on, fraction clipped low / high / by a dual clip or
    cap (the report's column names match `charts.clip_fractions`), mean |gradient weight| and |ratio - 1|."""
    return sql(
        logs_dir,
        """SELECT "pass", count(*) AS tokens, avg((clip = ?)::DOUBLE) AS low, avg((clip = ?)::DOUBLE) AS high,
                  avg((clip = ?)::DOUBLE) AS "dual / cap", avg(abs(grad_weight)) AS mean_abs_grad_weight,
                  avg(abs(ratio - 1)) AS mean_abs_ratio_change
           FROM token_passes WHERE run = ? AND step = ? GROUP BY "pass" ORDER BY "pass" """,
        [CLIP_LOW, CLIP_HIGH, CLIP_CAP, run, step],
    )


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def rollout_total_weights(logs_dir: str, run: str, step: int) -> pd.DataFrame:
    """Each trained rollout of a step: its length, advantage and the sum of its tokens' gradient weights in the last
    pass that used it."""
    return sql(
        logs_dir,
        """WITH per_pass AS (SELECT rollout_id, "pass", sum(grad_weight) AS weight FROM token_passes
                             WHERE run = ? AND step = ? GROUP BY rollout_id, "pass"),
                last AS (SELECT rollout_id, arg_max_null(weight, "pass") AS total_weight FROM per_pass
                         GROUP BY rollout_id)
           SELECT r.rollout_id, r.length, r.advantage, l.total_weight
           FROM last l JOIN rollouts r ON r.rollout_id = l.rollout_id
           WHERE r.run = ? AND r.step = ? ORDER BY r.rollout_id""",
        [run, step, run, step],
    )


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def tokens_at_update(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...], update: int) -> pd.DataFrame:
    """Tokens of some rollouts, each with the values of its `update`-th pass (0-based; -1 = its last one).

    Different rollouts of a step are in different mini-batches, so "the same moment" for a group is the k-th time
    each of its rollouts was used, not one pass number."""
    return sql(
        logs_dir,
        """
        WITH used AS (
            SELECT DISTINCT rollout_id, "pass" FROM token_passes
            WHERE run = ? AND step = ? AND rollout_id BETWEEN ? AND ? AND list_contains(?, rollout_id)
        ), ranked AS (
            SELECT rollout_id, "pass", row_number() OVER (PARTITION BY rollout_id ORDER BY "pass") - 1 AS k,
                   count(*) OVER (PARTITION BY rollout_id) AS n
            FROM used
        ), chosen AS (
            SELECT rollout_id, "pass" FROM ranked WHERE k = CASE WHEN ? < 0 THEN n - 1 ELSE ? END
        ), passes AS (
            SELECT p.* FROM token_passes p JOIN chosen c ON c.rollout_id = p.rollout_id AND c."pass" = p."pass"
            WHERE p.run = ? AND p.step = ? AND p.rollout_id BETWEEN ? AND ?
        )
        SELECT t.rollout_id, t.position, t.token_id, t.token_text, t.old_logp, t.ref_logp, t.entropy, t.advantage,
               t.prm_step, p."pass", p.new_logp, p.ratio, p.clip, p.grad_weight, p.token_loss, p.kl
        FROM tokens t LEFT JOIN passes p ON p.rollout_id = t.rollout_id AND p.position = t.position
        WHERE t.run = ? AND t.step = ? AND t.rollout_id BETWEEN ? AND ? AND list_contains(?, t.rollout_id)
        ORDER BY t.rollout_id, t.position
        """,
        [run, step, *id_range(rollout_ids), list(rollout_ids), update, update, run, step, *id_range(rollout_ids),
         run, step, *id_range(rollout_ids), list(rollout_ids)],
    )


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def rollout_tokens(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...], pass_: int | None) -> pd.DataFrame:
    """Tokens of some rollouts with the values of one optimisation pass (NULL where the pass logged nothing)."""
    return sql(
        logs_dir,
        """
        SELECT t.rollout_id, t.position, t.token_id, t.token_text, t.old_logp, t.ref_logp, t.entropy, t.advantage,
               t.prm_step, p."pass", p.new_logp, p.ratio, p.clip, p.grad_weight, p.token_loss, p.kl
        FROM tokens t
        LEFT JOIN (SELECT * FROM token_passes WHERE run = ? AND step = ? AND "pass" = ?
                   AND rollout_id BETWEEN ? AND ?) p
               ON p.rollout_id = t.rollout_id AND p.position = t.position
        WHERE t.run = ? AND t.step = ? AND t.rollout_id BETWEEN ? AND ? AND list_contains(?, t.rollout_id)
        ORDER BY t.rollout_id, t.position
        """,
        [run, step, pass_, *id_range(rollout_ids), run, step, *id_range(rollout_ids), list(rollout_ids)],
    )


@st.cache_data(ttl=STEP_TTL, show_spinner=False)
def prm_steps(logs_dir: str, run: str, step: int, rollout_ids: tuple[int, ...]) -> pd.DataFrame:
    """Reasoning steps (with raw and normalized rewards) of some rollouts."""
    return sql(
        logs_dir,
        """SELECT rollout_id, step_index, first_pos, last_pos, text, reward_raw, reward_norm FROM prm_steps
           WHERE run = ? AND step = ? AND rollout_id BETWEEN ? AND ? AND list_contains(?, rollout_id)
           ORDER BY rollout_id, step_index""",
        [run, step, *id_range(rollout_ids), list(rollout_ids)],
    )


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def run_has_prm(logs_dir: str, run: str, version: tuple) -> bool:
    frame = sql(logs_dir, "SELECT count(*) AS n FROM (SELECT 1 FROM prm_steps WHERE run = ? LIMIT 1)", [run])
    return bool(frame["n"].iloc[0])


# ---------------------------------------------------------------- eval prompts across steps and runs


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def eval_prompts(logs_dir: str, run: str, version: tuple) -> pd.DataFrame:
    """The held-out prompts a run evaluated on (stable ids, so they can be followed)."""
    return sql(
        logs_dir,
        """SELECT prompt_id, any_value(prompt) AS prompt, any_value(answer) AS answer, count(DISTINCT step) AS steps
           FROM rollouts WHERE run = ? AND kind = 'eval' GROUP BY prompt_id ORDER BY prompt_id""",
        [run],
    )


@st.cache_data(ttl=RUN_TTL, show_spinner=False)
def eval_prompt_history(logs_dir: str, run: str, prompt_id: int, version: tuple) -> pd.DataFrame:
    """Every eval answer of one run to one prompt, step by step."""
    return sql(
        logs_dir,
        """SELECT step, index_in_group AS sample, completion, reward, reward_correct, length, truncated, rollout_id
           FROM rollouts WHERE run = ? AND kind = 'eval' AND prompt_id = ? ORDER BY step, index_in_group""",
        [run, prompt_id],
    )


@st.cache_data(ttl=LIVE_TTL, show_spinner=False)
def eval_prompt_across_runs(logs_dir: str, task: str, prompt_id: int, step: int) -> pd.DataFrame:
    """Every run on the same task answering one eval prompt, each at its latest evaluation at or before `step`
    (runs evaluate every few steps, not necessarily on the same ones)."""
    return sql(
        logs_dir,
        """
        WITH answers AS (
            SELECT r.run, x.algorithm, r.step, r.index_in_group AS sample, r.completion, r.reward,
                   r.reward_correct, r.length
            FROM rollouts r JOIN runs x ON x.run = r.run
            WHERE x.task = ? AND r.kind = 'eval' AND r.prompt_id = ? AND r.step <= ?
        ), latest AS (SELECT run, max(step) AS step FROM answers GROUP BY run)
        SELECT a.* FROM answers a JOIN latest l ON l.run = a.run AND l.step = a.step
        ORDER BY a.run, a.sample
        """,
        [task, prompt_id, step],
    )
