"""`RunWriter.log_stream` (how an import writes): the files of log_step plus every merge, written once; a failure
keeps the whole steps before it (engine/runlog/writer.py)."""

from __future__ import annotations

import pytest
from test_runlog import _files_of, make_step, settled, token_counts

from engine import runlog
from engine.runlog import RunLogError, RunReader, RunWriter, data_dir_of


def _step_data(step: int) -> dict:
    data = make_step(step, rollouts=2 + step % 3)
    data["metrics"].update(wall_time=2.0 * step, step_seconds=2.0)
    return data


def test_log_stream_writes_the_files_of_log_step_and_its_merges_without_merging(tmp_path, monkeypatch):
    monkeypatch.setattr(runlog.files, "_ROW_GROUP_ROWS", 5)  # row groups that straddle steps
    one_by_one = RunWriter.create(tmp_path / "a", "run", compact_every=4)
    for step in range(10):
        one_by_one.log_step(step, **_step_data(step))
    one_by_one.close()
    settled(one_by_one)

    merges = []
    monkeypatch.setattr(runlog.repair, "merge", lambda *args, **kwargs: merges.append(args))
    streamed = RunWriter.create(tmp_path / "b", "run", compact_every=4)
    assert streamed.log_stream((step, _step_data(step)) for step in range(10)) == list(range(10))
    streamed.close()

    assert merges == []  # every row encoded once: nothing merged, not even when closing
    expected, got = _files_of(tmp_path / "a" / "run"), _files_of(tmp_path / "b" / "run")
    assert sorted(got) == sorted(expected)  # chunks 0-3, 4-7 and the closing merge's 8-9
    assert sorted({name.split("/")[0][:25] for name in got}) == [
        "chunk-000000000-000000003", "chunk-000000004-000000007", "chunk-000000008-000000009"]
    for name, content in expected.items():
        assert got[name] == content, name
    with pytest.raises(RunLogError, match="strictly increasing"):
        RunWriter.resume(tmp_path / "b", "run").log_stream([(9, _step_data(9))])


def test_a_failing_stream_keeps_the_steps_it_yielded_and_resumes_after_them(tmp_path):
    def steps_then_damage():
        for step in range(3):
            yield step, _step_data(step)
        raise RuntimeError("a dump the reader cannot go on with")

    writer = RunWriter.create(tmp_path, "run", compact_every=8)
    with pytest.raises(RuntimeError, match="cannot go on"):
        writer.log_stream(steps_then_damage())
    writer.close("crashed")
    assert token_counts(RunReader(tmp_path), "run") == {s: len(_step_data(s)["tokens"]["position"]) for s in range(3)}
    assert not [p for p in data_dir_of(tmp_path / "run").iterdir() if p.name.startswith(".tmp-")]

    resumed = RunWriter.resume(tmp_path, "run", compact_every=8)
    assert resumed.last_step == 2
    assert resumed.log_stream((step, _step_data(step)) for step in range(3, 5)) == [3, 4]
    resumed.close()
    assert sorted(token_counts(RunReader(tmp_path), "run")) == [0, 1, 2, 3, 4]


def test_a_step_that_cannot_be_written_leaves_no_part_of_its_chunk(tmp_path, monkeypatch):
    def broken_add(self, tables):
        raise OSError("disk full")

    writer = RunWriter.create(tmp_path, "run", compact_every=8)
    writer.log_stream((step, _step_data(step)) for step in range(2))  # a whole chunk, kept
    monkeypatch.setattr(runlog.files.FolderWriter, "add_tables", broken_add)
    with pytest.raises(RunLogError, match="disk full"):
        writer.log_stream((step, _step_data(step)) for step in range(2, 5))
    assert writer.last_step == 1
    writer.close("crashed")
    assert sorted(token_counts(RunReader(tmp_path), "run")) == [0, 1]
    assert not [p for p in data_dir_of(tmp_path / "run").iterdir() if p.name.startswith(".tmp-")]
