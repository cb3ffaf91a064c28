"""Token values the run log does not store when another column holds them, token-pass values it does not store
when the step's tokens determine them, and the SQL that derives them again; plus what the writer copies or computes
from the token rows into each pass row (its token's text and entropy decile within its response), so that
statistics over a whole run read the passes without joining tokens.

What a pass row would repeat from its token row:
- `new_logp` = old_logp + ln(ratio) for a token-level ratio (GRPO, DAPO, PPO...; not for a sequence-level ratio
  such as GSPO's, or a truncated one such as DPPO's: those rows keep their `new_logp`);
- `kl` = the k3 estimate exp(x) - x - 1, x = ref_logp - new_logp (engine.objectives.k3_kl).
The writer leaves such a value out (NULL) on the rows where the derivation gives it back to float32 precision
(`stored_passes`), and the reader's `token_passes` view computes it from the token row (`TOKEN_PASSES_SQL`): a
row where the producer's value differs (another estimator, a clamp) keeps it as given. The ratio itself is
stored, not new_logp, since on-policy passes have ratio exactly 1 (almost free to store) and the ratio is what most
questions about passes ask for, without reading the tokens.

What a token row would repeat from itself (`stored_tokens`): a run whose sampler is the policy logs sampler_logp
equal to old_logp, and one sampled without top-p / top-k truncation logs sampler_logp_full equal to sampler_logp
(7 of a token row's 19 bytes when both are repeated). The writer leaves a value out (NULL) where it is bit-for-bit the
other column's and sets the row's `elided` bit (schema.STORED_ONLY); the `tokens` view reads the other column there
(`tokens_sql`). A NULL without the bit stays NULL: an import with the sampler's log-prob but not its full one.

What a token row would repeat from the run's other token rows (`TokenVocabulary`): its token id, where the
token's text says it. A run writes the same few thousand texts, each with the same id, millions of times, and Parquet
stores the id and the text column each in full (1.1 and 1.2 bytes a row with a real tokenizer's vocabulary). The
writer keeps one id per text for the run (its smallest id in the step that first logged the text: several ids can
decode to one text, e.g. pieces of a multi-byte character), leaves the id out (NULL, `elided` bit 4) where a row's id
is its text's, and writes each step's (text, id) pairs to the `token_vocab` table; the `tokens` view reads the id
back from there (`tokens_sql`). The text stays in the row, so filtering and grouping on it cost what they did;
reading an id costs a join (a few milliseconds a query), which DuckDB drops from an aggregate that reads no id but
keeps in any other query: those read `TOKEN_ROWS`. Only rank 0 leaves ids out, so a run's pairs never disagree (the
ranks of a multi-process run log each with their own writer, which knows only its own rows).

The entropy decile (`entropy_deciles`): with r the number of tokens of the response whose entropy is lower than
the token's and n the number of tokens with an entropy, the number of k in 1..9 with k (n - 1) / 10 < r, i.e. the
number of the response's linearly interpolated entropy quantiles at 0.1, ..., 0.9 strictly below the token's
entropy (the quantiles torch.quantile computes). Deciles 8 and 9 are exactly the tokens above the response's 80th
percentile, ASPO's high-entropy tokens.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_EPS32 = float(np.finfo(np.float32).eps)
DECILES = 10


def _floats(table: pa.Table, column: str) -> np.ndarray:
    """(n,) float64 of a column, NaN where NULL."""
    return pc.fill_null(table[column], float("nan")).to_numpy().astype(np.float64)


def _token_keys(table: pa.Table) -> np.ndarray:
    """(n,) int64 rollout_id * 2^32 + position: one sortable key per token of a step."""
    rollout = pc.fill_null(table["rollout_id"], -1).to_numpy().astype(np.int64)
    position = pc.fill_null(table["position"], -1).to_numpy().astype(np.int64)
    return (rollout << 32) + position


ELIDED_TOKEN_COLUMNS = (("sampler_logp", "old_logp"), ("sampler_logp_full", "sampler_logp"))
"""(column, the column it repeats) pairs of `stored_tokens`; the i-th pair is bit 1 << i of `tokens.elided`."""


def _float32_bits(table: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(n,) uint32 bit patterns of a float32 column (0 where NULL) and (n,) bool: not NULL."""
    values = table[column].combine_chunks()
    present = np.asarray(values.is_valid())
    return np.asarray(pc.fill_null(values, 0.0)).view(np.uint32), present


