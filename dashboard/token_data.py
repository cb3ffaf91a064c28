"""The Token statistics page's data: per token text and position bucket over a step range, entropy bins, and the
covariance and KL drivers (Cui et al. 2025, arXiv 2505.22617). Streamlit-free like `dashboard.data`, whose shared
fragments it uses; `_TRAIN_TOKENS` / `_PASSES` select the train tokens and the optimisation passes of some runs in a
step range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dashboard.data import PASSES
from engine.clip_codes import CLIP_COV, CLIP_EVENTS, CLIP_NONE, rate_column
from engine.runlog.derived import TOKEN_ROWS, kl_sql, new_logp_sql
from engine.runlog.summary import SPLIT_UNTIL, SUMMARY_BUCKET, position_from_sql

SUMMARY = "token_summary"  # the run log's per-step sums of token statistics (engine.runlog.summary)

# ---------------------------------------------------------------- token statistics over a step range

_TOKEN_KEY = "(step::HUGEINT * 18446744073709551616 + rollout_id::HUGEINT * 4294967296 + position)"
"""(step, rollout_id, position) as one number (rollout ids and positions are below 2^32): joining and grouping a
million tokens on one key takes half the time of three."""

_TRAIN_TOKENS = f"""
    SELECT t.run, t.step, t.rollout_id, t.position, {_TOKEN_KEY} AS token_key, t.token_text, t.advantage, t.entropy
    FROM {TOKEN_ROWS} t SEMI JOIN (
        SELECT run, step, rollout_id FROM rollouts
        WHERE list_contains($runs, run) AND step BETWEEN $first AND $last AND kind = 'train'
    ) r ON r.run = t.run AND r.step = t.step AND r.rollout_id = t.rollout_id
    WHERE list_contains($runs, t.run) AND t.step BETWEEN $first AND $last"""
"""The train tokens of some runs in a step range (eval completions are logged in `tokens` too, but never trained on)."""

_PASSES = f"""
    SELECT run, {_TOKEN_KEY} AS token_key, clip, grad_weight, ratio FROM {PASSES}
    WHERE list_contains($runs, run) AND step BETWEEN $first AND $last"""
"""The optimisation passes of some runs in a step range, keyed like `_TRAIN_TOKENS`. Joined to the tokens row by
row and aggregated straight into the few output groups: a third cheaper than summing each token's passes first."""


@dataclass(frozen=True)
class _Split:
    """Which steps of a range a statistic reads from the token summary (engine.runlog.summary) and which from the
    tokens and passes: SQL conditions on `step` (integers only), and the summary rows' bucket to read."""

    exact: str  # the steps read row by row: those no summary file covers (logged before it, or its file damaged)
    summary: str  # the others
    bucket: int  # 0 (no position split) or SUMMARY_BUCKET (rows every position bucket that is a multiple of it sums)

    @property
    def any_exact(self) -> bool:
        return self.exact != "false"

    @property
    def any_summary(self) -> bool:
        return self.summary != "false"


def _split(reader, run: str, first: int, last: int, bucket: int = 0) -> _Split:
    """The steps first..last of `run` a summary serves (`_Split`): all but those in a folder without a readable
    summary file, and none for a position bucket that is not a multiple of `SUMMARY_BUCKET`."""
    if bucket % SUMMARY_BUCKET:
        return _Split("true", "false", 0)
    gaps = [(max(a, first), min(b, last)) for a, b in reader.steps_without(SUMMARY, run, ("tokens", "token_passes"))
            if a <= last and b >= first]
    if not gaps:
        return _Split("false", "true", min(bucket, SUMMARY_BUCKET))
    if gaps == [(first, last)]:
        return _Split("true", "false", 0)
    exact = "(" + " OR ".join(f"step BETWEEN {int(a)} AND {int(b)}" for a, b in gaps) + ")"
    return _Split(exact, f"NOT {exact}", min(bucket, SUMMARY_BUCKET))


def _consistent(reader, runs, first: int, last: int, bucket: int, compute):
    """`compute(splits)` with one `_Split` per run, again if the splits changed meanwhile (a damaged summary file
    found and left out by the query: its steps are then read row by row)."""
    for _ in range(3):
        splits = {run: _split(reader, run, first, last, bucket) for run in runs}
        out = compute(splits)
        if splits == {run: _split(reader, run, first, last, bucket) for run in runs}:
            return out
    return out


