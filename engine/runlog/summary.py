"""The `token_summary` table: per-step sums of what the dashboard's token statistics show, written by the writer
from each step's own rows, so that statistics over a whole run add a few rows per step instead of reading every
token and pass (a 10M-token benchmark run holds 5.5% as many summary rows as tokens, 99% of them per position
bucket).

Every row holds sums over one step of one writer (rank), for one key; `kind` says which:
- "tokens", per token text and position bucket: the step's train tokens (tokens of its rollouts of kind "train"):
  rows; advantage_sum / advantage_rows and entropy_sum / entropy_rows, the sums and counts of the non-NULL values.
- "passes", per token text, position bucket and clip code: the pass rows whose token is logged and has a text or
  is a train token: rows; abs_weight, the sum of |grad_weight|; ratio_dev, the sum of |ratio - 1|.
- "deciles", per entropy decile (engine.runlog.derived) and clip code: the pass rows with a decile: rows,
  abs_weight.
- "loss", per pass, token text and position bucket: the loss token x pass rows (train rollouts not filtered out,
  passes the mismatch corrections did not reject): rows; advantage_sum; logp_sum, the new log-probs;
  advantage_logp_sum; kl_sum / kl_rows, the k3 KL to the reference and the rows with one (a NaN KL is none);
  entropy_sum; cov_rows, the rows Clip-Cov or KL-Cov selected (clip code 4). Cui et al.'s covariance of a group is
  linear in these sums (`dashboard.token_data`).
- "loss_tokens", one row: loss_tokens, the step's loss tokens counted once each: over its rollouts, the rollout's
  loss rows over the number of passes that used it.

Rows of `bucket` 0 have no position split (position_from NULL); rows of bucket `SUMMARY_BUCKET` are per
position_from = position // 4 * 4 below `SPLIT_UNTIL` (1024), and any bucket that is a multiple of 4 is a sum of
them (since (p // 4 * 4) // b * b = p // b * b). From position 1024 on, the positions are split in doubling ranges
[1024, 2048), [2048, 4096), ... (position_from the power of two at or below the position), whatever the bucket: a
16k-token response adds four buckets per token text instead of 3,840, which kept the summary of a run of long
responses about as large as its tokens (`position_from_sql` reads rows written before either way). The values
are the ones the reader's views give: float32 columns summed as float64, new_logp and kl derived as
`engine.runlog.derived` derives them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.runlog.derived import _token_keys
from engine.runlog.schema import TABLE_SCHEMAS

SUMMARY_BUCKET = 4
"""The finest position bucket summarised: the dashboard's buckets (4, 8, 16, 32 positions) are multiples of it."""

SPLIT_UNTIL = 1024
"""The first position of the doubling ranges (a multiple of every bucket the dashboard offers)."""


def position_from_sql(position: str, bucket: str) -> str:
    """SQL of the first position of the bucket that holds `position` (a column or expression) for a split of
    `bucket` positions (an expression; a multiple of SUMMARY_BUCKET to be read from the summary, as every bucket
    the dashboard offers is; NULL when it is 0 or less: no split): below
    SPLIT_UNTIL position // bucket * bucket, from there the power of two at or below the position. Applied to
    summary rows' position_from, it gives the same bucket as applied to their tokens' positions."""
    return (f"CASE WHEN {bucket} <= 0 THEN NULL WHEN {position} >= {SPLIT_UNTIL} "
            f"THEN 1::BIGINT << floor(log2({position}))::INTEGER ELSE {position} // {bucket} * {bucket} END")


def position_from(position: np.ndarray) -> np.ndarray:
    """`position_from_sql` of non-negative positions (n,) for SUMMARY_BUCKET, in numpy."""
    out = position // SUMMARY_BUCKET * SUMMARY_BUCKET
    tail = position >= SPLIT_UNTIL
    out[tail] = np.left_shift(1, np.floor(np.log2(position[tail])).astype(np.int64))
    return out


CLIP_COV = 4  # engine.clip_codes.CLIP_COV (not imported: the run log depends on nothing of the engine)
_SCHEMA = TABLE_SCHEMAS["token_summary"]


