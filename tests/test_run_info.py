"""run.json as `RunInfo` (engine/runlog/layout.py): the algorithm stored once, run.json files of earlier releases
(which stored it twice) read the same way, keys this release does not know kept."""

from __future__ import annotations

import json

import pytest

from engine.config import TrainConfig
from engine.runlog import RunInfo, RunLogError, RunReader, RunWriter, list_runs


def _run_json(logs, name) -> dict:
    return json.loads((logs / name / "run.json").read_text())


def test_a_new_run_stores_the_algorithm_once_and_resumes_with_it(tmp_path):
    cfg = TrainConfig(algo="dapo", steps=3)
    RunWriter.create(tmp_path, "r", algorithm=cfg.algo, task=cfg.task, config=cfg.to_dict()).close()
    meta = _run_json(tmp_path, "r")
    assert meta["algorithm"] == "dapo" and "algo" not in meta["config"]
    info = RunInfo.read(tmp_path / "r")
    assert TrainConfig.from_dict(info.train_config()) == cfg  # what `policylens train --resume` rebuilds
    assert list_runs(tmp_path)[0]["algorithm"] == "dapo"


def test_a_run_json_of_the_previous_release_with_the_algorithm_twice(tmp_path):
    RunWriter.create(tmp_path, "old", config={}).close()
    meta = _run_json(tmp_path, "old")
    cfg = TrainConfig(algo="gspo").to_dict()
    # as earlier releases wrote it: `algorithm` and `config.algo`, plus a key this release does not know
    meta.update(algorithm="gspo", config=cfg, comment="kept")
    (tmp_path / "old" / "run.json").write_text(json.dumps(meta))

    info = RunInfo.read(tmp_path / "old")
    assert info.algorithm == "gspo" and "algo" not in info.config
    assert info.train_config() == cfg
    with RunReader(tmp_path) as reader:
        row = reader.sql("SELECT algorithm, config FROM runs")
    assert row.algorithm.tolist() == ["gspo"] and "algo" not in json.loads(row.config[0])
    RunWriter.resume(tmp_path, "old").close()  # rewritten by this release: once, the unknown key kept
    meta = _run_json(tmp_path, "old")
    assert meta["algorithm"] == "gspo" and "algo" not in meta["config"] and meta["comment"] == "kept"


def test_a_run_json_with_the_algorithm_only_in_its_config_names_it(tmp_path):
    RunWriter.create(tmp_path, "bare", config={"algo": "cispo", "lr": 1e-6}).close()  # no `algorithm` given
    info = RunInfo.read(tmp_path / "bare")
    assert (info.algorithm, info.config) == ("cispo", {"lr": 1e-6})
    meta = _run_json(tmp_path, "bare")
    meta.pop("algorithm")
    (tmp_path / "bare" / "run.json").write_text(json.dumps(meta))
    info = RunInfo.read(tmp_path / "bare")
    assert (info.algorithm, info.config) == ("cispo", {"lr": 1e-6})


def test_a_config_algorithm_that_differs_is_not_dropped(tmp_path):
    RunWriter.create(tmp_path, "odd", algorithm="grpo", config={"algo": "dapo"}).close()
    assert _run_json(tmp_path, "odd")["config"] == {"algo": "dapo"}


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "damaged run.json"),
    ('{"config": {}}', "not a PolicyLens run.json"),
    ('{"schema_version": 99}', "newer than this PolicyLens understands"),
])
def test_unreadable_run_json_is_a_clear_error(tmp_path, text, message):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.json").write_text(text)
    with pytest.raises(RunLogError, match=message):
        RunInfo.read(tmp_path / "bad")