def _added(frames: list[pd.DataFrame], keys: list[str]) -> pd.DataFrame:
    """Totals of several parts (disjoint steps) added per `keys` (a sum of NULLs stays NULL)."""
    frames = [f for f in frames if f is not None]
    if len(frames) == 1:
        return frames[0]
    return pd.concat(frames).groupby(keys, as_index=False, dropna=False).sum(min_count=1)


def token_stats(reader, run: str, first: int, last: int, bucket: int) -> pd.DataFrame:
    """Per token text (and per position bucket of `bucket` positions when bucket > 0) over steps first..last:
    count of train tokens, mean advantage and entropy, clip rates (low, high, dual: fractions of the token's
    optimisation passes), mean |gradient weight| and mean |ratio - 1| per pass.

    Steps a token summary covers add its rows (a whole 10M-token run: 0.08 s of CPU, docs/benchmarks.md); the
    others are read row by row. The passes carry their token's text (engine.runlog.derived), so they are summed without
    joining the tokens (a whole 100M-token run took 44 s with the join); pass rows without it (runs logged before
    it) are joined."""
    return _consistent(reader, [run], first, last, bucket,
                       lambda splits: _token_stats(reader, run, first, last, bucket, splits[run]))


def _token_stats(reader, run: str, first: int, last: int, bucket: int, split: _Split) -> pd.DataFrame:
    params = {"runs": [run], "first": first, "last": last, "bucket": bucket}
    position_from = position_from_sql("position", "$bucket")
    keys = ["token_text", "position_from"]
    per_token, per_pass = [], []
    if split.any_exact:
        per_token.append(reader.sql(f"""
            SELECT token_text, {position_from} AS position_from, count(*) AS count, sum(advantage) AS advantage_sum,
                   count(advantage) AS advantage_rows, sum(entropy) AS entropy_sum, count(entropy) AS entropy_rows
            FROM ({_TRAIN_TOKENS}) WHERE {split.exact} GROUP BY ALL""", params))
        per_pass.append(_summed(reader, params, keys, f"""
            SELECT token_text, {position_from} AS position_from, clip, grad_weight, ratio FROM {PASSES}
            WHERE list_contains($runs, run) AND step BETWEEN $first AND $last AND {split.exact}""", f"""
            SELECT t.token_text, t.position_from, p.clip, p.grad_weight, p.ratio
            FROM (SELECT *, {position_from} AS position_from FROM ({_TRAIN_TOKENS}) WHERE {split.exact}) t
            JOIN ({_PASSES} AND token_text IS NULL) p USING (run, token_key)"""))
    if split.any_summary:
        summary_keys = f"token_text, {position_from_sql('position_from', '$bucket')} AS position_from"
        per_token.append(reader.sql(f"""
            SELECT token_text, position_from, sum(rows)::BIGINT AS count, sum(advantage_sum) AS advantage_sum,
                   sum(advantage_rows)::BIGINT AS advantage_rows, sum(entropy_sum) AS entropy_sum,
                   sum(entropy_rows)::BIGINT AS entropy_rows
            FROM ({_summary_rows("tokens", split, summary_keys)}) GROUP BY ALL""", params))
        per_pass.append(reader.sql(_pass_totals(_summary_rows("passes", split, summary_keys), keys, summed=True),
                                   params))
    out = _added(per_token, keys)
    out.insert(3, "advantage_mean", out.pop("advantage_sum") / out.pop("advantage_rows").where(lambda n: n > 0))
    out.insert(4, "entropy_mean", out.pop("entropy_sum") / out.pop("entropy_rows").where(lambda n: n > 0))
    out = out.merge(_with_rates(_added(per_pass, keys)), on=keys, how="left")
    out["abs_grad_weight_mean"] = out.pop("abs_weight") / out["pass_rows"]
    out["ratio_deviation_mean"] = out.pop("ratio_dev") / out.pop("pass_rows")
    out["entropy_mean"] = out.pop("entropy_mean")
    out = out.drop(columns="clip_rate").sort_values(["count", *keys], ascending=[False, True, True])
    return out.reset_index(drop=True)


