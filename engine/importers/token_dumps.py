"""The part shared by the per-token importers (prime-rl, NeMo-RL, slime): one step's samples -> rollouts + tokens.

Each format reader turns one step of its dump into a *samples* table (Arrow, one row per sample, `SAMPLE_SCHEMA`):
the token ids of the whole sequence (prompt + completion), the framework's loss mask over it, and per-token lists
aligned with the token ids (`LIST_COLUMNS`: sampler and trainer log-probs, reference log-probs, entropy,
advantage, value, return). Framework fields outside these columns are list columns named `x_<name>`.
`step_tables` then builds the run-log tables in DuckDB, without a Python loop per token:

- **Prompt / completion split (the same for every format).** The prompt is every token before the first token
  of the loss mask (the first token the trainer learns from); the completion is every token from there to the end
  of the sequence, *including* tokens the loss mask leaves out after it (tool outputs, environment turns, user
  turns of a multi-turn sample). `tokens` holds the completion tokens, `position` 0 at the first trained token;
  `rollouts.length` counts them all. Whether a completion token was trained on is `tokens.extra.loss_mask`.
- **Columns.** sampler log-prob -> `tokens.sampler_logp`, trainer log-prob -> `tokens.old_logp`, reference
  log-prob -> `ref_logp`, entropy, advantage, value, return -> their columns, as the dump has them (tokens the
  loss mask leaves out keep whatever the framework wrote there, often 0).
- **`tokens.extra`** (JSON text, one object per token; read it with DuckDB's `json_extract` or `->>`): `loss_mask`
  (bool) and the framework's own per-token masks and weights (`x_` columns: prime-rl's DPPO masks, importance
  ratio, mismatch KL and loss-component weights; slime's KL estimate; ...) under their names in the dump.
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

import duckdb
import pyarrow as pa

from engine.importers.base import ReadContext, Step

LIST_COLUMNS = ("sampler_logp", "old_logp", "ref_logp", "entropy", "advantage", "value", "return")
"""Per-token float lists of a samples table, each stored in the `tokens` column of the same name."""

SAMPLE_SCHEMA = pa.schema(
    [("rank", pa.int64()), ("group_index", pa.int64()), ("token_ids", pa.list_(pa.int64())),
     ("loss_mask", pa.list_(pa.bool_())), *((name, pa.list_(pa.float64())) for name in LIST_COLUMNS),
     ("reward", pa.float64()), ("reward_components", pa.string()), ("prompt_text", pa.string()),
     ("completion_text", pa.string()), ("truncated", pa.bool_()), ("filtered", pa.bool_()),
     ("filter_reason", pa.string())]
)
"""The columns every samples table has (any of them may be null); `x_<name>` list columns may follow."""

SAMPLE_SQL_TYPES = {
    "rank": "BIGINT", "group_index": "BIGINT", "token_ids": "BIGINT[]", "loss_mask": "BOOLEAN[]",
    **{name: "DOUBLE[]" for name in LIST_COLUMNS}, "reward": "DOUBLE", "reward_components": "VARCHAR",
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
    of whatever type pyarrow infers (floats, bools, ints)."""
    names = [f.name for f in SAMPLE_SCHEMA] + sorted({k for r in rows for k in r if k.startswith("x_")})
    arrays = {}
    for name in names:
        values = [r.get(name) for r in rows]
        arrays[name] = pa.array(values, SAMPLE_SCHEMA.field(name).type) if name in SAMPLE_SCHEMA.names \
            else pa.array(values)
    return pa.table(arrays)


class TokenVocabulary:
    """Token id -> text, decoded once per id with `--tokenizer` (`<id>` without it), as a DuckDB table."""

    def __init__(self, token_text):
        self.token_text = token_text
        self.texts: dict[int, str] = {}

    def table_for(self, con: duckdb.DuckDBPyConnection) -> pa.Table:
        """id/text of every token id in the connection's `s` table (its samples)."""
        ids = con.sql("SELECT DISTINCT unnest(token_ids) AS id FROM s").to_arrow_table().column("id").to_pylist()
        ids = [i for i in ids if i is not None]
        for i in ids:
            if i not in self.texts:
                self.texts[i] = self.token_text.token(i) if self.token_text is not None else f"<{i}>"
        return pa.table({"id": pa.array(ids, pa.int64()), "text": pa.array([self.texts[i] for i in ids],
                                                                             pa.string())})


_STEP_SQL = """
CREATE TEMP VIEW s AS
SELECT *, coalesce(list_position(loss_mask, true), len(token_ids) + 1) - 1 AS plen,
       coalesce('g' || CAST(group_index AS VARCHAR), 'p' || CAST(hash(token_ids[1:plen]) AS VARCHAR)) AS gkey
FROM samples
"""