def step_summary(rollouts: pa.Table | None, tokens: pa.Table | None, passes: pa.Table | None) -> pa.Table | None:
    """The `token_summary` rows of one step of one writer, from its rows in the run-log schema (`passes` as stored:
    token text and entropy decile filled in by `derived.stored_passes`); None without tokens or passes."""
    if tokens is None and passes is None:
        return None
    some = tokens if tokens is not None else passes
    train, loss = _rollout_sets(rollouts)
    parts = []
    if tokens is not None:
        # Token texts as codes into the step's distinct texts: grouping and copying them per pass row is cheap.
        tokens = tokens.select(["rollout_id", "position", "token_text", "old_logp", "ref_logp", "advantage",
                                "entropy"])
        tokens = tokens.set_column(2, "token_text", pc.dictionary_encode(tokens["token_text"]))
        tokens = tokens.append_column("train", pc.is_in(tokens["rollout_id"], value_set=train)).append_column(
            "loss", pc.is_in(tokens["rollout_id"], value_set=loss))
        train_tokens = tokens.filter(tokens["train"])
        parts += _by_bucket("tokens", {
            "token_text": train_tokens["token_text"], "position": train_tokens["position"],
            "advantage": train_tokens["advantage"], "entropy": train_tokens["entropy"]}, ["token_text"],
            sums={"advantage_sum": "advantage", "entropy_sum": "entropy"},
            counts={"advantage_rows": "advantage", "entropy_rows": "entropy"})
    if passes is not None:
        parts += _pass_parts(passes, tokens)
    parts = [p for p in parts if len(p["rows"])]
    if not parts:
        return None
    n = sum(len(p["rows"]) for p in parts)
    columns = {"run": pa.repeat(some["run"][0], n), "step": pa.repeat(some["step"][0], n)}
    for field in _SCHEMA:
        if field.name not in columns:
            columns[field.name] = pa.concat_arrays([_column(p, field) for p in parts])
    return pa.table(columns, schema=_SCHEMA)


def _column(part: dict, field: pa.Field) -> pa.Array:
    """A summary column of one part (`_grouped` columns, `kind` and `bucket` one value for all its rows)."""
    n = len(part["rows"])
    value = part.get(field.name)
    if value is None:
        return pa.nulls(n, field.type)
    if isinstance(value, str | int):
        return pa.repeat(pa.scalar(value, field.type), n)
    return _array(value).cast(field.type)


def _rollout_sets(rollouts: pa.Table | None) -> tuple[pa.Array, pa.Array]:
    """The ids of the step's train rollouts, and of those not filtered out (whose tokens are loss tokens)."""
    if rollouts is None:
        return pa.array([], pa.int64()), pa.array([], pa.int64())
    is_train = pc.fill_null(pc.equal(rollouts["kind"], "train"), False)
    kept = pc.and_(is_train, pc.invert(pc.fill_null(rollouts["filtered"], False)))
    ids = rollouts["rollout_id"]
    return ids.filter(is_train).combine_chunks(), ids.filter(kept).combine_chunks()


