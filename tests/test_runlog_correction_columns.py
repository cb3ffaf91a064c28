"""The token_passes columns `is_weight` and `rejected` (the mismatch corrections), end to end as CONTRIBUTING.md's
"How to add a table column" asks: schema, RunWriter -> Parquet -> RunReader and `policylens sql`, and runs logged
before the columns existed."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from synthetic_runs import write_run_before_columns

from engine.cli import main
from engine.correction_settings import REJECT_NAMES
from engine.runlog import ADDED_COLUMNS, TABLE_SCHEMAS, RunReader, RunWriter

NEW = ["is_weight", "rejected"]


def _passes(n: int, rng: np.random.Generator, corrected: bool = True) -> dict:
    cols = {"pass": np.zeros(n, int), "rollout_id": np.zeros(n, int), "position": np.arange(n),
            "new_logp": -rng.exponential(0.7, n), "ratio": np.ones(n), "clip": np.zeros(n, np.int8),
            "grad_weight": rng.normal(0, 1, n), "token_loss": rng.normal(0, 1, n), "kl": np.full(n, np.nan)}
    if corrected:
        cols["is_weight"] = rng.uniform(0, 2, n)
        cols["rejected"] = rng.integers(0, len(REJECT_NAMES), n).astype(np.int8)
    return cols


def test_the_columns_are_nullable_at_the_end_of_token_passes_and_marked_added():
    fields = TABLE_SCHEMAS["token_passes"]
    assert fields.names[-4:-2] == NEW  # entropy_decile and token_text were added after them
    assert fields.field("is_weight").type == pa.float32() and fields.field("rejected").type == pa.int8()
    assert all(fields.field(name).nullable for name in NEW)
    assert set(NEW) <= set(ADDED_COLUMNS["token_passes"])


def test_they_read_back_through_the_reader_and_the_cli(tmp_path, capsys):
    rng = np.random.default_rng(3)
    steps = {step: _passes(6 + step, rng) for step in (1, 2, 3)}
    with RunWriter.create(tmp_path, "corr", algorithm="grpo", compact_every=2) as writer:
        for step, cols in steps.items():
            writer.log_step(step, metrics={"loss": 0.0}, token_passes=cols)
    with RunReader(tmp_path) as reader:
        for step, cols in steps.items():
            got = reader.sql("SELECT is_weight, rejected FROM token_passes WHERE step = ? ORDER BY position", [step])
            np.testing.assert_array_equal(got.is_weight.to_numpy(), cols["is_weight"].astype(np.float32))
            np.testing.assert_array_equal(got.rejected.to_numpy(), cols["rejected"])
    query = "SELECT count(*) FILTER (WHERE rejected > 0) AS out FROM token_passes WHERE step = 3"
    assert main(["sql", "corr", query, "--logs-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[2].split() == [str(int((steps[3]["rejected"] > 0).sum()))]


def test_a_run_logged_before_the_columns_reads_them_as_null(tmp_path):
    rng = np.random.default_rng(4)
    write_run_before_columns(tmp_path, "old", "token_passes", _passes(5, rng, corrected=False), NEW)
    with RunReader(tmp_path) as reader:
        assert reader.problems == []
        assert reader.rows("SELECT count(*), count(is_weight), count(rejected) FROM token_passes")[1] == [(5, 0, 0)]
