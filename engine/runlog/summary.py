"""The `token_summary` table: per-step sums of what the dashboard's token statistics show, written by the writer
from each step's own rows, so that statistics over a whole run add a few rows per step instead of reading every
token and pass (a 100M-token run holds ~7M summary rows, most of them per position bucket).

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
position_from = position // 4 * 4, and any bucket that is a multiple of 4 is a sum of them (since
(p // 4 * 4) // b * b = p // b * b). The values are the ones the reader's views give: float32 columns summed as
float64, new_logp and kl derived as `engine.runlog.derived` derives them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.runlog.derived import _token_keys
from engine.runlog.schema import TABLE_SCHEMAS

SUMMARY_BUCKET = 4
"""The finest position bucket summarised: the dashboard's buckets (4, 8, 16, 32 positions) are multiples of it."""

CLIP_COV = 4  # engine.clip_codes.CLIP_COV (not imported: the run log depends on nothing of the engine)
_SCHEMA = TABLE_SCHEMAS["token_summary"]


def step_summary(rollouts: pa.Table | None, tokens: pa.Table | None, passes: pa.Table | None) -> pa.Table | None:
    """The `token_summary` rows of one step of one writer, from its rows in the run-log schema (`passes` as stored:
    token text and entropy decile filled in by `derived.stored_passes`); None without tokens or passes."""
    if tokens is None and passes is None:
        return None
    some = tokens if tokens is not None else passes
    run, step = some["run"][0], some["step"][0]
    train, loss = _rollout_sets(rollouts)
    parts = []
    if tokens is not None:
        train_tokens = tokens.filter(pc.is_in(tokens["rollout_id"], value_set=train))
        values = pa.table({"token_text": train_tokens["token_text"], "position": train_tokens["position"],
                           "advantage": train_tokens["advantage"].cast(pa.float64()),
                           "entropy": train_tokens["entropy"].cast(pa.float64())})
        parts += _by_bucket("tokens", values, ["token_text"], [
            ("advantage", "sum"), ("advantage", "count"), ("entropy", "sum"), ("entropy", "count")])
    if passes is not None:
        parts += _pass_parts(passes, tokens, train, loss)
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return None
    n = sum(p.num_rows for p in parts)
    columns = {"run": pa.repeat(run, n), "step": pa.repeat(step, n)}
    for field in _SCHEMA:
        if field.name not in columns:
            columns[field.name] = pa.concat_arrays(
                [p[field.name].combine_chunks().cast(field.type) if field.name in p.column_names
                 else pa.nulls(p.num_rows, field.type) for p in parts])
    return pa.table(columns, schema=_SCHEMA)


def _rollout_sets(rollouts: pa.Table | None) -> tuple[pa.Array, pa.Array]:
    """The ids of the step's train rollouts, and of those not filtered out (whose tokens are loss tokens)."""
    if rollouts is None:
        return pa.array([], pa.int64()), pa.array([], pa.int64())
    is_train = pc.fill_null(pc.equal(rollouts["kind"], "train"), False)
    kept = pc.and_(is_train, pc.invert(pc.fill_null(rollouts["filtered"], False)))
    ids = rollouts["rollout_id"]
    return ids.filter(is_train).combine_chunks(), ids.filter(kept).combine_chunks()


def _pass_parts(passes: pa.Table, tokens: pa.Table | None, train: pa.Array, loss: pa.Array) -> list[pa.Table]:
    """The "passes", "deciles", "loss" and "loss_tokens" rows of one step's stored pass rows."""
    parts = []
    weight = pc.abs(passes["grad_weight"].cast(pa.float64()))
    decided = pc.is_valid(passes["entropy_decile"])
    parts.append(_grouped("deciles", pa.table({
        "entropy_decile": passes["entropy_decile"], "clip": passes["clip"], "abs_weight": weight}).filter(decided),
        ["entropy_decile", "clip"], [("abs_weight", "sum")]))
    if tokens is None or tokens.num_rows == 0:
        return parts
    token_keys = _token_keys(tokens)  # (n,) sorted, as the writer sorts the tokens
    keys = _token_keys(passes)  # (m,)
    at = np.minimum(np.searchsorted(token_keys, keys), len(token_keys) - 1)  # (m,)
    found = token_keys[at] == keys  # (m,)
    token = tokens.take(pa.array(at))  # (m,) the pass row's token row (where found)
    text = token["token_text"]
    is_train = pc.is_in(token["rollout_id"], value_set=train).to_numpy(zero_copy_only=False)
    counted = found & (pc.is_valid(text).to_numpy(zero_copy_only=False) | is_train)
    ratio = passes["ratio"].cast(pa.float64())
    per_text = pa.table({"token_text": text, "position": passes["position"], "clip": passes["clip"],
                         "abs_weight": weight, "ratio_dev": pc.abs(pc.subtract(ratio, 1.0))})
    parts += _by_bucket("passes", per_text.filter(pa.array(counted)), ["token_text", "clip"],
                        [("abs_weight", "sum"), ("ratio_dev", "sum")])
    kept = pc.equal(pc.fill_null(passes["rejected"], 0), 0).to_numpy(zero_copy_only=False)
    in_loss = found & kept & pc.is_in(token["rollout_id"], value_set=loss).to_numpy(zero_copy_only=False)
    parts += _loss_parts(passes.filter(pa.array(in_loss)), token.filter(pa.array(in_loss)), ratio.filter(in_loss))
    return parts