def _summary_rows(kind: str, split: _Split, keys: str, of_run: str = "list_contains($runs, run)") -> str:
    """SQL of a run's token summary rows of `kind` in the steps `split` reads from it, with the `keys`
    (expressions over the summary's columns) and every other column; `of_run`: the condition picking the run."""
    return f"""
        SELECT {keys}, * EXCLUDE (token_text, position_from, entropy_decile)
        FROM {SUMMARY} WHERE {of_run} AND kind = '{kind}' AND bucket = {split.bucket}
                             AND step BETWEEN $first AND $last AND {split.summary}"""


def _summed(reader, params: dict, keys: list[str], stored: str, joined: str) -> pd.DataFrame:
    """`_pass_totals` per `keys` of the pass rows `stored` (SQL of rows with the keys, clip, grad_weight, ratio),
    where the first key is NULL on rows logged without it, which `joined` (the same rows with the key from the
    tokens, for those rows only) replaces: run only when there are such rows."""
    totals = reader.sql(_pass_totals(stored, keys), params)
    if totals[keys[0]].isna().any():
        totals = pd.concat([totals.dropna(subset=[keys[0]]), reader.sql(_pass_totals(joined, keys), params)])
        totals = totals.groupby(keys, as_index=False, dropna=False).sum()
    return totals


def bucket_last(position_from, bucket: int):
    """The last position of the bucket that starts at `position_from` (an int or a Series): position_from + bucket -
    1, or 2 position_from - 1 from SPLIT_UNTIL on (`position_from_sql`)."""
    return np.where(position_from >= SPLIT_UNTIL, 2 * position_from, position_from + bucket) - 1


def bucket_positions(position_from: int, bucket: int) -> str:
    """The positions of a bucket as text, e.g. "8..15", or "2048..4095" from SPLIT_UNTIL on."""
    return f"{position_from}..{int(bucket_last(position_from, bucket))}"


def rollouts_with_token(reader, run: str, first: int, last: int, token_text: str, bucket: int,
                        position_from: int | None, limit: int = 500) -> pd.DataFrame:
    """The train rollouts of steps first..last that hold a token text (within a position bucket, when given),
    with how often and where."""
    return reader.sql(
        f"""
        WITH tok AS ({_TRAIN_TOKENS})
        SELECT r.step, r.rollout_id, r.group_id, count(*) AS occurrences, list(t.position ORDER BY t.position)
               AS positions, r.completion, r.reward, r.advantage, r.length
        FROM tok t JOIN rollouts r ON r.run = t.run AND r.step = t.step AND r.rollout_id = t.rollout_id
        WHERE t.token_text = $token AND ($bucket <= 0 OR {position_from_sql("t.position", "$bucket")} = $position_from)
        GROUP BY ALL ORDER BY r.step, r.rollout_id LIMIT $limit
        """,
        {"runs": [run], "first": first, "last": last, "token": token_text, "bucket": bucket,
         "position_from": position_from, "limit": limit},
    )


