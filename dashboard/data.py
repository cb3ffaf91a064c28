"""The dashboard's data layer: every SQL query of the dashboard and report, with bound parameters, and the pandas
helpers around them. No Streamlit here: `dashboard.queries` wraps these functions in Streamlit's caches for the
pages, and `policylens report` calls them directly with a reader of its own (`open_reader`).

Every query takes a `engine.runlog.RunReader` (read-only DuckDB views of the run-log tables). The Token statistics
page's queries are in `dashboard.token_data`. Shared fragments, each written once:
- `of_rollouts`: "these rollouts of a step" ($run, $step, $ids and the id range from `rollouts_of_step`);
- `clip_rates`: the share of pass rows with each clip code of `engine.clip_codes`, named by `rate_column`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from engine.clip_codes import CLIP_EVENTS, CLIP_NAMES, rate_column
from engine.runlog.derived import STORED, TOKEN_ROWS, kl_sql, new_logp_sql

# DuckDB's memory for the dashboard's queries (they read one step or one run's metrics; the largest, a whole
# step's token passes, needs well under this), so a dashboard left open stays within a small machine's means.
READER_MEMORY_LIMIT = "1GB"


def open_reader(logs_dir: str, gives_way: Callable[[], bool] | None = None):
    """A read-only reader of a logs folder (reading statements only, no file outside the logs folder, see
    `engine.runlog.RunReader`, as its `gives_way`)."""
    from engine.runlog import RunReader

    return RunReader(logs_dir, memory_limit=READER_MEMORY_LIMIT, gives_way=gives_way)


# ---------------------------------------------------------------- shared fragments

PASSES = STORED.format("token_passes")
"""The stored token passes: the `token_passes` view derives new_logp and kl with a join to the tokens that DuckDB
keeps in any query filtered by step or rollout; the dashboard's queries read the stored rows, and those that show
new_logp or kl derive them from the token row they join anyway (`TOKEN_PASS_COLUMNS`)."""


def rollouts_of_step(run: str, step: int, rollout_ids: tuple[int, ...], **more) -> dict:
    """Named parameters for `of_rollouts`: $run, $step, $ids and $first_id / $last_id, the smallest and largest id.
    `more`: the query's other parameters."""
    first, last = (min(rollout_ids), max(rollout_ids)) if rollout_ids else (None, None)
    return {"run": run, "step": step, "ids": list(rollout_ids), "first_id": first, "last_id": last, **more}


def of_rollouts(alias: str = "", listed: bool = True) -> str:
    """The rows of "these rollouts of a step" (parameters from `rollouts_of_step`) of a table (`alias`, e.g. "t").

    `rollout_id BETWEEN $first_id AND $last_id` comes with `list_contains($ids, rollout_id)`: DuckDB checks a range
    against each row group's min/max statistics (files are sorted by step, rollout id), so a query for one rollout
    decodes its one or two row groups instead of the whole step (171 -> ~20 ms at 100M token rows); `list_contains`
    alone is not pushed into the scan. `listed=False`: the range only (a join with listed rows does the rest)."""
    a = f"{alias}." if alias else ""
    where = f"{a}run = $run AND {a}step = $step AND {a}rollout_id BETWEEN $first_id AND $last_id"
    return where + (f" AND list_contains($ids, {a}rollout_id)" if listed else "")


def clip_rates(column: str = "clip", name: Callable[[int], str] = rate_column, codes=CLIP_EVENTS) -> str:
    """SELECT items: for each clip code, the share of the rows whose `column` holds it, as `name(code)` (double
    quoted). The codes are the integers of `engine.clip_codes`, written into the text, never a user's value."""
    return ", ".join(f'avg(({column} = {int(code)})::DOUBLE) AS "{name(code)}"' for code in codes)


# ---------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunOverview:
    """One run as the runs table holds it, its config parsed once (for the selection every page gets)."""

    run: str
    status: str
    algorithm: str
    task: str
    model: str
    last_step: int  # -1 before the first logged step
    updated_at: str
    config: dict = field(default_factory=dict)  # {} when none was logged or it is not a JSON object
    config_readable: bool = True  # False when the logged config is not a JSON object

    @property
    def version(self) -> tuple:
        """Changes whenever the run gets a new step or status: keys run-wide caches."""
        return (self.run, self.status, self.last_step, self.updated_at)


def _text(value) -> str:
    """A runs-table cell as text; a missing one (None, NaN) as ""."""
    return "" if value is None or (isinstance(value, float) and value != value) or value is pd.NA else str(value)


def run_overview(table: pd.DataFrame, run: str) -> RunOverview | None:
    """The row of `run` in a runs table (`runs_table`) as a RunOverview; None when the table has no such run."""
    found = table[table["run"] == run]
    if found.empty:
        return None
    row = found.iloc[0]
    parsed = parsed_config(row.get("config"))
    return RunOverview(
        run=run, status=str(row["status"]), algorithm=_text(row.get("algorithm")), task=_text(row.get("task")),
        model=_text(row.get("model")), last_step=int(row["last_step"]) if pd.notna(row["last_step"]) else -1,
        updated_at=str(row.get("updated_at")), config=parsed or {}, config_readable=parsed is not None)