def _pass_parts(passes: pa.Table, tokens: pa.Table | None) -> list[dict]:
    """The "deciles", "passes", "loss" and "loss_tokens" rows of one step's stored pass rows (`tokens`: the step's
    with the flags `train` and `loss`, their rollout's)."""
    weight = pc.abs(passes["grad_weight"].cast(pa.float64()))
    deciles = {"entropy_decile": passes["entropy_decile"], "clip": passes["clip"], "abs_weight": weight}
    if passes["entropy_decile"].null_count:
        decided = pc.is_valid(passes["entropy_decile"])
        deciles = {name: values.filter(decided) for name, values in deciles.items()}
    parts = [_grouped(deciles, ["entropy_decile", "clip"], sums={"abs_weight": "abs_weight"})
             | {"kind": "deciles", "bucket": 0}]
    if tokens is None or tokens.num_rows == 0:
        return parts
    token_keys = _token_keys(tokens)  # (n,) sorted, as the writer sorts the tokens
    keys = _token_keys(passes)  # (m,)
    at = np.minimum(np.searchsorted(token_keys, keys), len(token_keys) - 1)  # (m,)
    found = token_keys[at] == keys  # (m,)
    token = tokens.take(at)  # (m,) each pass row's token (where found)
    text = token["token_text"]
    is_train = pc.fill_null(token["train"], False).to_numpy(zero_copy_only=False)
    counted = pa.array(found & (pc.is_valid(text).to_numpy(zero_copy_only=False) | is_train))
    ratio = passes["ratio"].cast(pa.float64())
    parts += _by_bucket("passes", {
        "token_text": text.filter(counted), "position": passes["position"].filter(counted),
        "clip": passes["clip"].filter(counted), "abs_weight": weight.filter(counted),
        "ratio_dev": pc.abs(pc.subtract(ratio, 1.0)).filter(counted)}, ["token_text", "clip"],
        sums={"abs_weight": "abs_weight", "ratio_dev": "ratio_dev"})
    kept = pc.equal(pc.fill_null(passes["rejected"], 0), 0).to_numpy(zero_copy_only=False)
    in_loss = pa.array(found & kept & pc.fill_null(token["loss"], False).to_numpy(zero_copy_only=False))
    loss_columns = passes.select(["pass", "rollout_id", "position", "new_logp", "kl", "clip"])
    parts += _loss_parts(loss_columns.filter(in_loss), token.filter(in_loss), ratio.filter(in_loss))
    return parts


def _loss_parts(passes: pa.Table, tokens: pa.Table, ratio: pa.Array) -> list[dict]:
    """The "loss" and "loss_tokens" rows of the loss token x pass rows (`tokens`: each row's token values)."""
    if passes.num_rows == 0:
        return []
    old, ref = tokens["old_logp"].cast(pa.float64()), tokens["ref_logp"].cast(pa.float64())
    new_logp = pc.coalesce(passes["new_logp"].cast(pa.float64()), pc.add(old, pc.ln(ratio)))
    x = pc.subtract(ref, new_logp)
    kl = pc.coalesce(passes["kl"].cast(pa.float64()), pc.subtract(pc.subtract(pc.exp(x), x), 1.0))
    kl = pc.if_else(pc.is_nan(kl), pa.scalar(None, pa.float64()), kl)
    advantage = tokens["advantage"].cast(pa.float64())
    parts = _by_bucket("loss", {
        "pass": passes["pass"], "token_text": tokens["token_text"], "position": passes["position"],
        "advantage": advantage, "logp": new_logp, "advantage_logp": pc.multiply(advantage, new_logp), "kl": kl,
        "entropy": tokens["entropy"], "cov": pc.fill_null(pc.equal(passes["clip"], CLIP_COV), False)},
        ["pass", "token_text"], counts={"kl_rows": "kl"}, totals={"cov_rows": "cov"},
        sums={"advantage_sum": "advantage", "logp_sum": "logp", "advantage_logp_sum": "advantage_logp",
              "kl_sum": "kl", "entropy_sum": "entropy"})
    uses = _grouped({"rollout_id": passes["rollout_id"], "pass": passes["pass"]}, ["rollout_id", "pass"])
    per_rollout = _grouped({"rollout_id": uses["rollout_id"], "rows": uses["rows"], "uses": np.ones(len(uses["rows"]))},
                           ["rollout_id"], totals={"rows": "rows", "uses": "uses"})
    once = float(np.sum(per_rollout["rows"] / per_rollout["uses"]))
    return [*parts, {"kind": "loss_tokens", "bucket": 0, "rows": np.zeros(1, np.int64), "loss_tokens": [once]}]


def _by_bucket(kind: str, rows: dict, keys: list[str], sums: dict[str, str] | None = None,
               counts: dict[str, str] | None = None, totals: dict[str, str] | None = None) -> list[dict]:
    """`_grouped` rows of `kind` per `SUMMARY_BUCKET` positions, and without a position split (bucket 0, the
    former added up)."""
    position = pc.fill_null(rows.pop("position"), -1).to_numpy(zero_copy_only=False)  # (n,) NULL: none logged
    rows["position_from"] = pa.array(position_from(np.maximum(position, 0)), mask=position < 0)
    split = _grouped(rows, [*keys, "position_from"], sums, counts, totals)
    added = [*(counts or {}), *(totals or {}), "rows"]
    whole = _grouped({k: v for k, v in split.items() if k != "position_from"}, keys,
                     {name: name for name in sums or {}}, totals={name: name for name in added})
    return [split | {"kind": kind, "bucket": SUMMARY_BUCKET}, whole | {"kind": kind, "bucket": 0}]