def entropy_bins(reader, runs: tuple[str, ...], first: int, last: int, bins: int) -> pd.DataFrame:
    """Train tokens binned by the quantile of their entropy within their own response, per run: clip rates
    (fractions of the token x pass rows) and each bin's share of the run's total |gradient weight|, steps first..last.

    A response's cut points are the linearly interpolated quantiles of its token entropies at 1/bins, 2/bins, ...
    (as torch.nanquantile computes them); a token's bin is the number of cut points strictly below its entropy. With
    10 bins, bins 8 and 9 are exactly the tokens ASPO treats as high-entropy (entropy > the 80th percentile).

    With 2, 5 or 10 bins the writer's `entropy_decile` of each pass row gives the bin (decile // (10 / bins)): one
    scan of the passes, no tokens read (a whole 100M-token run fits). Pass rows without it (runs logged before it)
    and other bin counts compute the quantiles from the tokens.
    """
    if not (isinstance(bins, int) and 2 <= bins <= 100):
        raise ValueError(f"bins = {bins!r}; accepted: an integer from 2 to 100")
    # The summary holds deciles: other bin counts read every step row by row, as a bucket of 1 position would.
    bucket = 0 if ENTROPY_DECILES % bins == 0 else 1
    totals = _consistent(reader, runs, first, last, bucket, lambda splits: _added(
        [part for run, split in splits.items() for part in _bin_totals(reader, run, first, last, bins, split)],
        ["bin", "run"]))
    algorithms = reader.sql("SELECT run, algorithm FROM runs WHERE list_contains($runs, run)", {"runs": list(runs)})
    out = algorithms.merge(_with_rates(totals.drop(columns="ratio_dev")), on="run")
    out = out.sort_values(["run", "bin"], ignore_index=True).astype({"bin": int})
    out.insert(3, "quantile_mid", (out["bin"] + 0.5) / bins)
    out["abs_weight"] = out.pop("abs_weight")
    run_total = out.groupby("run")["abs_weight"].transform("sum")
    out["weight_share"] = out["abs_weight"] / run_total.where(run_total != 0)
    return out[["algorithm", "run", "bin", "quantile_mid", "pass_rows", "clip_rate",
                *(rate_column(code) for code in CLIP_EVENTS), "abs_weight", "weight_share"]]


ENTROPY_DECILES = 10
"""The resolution of the token passes' stored `entropy_decile` (engine.runlog.derived)."""


def _bin_totals(reader, run: str, first: int, last: int, bins: int, split: _Split) -> list[pd.DataFrame]:
    """`_pass_totals` per (bin, run) of one run's steps first..last: from its token summary's deciles where
    `split` says so, else from the passes' deciles, else (bins that do not divide 10, passes logged without a
    decile) from the quantiles of the tokens' entropies."""
    params = {"runs": [run], "first": first, "last": last}
    from_quantiles = _quantile_bins(bins).replace("{exact}", split.exact)
    per_decile = ENTROPY_DECILES // bins
    parts = []
    if split.any_summary:
        summary = _summary_rows("deciles", split, f"entropy_decile // {per_decile} AS bin")
        parts.append(reader.sql(_pass_totals(summary, ["bin", "run"], summed=True), params))
    if split.any_exact and ENTROPY_DECILES % bins == 0:
        parts.append(_summed(reader, params, ["bin", "run"], f"""
            SELECT run, entropy_decile // {per_decile} AS bin, clip, grad_weight, NULL::DOUBLE AS ratio
            FROM {PASSES} WHERE list_contains($runs, run) AND step BETWEEN $first AND $last AND {split.exact}""",
                             from_quantiles.replace("{missing}", " AND entropy_decile IS NULL")))
    elif split.any_exact:
        parts.append(reader.sql(_pass_totals(from_quantiles.replace("{missing}", ""), ["bin", "run"]), params))
    return parts


def _pass_totals(rows: str, keys: list[str], summed: bool = False) -> str:
    """Per `keys` of `rows` (SQL of rows with the keys, clip, grad_weight, ratio): pass rows, rows with a clip
    code (clip_rows), the clipped ones and one count per clip code, the sums of |gradient weight| and |ratio - 1|:
    totals that add up across parts (`_with_rates` turns them into shares). `summed`: `rows` are token summary
    rows (engine.runlog.summary: keys, clip, rows, abs_weight, ratio_dev), whose sums are added."""
    n = "sum(rows)" if summed else "count(*)"

    def where(condition: str) -> str:
        return f"coalesce({n} FILTER (WHERE {condition}), 0)::BIGINT"

    counts = ", ".join(f'{where(f"clip = {int(code)}")} AS "{rate_column(code)}"' for code in CLIP_EVENTS)
    weight, ratio = ("sum(abs_weight)", "sum(ratio_dev)") if summed else ("sum(abs(grad_weight))",
                                                                          "sum(abs(ratio - 1))")
    return f"""
        SELECT {", ".join(keys)}, {n}::BIGINT AS pass_rows, {where("clip IS NOT NULL")} AS clip_rows,
               {where(f"clip <> {CLIP_NONE}")} AS clipped, {counts}, {weight} AS abs_weight, {ratio} AS ratio_dev
        FROM ({rows}) GROUP BY ALL"""