def parsed_config(config) -> dict | None:
    """A run's config as `runs_table` holds it (JSON text) as a dict; {} when there is none, None when it is not a
    JSON object (a run logged by other code may carry anything as its config)."""
    try:
        parsed = json.loads(config) if isinstance(config, str) else dict(config or {})
    except (TypeError, ValueError):
        return None
    return parsed if isinstance(parsed, dict) else None


def config_diff(table: pd.DataFrame) -> pd.DataFrame:
    """Config keys whose values differ between the given runs (nested keys flattened with dots)."""
    flat = {}
    for run, config in zip(table["run"], table["config"], strict=True):
        parsed = parsed_config(config)
        if parsed is None:
            parsed = {"config": "(unreadable)"}
        flat[run] = pd.json_normalize(parsed, sep=".").iloc[0].to_dict() if parsed else {}
    frame = pd.DataFrame(flat)
    if frame.empty or frame.shape[1] < 2:
        return frame
    differs = frame.astype(str).nunique(axis=1) > 1
    return frame[differs].sort_index()


def comparable_runs(table: pd.DataFrame, run: str) -> list[str]:
    """The runs of `runs_table` whose held-out prompts are the same as `run`'s (same task and task seed), `run`
    first: only then is a prompt id the same prompt, with the same reference solution, in every run."""

    def key(row) -> tuple:
        return row["task"], (parsed_config(row["config"]) or {}).get("task_seed")

    keys = {row["run"]: key(row) for _, row in table.iterrows()}
    return [run] + [r for r in table["run"] if r != run and keys[r] == keys.get(run)]


def process_supervised_runs(table: pd.DataFrame) -> list[str]:
    """The runs of a runs table whose config says they were trained with process supervision."""
    return [name for name, config in zip(table["run"], table["config"], strict=True)
            if (parsed_config(config) or {}).get("supervision") == "process"]


def runs_table(reader) -> pd.DataFrame:
    """Every run with its status, algorithm, task, number of steps and latest held-out accuracy (and its step)."""
    return reader.runs_overview()


def reader_problems(reader) -> list[str]:
    """Files and runs the reader had to leave out (damaged Parquet, unreadable run.json, ...), as messages."""
    reader.refresh()
    return list(reader.problems)


def run_steps(reader, runs: tuple[str, ...]) -> pd.DataFrame:
    """All per-step metrics of the given runs."""
    return reader.sql("SELECT * FROM steps WHERE list_contains(?, run) ORDER BY run, step", [list(runs)])


def step_numbers(reader, run: str) -> list[int]:
    """The steps logged for a run, ascending."""
    frame = reader.sql("SELECT DISTINCT step FROM steps WHERE run = ? ORDER BY step", [run])
    return [int(s) for s in frame["step"]]


# ---------------------------------------------------------------- one step

ROLLOUT_COLUMNS = """rollout_id, group_id, index_in_group, kind, prompt_id, prompt, completion, answer, reward,
    reward_correct, reward_process, reward_length, advantage, length, truncated, filtered, filter_reason,
    reward_components"""

def tokens_reading(columns: str) -> str:
    """The tokens to read `columns` from: the `tokens` view when they include token_id, else its rows without the
    join that gives back the ids the run log stores once per run (`TOKEN_ROWS`: DuckDB keeps that join in a query
    that does not aggregate, whether it reads the ids or not)."""
    return "tokens" if "token_id" in columns else TOKEN_ROWS


# The columns of a token with the values of one optimisation pass (`t`: tokens, `p`: token_passes).
# mismatch: the trainer's log-prob minus the sampler's (engine.corrections' log_ratio), NULL without a sampler.
TOKEN_PASS_COLUMNS = f"""t.rollout_id, t.position, t.token_id, t.token_text, t.old_logp, t.ref_logp, t.entropy,
    t.advantage, t.prm_step, t.sampler_logp, t.old_logp - t.sampler_logp AS mismatch, p."pass",
    {new_logp_sql("p", "t")} AS new_logp, p.ratio, p.clip, p.grad_weight, p.token_loss, {kl_sql("p", "t")} AS kl,
    p.is_weight, p.rejected"""


def step_rollouts(reader, run: str, step: int, kind: str | None = None) -> pd.DataFrame:
    """The rollouts of one step (train and eval unless `kind` says which)."""
    return reader.sql(
        f"""SELECT {ROLLOUT_COLUMNS} FROM rollouts
            WHERE run = $run AND step = $step AND ($kind IS NULL OR kind = $kind)
            ORDER BY kind DESC, group_id, index_in_group""",
        {"run": run, "step": step, "kind": kind},
    )


# How much of a completion the pages that show many at once (Groups, Replay) receive: a reasoning run's completions
# run to 16k tokens (~60k characters), 16 of them a group; the whole text is one click away in the Token inspector.
COMPLETION_PREVIEW_CHARS = 1500


def step_rollout_previews(reader, run: str, step: int, kind: str | None = None,
                          chars: int = COMPLETION_PREVIEW_CHARS) -> pd.DataFrame:
    """`step_rollouts` with each completion cut to its first `chars` characters by DuckDB (the page never receives
    the rest) and `completion_chars`, the whole completion's length in characters."""
    return reader.sql(
        f"""SELECT * REPLACE (left(completion, $chars) AS completion), length(completion) AS completion_chars
            FROM (SELECT {ROLLOUT_COLUMNS} FROM rollouts
                  WHERE run = $run AND step = $step AND ($kind IS NULL OR kind = $kind))
            ORDER BY kind DESC, group_id, index_in_group""",
        {"run": run, "step": step, "kind": kind, "chars": chars},
    )


