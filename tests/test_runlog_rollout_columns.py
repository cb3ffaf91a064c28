"""The rollouts columns `rank` and `reward_components`, and runs written before they existed."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from engine.runlog import TABLE_SCHEMAS, RunReader, RunWriter, data_dir_of


def _rollouts(ids, rank=None, components=None):
    cols = {"rollout_id": ids, "group_id": [0] * len(ids), "reward": [1.0] * len(ids), "completion": ["x"] * len(ids)}
    if rank is not None:
        cols["rank"] = [rank] * len(ids)
    if components is not None:
        cols["reward_components"] = [json.dumps(c) for c in components]
    return cols


def test_two_ranks_log_their_rollouts_with_rank_and_reward_components(tmp_path):
    w0 = RunWriter.create(tmp_path, "r", background=False)
    w1 = RunWriter.create(tmp_path, "r", rank=1, background=False)
    w0.log_step(1, rollouts=_rollouts([0, 1], 0, [{"acc": 1.0, "fmt": 0.5}] * 2))
    w1.log_step(1, rollouts=_rollouts([2, 3], 1, [{"acc": 0.0, "fmt": 0.5}] * 2))
    w1.close()
    w0.close()
    with RunReader(tmp_path) as reader:
        got = reader.rows("SELECT rollout_id, rank, json_extract(reward_components, '$.acc')::DOUBLE "
                          "FROM rollouts ORDER BY rollout_id")[1]
    assert got == [(0, 0, 1.0), (1, 0, 1.0), (2, 1, 0.0), (3, 1, 0.0)]


def test_a_run_written_before_the_new_columns_is_read_and_compacted(tmp_path):
    writer = RunWriter.create(tmp_path, "old", background=False, compact_every=1000)
    writer.log_step(1, rollouts=_rollouts([0, 1]))
    writer.close()
    # Rewrite the step's rollouts file as an older version of PolicyLens wrote it: without the two columns.
    (path,) = data_dir_of(tmp_path / "old").glob("step-*/rollouts.parquet")
    table = pq.read_table(path).drop_columns(["rank", "reward_components"])
    assert "rank" not in table.column_names
    pq.write_table(table, path)

    with RunReader(tmp_path) as reader:
        assert reader.problems == []
        assert reader.rows("SELECT rollout_id, rank, reward_components FROM rollouts ORDER BY 1")[1] == [
            (0, None, None), (1, None, None)]

    # Resuming and compacting merges the old file with new ones into the current schema.
    writer = RunWriter.resume(tmp_path, "old", background=False, compact_every=2)
    writer.log_step(2, rollouts=_rollouts([5], rank=0, components=[{"acc": 1.0}]))
    writer.close()
    chunks = list(data_dir_of(tmp_path / "old").glob("chunk-*/rollouts.parquet"))
    assert len(chunks) == 1
    assert pq.read_schema(chunks[0]).remove_metadata().equals(TABLE_SCHEMAS["rollouts"])
    with RunReader(tmp_path) as reader:
        assert reader.rows("SELECT rollout_id, rank FROM rollouts ORDER BY 1")[1] == [(0, None), (1, None), (5, 0)]


def test_a_rollouts_file_with_other_columns_is_still_refused(tmp_path):
    writer = RunWriter.create(tmp_path, "foreign", background=False)
    writer.log_step(1, rollouts=_rollouts([0]))
    writer.close()
    (path,) = data_dir_of(tmp_path / "foreign").glob("step-*/rollouts.parquet")
    pq.write_table(pa.table({"rollout_id": [0], "surprise": ["x"]}), path)
    with RunReader(tmp_path) as reader:
        assert any("not a rollouts file" in p for p in reader.problems)
        assert reader.rows("SELECT count(*) FROM rollouts")[1] == [(0,)]
