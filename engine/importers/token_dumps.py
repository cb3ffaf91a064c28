"""The part shared by the per-token importers (prime-rl, NeMo-RL, slime): one step's samples -> rollouts + tokens.

Each format reader turns one step of its dump into a *samples* table (Arrow, one row per sample, `SAMPLE_SCHEMA`):
the token ids of the whole sequence (prompt + completion), the framework's loss mask over it, and per-token lists
aligned with the token ids (`LIST_COLUMNS`: sampler and trainer log-probs, reference log-probs, entropy,
advantage, value, return). Framework fields outside these columns are list columns named `x_<name>`.
`step_tables` then builds the run-log tables without a Python loop per token (Arrow and numpy over the step's
flattened lists, `FlatTokens`; DuckDB for the one-row-per-sample rollouts):

- **Prompt / completion split (the same for every format).** The prompt is every token before the first token
  of the loss mask (the first token the trainer learns from); the completion is every token from there to the end
  of the sequence, *including* tokens the loss mask leaves out after it (tool outputs, environment turns, user
  turns of a multi-turn sample). `tokens` holds the completion tokens, `position` 0 at the first trained token;
  `rollouts.length` counts them all. Whether a completion token was trained on is `tokens.dump.loss_mask`.
- **Columns.** sampler log-prob -> `tokens.sampler_logp`, trainer log-prob -> `tokens.old_logp`, reference
  log-prob -> `ref_logp`, entropy, advantage, value, return -> their columns, as the dump has them (tokens the
  loss mask leaves out keep whatever the framework wrote there, often 0).
- **`tokens.dump`** (a typed struct, `engine.runlog.schema.DUMP_FIELDS`; SQL `dump.loss_mask`): `loss_mask`
  (bool) and the framework's own per-token masks and weights (`x_` columns: prime-rl's DPPO masks and
  loss-component weights, slime's KL estimate...) under their names in the dump. A field it has no member for
  goes to `tokens.extra`, one JSON object per token (none of the formats read today has one): building a JSON
  text per token cost more than the rest of the token's row.
- **Groups.** From the dump's group index (`group_index`) where it has one, else rebuilt: the samples of the step
  with identical prompt token ids form a group, numbered in order of first appearance.
- **Rewards.** `rollouts.reward` is the raw reward where the dump has it; normalised values stay what they are
  (`advantage`, or named in `reward_components`). `rollouts.advantage` is the advantage of the first completion
  token (the sequence's advantage for outcome-reward GRPO-style trainers).
- **Token texts.** With `--tokenizer`, each distinct token id of the step is decoded once (`TokenText`); prompt and
  completion texts are the concatenated token texts. Without it, tokens read `<id>` and the texts are the dump's
  own text where it has one, else `<N token ids>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.importers.base import ReadContext, Step, duckdb_connection
from engine.runlog.schema import DUMP_FIELDS

LIST_COLUMNS = ("sampler_logp", "old_logp", "ref_logp", "entropy", "advantage", "value", "return")
"""Per-token float lists of a samples table, each stored in the `tokens` column of the same name: float32, as the
run log stores them (rounded once, as the run log's own cast would; half the memory of a step)."""

SAMPLE_SCHEMA = pa.schema(
    [("rank", pa.int64()), ("group_index", pa.int64()), ("token_ids", pa.list_(pa.int64())),
     ("loss_mask", pa.list_(pa.bool_())), *((name, pa.list_(pa.float32())) for name in LIST_COLUMNS),
     ("reward", pa.float64()), ("reward_components", pa.string()), ("prompt_text", pa.string()),
     ("completion_text", pa.string()), ("truncated", pa.bool_()), ("filtered", pa.bool_()),
     ("filter_reason", pa.string())]
)
"""The columns every samples table has (any of them may be null); `x_<name>` list columns may follow."""

SAMPLE_SQL_TYPES = {
    "rank": "BIGINT", "group_index": "BIGINT", "token_ids": "BIGINT[]", "loss_mask": "BOOLEAN[]",
    **{name: "FLOAT[]" for name in LIST_COLUMNS}, "reward": "DOUBLE", "reward_components": "VARCHAR",
    "prompt_text": "VARCHAR", "completion_text": "VARCHAR", "truncated": "BOOLEAN", "filtered": "BOOLEAN",
    "filter_reason": "VARCHAR",
}


def samples_select(expressions: dict[str, str]) -> str:
    """The SELECT list making a samples table: `expressions` maps a column (standard or `x_...`) to a SQL
    expression over the dump's columns; the standard columns not given are typed NULLs."""
    parts = [f"CAST({expressions[name]} AS {sql_type}) AS {quote(name)}" if name in expressions
             else f"CAST(NULL AS {sql_type}) AS {quote(name)}" for name, sql_type in SAMPLE_SQL_TYPES.items()]
    parts += [f"{expr} AS {quote(name)}" for name, expr in expressions.items() if name.startswith("x_")]
    return ", ".join(parts)


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def valid_lengths_sql(list_names: Iterable[str]) -> str:
    """A SQL condition: every per-token list of the sample is null or as long as its token ids."""
    return " AND ".join(["token_ids IS NOT NULL", "loss_mask IS NOT NULL", "len(loss_mask) = len(token_ids)"]
                        + [f"({quote(n)} IS NULL OR len({quote(n)}) = len(token_ids))" for n in list_names])


def samples_from_rows(rows: list[dict[str, Any]]) -> pa.Table:
    """A samples table from Python rows (slime's torch dumps): the standard columns typed, `x_` columns as lists
    of floats. A list column's value in a row is a numpy array (NaN: a null token value) or None (no list)."""
    names = [f.name for f in SAMPLE_SCHEMA] + sorted({k for r in rows for k in r if k.startswith("x_")})
    arrays = {}
    for name in names:
        values = [r.get(name) for r in rows]
        field_type = SAMPLE_SCHEMA.field(name).type if name in SAMPLE_SCHEMA.names else pa.list_(pa.float64())
        arrays[name] = _list_array(values, field_type) if pa.types.is_list(field_type) \
            else pa.array(values, field_type)
    return pa.table(arrays)


def _list_array(values: list[np.ndarray | None], list_type: pa.ListType) -> pa.Array:
    """One list per row from numpy arrays, concatenated once (no Python per token); NaN values become nulls."""
    lengths = np.array([0 if v is None else len(v) for v in values], dtype=np.int32)  # (n,)
    offsets = pa.array(np.concatenate([np.zeros(1, np.int32), np.cumsum(lengths, dtype=np.int32)]))  # (n + 1,)
    present = [v for v in values if v is not None]
    flat = np.concatenate(present) if present else np.zeros(0)  # (N,)
    missing = np.isnan(flat) if flat.dtype.kind == "f" else None
    child = pa.array(flat, mask=missing).cast(list_type.value_type)
    return pa.ListArray.from_arrays(offsets, child, type=list_type,
                                    mask=pa.array([v is None for v in values], pa.bool_()))


class TokenVocabulary:
    """Token id -> text, decoded once per id with `--tokenizer` (`<id>` without it, formatted column-wise)."""

    def __init__(self, token_text):
        self.token_text = token_text
        self.texts: dict[int, str] = {}

    def texts_of(self, token_ids: pa.Array) -> pa.Array:
        """The text of every token of `token_ids` (N,): each distinct id looked up once, then one `take`."""
        distinct = pc.drop_null(pc.unique(token_ids))
        if self.token_text is None:
            texts = pc.binary_join_element_wise("<", pc.cast(distinct, pa.string()), ">", "")
        else:
            ids = distinct.to_pylist()
            for i in ids:
                if i not in self.texts:
                    self.texts[i] = self.token_text.token(i)
            texts = pa.array([self.texts[i] for i in ids], pa.string())
        return texts.take(pc.index_in(token_ids, value_set=distinct))


class FlatTokens:
    """A step's token lists flattened into one array of N tokens (prompts included), with each token's sample
    (`parent`) and index in its sequence (`local`), the prompt length of each sample by the split rule (the
    index of its first loss-masked token) and which tokens are completion tokens. Everything is vectorised."""

    def __init__(self, samples: pa.Table):
        ids = _one_chunk(samples["token_ids"])
        self.lengths = np.asarray(pc.fill_null(pc.list_value_length(ids), 0), dtype=np.int64)  # (n,)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])  # (n + 1,)
        n_tokens = int(self.offsets[-1])
        self.parent = np.repeat(np.arange(len(self.lengths)), self.lengths)  # (N,)
        self.local = np.arange(n_tokens) - self.offsets[self.parent]  # (N,)
        self.token_ids = ids.flatten()  # (N,)
        self.loss_mask = self.values(samples["loss_mask"])  # (N,) bool, nulls kept
        trained = np.asarray(pc.fill_null(self.loss_mask, False), dtype=bool)
        first = np.flatnonzero(trained)  # (M,) ascending, so the first of each sample comes first
        owner = self.parent[first]  # (M,) ascending
        at = np.flatnonzero(np.r_[len(owner) > 0, owner[1:] != owner[:-1]])  # each sample's first (no sort)
        self.prompt_len = self.lengths.copy()  # (n,) a sample without a loss-masked token is all prompt
        self.prompt_len[owner[at]] = self.local[first[at]]
        self.position = self.local - self.prompt_len[self.parent]  # (N,) 0 at the first trained token
        self.completion = pa.array(self.position >= 0)  # (N,)

    def values(self, column: pa.ChunkedArray) -> pa.Array:
        """A per-token list column of the samples (null, or as long as the sample's token ids) as (N,) values."""
        lists = _one_chunk(column)
        n_tokens = len(self.parent)
        if lists.null_count == len(lists):
            return pa.nulls(n_tokens, lists.type.value_type)
        if lists.null_count == 0:
            flat = lists.flatten()
            if len(flat) == n_tokens:
                return flat
        starts = np.asarray(lists.offsets)[:-1]  # (n,) into lists.values
        missing = np.asarray(lists.is_null(), dtype=bool)[self.parent]  # (N,)
        return lists.values.take(pa.array(starts[self.parent] + self.local, mask=missing))

    def joined_texts(self, texts: pa.Array) -> tuple[pa.Array, pa.Array]:
        """Each sample's prompt and completion text: its token texts (N,) concatenated (null when empty)."""
        n = len(self.lengths)
        bounds = np.empty(2 * n + 1, dtype=np.int64)  # prompt i = [o_i, o_i + plen_i), completion i = [.., o_i+1)
        bounds[0:2 * n:2] = self.offsets[:-1]
        bounds[1:2 * n:2] = self.offsets[:-1] + self.prompt_len
        bounds[2 * n] = self.offsets[-1]
        parts = pa.LargeListArray.from_arrays(pa.array(bounds), texts)
        joined = pc.if_else(pa.array(np.diff(bounds) == 0), pa.scalar(None, pa.string()),
                            pc.binary_join(parts, ""))
        return joined.take(pa.array(np.arange(0, 2 * n, 2))), joined.take(pa.array(np.arange(1, 2 * n, 2)))


def _one_chunk(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def dump_struct(fields: dict[str, pa.Array]) -> tuple[pa.StructArray, dict[str, pa.Array]]:
    """The `tokens.dump` struct of the fields it has a member for (cast to the member's type, the members a dump
    lacks null), and the fields left for `tokens.extra` (none of the formats read today leaves any)."""
    n = len(fields["loss_mask"])
    typed, others = {}, {}
    for name, values in fields.items():
        index = DUMP_FIELDS.get_field_index(name)
        if index >= 0:
            try:
                typed[name] = values.cast(DUMP_FIELDS[index].type)
                continue
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # not of the member's type: kept as JSON
                pass
        others[name] = values
    arrays = [typed[f.name] if f.name in typed else pa.nulls(n, f.type) for f in DUMP_FIELDS]
    return pa.StructArray.from_arrays(arrays, fields=list(DUMP_FIELDS)), others


def json_objects(fields: dict[str, pa.Array]) -> pa.Array:
    """One JSON object text per row, `{"name": value, ...}`, built column-wise (no Python per row): booleans as
    true/false, numbers as their shortest text, NaN, infinities and nulls as null, JSON texts as they are."""
    pieces: list[Any] = []
    for i, (name, values) in enumerate(fields.items()):
        pieces += [("{" if i == 0 else ",") + json.dumps(name) + ":", _json_values(values)]
    return pc.binary_join_element_wise(*pieces, "}", "")


def _json_values(values: pa.Array) -> pa.Array:
    kind = values.type
    if pa.types.is_boolean(kind):
        text = pc.if_else(values, "true", "false")
    elif pa.types.is_floating(kind):
        text = pc.if_else(pc.is_finite(values), pc.cast(values, pa.string()), "null")
    elif pa.types.is_integer(kind):
        text = pc.cast(values, pa.string())
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):  # JSON values (prime-rl's `losses`)
        text = values
    else:  # anything else pyarrow inferred from a torch dump: via Python, rare
        text = pa.array([None if v is None else json.dumps(v, default=str) for v in values.to_pylist()],
                        pa.string())
    return pc.fill_null(text, "null")


_ROLLOUTS_SQL = """
WITH s AS (SELECT rid, plen, len(token_ids) AS n, advantage[plen + 1] AS advantage, reward, truncated, filtered,
                  filter_reason, rank, reward_components, {prompt} AS prompt, {completion} AS completion,
                  coalesce('g' || CAST(group_index AS VARCHAR), 'p' || CAST(hash(token_ids[1:plen]) AS VARCHAR))
                  AS gkey
           FROM samples),  -- one row per sample, without its token lists
g AS (SELECT rid, gkey, min(rid) OVER (PARTITION BY gkey) AS first_rid,
             row_number() OVER (PARTITION BY gkey ORDER BY rid) - 1 AS index_in_group FROM s)
SELECT s.rid AS rollout_id, dense_rank() OVER (ORDER BY g.first_rid) - 1 AS group_id, g.index_in_group,
       'train' AS kind, prompt, completion, reward, advantage, n - plen AS length, truncated,
       coalesce(filtered, false) AS filtered, filter_reason, rank, reward_components
FROM s JOIN g USING (rid) ORDER BY s.rid
"""

_METRICS_SQL = """
SELECT avg(reward), stddev_samp(reward), avg(len(token_ids) - plen), max(len(token_ids) - plen),
       avg(truncated::DOUBLE)
FROM samples
"""


def step_tables(step: int, samples: pa.Table, ctx: ReadContext, vocabulary: TokenVocabulary,
                extra: dict[str, Any]) -> Step:
    """One step of a per-token dump (its samples table) as rollouts, tokens and step metrics (see the module).

    The per-token work is vectorised over the step's flattened lists (`FlatTokens`: Arrow and numpy, no Python
    loop per token); DuckDB only builds the rollouts, one row per sample."""
    samples = samples.combine_chunks()
    flat = FlatTokens(samples)
    present = [n for n in samples.column_names if n.startswith("x_") and samples[n].null_count < samples.num_rows]
    kept = flat.completion
    token_ids = flat.token_ids.filter(kept)
    # With token texts, the prompt's are needed too (the joined prompt text); without, only the rows' "<id>".
    texts = vocabulary.texts_of(flat.token_ids) if vocabulary.token_text is not None else None
    columns = {"rollout_id": pa.array(flat.parent).filter(kept), "position": pa.array(flat.position).filter(kept),
               "token_id": token_ids,
               "token_text": texts.filter(kept) if texts is not None else vocabulary.texts_of(token_ids),
               **{name: flat.values(samples[name]).filter(kept) for name in LIST_COLUMNS}}
    fields = {"loss_mask": flat.loss_mask, **{name[2:]: flat.values(samples[name]) for name in present}}
    columns["dump"], others = dump_struct({name: values.filter(kept) for name, values in fields.items()})
    columns["extra"] = json_objects(others) if others else pa.nulls(len(columns["position"]), pa.string())
    tokens = pa.table(columns)
    entropy = pc.mean(flat.values(samples["entropy"]).filter(pc.fill_null(flat.loss_mask, False))).as_py()

    samples = samples.append_column("rid", pa.array(np.arange(samples.num_rows)))
    samples = samples.append_column("plen", pa.array(flat.prompt_len))
    if vocabulary.token_text is not None:
        prompt_texts, completion_texts = flat.joined_texts(texts)
        samples = samples.append_column("prompt_tokens", prompt_texts)
        samples = samples.append_column("completion_tokens", completion_texts)
        prompt, completion = "prompt_tokens", "completion_tokens"
    else:  # no token texts to join: the dump's text, else how many token ids
        prompt = "coalesce(prompt_text, '<' || plen || ' token ids>')"
        completion = "coalesce(completion_text, '<' || (len(token_ids) - plen) || ' token ids>')"
    con = duckdb_connection()
    con.register("samples", samples)
    try:
        rollouts = con.sql(_ROLLOUTS_SQL.format(prompt=prompt, completion=completion)).to_arrow_table()
        row = con.execute(_METRICS_SQL).fetchall()[0]
    finally:
        con.unregister("samples")
    names = ("reward_mean", "reward_std", "response_len_mean", "response_len_max", "truncated_frac")
    metrics = {**dict(zip(names, row, strict=True)), "entropy": entropy}
    info = {**extra, "framework_fields": [n[2:] for n in present], "advantage_source": "the dump's",
            "optimisation_passes": "not in the dump (token_passes empty)"}
    return Step(step, rollouts, info, tokens=tokens, metrics=metrics)


def json_or_none(value: Any) -> str | None:
    return None if value is None else json.dumps(value, default=str)