def rollout_previews(reader, run: str, step: int, rollout_ids: tuple[int, ...],
                     chars: int = COMPLETION_PREVIEW_CHARS) -> pd.DataFrame:
    """`step_rollout_previews` of some rollouts of a step (a group): only their row groups are read."""
    return reader.sql(
        f"""SELECT * REPLACE (left(completion, $chars) AS completion), length(completion) AS completion_chars
            FROM (SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE {of_rollouts()})
            ORDER BY kind DESC, group_id, index_in_group""",
        rollouts_of_step(run, step, rollout_ids, chars=chars),
    )


# `ROLLOUT_COLUMNS` without the texts (prompt, completion, answer, reward components).
ROLLOUT_NUMBERS = """rollout_id, group_id, index_in_group, kind, prompt_id, reward, reward_correct, reward_process,
    reward_length, advantage, length, truncated, filtered, filter_reason"""


def step_rollout_numbers(reader, run: str, step: int, kind: str | None = None) -> pd.DataFrame:
    """`step_rollouts` without their texts (`ROLLOUT_NUMBERS`): what a step's distributions, group pickers and
    objectives need. A reasoning run's step holds ~15 MB of completions, which DuckDB then never decompresses
    (long shape, 256 completions of 2k-16k tokens: 94 ms of CPU with previews, 14 ms without)."""
    return reader.sql(
        f"""SELECT {ROLLOUT_NUMBERS} FROM rollouts WHERE run = $run AND step = $step AND ($kind IS NULL OR kind = $kind)
            ORDER BY kind DESC, group_id, index_in_group""",
        {"run": run, "step": step, "kind": kind},
    )


def groups_matching(reader, run: str, step: int, text: str) -> list:
    """The train groups of a step with `text` in the prompt or a completion (case-insensitive), searched in the
    whole texts by DuckDB (the page holds only their previews)."""
    frame = reader.sql(
        """SELECT DISTINCT group_id FROM rollouts
           WHERE run = $run AND step = $step AND kind = 'train'
             AND (contains(lower(prompt), lower($text)) OR contains(lower(completion), lower($text)))
           ORDER BY group_id""",
        {"run": run, "step": step, "text": text},
    )
    return frame["group_id"].tolist()


OUTCOME_BY_CORRECTNESS = "correctness"
OUTCOME_BY_REWARD = "reward"
"""How a group's outcome was decided: by its `reward_correct` column, or, for a run that logged none (every TRL run
and import), by its rewards (all equal: the group carries no signal)."""


def group_summary(reader, run: str, step: int) -> pd.DataFrame:
    """One row per train group of a step: its prompt, reward mean/std, outcome mix, filtering.

    `outcome`: "all correct" / "all wrong" / "mixed" from `reward_correct`; for a group without any correctness
    logged, "no reward" when none of its rewards was logged either (an import of a dump that holds none), "no
    signal" when all its rewards are equal (reward std 0, every advantage 0: the groups DAPO's dynamic sampling
    drops) and "mixed" otherwise; `outcome_from` says which ("correctness" or "reward")."""
    return reader.sql(
        f"""
        SELECT group_id, any_value(prompt) AS prompt, any_value(answer) AS answer, count(*) AS size,
               avg(reward) AS reward_mean,
               CASE WHEN count(reward) > 0 THEN coalesce(stddev_samp(reward), 0) END AS reward_std,
               avg(reward_correct) AS accuracy, avg(length) AS length_mean,
               max(abs(advantage)) AS max_abs_advantage,
               bool_or(filtered) AS filtered, any_value(filter_reason) FILTER (WHERE filtered) AS filter_reason,
               sum(truncated::INT) AS truncated,
               CASE WHEN count(reward_correct) > 0 THEN
                        CASE WHEN min(reward_correct) > 0 THEN 'all correct'
                             WHEN max(reward_correct) <= 0 THEN 'all wrong' ELSE 'mixed' END
                    WHEN count(reward) = 0 THEN 'no reward'
                    WHEN min(reward) = max(reward) THEN 'no signal'
                    ELSE 'mixed' END AS outcome,
               CASE WHEN count(reward_correct) > 0 THEN '{OUTCOME_BY_CORRECTNESS}'
                    ELSE '{OUTCOME_BY_REWARD}' END AS outcome_from
        FROM rollouts WHERE run = $run AND step = $step AND kind = 'train'
        GROUP BY group_id ORDER BY group_id
        """,
        {"run": run, "step": step},
    )


def group_members(rollouts: pd.DataFrame, group_id) -> pd.DataFrame:
    """The rollouts of one group of `group_summary`, in group order. A NULL group id (rollouts logged without a group,
    which `group_summary` gathers in one row) takes every rollout without one: NULL never equals NULL."""
    same = rollouts["group_id"].isna() if pd.isna(group_id) else rollouts["group_id"] == group_id
    return rollouts[same].sort_values("index_in_group")


