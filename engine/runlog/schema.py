"""The run log's tables: their columns and types, and the row builders that put data into them.

The column names and types are the contract between the trainer, the TRL adapter, the importers, the dashboard and
users' SQL. `run` and `step` are filled in by the writer; every other column may be omitted (stored as NULL).

Row builders (one per table, all through `table_rows`; `steps_row` for the one `steps` row of a step):

    from engine.runlog.schema import table_rows, steps_row
    tokens = table_rows("tokens", {"rollout_id": ids, "position": pos, "old_logp": logp, "sampler_logp": s_logp},
                        run, step)   # a pyarrow Table in the tokens schema, sorted, missing columns NULL
    log.log_step(step, tokens=tokens)   # `RunWriter.log_step` takes it as is (and builds the same from a dict)

A producer of rows (engine/logrows.py for the trainer, the TRL adapter, an importer) hands column dicts,
DataFrames or Tables to `RunWriter.log_step`, which builds each table's rows with `table_rows` / `steps_row`; a
producer that wants bad columns reported where it reads them (an importer, per line of its input) calls the builder
itself and passes the result on: the writer's second pass over a Table already in the schema only stamps run/step.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from engine.runlog.layout import RunLogError, json_default

_F = pa.float64()
# Per-token values (log-probs, entropies, advantages, ratios, weights, losses) are stored as float32: what
# trainers compute them in (bf16 training has less precision still), at half the bytes. Views read them as DOUBLE.
_F32 = pa.float32()
_I = pa.int64()
_S = pa.string()

DUMP_FIELDS = pa.struct(
    [("loss_mask", pa.bool_()),  # whether the other trainer learned from the token (every per-token dump has it)
     # prime-rl: the DPPO masks, the loss-component weights, and its per-token `losses` record (a JSON text)
     ("is_masked", pa.bool_()), ("is_masked_high", pa.bool_()), ("is_masked_low", pa.bool_()),
     ("rl_weights", _F), ("ce_weights", _F), ("ref_kl_weights", _F), ("losses", _S),
     # slime: its per-token KL estimate and a teacher's log-prob
     ("kl", _F), ("teacher_logp", _F)]
)
"""`tokens.dump`: the per-token fields of an imported trainer's dump outside the contract columns, each typed and
under the dump's own name (SQL: `dump.loss_mask`, `dump.is_masked`); NULL for runs PolicyLens trained itself."""

TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "steps": pa.schema(
        [("run", _S), ("step", _I), ("wall_time", _F), ("reward_mean", _F), ("reward_std", _F), ("accuracy", _F),
         ("heldout_accuracy", _F), ("heldout_accuracy_sampled", _F), ("entropy", _F), ("kl", _F),
         ("clip_low_frac", _F), ("clip_high_frac", _F), ("clip_dual_frac", _F), ("response_len_mean", _F),
         ("response_len_max", _F), ("truncated_frac", _F), ("groups_kept", _I), ("groups_filtered", _I),
         ("gen_batches", _I), ("loss", _F), ("grad_norm", _F), ("lr", _F), ("step_seconds", _F),
         # algorithms with a critic (PPO, engine.critic); NULL otherwise
         ("value_loss", _F), ("value_clip_frac", _F), ("explained_variance", _F), ("critic_grad_norm", _F),
         ("critic_seconds", _F), ("critic_memory_mb", _F), ("advantage_mean", _F), ("advantage_std", _F),
         # metrics outside the contract, as a JSON object, so any training loop can log its own
         ("extra", _S)]
    ),
    "rollouts": pa.schema(
        [("run", _S), ("step", _I), ("rollout_id", _I), ("group_id", _I), ("index_in_group", _I), ("kind", _S),
         ("prompt_id", _I), ("prompt", _S), ("completion", _S), ("answer", _S), ("reward", _F),
         ("reward_correct", _F), ("reward_process", _F), ("reward_length", _F), ("advantage", _F),
         ("length", _I), ("truncated", pa.bool_()), ("filtered", pa.bool_()), ("filter_reason", _S),
         ("seq_ratio", pa.list_(_F)),
         # the process (rank) that sampled the rollout; one reward per reward function as a JSON object
         # {"name": value} (`reward` stays the total the trainer optimised)
         ("rank", _I), ("reward_components", _S)]
    ),
    "tokens": pa.schema(
        [("run", _S), ("step", _I), ("rollout_id", _I), ("position", _I), ("token_id", _I), ("token_text", _S),
         ("old_logp", _F32), ("ref_logp", _F32), ("entropy", _F32), ("advantage", _F32), ("prm_step", _I),
         ("value", _F32), ("return", _F32), ("kl_reward", _F32),  # critic algorithms only
         # What the sampler (the rollout engine: vLLM, SGLang, ...) reported for the sampled token, next to
         # `old_logp`, the trainer's own recomputation: their gap is the sampler/trainer mismatch.
         # sampler_logp: its log-prob after the sampling transforms it applied (temperature, top-p / top-k
         # truncation renormalised); sampler_logp_full: the same token's log-prob before top-p / top-k truncation.
         # NULL when the producer had no sampler log-probs (and in runs logged before these columns).
         ("sampler_logp", _F32), ("sampler_logp_full", _F32),
         # Per-token fields of an imported run outside this schema and outside `dump` (a field of a dump format
         # added later), one JSON object per token; SQL reads them with `extra->>'name'`. Runs imported before
         # `dump` existed hold all their fields here (`extra->>'loss_mask'`).
         ("extra", _S),
         # The imported trainer's own per-token fields, typed (see DUMP_FIELDS): a struct costs a few typed
         # columns where a JSON text per token cost more than the rest of the token's row to build.
         ("dump", DUMP_FIELDS)]
    ),
    "token_passes": pa.schema(
        [("run", _S), ("step", _I), ("pass", _I), ("rollout_id", _I), ("position", _I), ("new_logp", _F32),
         ("ratio", _F32), ("clip", pa.int8()), ("grad_weight", _F32), ("token_loss", _F32), ("kl", _F32),
         # sampler/trainer mismatch corrections (engine.corrections), NULL when none is on: is_weight, the
         # batch's importance weight pi_trainer / pi_sampler of the token (NULL when IS is off); rejected, why the
         # corrections took the token out of this pass's loss (engine.correction_settings REJECT_*, 0 = kept)
         ("is_weight", _F32), ("rejected", pa.int8()),
         # filled in by the writer from the step's tokens (engine.runlog.derived), NULL without them (and in runs
         # logged before these columns): the token's entropy decile within its response (0-9) and its text, so
         # that statistics per decile or per token text over a whole run read the passes alone
         ("entropy_decile", pa.int8()), ("token_text", _S)]
    ),
    "prm_steps": pa.schema(
        [("run", _S), ("step", _I), ("rollout_id", _I), ("step_index", _I), ("first_pos", _I), ("last_pos", _I),
         ("text", _S), ("reward_raw", _F), ("reward_norm", _F)]
    ),
    # the held-out prompts' reference solutions scored by the policy (teacher-forced) at each evaluation
    "ref_tokens": pa.schema(
        [("run", _S), ("step", _I), ("prompt_id", _I), ("position", _I), ("token_id", _I), ("token_text", _S),
         ("logp", _F32), ("entropy", _F32), ("answer_class", _S)]
    ),
    # written by the writer from each step's tokens (engine.runlog.derived.TokenVocabulary), never by a producer:
    # the token id of each text whose id the step's `tokens` rows leave out (the view reads it back from here)
    "token_vocab": pa.schema([("run", _S), ("step", _I), ("token_id", _I), ("token_text", _S)]),
    # written by the writer from each step's tokens and passes (engine.runlog.summary), never by a producer: sums
    # per step and token text (and position bucket, clip code, pass, entropy decile) that statistics over a whole
    # run add up instead of reading every token; `kind` says which sums a row holds (see the module)
    "token_summary": pa.schema(
        [("run", _S), ("step", _I), ("kind", _S), ("bucket", _I), ("position_from", _I), ("token_text", _S),
         ("pass", _I), ("clip", pa.int8()), ("entropy_decile", pa.int8()), ("rows", _I), ("advantage_sum", _F),
         ("advantage_rows", _I), ("entropy_sum", _F), ("entropy_rows", _I), ("abs_weight", _F), ("ratio_dev", _F),
         ("logp_sum", _F), ("advantage_logp_sum", _F), ("kl_sum", _F), ("kl_rows", _I), ("cov_rows", _I),
         ("loss_tokens", _F)]
    ),
}
VOCABULARY_TABLE = "token_vocab"
STORED_TABLES = tuple(TABLE_SCHEMAS)
"""The tables a step or chunk folder may hold a file of."""
DATA_TABLES = tuple(t for t in STORED_TABLES if t != VOCABULARY_TABLE)
"""The tables a `RunReader` has a view of (`token_vocab` is storage: the `tokens` view reads its ids)."""
ALL_TABLES = ("runs", *DATA_TABLES)