def _with_rates(totals: pd.DataFrame) -> pd.DataFrame:
    """`_pass_totals` with the clip counts as shares of the rows with a clip code (clip_rate: any clip)."""
    judged = totals.pop("clip_rows").where(lambda n: n > 0)
    out = totals.assign(clip_rate=totals.pop("clipped") / judged)
    for code in CLIP_EVENTS:
        out[rate_column(code)] = out.pop(rate_column(code)) / judged
    return out


def _quantile_bins(bins: int) -> str:
    """(run, bin, clip, grad_weight, ratio) of the pass rows of train tokens, the bin computed from the quantiles
    of each response's token entropies; `{exact}` stands for a condition on the tokens' step, `{missing}` for a
    further condition on the passes."""
    cuts = ", ".join(f"{k / bins!r}" for k in range(1, bins))
    # Written out (from the integer `bins` only): one comparison per cut point is cheaper than a list lambda.
    bin_of = " + ".join(f"(t.entropy > c.cuts[{k}])::INT" for k in range(1, bins))
    return f"""
        WITH tok AS (SELECT * FROM ({_TRAIN_TOKENS}) WHERE {{exact}}),
        cut_points AS (
            SELECT run, step, rollout_id, quantile_cont(entropy, [{cuts}]) AS cuts
            FROM tok GROUP BY run, step, rollout_id
        ), binned AS (
            SELECT t.run, t.token_key, {bin_of} AS bin
            FROM tok t JOIN cut_points c USING (run, step, rollout_id) WHERE t.entropy IS NOT NULL
        )
        SELECT b.run, b.bin, p.clip, p.grad_weight, p.ratio
        FROM binned b JOIN ({_PASSES}{{missing}}) p USING (run, token_key)"""


# ---------------------------------------------------------------- covariance and KL drivers (arXiv 2505.22617)

_LOSS_TOKEN_PASSES = f"""
    SELECT t.step, p."pass", t.rollout_id, t.position, t.token_text, t.entropy, t.advantage,
           {new_logp_sql("p", "t")} AS new_logp, nullif({kl_sql("p", "t")}, 'NaN'::DOUBLE) AS kl, p.clip
    FROM (
        SELECT t.*, {_TOKEN_KEY} AS token_key FROM {TOKEN_ROWS} t SEMI JOIN (
            SELECT run, step, rollout_id FROM rollouts
            WHERE run = $run AND step BETWEEN $first AND $last AND kind = 'train' AND NOT coalesce(filtered, false)
        ) r ON r.run = t.run AND r.step = t.step AND r.rollout_id = t.rollout_id
        WHERE t.run = $run AND t.step BETWEEN $first AND $last
    ) t JOIN (
        SELECT run, "pass", {_TOKEN_KEY} AS token_key, new_logp, ratio, kl, clip FROM {PASSES}
        WHERE run = $run AND step BETWEEN $first AND $last AND coalesce(rejected, 0) = 0
    ) p USING (run, token_key)"""
"""The loss tokens of a run's optimisation passes in steps first..last: train rollouts not filtered out (DAPO's
dropped groups, overlong-filtered completions), tokens no mismatch correction rejected. A logged NaN KL (a run
without a reference model) reads as NULL."""


def _keys(*expressions: str) -> str:
    """A SELECT list of the non-empty `expressions`."""
    return ", ".join(e for e in expressions if e)