def stored_tokens(tokens: pa.Table | None) -> pa.Table | None:
    """One step's token rows (run-log schema) as stored (schema.FILE_SCHEMAS): each value of
    `ELIDED_TOKEN_COLUMNS` NULL where it is bit-for-bit the value it repeats, with `elided` saying so."""
    if tokens is None:
        return None
    elided = np.zeros(tokens.num_rows, dtype=np.int8)  # (n,)
    bits = {name: _float32_bits(tokens, name) for pair in ELIDED_TOKEN_COLUMNS for name in pair}
    for i, (column, source) in enumerate(ELIDED_TOKEN_COLUMNS):  # compared before any value is left out
        (value, has_value), (repeated, has_repeated) = bits[column], bits[source]
        elided |= np.where(has_value & has_repeated & (value == repeated), np.int8(1 << i), np.int8(0))
    for i, (column, _) in enumerate(ELIDED_TOKEN_COLUMNS):
        kept = pc.if_else(pa.array((elided & (1 << i)) != 0), pa.scalar(None, pa.float32()), tokens[column])
        tokens = tokens.set_column(tokens.schema.get_field_index(column), column, kept)
    return tokens.append_column("elided", pa.array(elided, pa.int8()))


ID_FROM_VOCABULARY = 1 << len(ELIDED_TOKEN_COLUMNS)
"""The bit of `tokens.elided` saying the row's token_id is its text's in the run's `token_vocab`."""


class TokenVocabulary:
    """One run's token ids by text, as rank 0's writer leaves them out of the token rows (module docstring).
    Looked up column-wise (a hash of the known texts per step, no Python per text: a step of long responses
    holds ~10^5 distinct texts)."""

    def __init__(self, pairs: pa.Table | None = None):
        self._texts = pa.array([], pa.string())  # (V,) each known text once, first logged first
        self._ids = np.zeros(0, np.int64)  # (V,) its id
        if pairs is not None and pairs.num_rows:  # what the run's files hold: its `token_vocab` rows, oldest first
            texts = pc.dictionary_encode(pairs["token_text"].combine_chunks())  # distinct, first seen first
            codes = pc.fill_null(texts.indices, -1).to_numpy().astype(np.int64)  # (n,)
            present = np.flatnonzero(codes >= 0)
            _, first = np.unique(codes[present], return_index=True)  # each text's first pair (its code's order)
            self._texts = texts.dictionary
            self._ids = pc.fill_null(pairs["token_id"].combine_chunks(), -1).to_numpy()[present[first]]

    def elide(self, tokens: pa.Table) -> tuple[pa.Table, pa.Table | None]:
        """One step's stored token rows (`stored_tokens`'s) with each id NULL where it is its text's (the
        `ID_FROM_VOCABULARY` bit set), and the step's `token_vocab` rows: the pairs of the ids left out."""
        texts = pc.dictionary_encode(tokens["token_text"]).combine_chunks()  # distinct texts, first seen first
        distinct = texts.dictionary  # (d,)
        codes = pc.fill_null(texts.indices, -1).to_numpy().astype(np.int64)  # (n,) -1: no text
        stored_ids = tokens["token_id"].combine_chunks()
        ids = pc.fill_null(stored_ids, -1).to_numpy()  # (n,)
        has_id = np.asarray(stored_ids.is_valid()) & (ids >= 0) & (codes >= 0)  # -1 below: unknown
        known = pc.fill_null(pc.index_in(distinct, value_set=self._texts), -1).to_numpy()  # (d,) into the run's
        id_of = np.full(len(distinct) + 1, -1, np.int64)  # (d + 1,) the run's id of each text (code -1: the last)
        id_of[:-1][known >= 0] = self._ids[known[known >= 0]]
        new = has_id & (id_of[codes] < 0)
        if new.any():  # a text first logged in this step: its smallest id in the step becomes the run's
            first = np.full(len(id_of), np.iinfo(np.int64).max)
            np.minimum.at(first, codes[new], ids[new])
            added = np.flatnonzero(first < np.iinfo(np.int64).max)
            id_of[added] = first[added]
            self._texts = pa.concat_arrays([self._texts, distinct.take(pa.array(added))])
            self._ids = np.concatenate([self._ids, first[added]])
        elide = has_id & (ids == id_of[codes])  # (n,)
        if not elide.any():
            return tokens, None
        used = np.zeros(len(id_of), dtype=bool)
        used[codes[elide]] = True
        used = np.flatnonzero(used)
        used = used[np.argsort(id_of[used], kind="stable")]
        run, step = tokens["run"][0], tokens["step"][0]  # one step's rows
        pairs = pa.table({"run": pa.repeat(run, len(used)), "step": pa.repeat(step, len(used)),
                          "token_id": id_of[used], "token_text": texts.dictionary.take(pa.array(used))})
        column = tokens.schema.get_field_index("token_id")
        tokens = tokens.set_column(column, "token_id",
                                   pa.array(ids, pa.int64(), mask=elide | ~np.asarray(stored_ids.is_valid())))
        elided = pc.bit_wise_or(tokens["elided"], pa.array(np.where(elide, ID_FROM_VOCABULARY, 0).astype(np.int8)))
        return tokens.set_column(tokens.schema.get_field_index("elided"), "elided", elided), pairs