# Columns of a table's files that its view does not show: how to read the stored rows back (engine.runlog.derived).
# `tokens.elided`: which values the writer left out because another column of the row holds them (bit 1:
# sampler_logp = old_logp, bit 2: sampler_logp_full = sampler_logp, bit 4: token_id is the run's id of the token's
# text in `token_vocab`); 0 or NULL (files written before it): none.
STORED_ONLY: dict[str, tuple[pa.Field, ...]] = {"tokens": (pa.field("elided", pa.int8()),)}
FILE_SCHEMAS: dict[str, pa.Schema] = {
    table: pa.schema([*schema, *STORED_ONLY.get(table, ())]) for table, schema in TABLE_SCHEMAS.items()
}
"""The columns of each table's Parquet files: the table's (`TABLE_SCHEMAS`), then its `STORED_ONLY` ones."""

# Columns added after files were first written with SCHEMA_VERSION 1: a file without some of them is still read
# (they read as NULL) and rewritten with them when compacted, so older runs stay visible and resumable. A new
# column goes at the end of its table and here (see CONTRIBUTING.md, "How to add a table column").
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": ("value_loss", "value_clip_frac", "explained_variance", "critic_grad_norm", "critic_seconds",
              "critic_memory_mb", "advantage_mean", "advantage_std"),
    "rollouts": ("rank", "reward_components"),
    "tokens": ("value", "return", "kl_reward", "sampler_logp", "sampler_logp_full", "extra", "dump", "elided"),
    "token_passes": ("is_weight", "rejected", "entropy_decile", "token_text"),
}
# Columns whose type changed since files were first written: a file with the older type is read (as the wider
# type, see `view_schema`) and rewritten in the current type when compacted.
OLDER_TYPES: dict[str, dict[str, pa.DataType]] = {
    table: {f.name: _F for f in TABLE_SCHEMAS[table] if f.type == _F32}
    for table in ("tokens", "token_passes", "ref_tokens")
}

RUNS_SCHEMA = pa.schema(
    [("run", _S), ("run_id", _S), ("algorithm", _S), ("task", _S), ("created_at", pa.timestamp("us")),
     ("updated_at", pa.timestamp("us")), ("status", _S), ("config", _S), ("model", _S), ("last_step", _I)]
)

# Files are sorted by these keys so that, inside a compacted chunk, Parquet row-group min/max statistics let
# DuckDB skip everything but the row groups of the rollout a query asks for.
SORT_KEYS = {
    "steps": ["step"],
    "rollouts": ["step", "rollout_id"],
    "tokens": ["step", "rollout_id", "position"],
    "token_passes": ["step", "rollout_id", "pass", "position"],
    "prm_steps": ["step", "rollout_id", "step_index"],
    "ref_tokens": ["step", "prompt_id", "position"],
    "token_summary": ["step"],
    "token_vocab": ["step", "token_id"],
}

_DUCKDB_TYPES = {
    pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN",
    pa.int8(): "TINYINT", pa.list_(pa.float64()): "DOUBLE[]", pa.timestamp("us"): "TIMESTAMP",
    pa.float32(): "FLOAT",
}
_DUCKDB_TYPES[DUMP_FIELDS] = "STRUCT(" + ", ".join(f'"{f.name}" {_DUCKDB_TYPES[f.type]}' for f in DUMP_FIELDS) + ")"


def columns_ddl(schema: pa.Schema) -> str:
    """The column list of a SQL CREATE TABLE for `schema`, in DuckDB's types."""
    return ", ".join(f'"{f.name}" {_DUCKDB_TYPES[f.type]}' for f in schema)