def _covariance_sums(split: _Split, exact_group: str, summary_group: str, per_text: bool = False) -> str:
    """Per step, pass and `group` (more GROUP BY expressions over `_LOSS_TOKEN_PASSES`, named): rows n, the summed
    covariance (A - mean A)(log pi - mean log pi) of Cui et al., the means over the pass's loss tokens and log pi
    the pass's new log-prob (the quantity Clip-Cov and KL-Cov select by: `engine.objectives.token_covariance`, verl
    0.9.1 `compute_policy_loss_clip_cov`), the summed KL (kl_sum over kl_rows rows with one) and entropy, and the
    rows Clip-Cov or KL-Cov selected (cov_rows: clip code 4, `engine.clip_codes.CLIP_COV`).

    A group's summed covariance is sum(A log pi) - mean(log pi) sum(A) - mean(A) sum(log pi) + n mean(A) mean(log pi)
    with the pass's means: one aggregation over the rows, where a window for the means and a product per row took
    1.7-1.8 times as long (benchmarks/bench_token_drivers.py). A critic run's loss saw its advantages whitened with the
    step's (mean, std) (`as_loss_used`): its covariance is divided by that std. A pass spread over several
    processes is one batch here, where each process's loss took its own means.

    `per_text` (the groups are token_text, position_from): the summary's rows, already one per step, pass, text and
    position bucket, are not grouped again; only the groups where some row lacks one of the covariance's sums, which
    a grouping would have ignored, are (`_summary_loss_rows`)."""
    parts = []
    if split.any_exact:
        parts.append(f"""
            SELECT {_keys("step", '"pass"', exact_group)}, count(*) AS n, sum(advantage) AS sum_a,
                   sum(new_logp) AS sum_logp, sum(advantage * new_logp) AS sum_a_logp, sum(kl) AS kl_sum,
                   count(kl) AS kl_rows, sum(entropy) AS entropy_sum,
                   count(*) FILTER (WHERE clip = {CLIP_COV}) AS cov_rows
            FROM ({_LOSS_TOKEN_PASSES}) WHERE {split.exact} GROUP BY ALL""")
    if split.any_summary and per_text:
        parts.append(_summary_loss_rows(split, summary_group))
    elif split.any_summary:
        parts.append(f"""
            SELECT {_keys("step", '"pass"', summary_group)}, sum(rows)::BIGINT AS n, sum(advantage_sum) AS sum_a,
                   sum(logp_sum) AS sum_logp, sum(advantage_logp_sum) AS sum_a_logp, sum(kl_sum) AS kl_sum,
                   sum(kl_rows)::BIGINT AS kl_rows, sum(entropy_sum) AS entropy_sum, sum(cov_rows)::BIGINT AS cov_rows
            FROM ({_summary_rows("loss", split, "token_text, position_from", "run = $run")}) GROUP BY ALL""")
    return f"""
        WITH sums AS ({" UNION ALL BY NAME ".join(parts)}
        ), means AS (
            SELECT step, "pass", sum(sum_a) / sum(n) AS mean_a, sum(sum_logp) / sum(n) AS mean_logp
            FROM sums GROUP BY step, "pass"
        )
        SELECT s.*, (s.sum_a_logp - m.mean_logp * s.sum_a - m.mean_a * s.sum_logp + s.n * m.mean_a * m.mean_logp)
                    / coalesce(w.advantage_std, 1.0) AS covariance_sum
        FROM sums s JOIN means m USING (step, "pass") LEFT JOIN steps w ON w.run = $run AND w.step = s.step"""


def _summary_loss_rows(split: _Split, keys: str) -> str:
    """The token summary's loss rows as `_covariance_sums`' groups per step, pass, token_text and position_from
    (`keys`: the last two, over the summary's columns), without grouping them all again.

    Every column is a sum, and the covariance of a group is linear in its sums, so rows of the same group (two
    processes' rows, two 4-position buckets of one 8-position bucket) can each take their share and be added up
    later. Not where a row lacks one of the covariance's sums (NULL): a grouping adds the others' and keeps the
    group, a row's share would drop the row. Those groups, and only those, are summed first. A real vocabulary's
    10M-token run has ~2.7M loss rows and ~150k token texts: with every row grouped again the drivers took 1.23-1.43
    s over the whole run, 0.75-0.85 s without (split by 8 positions: 7.2-7.6 -> 4.5-5.0 s; docs/benchmarks.md)."""
    same = ('q.step = r.step AND q."pass" = r."pass" AND q.token_text IS NOT DISTINCT FROM r.token_text '
            "AND q.position_from IS NOT DISTINCT FROM r.position_from")
    return f"""
        SELECT * FROM (
        WITH summary_rows AS (
            SELECT step, "pass", {keys}, rows::BIGINT AS n, advantage_sum AS sum_a, logp_sum AS sum_logp,
                   advantage_logp_sum AS sum_a_logp, kl_sum, kl_rows::BIGINT AS kl_rows, entropy_sum,
                   cov_rows::BIGINT AS cov_rows
            FROM ({_summary_rows("loss", split, "token_text, position_from", "run = $run")})
        ), partial AS (
            SELECT DISTINCT step, "pass", token_text, position_from FROM summary_rows
            WHERE sum_a IS NULL OR sum_logp IS NULL OR sum_a_logp IS NULL
        )
        SELECT r.* FROM summary_rows r ANTI JOIN partial q ON {same}
        UNION ALL BY NAME
        SELECT step, "pass", token_text, position_from, sum(n)::BIGINT AS n, sum(sum_a) AS sum_a,
               sum(sum_logp) AS sum_logp, sum(sum_a_logp) AS sum_a_logp, sum(kl_sum) AS kl_sum,
               sum(kl_rows)::BIGINT AS kl_rows, sum(entropy_sum) AS entropy_sum, sum(cov_rows)::BIGINT AS cov_rows
        FROM summary_rows r SEMI JOIN partial q ON {same} GROUP BY ALL
        )"""