def rollout_passes(reader, run: str, step: int, rollout_id: int) -> list[int]:
    """The optimisation passes that used a rollout. With mini-batches a rollout is in one pass per epoch, not in
    every pass of the step."""
    frame = reader.sql(f'SELECT DISTINCT "pass" FROM {PASSES} WHERE {of_rollouts()} ORDER BY 1',
                       rollouts_of_step(run, step, (rollout_id,)))
    return [int(p) for p in frame["pass"]]


def update_count(reader, run: str, step: int, rollout_ids: tuple[int, ...]) -> int:
    """How many optimisation passes used each of these rollouts (the number of epochs; 0 if none was logged)."""
    frame = reader.sql(
        f"""SELECT coalesce(max(n), 0) AS n FROM (
               SELECT rollout_id, count(DISTINCT "pass") AS n FROM {PASSES} WHERE {of_rollouts()}
               GROUP BY rollout_id)""",
        rollouts_of_step(run, step, rollout_ids),
    )
    return int(frame["n"].iloc[0])


def step_pass_summary(reader, run: str, step: int) -> pd.DataFrame:
    """One row per optimisation pass of a step: tokens trained on, the fraction of them with each clip code (columns
    named as `engine.clip_codes.CLIP_NAMES`, which `charts.clip_fractions` draws), mean |gradient weight| and
    |ratio - 1|."""
    return reader.sql(
        f"""SELECT "pass", count(*) AS tokens, {clip_rates(name=CLIP_NAMES.get)},
                  avg(abs(grad_weight)) AS mean_abs_grad_weight, avg(abs(ratio - 1)) AS mean_abs_ratio_change
           FROM {PASSES} WHERE run = $run AND step = $step GROUP BY "pass" ORDER BY "pass" """,
        {"run": run, "step": step},
    )


def rollout_total_weights(reader, run: str, step: int) -> pd.DataFrame:
    """Each trained rollout of a step: its length, advantage and the sum of its tokens' gradient weights in the last
    pass that used it."""
    return reader.sql(
        f"""WITH per_pass AS (SELECT rollout_id, "pass", sum(grad_weight) AS weight FROM {PASSES}
                             WHERE run = $run AND step = $step GROUP BY rollout_id, "pass"),
                last AS (SELECT rollout_id, arg_max_null(weight, "pass") AS total_weight FROM per_pass
                         GROUP BY rollout_id)
           SELECT r.rollout_id, r.length, r.advantage, l.total_weight
           FROM last l JOIN rollouts r ON r.rollout_id = l.rollout_id
           WHERE r.run = $run AND r.step = $step ORDER BY r.rollout_id""",
        {"run": run, "step": step},
    )


CHOSEN_PASSES = f"""used AS (
        SELECT DISTINCT rollout_id, "pass" FROM {PASSES} WHERE {of_rollouts()}
    ), ranked AS (
        SELECT rollout_id, "pass", row_number() OVER (PARTITION BY rollout_id ORDER BY "pass") - 1 AS k,
               count(*) OVER (PARTITION BY rollout_id) AS n
        FROM used
    ), chosen AS (
        SELECT rollout_id, "pass" FROM ranked WHERE k = CASE WHEN $update < 0 THEN n - 1 ELSE $update END
    )"""
"""Common table expressions ending in `chosen`: each rollout's `$update`-th pass (0-based; -1 = its last), of the
rollouts of `rollouts_of_step`'s parameters. Different rollouts of a step are in different mini-batches, so "the
same moment" for a group is the k-th time each of its rollouts was used, not one pass number."""


def tokens_at_update(reader, run: str, step: int, rollout_ids: tuple[int, ...], update: int) -> pd.DataFrame:
    """Tokens of some rollouts, each with the values of its `update`-th pass (`CHOSEN_PASSES`)."""
    return reader.sql(
        f"""
        WITH {CHOSEN_PASSES}, passes AS (
            SELECT p.* FROM {PASSES} p JOIN chosen c ON c.rollout_id = p.rollout_id AND c."pass" = p."pass"
            WHERE {of_rollouts("p", listed=False)}
        )
        SELECT {TOKEN_PASS_COLUMNS}
        FROM tokens t
        LEFT JOIN passes p ON p.rollout_id = t.rollout_id AND p.position = t.position
        WHERE {of_rollouts("t")}
        ORDER BY t.rollout_id, t.position
        """,
        rollouts_of_step(run, step, rollout_ids, update=update),
    )


def weighed_tokens(reader, run: str, step: int, rollout_ids: tuple[int, ...]) -> pd.DataFrame:
    """What the objectives read of the tokens of some rollouts (`engine.logrows.batch_from_tokens`), those with a
    position (one without has no place in a (B, T) batch), before any pass: their new log-probs at an update come
    from `weighed_passes`."""
    return reader.sql(
        f"""SELECT rollout_id, position, old_logp, ref_logp, entropy, advantage FROM {TOKEN_ROWS}
            WHERE {of_rollouts()} AND position IS NOT NULL ORDER BY rollout_id, position""",
        rollouts_of_step(run, step, rollout_ids),
    )


def weighed_passes(reader, run: str, step: int, rollout_ids: tuple[int, ...], update: int) -> pd.DataFrame:
    """The pass rows of some rollouts' `update`-th pass each (`CHOSEN_PASSES`):
    new_logp as stored, NULL where only the ratio was (new = old + ln ratio: `engine.runlog.derived`)."""
    return reader.sql(
        f"""
        WITH {CHOSEN_PASSES}
        SELECT p.rollout_id, p.position, p.new_logp, p.ratio
        FROM {PASSES} p JOIN chosen c ON c.rollout_id = p.rollout_id AND c."pass" = p."pass"
        WHERE {of_rollouts("p", listed=False)}
        """,
        rollouts_of_step(run, step, rollout_ids, update=update),
    )


