"""The token summary (engine.runlog.summary): the Token statistics computed from it equal the row-by-row queries,
for runs written with it, runs logged before it (whole or in part), a damaged summary file, and compaction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from synthetic_runs import synthetic_step

from dashboard import token_data
from engine.runlog import RunReader, RunWriter, data_dir_of
from engine.runlog.layout import scan_segments
from engine.runlog.schema import DATA_TABLES, table_rows
from engine.runlog.summary import position_from, position_from_sql, step_summary

BUCKETS = (0, 4, 8, 32, 3)  # 3: not a multiple of the summary's 4 positions, read row by row
WITHOUT_SUMMARY = [t for t in DATA_TABLES if t != "token_summary"]


def _step(step: int, seed: int) -> dict:
    """A synthetic step with eval completions, filtered groups, rejected passes, NaN KLs and NULL advantages."""
    data = synthetic_step(step, groups=3, group_size=4, length=12, passes=2, rng=np.random.default_rng(seed))
    passes, tokens = data["token_passes"], data["tokens"]
    passes["rejected"] = np.where(np.arange(len(passes)) % 7 == 0, 1, 0).astype("int8")
    passes.loc[passes.index % 11 == 0, "kl"] = np.nan
    tokens.loc[tokens.index % 13 == 0, "advantage"] = None
    return data


def _write(logs: Path, name: str, steps: int = 4, compact_every: int = 0) -> None:
    """A run of `steps` synthetic steps, one folder each unless `compact_every` > 0."""
    with RunWriter.create(logs, name, algorithm="grpo", background=False, compact_every=compact_every) as writer:
        for step in range(steps):
            writer.log_step(step, **_step(step, seed=step))


def _statistics(reader, run: str, first: int, last: int) -> dict[str, pd.DataFrame]:
    """Everything the Token statistics page shows, by name."""
    out = {}
    for bucket in BUCKETS:
        out[f"token_stats {bucket}"] = token_data.token_stats(reader, run, first, last, bucket)
        out[f"covariance_drivers {bucket}"] = token_data.covariance_drivers(reader, run, first, last, bucket, 1000)
    for bins in (10, 5, 3):
        out[f"entropy_bins {bins}"] = token_data.entropy_bins(reader, (run,), first, last, bins)
    out["covariance_per_step"] = token_data.covariance_per_step(reader, run, first, last)
    return out


def _assert_same(got: dict[str, pd.DataFrame], want: dict[str, pd.DataFrame]) -> None:
    for name, frame in want.items():
        assert len(frame), name  # something to compare
        pd.testing.assert_frame_equal(got[name], frame, check_dtype=False, rtol=1e-9, atol=1e-12, obj=name)


def _exact(logs: Path, run: str, first: int, last: int) -> dict[str, pd.DataFrame]:
    with RunReader(logs, tables=WITHOUT_SUMMARY) as reader:
        assert reader.steps_without("token_summary", run, ("tokens", "token_passes")) == [(0, 3)]
        return _statistics(reader, run, first, last)


def _delete(logs: Path, run: str, table: str, steps=None) -> None:
    for segment in scan_segments(data_dir_of(logs / run)):
        if steps is None or segment.first in steps:
            (Path(segment.path) / f"{table}.parquet").unlink()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("summary")
    _write(folder, "run")
    return folder


def test_the_summary_alone_gives_every_statistic_of_the_tokens(logs, tmp_path):
    """With the tokens and passes deleted, the statistics still come out, equal to the row-by-row ones (but for
    3 positions or 3 bins: not summarised)."""
    import shutil

    want = {span: {name: frame for name, frame in _exact(logs, "run", *span).items() if not name.endswith(" 3")}
            for span in ((0, 3), (1, 2))}
    shutil.copytree(logs / "run", tmp_path / "run")
    _delete(tmp_path, "run", "tokens")
    _delete(tmp_path, "run", "token_passes")
    with RunReader(tmp_path) as reader:
        assert reader.steps_without("token_summary", "run", ("tokens", "token_passes")) == []
        for span, expected in want.items():
            _assert_same(_statistics(reader, "run", *span), expected)


@pytest.mark.parametrize("unsummarised", [{1, 2}, {0, 1, 2, 3}])
def test_steps_logged_before_the_summary_are_read_row_by_row(logs, tmp_path, unsummarised):
    """A run whose steps lack the summary (all, or some: folders logged before it) gives the same statistics."""
    import shutil

    want = _exact(logs, "run", 0, 3)
    shutil.copytree(logs / "run", tmp_path / "run")
    _delete(tmp_path, "run", "token_summary", unsummarised)
    with RunReader(tmp_path) as reader:
        gaps = reader.steps_without("token_summary", "run", ("tokens", "token_passes"))
        assert {s for a, b in gaps for s in range(a, b + 1)} == unsummarised
        _assert_same(_statistics(reader, "run", 0, 3), want)


def test_a_damaged_summary_file_costs_only_itself(logs, tmp_path):
    import shutil

    want = _exact(logs, "run", 0, 3)
    shutil.copytree(logs / "run", tmp_path / "run")
    damaged = Path(scan_segments(data_dir_of(tmp_path / "run"))[2].path) / "token_summary.parquet"
    damaged.write_bytes(b"PAR1 not a parquet file")
    with RunReader(tmp_path) as reader:
        assert reader.steps_without("token_summary", "run", ("tokens", "token_passes")) == [(2, 2)]
        _assert_same(_statistics(reader, "run", 0, 3), want)
        assert any("token_summary.parquet" in p for p in reader.problems)


def test_compaction_summarises_folders_logged_before_the_summary(tmp_path):
    _write(tmp_path, "run", steps=3)
    _delete(tmp_path, "run", "token_summary")  # the run as an older release wrote it
    with RunWriter.resume(tmp_path, "run", compact_every=1000) as writer:  # its close merges the step folders
        writer.log_step(3, **_step(3, seed=3))
    want = _exact(tmp_path, "run", 0, 3)
    with RunReader(tmp_path) as reader:
        assert [s.is_chunk for s in scan_segments(data_dir_of(tmp_path / "run"))] == [True]
        assert reader.steps_without("token_summary", "run", ("tokens", "token_passes")) == []
        _assert_same(_statistics(reader, "run", 0, 3), want)


def test_positions_from_1024_on_fall_in_doubling_ranges_in_numpy_and_in_sql():
    """Worked by hand: buckets of 4 (and 32) below 1024, then [1024, 2048), [2048, 4096), ..., whatever the bucket."""
    import duckdb

    positions = np.array([0, 3, 4, 1021, 1023, 1024, 1025, 2047, 2048, 4095, 4096, 16383, 16384])
    by_four = [0, 0, 4, 1020, 1020, 1024, 1024, 1024, 2048, 2048, 4096, 8192, 16384]
    by_32 = [0, 0, 0, 992, 992, 1024, 1024, 1024, 2048, 2048, 4096, 8192, 16384]
    assert position_from(positions).tolist() == by_four
    con = duckdb.connect()
    for bucket, want in ((4, by_four), (32, by_32)):
        got = con.execute(f"SELECT {position_from_sql('p', '$b')} FROM unnest($p) AS t(p)",
                          {"p": positions.tolist(), "b": bucket}).fetchall()
        assert [g for (g,) in got] == want
    # a summary row's position_from gives its tokens' bucket: applied to by_four, the same as to the positions
    got = con.execute(f"SELECT {position_from_sql('p', '32')} FROM unnest($p) AS t(p)", {"p": by_four}).fetchall()
    assert [g for (g,) in got] == by_32
    assert con.execute(f"SELECT {position_from_sql('5', '0')}").fetchall() == [(None,)]
    assert token_data.bucket_positions(992, 32) == "992..1023" and token_data.bucket_positions(2048, 32) == "2048..4095"
    assert token_data.bucket_last(pd.Series([0, 992, 1024, 4096]), 32).tolist() == [31, 1023, 2047, 8191]


def test_long_responses_are_summarised_in_doubling_ranges_and_give_the_row_by_row_statistics(tmp_path):
    """Responses of 1,300-2,600 tokens: the summary splits positions from 1024 on in two ranges only, and every
    statistic of the page equals the row-by-row one (which buckets the positions by the same rule)."""
    with RunWriter.create(tmp_path, "long", algorithm="grpo", background=False, compact_every=0) as writer:
        for step in range(2):
            writer.log_step(step, **synthetic_step(step, groups=2, group_size=2, length=2600, passes=2,
                                                   rng=np.random.default_rng(step)))
    with RunReader(tmp_path) as reader:
        split = reader.sql("SELECT DISTINCT position_from FROM token_summary WHERE kind = 'tokens' AND bucket = 4 "
                           "AND position_from >= 1000 ORDER BY 1")["position_from"].tolist()
        assert split == [1000, 1004, 1008, 1012, 1016, 1020, 1024, 2048]
        got = _statistics(reader, "long", 0, 1)
    with RunReader(tmp_path, tables=WITHOUT_SUMMARY) as reader:
        want = _statistics(reader, "long", 0, 1)
    _assert_same(got, want)
    tail = want["token_stats 32"].dropna(subset=["position_from"])
    assert set(tail["position_from"][tail["position_from"] >= 1024]) == {1024, 2048}


def test_summary_rows_of_a_hand_worked_step():
    """Two train rollouts (one filtered out) and an eval one; two passes, one row rejected."""
    rollouts = table_rows("rollouts", {"rollout_id": [0, 1, 2], "kind": ["train", "train", "eval"],
                                       "filtered": [False, True, None]}, "r", 5)
    tokens = table_rows("tokens", {
        "rollout_id": [0, 0, 0, 0, 0, 1, 2], "position": [0, 1, 2, 3, 4, 0, 0],
        "token_text": ["a", "b", "a", "a", "a", "a", "a"], "old_logp": [-1.0, -2.0, -0.5, -1.0, -1.0, -1.0, -3.0],
        "ref_logp": [-1.0] * 7, "advantage": [2.0, 2.0, 2.0, None, 2.0, -1.0, 0.0],
        "entropy": [0.5, 1.5, 0.25, 1.0, 1.0, 2.0, 9.0]}, "r", 5)
    passes = table_rows("token_passes", {
        "pass": [0, 0, 1], "rollout_id": [0, 0, 0], "position": [0, 4, 0], "ratio": [1.0, 2.0, 0.5],
        "new_logp": [-1.0, -1.0 + np.log(2.0), -1.0 + np.log(0.5)], "clip": [0, 2, 4],
        "grad_weight": [0.5, -0.25, 1.0], "rejected": [0, 0, 1], "kl": [0.0, 0.125, 0.0],
        "entropy_decile": [0, 5, 0], "token_text": ["a", "a", "a"]}, "r", 5)
    rows = step_summary(rollouts, tokens, passes).to_pandas()
    tok = rows[(rows.kind == "tokens") & (rows.bucket == 4)].set_index(["token_text", "position_from"])
    # rollouts 0 and 1 are train tokens ("a" at 0, 2, 3 of rollout 0 and at 0 of rollout 1; "b" at 1)
    assert tok.loc[("a", 0), ["rows", "advantage_sum", "advantage_rows", "entropy_sum"]].tolist() == [4, 3.0, 3, 3.75]
    assert tok.loc[("a", 4), "rows"] == 1 and tok.loc[("b", 0), "rows"] == 1
    whole = rows[(rows.kind == "tokens") & (rows.bucket == 0)].set_index("token_text")
    assert whole.loc["a", ["rows", "advantage_rows", "advantage_sum"]].tolist() == [5, 4, 5.0]
    clipped = rows[(rows.kind == "passes") & (rows.bucket == 0)].set_index("clip")
    assert clipped.loc[2, ["rows", "abs_weight", "ratio_dev"]].tolist() == [1, 0.25, 1.0]
    assert clipped.loc[4, ["rows", "abs_weight", "ratio_dev"]].tolist() == [1, 1.0, 0.5]
    loss = rows[(rows.kind == "loss") & (rows.bucket == 0)]
    assert loss[["pass", "rows", "advantage_sum", "kl_sum", "kl_rows", "cov_rows"]].values.tolist() == [
        [0, 2, 4.0, 0.125, 2, 0]]  # the rejected row of pass 1 left out
    assert loss["logp_sum"].iloc[0] == pytest.approx(-2.0 + np.log(2.0))
    assert rows.loc[rows.kind == "loss_tokens", "loss_tokens"].tolist() == [2.0]
    deciles = rows[rows.kind == "deciles"].set_index(["entropy_decile", "clip"])["rows"].to_dict()
    assert deciles == {(0, 0): 1, (0, 4): 1, (5, 2): 1}
    assert step_summary(rollouts, None, None) is None
    assert pa.Table.from_pandas(rows).num_rows == len(rows)


@pytest.mark.parametrize("texts", [20, 5_000])  # few keys: counted in a table; many: hashed
def test_grouped_sums_equal_pandas_whichever_way_the_keys_are_grouped(texts):
    from engine.runlog.summary import _grouped

    rng = np.random.default_rng(texts)
    n = 3_000
    text = pa.array([f"t{i}" for i in rng.integers(0, texts, n)])
    bucket = pa.array(rng.integers(0, 300, n), mask=rng.random(n) < 0.05)  # NULL: a group of its own
    value = pa.array(rng.normal(size=n), mask=rng.random(n) < 0.2)
    got = _grouped({"token_text": text, "position_from": bucket, "value": value}, ["token_text", "position_from"],
                   sums={"value_sum": "value"}, counts={"value_rows": "value"})
    got = pd.DataFrame({"token_text": got["token_text"].to_pylist(), "position_from": got["position_from"].to_pylist(),
                        "rows": got["rows"], "value_sum": got["value_sum"].to_pylist(),
                        "value_rows": got["value_rows"]})
    frame = pd.DataFrame({"token_text": text.to_pylist(), "position_from": bucket.to_pylist(),
                          "value": value.to_pylist()})
    want = frame.groupby(["token_text", "position_from"], dropna=False).agg(
        rows=("value", "size"), value_sum=("value", lambda v: v.sum(min_count=1)), value_rows=("value", "count"))
    got = got.set_index(["token_text", "position_from"]).sort_index()
    assert len(got) == len(want) and got.index.is_unique
    pd.testing.assert_frame_equal(got[["rows", "value_rows"]].astype("int64"),
                                  want.sort_index()[["rows", "value_rows"]].astype("int64"), check_names=False)
    np.testing.assert_allclose(got["value_sum"].astype(float).to_numpy(), want.sort_index()["value_sum"].to_numpy())