def _grouped(rows: dict, keys: list[str], sums: dict[str, str] | None = None, counts: dict[str, str] | None = None,
             totals: dict[str, str] | None = None) -> dict:
    """Per distinct `keys` (NULL a value of its own) of the columns `rows` (pyarrow or numpy, one length):
    the keys; rows, their number (or the total of a `rows` column in `totals`); per `sums` name, the sum of the
    non-NULL values of its column (NULL when there are none, as SQL's sum); per `counts` name, the number of
    non-NULL values of its column; per `totals` name, the sum of its column (no NULLs). Groups in key order."""
    combined, size = np.zeros(len(rows[keys[0]]), np.int64), 1  # (n,) one code per distinct keys, below size
    for key in keys:
        codes, distinct = _codes(rows[key])
        if size * distinct >= 2**62:  # renumber the keys so far densely first
            _, combined = np.unique(combined, return_inverse=True)
            size = int(combined.max(initial=0)) + 1
        combined, size = combined.reshape(-1) * distinct + codes, size * distinct
    first, group = _groups(combined, size)
    out = {key: _array(rows[key]).take(first) for key in keys}
    out["rows"] = np.bincount(group, minlength=len(first))
    for name, column in (totals or {}).items():
        out[name] = np.bincount(group, weights=np.asarray(rows[column], np.float64), minlength=len(first))
    for name, column in (counts or {}).items():
        out[name] = np.bincount(group, weights=_valid(rows[column]), minlength=len(first))
    for name, column in (sums or {}).items():
        values = _array(rows[column]).cast(pa.float64())
        valid = _valid(values)
        summed = np.bincount(group, weights=np.where(valid, pc.fill_null(values, 0.0).to_numpy(), 0.0),
                             minlength=len(first))
        out[name] = pa.array(summed, mask=np.bincount(group, weights=valid, minlength=len(first)) == 0)
    return out


def _codes(values) -> tuple[np.ndarray, int]:
    """(n,) int64 codes of a column's values (NULL one more code), and the number of codes."""
    values = _array(values)
    if pa.types.is_integer(values.type):  # offsets from the smallest value: no hashing
        valid = pc.is_valid(values).to_numpy(zero_copy_only=False)
        numbers = pc.fill_null(values, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        low, high = (int(numbers[valid].min()), int(numbers[valid].max())) if valid.any() else (0, 0)
        return np.where(valid, numbers - low, high - low + 1), high - low + 2
    encoded = values if pa.types.is_dictionary(values.type) else pc.dictionary_encode(values)
    codes = pc.fill_null(encoded.indices, len(encoded.dictionary)).to_numpy(zero_copy_only=False)
    return codes.astype(np.int64), len(encoded.dictionary) + 1


def _groups(combined: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A row of each distinct value of `combined` (codes below `size`) in value order, (g,), and each row's
    group, (n,). Counted in a table of `size` entries when that is small (no sort), else sorted."""
    n = len(combined)
    if size > 8 * n + 4096:
        _, first, group = np.unique(combined, return_index=True, return_inverse=True)
        return first, group.reshape(-1)
    present = np.bincount(combined, minlength=size) > 0
    group = (np.cumsum(present) - 1)[combined]
    first = np.empty(int(present.sum()), np.int64)
    first[group] = np.arange(n)  # whichever row of a group lands: they share their keys
    return first, group


def _valid(values) -> np.ndarray:
    """(n,) 1.0 where a value is not NULL, else 0.0."""
    return pc.is_valid(_array(values)).to_numpy(zero_copy_only=False).astype(np.float64)


def _array(values) -> pa.Array:
    """A pyarrow column, numpy array or list as one pyarrow Array."""
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks()
    return values if isinstance(values, pa.Array) else pa.array(values)