def covariance_drivers(reader, run: str, first: int, last: int, bucket: int, top: int = 20) -> pd.DataFrame:
    """Per step, the token texts (per position bucket of `bucket` positions when bucket > 0) that are among the
    `top` of steps first..last by summed covariance or by summed KL to the reference (token x pass rows).

    Columns: step, token_text, position_from, rows, covariance_sum, kl_sum, kl_rows (rows with a KL logged),
    entropy_sum (entropy at sampling, summed over rows), cov_rows (rows Clip-Cov / KL-Cov selected),
    top_covariance / top_kl (which ranking picked the text), and the range's totals kl_total / kl_rows_total, for
    shares (`driver_table`)."""
    def by_position(position: str) -> str:
        return f"{position_from_sql(position, '$bucket')} AS position_from"

    # The ranking sums each text's rows over the range straight from the summary's rows (`per_text`), and only the
    # ranked texts' rows are summed per step: a real vocabulary's 10M-token run has ~1.3M (step, text) groups, where
    # summing them all per step first, then ranking, took 1.4 times as long.
    return _consistent(reader, [run], first, last, bucket, lambda splits: reader.sql(
        f"""
        WITH sums AS MATERIALIZED (
            SELECT step, token_text, position_from, n, covariance_sum, kl_sum, kl_rows, entropy_sum, cov_rows
            FROM ({_covariance_sums(splits[run], "token_text, " + by_position("position"),
                                    "token_text, " + by_position("position_from"), per_text=True)})
        ), ranked AS (
            SELECT token_text, position_from,
                   rank() OVER (ORDER BY sum(covariance_sum) DESC NULLS LAST) <= $top AS top_covariance,
                   coalesce(rank() OVER (ORDER BY sum(kl_sum) DESC NULLS LAST) <= $top AND sum(kl_sum) > 0, false)
                   AS top_kl
            FROM sums GROUP BY token_text, position_from
        ), picked AS (
            SELECT * FROM ranked WHERE top_covariance OR top_kl
        ), range_totals AS (
            SELECT sum(kl_sum) AS kl_total, sum(kl_rows) AS kl_rows_total FROM sums
        )
        SELECT s.step, s.token_text, s.position_from, sum(s.n)::BIGINT AS rows,
               sum(s.covariance_sum) AS covariance_sum, sum(s.kl_sum) AS kl_sum, sum(s.kl_rows)::BIGINT AS kl_rows,
               sum(s.entropy_sum) AS entropy_sum, sum(s.cov_rows)::BIGINT AS cov_rows,
               any_value(p.top_covariance) AS top_covariance, any_value(p.top_kl) AS top_kl,
               any_value(t.kl_total) AS kl_total, any_value(t.kl_rows_total) AS kl_rows_total
        FROM sums s JOIN picked p
             ON p.token_text = s.token_text AND p.position_from IS NOT DISTINCT FROM s.position_from
             CROSS JOIN range_totals t
        GROUP BY s.step, s.token_text, s.position_from
        ORDER BY s.token_text, s.position_from, s.step
        """,
        {"run": run, "first": first, "last": last, "bucket": bucket, "top": top}))