def _tokens_of_pass(columns: str) -> str:
    """SELECT `columns` from the tokens of some rollouts (parameters from `rollouts_of_step`, plus $pass and the
    position range $first_pos..$last_pos, NULL for every position) joined with one pass's rows."""
    return f"""
        SELECT {columns}
        FROM {tokens_reading(columns)} t
        LEFT JOIN (SELECT * FROM {PASSES} WHERE "pass" = $pass AND {of_rollouts(listed=False)}) p
               ON p.rollout_id = t.rollout_id AND p.position = t.position
        WHERE {of_rollouts("t")} AND t.position BETWEEN coalesce($first_pos, 0) AND coalesce($last_pos, 2147483647)
        """


def rollout_tokens(reader, run: str, step: int, rollout_ids: tuple[int, ...], pass_: int | None,
                   positions: tuple[int, int] | None = None) -> pd.DataFrame:
    """Tokens of some rollouts with the values of one optimisation pass (NULL where the pass logged nothing);
    `positions` = (first, last): only the tokens at those positions (a window of a long completion)."""
    first, last = positions or (None, None)
    return reader.sql(
        _tokens_of_pass(TOKEN_PASS_COLUMNS) + " ORDER BY t.rollout_id, t.position",
        rollouts_of_step(run, step, rollout_ids, first_pos=first, last_pos=last, **{"pass": pass_}),
    )


# The per-token channels of the Token inspector (dashboard.tokens.CHANNELS) as SQL over the tokens (t) and one
# pass (p); a bin holds their means. rejected: the share of the bin's tokens the corrections took out of the loss.
BINNED_CHANNELS = {
    "advantage": "t.advantage", "ratio": "p.ratio", "new_logp": new_logp_sql("p", "t"), "old_logp": "t.old_logp",
    "ref_logp": "t.ref_logp", "entropy": "t.entropy", "kl": kl_sql("p", "t"), "grad_weight": "p.grad_weight",
    "token_loss": "p.token_loss", "sampler_logp": "t.sampler_logp", "mismatch": "t.old_logp - t.sampler_logp",
    "is_weight": "p.is_weight", "rejected": "(p.rejected <> 0)::DOUBLE",
}


def rollout_token_bins(reader, run: str, step: int, rollout_id: int, pass_: int | None, bins: int) -> pd.DataFrame:
    """One rollout's tokens in at most `bins` bins of consecutive positions (width ceil((last position + 1) / bins),
    1 for a completion of at most `bins` tokens), so a figure of a 16k-token completion gets no more points than
    it has pixels; DuckDB bins them, the page receives only the bins.

    One row per non-empty bin: `bin`, `first_pos`, `last_pos`, `tokens`, the mean of every channel of
    `BINNED_CHANNELS` (NULL where no token of the bin has it), and the bin's clip events of this pass
    (`clip_low`, `clip_high`, `clip_dual`: token counts) and rejected tokens (`rejected_tokens`)."""
    means = ", ".join(f"avg({name}) AS {name}" for name in BINNED_CHANNELS)
    clips = ", ".join(f"count(*) FILTER (WHERE clip = {code}) AS clip_{CLIP_NAMES[code]}" for code in CLIP_EVENTS)
    values = ", ".join(f"{sql} AS {name}" for name, sql in BINNED_CHANNELS.items())
    return reader.sql(
        f"""
        WITH rows AS ({_tokens_of_pass(f"t.position, p.clip, p.rejected AS rejected_code, {values}")}),
             width AS (SELECT greatest(1, ceil((max(position) + 1) / $bins))::BIGINT AS w FROM rows)
        SELECT position // w AS bin, min(position) AS first_pos, max(position) AS last_pos, count(*) AS tokens,
               {means}, {clips}, count(*) FILTER (WHERE rejected_code <> 0) AS rejected_tokens
        FROM rows, width GROUP BY bin ORDER BY bin
        """,
        rollouts_of_step(run, step, (rollout_id,), first_pos=None, last_pos=None, bins=bins, **{"pass": pass_}),
    )


def prm_steps(reader, run: str, step: int, rollout_ids: tuple[int, ...]) -> pd.DataFrame:
    """Reasoning steps (with raw and normalized rewards) of some rollouts."""
    return reader.sql(
        f"""SELECT rollout_id, step_index, first_pos, last_pos, text, reward_raw, reward_norm FROM prm_steps
           WHERE {of_rollouts()} ORDER BY rollout_id, step_index""",
        rollouts_of_step(run, step, rollout_ids),
    )