_ROLLOUTS_SQL = """
WITH g AS (SELECT rid, gkey, min(rid) OVER (PARTITION BY gkey) AS first_rid,
                  row_number() OVER (PARTITION BY gkey ORDER BY rid) - 1 AS index_in_group FROM s),
{texts}
SELECT s.rid AS rollout_id, dense_rank() OVER (ORDER BY g.first_rid) - 1 AS group_id, g.index_in_group,
       'train' AS kind, {prompt} AS prompt, {completion} AS completion, reward, advantage[plen + 1] AS advantage,
       len(token_ids) - plen AS length, truncated, coalesce(filtered, false) AS filtered, filter_reason, rank,
       reward_components
FROM s JOIN g USING (rid) LEFT JOIN t USING (rid) ORDER BY s.rid
"""

_TEXTS_SQL = """t AS (SELECT rid, string_agg(text, '' ORDER BY i) FILTER (WHERE i < plen) AS prompt_tokens,
             string_agg(text, '' ORDER BY i) FILTER (WHERE i >= plen) AS completion_tokens
      FROM (SELECT rid, plen, unnest(range(len(token_ids))) AS i, unnest(token_ids) AS id FROM s) u
      LEFT JOIN vocab v ON v.id = u.id GROUP BY rid)"""

_TOKENS_SQL = """
SELECT rid AS rollout_id, i - plen AS position, id AS token_id, v.text AS token_text, {columns}, {extra} AS extra
FROM (SELECT rid, plen, unnest(range(len(token_ids))) AS i, unnest(token_ids) AS id, unnest(loss_mask) AS loss_mask,
             {unnests} FROM s) u
LEFT JOIN vocab v USING (id)
WHERE i >= plen
"""


def step_tables(step: int, samples: pa.Table, ctx: ReadContext, vocabulary: TokenVocabulary,
                extra: dict[str, Any]) -> Step:
    """One step of a per-token dump (its samples table) as rollouts, tokens and step metrics (see the module)."""
    samples = samples.append_column("rid", pa.array(range(samples.num_rows), pa.int64()))
    present = [n for n in samples.column_names if n.startswith("x_") and samples[n].null_count < samples.num_rows]
    con = duckdb.connect()
    try:
        con.execute("SET preserve_insertion_order = false")
        con.register("samples", samples)
        con.execute(_STEP_SQL)
        con.register("vocab", vocabulary.table_for(con))
        if vocabulary.token_text is not None:
            prompt, completion, texts = "t.prompt_tokens", "t.completion_tokens", _TEXTS_SQL
        else:  # no token texts to join: the dump's text, else how many token ids (joining `<id>` costs ~25%)
            prompt = "coalesce(prompt_text, '<' || plen || ' token ids>')"
            completion = "coalesce(completion_text, '<' || (len(token_ids) - plen) || ' token ids>')"
            texts = "t AS (SELECT CAST(NULL AS BIGINT) AS rid WHERE false)"
        rollouts = con.sql(_ROLLOUTS_SQL.format(texts=texts, prompt=prompt, completion=completion)
                               ).to_arrow_table()
        fields = ", ".join([f"{quote('loss_mask')} := loss_mask"]
                           + [f"{quote(n[2:])} := {quote(n)}" for n in present])
        tokens = con.sql(_TOKENS_SQL.format(
            columns=", ".join(quote(n) for n in LIST_COLUMNS), extra=f"to_json(struct_pack({fields}))",
            unnests=", ".join(f"unnest({quote(n)}) AS {quote(n)}" for n in (*LIST_COLUMNS, *present)))).to_arrow_table()
        metrics = _step_metrics(con)
    finally:
        con.close()
    info = {**extra, "framework_fields": [n[2:] for n in present], "advantage_source": "the dump's",
            "optimisation_passes": "not in the dump (token_passes empty)"}
    return Step(step, rollouts, info, tokens=tokens, metrics=metrics)


def _step_metrics(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    row = con.execute("""
        SELECT avg(reward), stddev_samp(reward), avg(len(token_ids) - plen), max(len(token_ids) - plen),
               avg(truncated::DOUBLE)
        FROM s""").fetchall()[0]
    entropy = con.execute("""
        SELECT avg(e) FROM (SELECT unnest(entropy) AS e, unnest(loss_mask) AS m FROM s) WHERE m""").fetchall()[0][0]
    names = ("reward_mean", "reward_std", "response_len_mean", "response_len_max", "truncated_frac")
    return {**dict(zip(names, row, strict=True)), "entropy": entropy}


def json_or_none(value: Any) -> str | None:
    return None if value is None else json.dumps(value, default=str)