def _loss_parts(passes: pa.Table, tokens: pa.Table, ratio: pa.Array) -> list[pa.Table]:
    """The "loss" and "loss_tokens" rows of the loss token x pass rows (`tokens`: each row's token row)."""
    if passes.num_rows == 0:
        return []
    old, ref = tokens["old_logp"].cast(pa.float64()), tokens["ref_logp"].cast(pa.float64())
    new_logp = pc.coalesce(passes["new_logp"].cast(pa.float64()), pc.add(old, pc.ln(ratio)))
    x = pc.subtract(ref, new_logp)
    kl = pc.coalesce(passes["kl"].cast(pa.float64()), pc.subtract(pc.subtract(pc.exp(x), x), 1.0))
    kl = pc.if_else(pc.is_nan(kl), pa.scalar(None, pa.float64()), kl)
    advantage = tokens["advantage"].cast(pa.float64())
    rows = pa.table({
        "pass": passes["pass"], "token_text": tokens["token_text"], "position": passes["position"],
        "rollout_id": passes["rollout_id"], "advantage": advantage, "logp": new_logp,
        "advantage_logp": pc.multiply(advantage, new_logp), "kl": kl,
        "entropy": tokens["entropy"].cast(pa.float64()),
        "cov": pc.fill_null(pc.equal(passes["clip"], CLIP_COV), False).cast(pa.int64())})
    parts = _by_bucket("loss", rows, ["pass", "token_text"], [
        ("advantage", "sum"), ("logp", "sum"), ("advantage_logp", "sum"), ("kl", "sum"), ("kl", "count"),
        ("entropy", "sum"), ("cov", "sum")])
    per_use = rows.group_by(["rollout_id", "pass"], use_threads=False).aggregate([([], "count_all")])
    per_rollout = per_use.group_by("rollout_id", use_threads=False).aggregate(
        [("count_all", "sum"), ("count_all", "count")])
    once = pc.sum(pc.divide(per_rollout["count_all_sum"].cast(pa.float64()), per_rollout["count_all_count"]))
    parts.append(pa.table({"kind": ["loss_tokens"], "bucket": [0], "loss_tokens": [once.as_py()]}))
    return parts


# The summary's column of each of pyarrow's aggregate names (column_function) that `_grouped` uses.
_NAMES = {"advantage_count": "advantage_rows", "entropy_count": "entropy_rows", "abs_weight_sum": "abs_weight",
          "ratio_dev_sum": "ratio_dev", "logp_sum": "logp_sum", "kl_count": "kl_rows", "cov_sum": "cov_rows",
          "count_all": "rows"}


def _by_bucket(kind: str, rows: pa.Table, keys: list[str], aggregates: list[tuple[str, str]]) -> list[pa.Table]:
    """`_grouped` rows of `kind` without a position split (bucket 0) and per `SUMMARY_BUCKET` positions."""
    position = pc.fill_null(rows["position"], -1).to_numpy(zero_copy_only=False)
    split = rows.append_column("position_from", pa.array(position // SUMMARY_BUCKET * SUMMARY_BUCKET,
                                                         mask=~pc.is_valid(rows["position"]).to_numpy(
                                                             zero_copy_only=False)))
    return [_grouped(kind, rows, keys, aggregates),
            _grouped(kind, split, [*keys, "position_from"], aggregates, bucket=SUMMARY_BUCKET)]


def _grouped(kind: str, rows: pa.Table, keys: list[str], aggregates: list[tuple[str, str]],
             bucket: int = 0) -> pa.Table:
    """Per `keys` of `rows`: rows (their number) and the `aggregates` (sums skip NULLs and are NULL when every
    value is; counts count the non-NULL values), named as the summary's columns, with `kind` and `bucket`."""
    out = rows.group_by(keys, use_threads=False).aggregate([*aggregates, ([], "count_all")])
    out = out.rename_columns([_NAMES.get(c, c) for c in out.column_names])
    n = out.num_rows
    return out.append_column("kind", pa.repeat(kind, n)).append_column("bucket", pa.repeat(bucket, n))