def prm_step_bins(reader, run: str, step: int, rollout_ids: tuple[int, ...], bins: int) -> pd.DataFrame:
    """The step rewards of some rollouts (a group) in bins of consecutive step indices, one width for all of them
    (`width`: ceil((the group's last step index + 1) / `bins`), 1 when every completion has at most `bins` steps),
    so a 16k-token completion's ~300 steps become at most `bins` bars; DuckDB bins them, the page receives only the
    bins.

    One row per rollout and non-empty bin: `rollout_id`, `bin`, `width`, `first_step`, `last_step`, `steps`, and for
    reward_raw and reward_norm the mean, `_low` (min) and `_high` (max), NULL when not logged."""
    stats = ", ".join(f"avg({c}) AS {c}, min({c}) AS {c}_low, max({c}) AS {c}_high"
                      for c in ("reward_raw", "reward_norm"))
    return reader.sql(
        f"""
        WITH rows AS (SELECT rollout_id, step_index, reward_raw, reward_norm FROM prm_steps WHERE {of_rollouts()}),
             width AS (SELECT greatest(1, ceil((max(step_index) + 1) / $bins))::BIGINT AS w FROM rows)
        SELECT rollout_id, step_index // w AS bin, any_value(w) AS width, min(step_index) AS first_step,
               max(step_index) AS last_step, count(*) AS steps, {stats}
        FROM rows, width GROUP BY rollout_id, bin ORDER BY rollout_id, bin
        """,
        rollouts_of_step(run, step, rollout_ids, bins=bins),
    )


def critic_tokens(reader, run: str, step: int, rollout_ids: tuple[int, ...]) -> pd.DataFrame:
    """Tokens of some rollouts with the logged advantage and, for runs with a critic, value, return and the KL part
    of the reward (NULL otherwise)."""
    return reader.sql(
        f"""SELECT rollout_id, position, token_text, advantage, value, "return", kl_reward, prm_step
           FROM {TOKEN_ROWS} WHERE {of_rollouts()} ORDER BY rollout_id, position""",
        rollouts_of_step(run, step, rollout_ids),
    )


CRITIC_CHANNELS = ("advantage", "value", "kl_reward")


def critic_token_bins(reader, run: str, step: int, rollout_ids: tuple[int, ...], bins: int) -> pd.DataFrame:
    """`critic_tokens` of some rollouts (a group) in bins of consecutive positions, one width for all of them
    (`width`: ceil((the group's last position + 1) / `bins`), 1 for completions of at most `bins` tokens), so the
    group's lines share one token axis at screen resolution; DuckDB bins them, the page receives only the bins.

    One row per rollout and non-empty bin: `rollout_id`, `bin`, `width`, `first_pos`, `last_pos`, `tokens`, and for
    each of `CRITIC_CHANNELS` its mean, `<channel>_low` (min) and `<channel>_high` (max), NULL without values."""
    stats = ", ".join(f'avg({c}) AS {c}, min({c}) AS {c}_low, max({c}) AS {c}_high' for c in CRITIC_CHANNELS)
    return reader.sql(
        f"""
        WITH rows AS (
            SELECT rollout_id, position, {", ".join(CRITIC_CHANNELS)} FROM {TOKEN_ROWS} WHERE {of_rollouts()}
        ),
             width AS (SELECT greatest(1, ceil((max(position) + 1) / $bins))::BIGINT AS w FROM rows)
        SELECT rollout_id, position // w AS bin, any_value(w) AS width, min(position) AS first_pos,
               max(position) AS last_pos, count(*) AS tokens, {stats}
        FROM rows, width GROUP BY rollout_id, bin ORDER BY rollout_id, bin
        """,
        rollouts_of_step(run, step, rollout_ids, bins=bins),
    )


def step_whitening(reader, run: str, step: int) -> tuple[float, float] | None:
    """(mean, std) a critic run's loss whitened this step's GAE advantages with (every step of a critic run logs
    them); None without a critic."""
    frame = reader.sql("SELECT advantage_mean, advantage_std FROM steps WHERE run = ? AND step = ?", [run, step])
    if frame.empty or frame[["advantage_mean", "advantage_std"]].isna().any(axis=None):
        return None
    return float(frame["advantage_mean"].iloc[0]), float(frame["advantage_std"].iloc[0])


def as_loss_used(tokens: pd.DataFrame, whitening: tuple[float, float] | None) -> pd.DataFrame:
    """Tokens of a step as its loss saw them. A critic run (`whitening` = the step's (mean, std) from
    `step_whitening`) logs each token's GAE advantage before whitening, but its PPO loss, and so its clip decisions,
    used (A - mean) / std (`engine.advantages.masked_whiten`; std already holds its epsilon): that goes into
    `advantage`, and the logged value into `gae_advantage`. Without a critic the logged advantage is the loss's own
    and the frame is returned as it is."""
    if whitening is None or "advantage" not in tokens.columns:
        return tokens
    mean, std = whitening
    logged = pd.to_numeric(tokens["advantage"], errors="coerce")
    return tokens.assign(advantage=(logged - mean) / std, gae_advantage=logged)


def train_tokens_per_step(reader, run: str) -> dict[int, int]:
    """Train tokens of each step: the sum of its train rollouts' lengths (0 where no length was logged)."""
    frame = reader.sql("SELECT step, coalesce(sum(length), 0) AS tokens FROM rollouts "
                       "WHERE run = ? AND kind = 'train' GROUP BY step", [run])
    return {int(s): int(n) for s, n in zip(frame["step"], frame["tokens"], strict=True)}


def unsummarised_steps(reader, run: str) -> list[tuple[int, int]]:
    """The step ranges of a run that its token summary does not cover (logged before it, or its file damaged):
    the Token statistics read those row by row (`dashboard.token_data`)."""
    return reader.steps_without("token_summary", run, ("tokens", "token_passes"))


