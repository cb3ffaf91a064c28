"""The tokens columns `sampler_logp` and `sampler_logp_full`, end to end: the check of CONTRIBUTING.md's "How to add
a table column" (schema -> row builder -> RunWriter -> Parquet -> RunReader -> `policylens sql` / export), and runs
logged before the columns existed."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
from synthetic_runs import write_run_before_columns

from engine.cli import main
from engine.runlog import (
    ADDED_COLUMNS,
    FILE_SCHEMAS,
    TABLE_SCHEMAS,
    RunLogError,
    RunReader,
    RunWriter,
    data_dir_of,
    table_rows,
)

NEW = ["sampler_logp", "sampler_logp_full"]


def _tokens(n: int, rng: np.random.Generator, sampler: bool = True) -> dict:
    old_logp = -rng.exponential(0.7, n)  # (n,)
    cols = {"rollout_id": np.zeros(n, int), "position": np.arange(n), "old_logp": old_logp}
    if sampler:
        # a sampler that truncated with top-p renormalises: its log-prob is >= the untruncated one
        cols["sampler_logp_full"] = old_logp + rng.normal(0, 0.01, n)
        cols["sampler_logp"] = np.minimum(cols["sampler_logp_full"] + rng.uniform(0, 0.2, n), 0.0)
    return cols


def test_the_columns_are_in_the_schema_as_nullable_floats_and_marked_added():
    fields = {f.name: f for f in TABLE_SCHEMAS["tokens"]}
    for name in NEW:
        assert str(fields[name].type) == "float" and fields[name].nullable  # float32, read as DOUBLE
        assert name in ADDED_COLUMNS["tokens"]


def test_a_step_with_sampler_logps_reads_back_through_reader_sql_and_export(tmp_path, capsys):
    rng = np.random.default_rng(7)
    steps = {step: _tokens(5 + step, rng) for step in range(3)}
    with RunWriter.create(tmp_path, "mismatch", algorithm="grpo", compact_every=2) as writer:
        for step, cols in steps.items():  # step 0 and 1 are compacted into a chunk, step 2 merged on close
            writer.log_step(step, metrics={"loss": 0.0}, tokens=cols)
    with RunReader(tmp_path) as reader:
        assert reader.problems == []
        for step, cols in steps.items():
            got = reader.sql("SELECT position, old_logp, sampler_logp, sampler_logp_full FROM tokens "
                             "WHERE step = ? ORDER BY position", [step])
            assert got.position.tolist() == list(range(len(cols["position"])))
            for name in ["old_logp", *NEW]:
                # stored exactly as their float32 rounding
                np.testing.assert_array_equal(got[name].to_numpy(), cols[name].astype(np.float32))
        exported = reader.export(tmp_path / "run.duckdb")
    with duckdb.connect(str(exported), read_only=True) as con:
        assert con.execute("SELECT count(sampler_logp), count(sampler_logp_full) FROM tokens").fetchone() == (
            sum(len(c["position"]) for c in steps.values()),) * 2

    # The CLI prints what the reader reads: step 2's largest sampler/trainer gap (in micro-nats, an integer: the
    # CLI shows floats to 4 digits) and how many of its tokens the sampler found more likely than the trainer.
    gap = np.abs(steps[2]["sampler_logp"] - steps[2]["old_logp"])
    query = ("SELECT round(max(abs(sampler_logp - old_logp)) * 1e6)::BIGINT AS gap_micro, "
             "count(*) FILTER (WHERE sampler_logp > old_logp) AS above FROM tokens WHERE step = 2")
    assert main(["sql", "mismatch", query, "--logs-dir", str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    above = int((steps[2]["sampler_logp"] > steps[2]["old_logp"]).sum())
    assert row == [str(round(float(gap.max()) * 1e6)), str(above)]


def test_the_row_builder_fills_missing_columns_with_null_and_refuses_a_misspelt_one():
    rows = table_rows("tokens", _tokens(3, np.random.default_rng(0), sampler=False), "r", 4)
    assert rows.column("sampler_logp").null_count == 3 and rows.column("step").to_pylist() == [4] * 3
    with pytest.raises(RunLogError, match=r"tokens: unknown column\(s\) \['sampler_logprob'\]"):
        table_rows("tokens", {"rollout_id": [0], "position": [0], "sampler_logprob": [-0.1]}, "r", 0)
    with pytest.raises(RunLogError, match=r"tokens.sampler_logp: cannot store string as float"):
        table_rows("tokens", {"rollout_id": [0], "position": [0], "sampler_logp": ["high"]}, "r", 0)


def test_a_run_logged_before_the_columns_reads_them_as_null_and_compacts_into_the_new_schema(tmp_path):
    rng = np.random.default_rng(1)
    write_run_before_columns(tmp_path, "old", "tokens", _tokens(4, rng, sampler=False), NEW)
    with RunReader(tmp_path) as reader:
        assert reader.problems == []
        assert reader.rows("SELECT count(*), count(sampler_logp), count(sampler_logp_full) FROM tokens")[1] == [
            (4, 0, 0)]
    # Resumed with the new columns: the old file and the new one merge into one chunk of the current schema.
    fresh = _tokens(2, rng)
    writer = RunWriter.resume(tmp_path, "old", background=False, compact_every=2)
    writer.log_step(2, tokens=fresh)
    writer.close()
    (chunk,) = data_dir_of(tmp_path / "old").glob("chunk-*/tokens.parquet")
    assert pq.read_schema(chunk).remove_metadata().equals(FILE_SCHEMAS["tokens"])
    with RunReader(tmp_path) as reader:
        got = reader.sql("SELECT step, sampler_logp FROM tokens ORDER BY step, position")
    assert got.step.tolist() == [1] * 4 + [2] * 2
    assert got.sampler_logp.isna().tolist() == [True] * 4 + [False] * 2
    np.testing.assert_array_equal(got.sampler_logp.to_numpy()[4:], fresh["sampler_logp"].astype(np.float32))