def view_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` as SQL reads it: float32 columns as float64 (users' queries and DataFrames keep their types)."""
    return pa.schema([pa.field(f.name, _F) if f.type == _F32 else f for f in schema])


def older_schema_missing(table: str, schema: pa.Schema) -> list[str] | None:
    """The added columns a file of `table` with `schema` lacks (possibly none), if it is a file of an older
    release (every column it has is the table's, in order, of the current type or of its `OLDER_TYPES` one; only
    columns of `ADDED_COLUMNS` missing); else None (also for a file in the current schema)."""
    current = FILE_SCHEMAS[table]
    if schema.equals(current):
        return None
    missing = [name for name in current.names if name not in schema.names]
    if not set(missing) <= set(ADDED_COLUMNS.get(table, ())):
        return None
    kept = [f for f in current if f.name in schema.names]
    older = OLDER_TYPES.get(table, {})
    if schema.names != [f.name for f in kept]:
        return None
    for field, want in zip(schema, kept, strict=True):
        if field.type != want.type and older.get(field.name) != field.type:
            return None
    return missing


def with_added_columns(piece: pa.Table, table: str) -> pa.Table:
    """Rows of a file of an older release (see `older_schema_missing`) in the current schema: the new columns
    NULL, the columns of `OLDER_TYPES` cast to their current type."""
    schema = FILE_SCHEMAS[table]
    if piece.schema.equals(schema):
        return piece
    n = piece.num_rows
    columns = [piece.column(f.name).cast(f.type) if f.name in piece.column_names else pa.nulls(n, f.type)
               for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


# ---------------------------------------------------------------- row builders


def table_rows(table: str, data: Any, run: str, step: int) -> pa.Table | None:
    """The rows builder of every data table: a DataFrame / pyarrow Table / dict of columns in the table's schema
    (columns checked and cast, missing ones NULL, `run` and `step` filled in, sorted by `SORT_KEYS`), converted in
    bulk. None when there are no rows. Raises `RunLogError` naming the table and column that cannot be stored."""
    if data is None:
        return None
    schema = TABLE_SCHEMAS[table]
    try:
        if type(data).__name__ == "DataFrame" and type(data).__module__.startswith("pandas"):
            arrow = pa.Table.from_pandas(data, preserve_index=False)
        elif isinstance(data, pa.Table):
            arrow = data
        elif isinstance(data, Mapping):
            arrow = pa.table({k: _column_values(v) for k, v in data.items()})
        else:
            raise RunLogError(
                f"{table}: expected a pandas DataFrame, pyarrow Table or dict of columns, got {type(data).__name__}"
            )
    except (pa.ArrowException, ValueError, TypeError) as err:  # e.g. columns of different lengths
        raise RunLogError(f"{table}: cannot convert the columns: {err}") from err
    unknown = sorted(set(arrow.column_names) - set(schema.names))
    if unknown:
        raise RunLogError(f"{table}: unknown column(s) {unknown}; the columns are {schema.names[2:]}")
    n = arrow.num_rows
    if n == 0:
        return None
    columns = []
    for field in schema:
        if field.name == "run":
            columns.append(pa.repeat(pa.scalar(run, _S), n))
        elif field.name == "step":
            columns.append(pa.repeat(pa.scalar(step, _I), n))
        elif field.name in arrow.column_names:
            col = arrow.column(field.name)
            try:
                columns.append(col.cast(field.type) if col.type != field.type else col)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
                raise RunLogError(f"{table}.{field.name}: cannot store {col.type} as {field.type}: {err}") from err
        else:
            columns.append(pa.nulls(n, field.type))
    rows = pa.Table.from_arrays(columns, schema=schema)
    return rows if _sorted_by(rows, SORT_KEYS[table]) else rows.sort_by([(k, "ascending") for k in SORT_KEYS[table]])


def _sorted_by(rows: pa.Table, keys: list[str]) -> bool:
    """Whether the rows are already in ascending order of the (integer, non-null) `keys`: checking costs a few
    vectorised comparisons, sorting a million token rows ~0.3 s, and producers mostly hand rows in order (the
    sort is stable, so skipping it for ordered rows changes nothing)."""
    if rows.num_rows < 2 or any(rows[k].null_count for k in keys):
        return rows.num_rows < 2
    undecided = np.ones(rows.num_rows - 1, dtype=bool)  # pairs (i, i + 1) equal on the keys compared so far
    for key in keys:
        values = np.asarray(rows[key].combine_chunks() if rows[key].num_chunks != 1 else rows[key].chunk(0))
        later, earlier = values[1:], values[:-1]
        if (undecided & (later < earlier)).any():
            return False
        undecided &= later == earlier
    return True


def _column_values(values: Any) -> Any:
    """Make torch tensors and numpy arrays acceptable to pyarrow without a Python loop."""
    if hasattr(values, "detach"):  # torch.Tensor
        values = values.detach().cpu().numpy()
    if hasattr(values, "ndim") and getattr(values, "ndim", 1) > 1:
        values = list(values)  # (B, T) -> list of rows, stored as LIST
    return values


def steps_row(metrics: Mapping[str, Any], run: str, step: int, wall_time: float,
              step_seconds: float | None) -> pa.Table | None:
    """The `steps` table's row builder: one row from a dict of metrics, the contract's names as columns and any
    other key into the JSON `extra` column (numpy / torch scalars as numbers)."""
    schema = TABLE_SCHEMAS["steps"]
    known = set(schema.names) - {"run", "step", "extra"}
    row: dict[str, Any] = {"wall_time": wall_time, "step_seconds": step_seconds}
    extra = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):  # numpy / torch scalars (an array of several values fails below, clearly)
            with contextlib.suppress(ValueError, RuntimeError):
                value = value.item()
        if key in known:
            row[key] = value
        elif key not in ("run", "step"):
            extra[key] = value
    if extra:
        row["extra"] = json.dumps(extra, default=json_default)
    return table_rows("steps", {k: [v] for k, v in row.items()}, run, step)