def run_has_prm(reader, run: str) -> bool:
    frame = reader.sql("SELECT count(*) AS n FROM (SELECT 1 FROM prm_steps WHERE run = ? LIMIT 1)", [run])
    return bool(frame["n"].iloc[0])


# ---------------------------------------------------------------- eval prompts across steps and runs


def eval_prompts(reader, run: str) -> pd.DataFrame:
    """The held-out prompts a run evaluated on (stable ids, so they can be followed)."""
    return reader.sql(
        """SELECT prompt_id, any_value(prompt) AS prompt, any_value(answer) AS answer, count(DISTINCT step) AS steps
           FROM rollouts WHERE run = ? AND kind = 'eval' GROUP BY prompt_id ORDER BY prompt_id""",
        [run],
    )


EVAL_PREVIEW_CHARS = 300
"""Characters of each eval answer the Replay page's tables receive: a table cell shows a glance of a reasoning
answer (7k characters on average, 36k at most, in the long benchmark run), and the history of a 140-step run sent
whole at every step of a replay was megabytes."""


def eval_prompt_history(reader, run: str, prompt_id: int, chars: int = EVAL_PREVIEW_CHARS) -> pd.DataFrame:
    """Every eval answer of one run to one prompt, step by step, each cut to its first `chars` characters by DuckDB;
    `completion_chars` is the whole answer's length in characters."""
    return reader.sql(
        """SELECT step, index_in_group AS sample, left(completion, $chars) AS completion,
                  length(completion) AS completion_chars, reward, reward_correct, length, truncated, rollout_id
           FROM rollouts WHERE run = $run AND kind = 'eval' AND prompt_id = $prompt ORDER BY step, index_in_group""",
        {"run": run, "prompt": prompt_id, "chars": chars},
    )


def eval_prompt_across_runs(reader, task: str, prompt_id: int, step: int, chars: int = EVAL_PREVIEW_CHARS
                            ) -> pd.DataFrame:
    """Every run on the same task answering one eval prompt, each at its latest evaluation at or before `step`
    (runs evaluate every few steps, not necessarily on the same ones); answers cut as in `eval_prompt_history`."""
    return reader.sql(
        """
        WITH answers AS (
            SELECT r.run, x.algorithm, r.step, r.index_in_group AS sample, left(r.completion, $chars) AS completion,
                   length(r.completion) AS completion_chars, r.reward, r.reward_correct, r.length
            FROM rollouts r JOIN runs x ON x.run = r.run
            WHERE x.task = $task AND r.kind = 'eval' AND r.prompt_id = $prompt AND r.step <= $step
        ), latest AS (SELECT run, max(step) AS step FROM answers GROUP BY run)
        SELECT a.* FROM answers a JOIN latest l ON l.run = a.run AND l.step = a.step
        ORDER BY a.run, a.sample
        """,
        {"task": task, "prompt": prompt_id, "step": step, "chars": chars},
    )


# ---------------------------------------------------------------- token trajectories: reference solutions over training


def ref_prompts(reader, run: str) -> pd.DataFrame:
    """The held-out prompts whose reference solution a run scored (`ref_tokens`), with their text and class."""
    return reader.sql(
        """
        WITH scored AS (
            SELECT prompt_id, any_value(answer_class) AS answer_class, count(DISTINCT step) AS steps,
                   max(position) + 1 AS tokens
            FROM ref_tokens WHERE run = $run GROUP BY prompt_id
        ), asked AS (
            SELECT prompt_id, any_value(prompt) AS prompt, any_value(answer) AS answer
            FROM rollouts WHERE run = $run AND kind = 'eval' GROUP BY prompt_id
        )
        SELECT s.prompt_id, a.prompt, a.answer, s.answer_class, s.tokens, s.steps
        FROM scored s LEFT JOIN asked a USING (prompt_id) ORDER BY s.prompt_id
        """,
        {"run": run},
    )


def ref_trajectories(reader, runs: tuple[str, ...], prompt_id: int) -> pd.DataFrame:
    """Every scored token of one held-out prompt's reference solution, per run and evaluation step."""
    return reader.sql(
        """SELECT run, step, position, token_text, logp, exp(logp) AS p, entropy FROM ref_tokens
           WHERE list_contains(?, run) AND prompt_id = ? ORDER BY run, step, position""",
        [list(runs), prompt_id],
    )


def ref_class_curves(reader, runs: tuple[str, ...]) -> pd.DataFrame:
    """Per run, evaluation step and answer class: the mean log-prob of a whole reference solution (summed over its
    tokens, EOS included) and the mean per-token log-prob, over the held-out prompts of that class."""
    return reader.sql(
        """
        WITH solutions AS (
            SELECT run, step, prompt_id, any_value(answer_class) AS answer_class, sum(logp) AS logp,
                   count(*) AS tokens
            FROM ref_tokens WHERE list_contains(?, run) GROUP BY run, step, prompt_id
        )
        SELECT run, step, answer_class, avg(logp) AS solution_logp, sum(logp) / sum(tokens) AS token_logp,
               count(*) AS prompts
        FROM solutions GROUP BY run, step, answer_class ORDER BY run, answer_class, step
        """,
        [list(runs)],
    )