def tokens_sql(stored: str, columns: list[str], vocabulary: str | None) -> str:
    """The `tokens` view: `columns` (the table's) of the stored rows `stored`, the values `stored_tokens` left
    out read from the column they repeat and the ids `TokenVocabulary` left out from `vocabulary`, the stored
    `token_vocab` rows (in files without `elided`, NULL: every value as stored). Without `vocabulary`, those ids
    stay NULL (`TOKEN_ROWS`)."""
    expressions = {}
    for i, (column, source) in enumerate(ELIDED_TOKEN_COLUMNS):
        repeated = expressions.get(source, f't."{source}"')
        expressions[column] = f'CASE WHEN t.elided & {1 << i} <> 0 THEN {repeated} ELSE t."{column}" END'
    join = ""
    if vocabulary is not None:
        expressions["token_id"] = f"CASE WHEN t.elided & {ID_FROM_VOCABULARY} <> 0 THEN v.token_id ELSE t.token_id END"
        join = (f" LEFT JOIN (SELECT run, token_text, min(token_id) AS token_id FROM {vocabulary} "
                f"GROUP BY run, token_text) v ON v.run = t.run AND v.token_text = t.token_text")
    return ("SELECT " + ", ".join(f'{expressions[c]} AS "{c}"' if c in expressions else f't."{c}"' for c in columns)
            + f" FROM {stored} t{join}")


TOKEN_ROWS = "_runlog.tokens_rows"
"""The SQL name of the `tokens` view's rows in a `RunReader` without the join that gives back the ids
`TokenVocabulary` left out (their token_id is NULL): DuckDB keeps that join in a query that does not aggregate even
when it reads no token_id, so queries that need no id read this (the dashboard's)."""