def driver_table(per_step: pd.DataFrame, ranking: str) -> pd.DataFrame:
    """The rows of `covariance_drivers` picked by `ranking` ("covariance" or "kl") summed over their steps, one row
    per token text (and position bucket), best first: rows, covariance_sum / _mean, kl_share (of the range's summed
    KL), kl_vs_mean (its mean KL over the mean KL of every loss token), cov_rate (the share of its rows Clip-Cov or
    KL-Cov selected), entropy_mean and, for the entropy over training, the text's mean entropy in the first and
    last step it was seen (entropy_first, entropy_last)."""
    columns = ["token_text", "position_from", "rows", "covariance_sum", "covariance_mean", "kl_share", "kl_vs_mean",
               "cov_rate", "entropy_mean", "entropy_first", "entropy_last", "first_step", "last_step"]
    picked = per_step[per_step["top_covariance" if ranking == "covariance" else "top_kl"]]
    if picked.empty:
        return pd.DataFrame(columns=columns)
    by_step = picked.assign(entropy_of_step=picked["entropy_sum"] / picked["rows"]).sort_values(
        "step", kind="stable").groupby(["token_text", "position_from"], dropna=False, sort=False)
    sums = by_step[["rows", "covariance_sum", "kl_sum", "kl_rows", "entropy_sum", "cov_rows"]].sum(min_count=1).astype(
        {"rows": "int64"})
    ends = by_step.agg(first_step=("step", "first"), last_step=("step", "last"),
                       entropy_first=("entropy_of_step", "first"), entropy_last=("entropy_of_step", "last"))
    kl_total, kl_rows_total = picked["kl_total"].iloc[0], picked["kl_rows_total"].iloc[0]
    out = sums.join(ends).reset_index()
    out["covariance_mean"] = out["covariance_sum"] / out["rows"]
    out["kl_share"] = out["kl_sum"] / kl_total if kl_total else float("nan")
    out["kl_vs_mean"] = (out["kl_sum"] / out["kl_rows"]) / (kl_total / kl_rows_total) if kl_total else float("nan")
    out["entropy_mean"] = out["entropy_sum"] / out["rows"]
    out["cov_rate"] = out["cov_rows"] / out["rows"]
    order = "covariance_sum" if ranking == "covariance" else "kl_sum"
    return out.sort_values(order, ascending=False, kind="stable")[columns].reset_index(drop=True)


def covariance_per_step(reader, run: str, first: int, last: int) -> pd.DataFrame:
    """Per step: the summed covariance of its loss tokens (over every token x pass row, divided by the passes per
    token, so a step trained in several epochs counts each token once), the mean covariance (Cui et al.'s
    Cov(log pi, A) of a batch, averaged over the passes), the logged mean entropy at sampling (`steps.entropy`) and
    its change to the next step: Cui et al. find the entropy change tracks -covariance."""
    return _consistent(reader, [run], first, last, 0, lambda splits: reader.sql(
        f"""
        WITH per_rollout AS (
            SELECT step, rollout_id, sum(covariance_sum) AS covariance_sum, sum(n) AS rows,
                   sum(n) / count(*) AS tokens  -- its loss tokens: its rows over the passes that used it
            FROM ({_covariance_sums(splits[run], "rollout_id", "NULL::BIGINT AS rollout_id")})
            GROUP BY step, rollout_id
        ), summarised AS (  -- the same count of the summarised steps (their rows have no rollout_id)
            SELECT step, sum(loss_tokens) AS tokens
            FROM ({_summary_rows("loss_tokens", splits[run], "token_text", "run = $run")}) GROUP BY step
        ), per_step AS (
            SELECT step, sum(covariance_sum) * coalesce(any_value(o.tokens), sum(p.tokens)) / sum(rows)
                   AS covariance_sum, sum(covariance_sum) / sum(rows) AS covariance_mean, sum(rows)::BIGINT AS rows
            FROM per_rollout p LEFT JOIN summarised o USING (step) GROUP BY step
        )
        SELECT c.step, c.covariance_sum, c.covariance_mean, c.rows, s.entropy,
               lead(s.entropy) OVER (ORDER BY c.step) - s.entropy AS entropy_change
        FROM per_step c LEFT JOIN steps s ON s.run = $run AND s.step = c.step ORDER BY c.step
        """,
        {"run": run, "first": first, "last": last}))