def most_changed_tokens(trajectories: pd.DataFrame, upto_step: int, k: int = 3) -> pd.DataFrame:
    """Per run, the k reference tokens whose probability moved most between the run's first evaluation and its
    latest evaluation at or before `upto_step` (run, position, token_text, p_first, p_now, change, first, now)."""
    picked = []
    for run, frame in trajectories.groupby("run", sort=True):
        steps = sorted(frame["step"].unique())
        now = max((s for s in steps if s <= upto_step), default=steps[0])
        first = frame[frame["step"] == steps[0]].set_index("position")
        latest = frame[frame["step"] == now].set_index("position")
        change = (latest["p"] - first["p"]).dropna()
        top = change.abs().sort_values(ascending=False, kind="stable").index[:k]
        picked.append(pd.DataFrame({
            "run": run, "position": top, "token_text": latest.loc[top, "token_text"].to_numpy(),
            "p_first": first.loc[top, "p"].to_numpy(), "p_now": latest.loc[top, "p"].to_numpy(),
            "change": change.loc[top].to_numpy(), "first_step": int(steps[0]), "now_step": int(now),
        }))
    columns = ["run", "position", "token_text", "p_first", "p_now", "change", "first_step", "now_step"]
    return pd.concat(picked, ignore_index=True) if picked else pd.DataFrame(columns=columns)


# ---------------------------------------------------------------- sampler/trainer mismatch

# The step metrics of the Mismatch page's curves: keys of `steps.extra` the trainer writes per step
# (engine.logrows.mismatch_metrics: engine.corrections.offpolicy_metrics, plus is_weight_* and rejected_* with a
# correction on), each with its title. Written into the SQL from this list only, never from a user's value.
MISMATCH_CURVES: list[tuple[str, str]] = [
    ("mismatch_kl", "mismatch KL(sampler ‖ trainer)"),
    ("mismatch_chi2_token", "chi-square (token)"),
    ("mismatch_out_of_band", "share of tokens outside [0.9, 1.1]"),
    ("mismatch_mean_abs_log_ratio", "mean |log-ratio|"),
    ("mismatch_rejected_token_share", "rejection rate (tokens)"),
    ("mismatch_is_weight_ess", "IS weight ESS"),
    ("mismatch_ess", "ESS of the raw ratio"),
    ("mismatch_chi2_seq", "chi-square (sequence)"),
]


def _extra_number(key: str) -> str:
    """SQL for one number of the `steps.extra` JSON (NULL when absent, not a number, or the JSON is unreadable)."""
    return f"CASE WHEN json_valid(extra) THEN TRY_CAST(extra->>'{key}' AS DOUBLE) END AS \"{key}\""


def mismatch_runs(reader) -> list[str]:
    """The runs whose steps logged a sampler/trainer mismatch (`mismatch_kl` in `steps.extra`), by name."""
    frame = reader.sql(f"SELECT DISTINCT run FROM (SELECT run, {_extra_number('mismatch_kl')} FROM steps) "
                       "WHERE mismatch_kl IS NOT NULL ORDER BY run")
    return [str(r) for r in frame["run"]]


def mismatch_curves(reader, runs: tuple[str, ...]) -> pd.DataFrame:
    """Per run and step: every `MISMATCH_CURVES` metric (NULL where the step did not log it)."""
    columns = ", ".join(_extra_number(key) for key, _ in MISMATCH_CURVES)
    return reader.sql(f"SELECT run, step, {columns} FROM steps WHERE list_contains(?, run) ORDER BY run, step",
                      [list(runs)])


def sampler_tokens(reader, run: str, step: int, rollout_ids: tuple[int, ...] | None = None,
                   everything: bool = True) -> pd.DataFrame:
    """The tokens of a step's trained rollouts (train, not dropped by dynamic sampling; only `rollout_ids` when
    given) that have both the sampler's and the trainer's log-prob, with `log_ratio` = old_logp - sampler_logp,
    log(pi_trainer / pi_sampler). `everything=False`: only rollout_id, position, log_ratio and advantage (what the
    corrections need; decoding the token texts is most of the query's time). Some rollouts' tokens are bounded by
    their id range too (`of_rollouts`), so a group's query decodes its row groups, not the whole step's. The rows
    come in no particular order: sorting a step's 250k rows was a fifth of the query's time, and what reads them
    (`dashboard.mismatch`, `recompute.correction_effects`) does not depend on their order."""
    more = "t.token_text, t.old_logp, t.sampler_logp, t.sampler_logp_full, t.entropy," if everything else ""
    listed = rollout_ids is not None
    return reader.arrow(
        f"""SELECT t.rollout_id, t.position, {more} t.old_logp - t.sampler_logp AS log_ratio, t.advantage
           FROM {TOKEN_ROWS} t SEMI JOIN (
               SELECT rollout_id FROM rollouts
               WHERE {of_rollouts() if listed else "run = $run AND step = $step"}
                     AND kind = 'train' AND NOT coalesce(filtered, false)
           ) r ON r.rollout_id = t.rollout_id
           WHERE {of_rollouts("t", listed=False) if listed else "t.run = $run AND t.step = $step"}
                 AND isfinite(t.old_logp - t.sampler_logp)""",
        rollouts_of_step(run, step, rollout_ids) if listed else {"run": run, "step": step},
    ).to_pandas()  # through Arrow: the texts without DuckDB's slower conversion (RunReader.arrow)