def entropy_deciles(tokens: pa.Table) -> np.ndarray:
    """(n,) int8: each token's entropy decile within its response (see the module docstring), -1 where its
    entropy is NULL or NaN. `tokens`: one step's rows, any order."""
    entropy = _floats(tokens, "entropy")  # (n,)
    rollout = pc.fill_null(tokens["rollout_id"], -1).to_numpy().astype(np.int64)  # (n,)
    out = np.full(len(entropy), -1, dtype=np.int8)
    has = ~np.isnan(entropy)
    idx = np.flatnonzero(has)
    if not len(idx):
        return out
    order = idx[np.lexsort((entropy[idx], rollout[idx]))]  # by response, then entropy
    r_sorted, e_sorted = rollout[order], entropy[order]
    new_response = np.r_[True, r_sorted[1:] != r_sorted[:-1]]
    response_start = np.maximum.accumulate(np.where(new_response, np.arange(len(order)), 0))
    new_value = new_response | np.r_[True, e_sorted[1:] != e_sorted[:-1]]
    # lower[i]: how many tokens of the response have a lower entropy (ties share their first index)
    lower = np.maximum.accumulate(np.where(new_value, np.arange(len(order)), 0)) - response_start
    counts = np.diff(np.r_[np.flatnonzero(new_response), len(order)])
    n_minus_1 = np.repeat(counts, counts) - 1
    # #{k >= 1 : k < 10 r / (n - 1)} = ceil(10 r / (n - 1)) - 1, in integers; a one-token response is decile 0
    decile = np.where(n_minus_1 > 0, (DECILES * lower + n_minus_1 - 1) // np.maximum(n_minus_1, 1) - 1, 0)
    out[order] = np.clip(decile, 0, DECILES - 1)
    return out


def stored_passes(tokens: pa.Table | None, passes: pa.Table | None) -> pa.Table | None:
    """One step's token-pass rows as stored: `new_logp` and `kl` NULL where `TOKEN_PASSES_SQL` derives them
    from the token row to float32 precision, `entropy_decile` and `token_text` filled in. Both tables in the
    run-log schema; without the step's tokens (or with a token key logged twice) the rows are stored as given."""
    if passes is None or tokens is None:
        return passes
    token_keys = _token_keys(tokens)  # (n,) sorted: tokens are sorted by step, rollout_id, position
    if np.any(np.diff(token_keys) <= 0):
        return passes
    keys = _token_keys(passes)  # (m,)
    at = np.minimum(np.searchsorted(token_keys, keys), len(token_keys) - 1)  # (m,)
    found = token_keys[at] == keys
    old, ref = _floats(tokens, "old_logp")[at], _floats(tokens, "ref_logp")[at]
    new, ratio, kl = _floats(passes, "new_logp"), _floats(passes, "ratio"), _floats(passes, "kl")
    with np.errstate(all="ignore"):
        # the same arithmetic as TOKEN_PASSES_SQL, in float64 from the stored float32 values
        new_derived = old + np.log(ratio)
        drop_new = found & (np.abs(new_derived - new) <= 2 * _EPS32 * (1 + np.abs(old) + np.abs(new)))
        new_seen = np.where(drop_new, new_derived, new)  # what the view will read
        x = ref - new_seen
        kl_derived = np.exp(x) - x - 1.0
        # a float32 k3 is off by a few float32 ulps of its terms, plus its slope times the inputs' rounding
        tol = 4 * _EPS32 * (1 + np.exp(x) + np.abs(x) + np.abs(np.expm1(x)) * (1 + np.abs(ref) + np.abs(new_seen)))
        drop_kl = found & ((np.abs(kl_derived - kl) <= tol) | (np.isnan(kl) & np.isnan(kl_derived)))
    decile = entropy_deciles(tokens)[at]
    columns = {
        "new_logp": pa.array(new.astype(np.float32), pa.float32(), mask=drop_new | np.isnan(new)),
        "kl": pa.array(kl.astype(np.float32), pa.float32(), mask=drop_kl | np.isnan(kl)),
        "entropy_decile": pa.array(decile, pa.int8(), mask=~found | (decile < 0)),
        "token_text": pc.if_else(pa.array(found), tokens["token_text"].take(pa.array(at)),
                                 pa.scalar(None, pa.string())),
    }
    for name, values in columns.items():
        passes = passes.set_column(passes.schema.get_field_index(name), name, values)
    return passes


STORED = "_runlog.{}_files"
"""The SQL name of a table's stored rows in a `RunReader` (`STORED.format("token_passes")`): what the files hold,
float32 columns as DOUBLE, the values of this module NULL where they are derived. A query that joins a pass row to
its token row anyway (the dashboard's) derives them from it with `new_logp_sql` / `kl_sql`, and one that reads no
derived value (clip, ratio, weights) needs no token row at all."""


def new_logp_sql(p: str, t: str) -> str:
    """SQL of a pass row's new_logp, aliases `p` (stored pass row) and `t` (its token row)."""
    return f"coalesce({p}.new_logp, {t}.old_logp + ln({p}.ratio))"


def kl_sql(p: str, t: str) -> str:
    """SQL of a pass row's k3 KL to the reference (as `new_logp_sql`)."""
    x = f"({t}.ref_logp - {new_logp_sql(p, t)})"
    return f"coalesce({p}.kl, exp({x}) - {x} - 1)"


TOKEN_PASSES_SQL = f"""
SELECT p.run, p.step, p."pass", p.rollout_id, p.position, {new_logp_sql("p", "t")} AS new_logp, p.ratio, p.clip,
       p.grad_weight, p.token_loss, {kl_sql("p", "t")} AS kl, p.is_weight, p.rejected, p.entropy_decile, p.token_text
FROM {{passes}} p LEFT JOIN (
    -- grouped on the key: DuckDB drops the join from a query that reads no derived column and filters on no key
    SELECT run, step, rollout_id, position, any_value(old_logp) AS old_logp, any_value(ref_logp) AS ref_logp
    FROM {{tokens}} GROUP BY run, step, rollout_id, position
) t ON t.run = p.run AND t.step = p.step AND t.rollout_id = p.rollout_id AND t.position = p.position"""
"""The `token_passes` view over the stored rows `{passes}` and `{tokens}` (see the module docstring)."""
