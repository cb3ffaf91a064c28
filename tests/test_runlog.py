"""Run log (engine/runlog/): schema, atomic steps, compaction, resume, bad files, hostile names, export.

Processes (read-while-write, SIGKILL) are in test_runlog_process.py, the CLI in test_runlog_cli.py.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from engine import runlog
from engine.runlog import (
    DATA_TABLES,
    SCHEMA_VERSION,
    TABLE_SCHEMAS,
    RunLogError,
    RunReader,
    RunWriter,
    data_dir_of,
    list_runs,
    validate_run_name,
)


def make_step(step: int, rollouts: int = 3, length: int = 4, passes: int = 2, prm: bool = False) -> dict:
    """A small but complete step: every table, known row counts (rollouts * length tokens)."""
    rid = np.repeat(np.arange(rollouts), length)  # (N*T,)
    pos = np.tile(np.arange(length), rollouts)
    out = {
        "metrics": {"reward_mean": 0.1 * step, "heldout_accuracy": 0.5 if step % 2 == 0 else None, "custom": step},
        "rollouts": pd.DataFrame({
            "rollout_id": np.arange(rollouts), "group_id": np.zeros(rollouts, int), "kind": ["train"] * rollouts,
            "prompt": ["1+1="] * rollouts, "completion": ["2"] * rollouts, "reward": np.ones(rollouts),
            "truncated": [False] * rollouts, "seq_ratio": [[1.0, 1.0 + step]] * rollouts,
        }),
        "tokens": {"rollout_id": rid, "position": pos, "token_text": [f"t{p}" for p in pos],
                   "old_logp": -np.ones(len(rid)), "prm_step": np.zeros(len(rid), int)},
        "token_passes": {"pass": np.repeat(np.arange(passes), len(rid)), "rollout_id": np.tile(rid, passes),
                         "position": np.tile(pos, passes), "ratio": np.ones(len(rid) * passes),
                         "clip": np.zeros(len(rid) * passes, np.int8)},
    }
    if prm:
        out["prm_steps"] = {"rollout_id": np.arange(rollouts), "step_index": np.zeros(rollouts, int),
                            "first_pos": np.zeros(rollouts, int), "last_pos": np.full(rollouts, length - 1),
                            "text": ["a"] * rollouts, "reward_raw": np.ones(rollouts)}
    return out


def write_run(logs: Path, name: str, steps: int, close: str | None = "finished", **kwargs) -> RunWriter:
    writer = RunWriter.create(logs, name, algorithm="grpo", task="arith", config={"lr": 1e-6, "g": 4},
                              model="tiny", **kwargs)
    for step in range(steps):
        writer.log_step(step, **make_step(step))
    if close:
        writer.close(close)
    return writer


def settled(writer: RunWriter) -> None:
    """Wait until the folders that `writer`'s last merges replaced are deleted (a thread does it after `close`)."""
    if writer._deleter is not None:
        writer._deleter.join()


def step_dir(data: Path, step: int, rank: int = 0) -> Path:
    [path] = data.glob(f"step-{step:09d}.rank{rank}.s*")
    return path


def token_counts(reader: RunReader, run: str) -> dict[int, int]:
    df = reader.sql("SELECT step, count(*) AS n FROM tokens WHERE run = ? GROUP BY step ORDER BY step", [run])
    return dict(zip(df.step.tolist(), df.n.tolist(), strict=True))


# ---------------------------------------------------------------- schema and round trip


def test_round_trip_all_tables_and_types(tmp_path):
    write_run(tmp_path, "a", 3)
    r = RunReader(tmp_path)
    runs = r.sql("SELECT * FROM runs")
    assert runs.loc[0, "run"] == "a" and runs.loc[0, "status"] == "finished" and runs.loc[0, "last_step"] == 2
    assert json.loads(runs.loc[0, "config"]) == {"lr": 1e-6, "g": 4}
    assert list(runs.columns) == ["run", "run_id", "algorithm", "task", "created_at", "updated_at", "status",
                                  "config", "model", "last_step"]
    steps = r.sql("SELECT * FROM steps ORDER BY step")
    assert steps.step.tolist() == [0, 1, 2]
    assert steps.heldout_accuracy.isna().tolist() == [False, True, False]
    assert json.loads(steps.extra[2]) == {"custom": 2}
    assert (steps.wall_time.diff().dropna() >= 0).all()
    assert token_counts(r, "a") == {0: 12, 1: 12, 2: 12}
    assert r.sql("SELECT count(*) AS n FROM token_passes").n[0] == 3 * 24
    ratio = r.sql("SELECT seq_ratio FROM rollouts WHERE step = 2 LIMIT 1").seq_ratio[0]
    assert list(ratio) == [1.0, 3.0]
    types = dict(r.rows("SELECT column_name, column_type FROM (DESCRIBE token_passes)")[1])
    assert types["clip"] == "TINYINT" and types["pass"] == "BIGINT" and types["ratio"] == "DOUBLE"
    for table in DATA_TABLES:  # every view has exactly the contract's columns
        assert list(r.sql(f"SELECT * FROM {table} LIMIT 0").columns) == TABLE_SCHEMAS[table].names


def test_empty_run_and_missing_tables_give_empty_views_with_columns(tmp_path):
    RunWriter.create(tmp_path, "empty").close()
    r = RunReader(tmp_path)
    for table in DATA_TABLES:
        df = r.sql(f"SELECT * FROM {table} WHERE run = ?", ["empty"])
        assert list(df.columns) == TABLE_SCHEMAS[table].names
    assert r.sql("SELECT count(*) AS n FROM prm_steps").n[0] == 0
    assert RunReader(tmp_path / "no-such-logs-dir").sql("SELECT count(*) AS n FROM runs").n[0] == 0


def test_unknown_column_and_bad_type_are_clear_errors(tmp_path):
    w = RunWriter.create(tmp_path, "a", background=False)
    with pytest.raises(RunLogError, match=r"tokens: unknown column\(s\) \['logp'\]"):
        w.log_step(0, tokens={"rollout_id": [0], "logp": [0.1]})
    with pytest.raises(RunLogError, match=r"tokens\.position"):
        w.log_step(0, tokens={"rollout_id": [0], "position": ["first"]})
    with pytest.raises(RunLogError, match="tokens: cannot convert the columns"):
        w.log_step(0, tokens={"rollout_id": [0, 1], "position": [0]})
    w.log_step(0, metrics={"loss": 1.0})
    with pytest.raises(RunLogError, match="not after the last logged step 0"):
        w.log_step(0)
    w.close()


def test_torch_tensors_are_accepted(tmp_path):
    torch = pytest.importorskip("torch")
    with RunWriter.create(tmp_path, "t") as w:
        w.log_step(0, metrics={"loss": torch.tensor(0.5)},
                   tokens={"rollout_id": torch.zeros(3, dtype=torch.long), "position": torch.arange(3),
                           "old_logp": torch.tensor([-1.0, -2.0, -3.0])})
    df = RunReader(tmp_path).sql("SELECT old_logp FROM tokens ORDER BY position")
    assert df.old_logp.tolist() == [-1.0, -2.0, -3.0]


def test_compaction_keeps_every_row_once_and_bounds_folders(tmp_path):
    w = write_run(tmp_path, "c", 0, close=None, compact_every=2)
    for step in range(21):
        w.log_step(step, **make_step(step))
    w.flush()
    folders = sorted(os.listdir(data_dir_of(tmp_path / "c")))
    assert any(f.startswith("chunk-") for f in folders)
    r = RunReader(tmp_path)
    assert token_counts(r, "c") == {s: 12 for s in range(21)}
    w.close()
    settled(w)
    # 21 steps, chunks of 2 merged 8 at a time: one 16-step chunk, two 2-step chunks, the last step alone
    folders = sorted(os.listdir(data_dir_of(tmp_path / "c")))
    assert len(folders) == 4 and folders[0].startswith("chunk-000000000-000000015-"), folders
    assert token_counts(r, "c") == {s: 12 for s in range(21)}
    assert r.sql("SELECT count(*) AS n FROM steps").n[0] == 21
    # a chunk file is sorted so one rollout's rows sit together
    chunk = data_dir_of(tmp_path / "c") / folders[0] / "tokens.parquet"
    df = pq.read_table(chunk, columns=["step", "rollout_id", "position"]).to_pandas()
    assert len(df) == 16 * 12 and df.equals(df.sort_values(["step", "rollout_id", "position"]).reset_index(drop=True))


# ---------------------------------------------------------------- status, resume, ranks


def test_status_running_crashed_and_context_manager(tmp_path):
    w = write_run(tmp_path, "live", 2, close=None)
    assert [r["status"] for r in list_runs(tmp_path)] == ["running"]
    w._lock.release()  # what the kernel does when the writer dies
    assert [r["status"] for r in list_runs(tmp_path)] == ["crashed"]
    with pytest.raises(ValueError), RunWriter.create(tmp_path, "boom"):
        raise ValueError
    with pytest.raises(KeyboardInterrupt), RunWriter.create(tmp_path, "ctrl-c"):
        raise KeyboardInterrupt
    statuses = {r["run"]: r["status"] for r in list_runs(tmp_path)}
    assert statuses == {"live": "crashed", "boom": "crashed", "ctrl-c": "stopped"}


def test_create_twice_and_second_writer_are_refused(tmp_path):
    w = write_run(tmp_path, "a", 1, close=None)
    with pytest.raises(RunLogError, match="already exists"):
        RunWriter.create(tmp_path, "a")
    with pytest.raises(RunLogError, match="being written by another process"):
        RunWriter.resume(tmp_path, "a")
    w.close()


def test_resume_continues_numbering(tmp_path):
    write_run(tmp_path, "a", 3, close="crashed")
    w = RunWriter.resume(tmp_path, "a")
    assert w.last_step == 2
    with pytest.raises(RunLogError, match="truncate_after"):
        w.log_step(2, **make_step(2))
    w.log_step(3, **make_step(3))
    w.close()
    r = RunReader(tmp_path)
    assert token_counts(r, "a") == {0: 12, 1: 12, 2: 12, 3: 12}
    assert r.sql("SELECT status, last_step FROM runs").values.tolist() == [["finished", 3]]


@pytest.mark.parametrize("compact_every", [0, 4])
def test_resume_truncate_after_replaces_steps_without_duplicates(tmp_path, compact_every):
    write_run(tmp_path, "a", 11, compact_every=compact_every)  # with 4: chunks 0-3, 4-7, steps 8-10
    reader = RunReader(tmp_path)  # a long-lived reader (the dashboard) must not serve the replaced rows
    assert token_counts(reader, "a") == {s: 12 for s in range(11)}
    w = RunWriter.resume(tmp_path, "a", truncate_after=5, compact_every=compact_every)
    assert w.last_step == 5
    for step in range(6, 9):
        w.log_step(step, **make_step(step, rollouts=1))  # 4 tokens instead of 12: tells old from new rows
    w.close()
    expected = {**{s: 12 for s in range(6)}, 6: 4, 7: 4, 8: 4}
    assert token_counts(reader, "a") == expected
    assert token_counts(RunReader(tmp_path), "a") == expected


def test_two_ranks_write_one_run(tmp_path):
    w0 = RunWriter.create(tmp_path, "ddp", rank=0, compact_every=3)
    w1 = RunWriter.create(tmp_path, "ddp", rank=1, compact_every=3)
    for step in range(7):
        w0.log_step(step, **make_step(step))
        part = make_step(step)
        part["tokens"]["rollout_id"] = part["tokens"]["rollout_id"] + 100  # ids unique across ranks
        w1.log_step(step, tokens=part["tokens"])
    w1.close()
    w0.close()
    r = RunReader(tmp_path)
    assert token_counts(r, "ddp") == {s: 24 for s in range(7)}
    assert r.sql("SELECT count(*) AS n FROM steps").n[0] == 7  # rank 1 logged no metrics
    assert r.sql("SELECT status FROM runs").status[0] == "finished"


# ---------------------------------------------------------------- damaged, foreign, newer, missing


def test_bad_files_are_skipped_and_reported(tmp_path):
    write_run(tmp_path, "good", 2)
    write_run(tmp_path, "bad", 4, compact_every=0)
    data = data_dir_of(tmp_path / "bad")
    (step_dir(data, 1) / "tokens.parquet").write_bytes(b"garbage, not parquet")
    step2 = step_dir(data, 2) / "tokens.parquet"
    step2.write_bytes(step2.read_bytes()[: step2.stat().st_size // 2])  # truncated
    (step_dir(data, 3) / "notes.txt").write_text("hello")  # foreign file
    (data / "README").write_text("foreign entry")
    pd.DataFrame({"x": [1]}).to_parquet(step_dir(data, 3) / "rollouts.parquet")  # foreign schema
    r = RunReader(tmp_path)
    assert token_counts(r, "good") == {0: 12, 1: 12}
    assert token_counts(r, "bad") == {0: 12, 3: 12}
    assert r.sql("SELECT count(*) AS n FROM rollouts WHERE run = 'bad'").n[0] == 3 * 3
    text = "\n".join(r.problems)
    for name in [f"{step_dir(data, 1).name}/tokens.parquet", f"{step_dir(data, 2).name}/tokens.parquet",
                 "notes.txt", "README", f"{step_dir(data, 3).name}/rollouts.parquet"]:
        assert name in text, (name, text)
    assert "damaged or not a Parquet file" in text


def test_corrupt_page_inside_valid_footer_is_quarantined_at_query_time(tmp_path):
    write_run(tmp_path, "a", 2, compact_every=0)
    path = step_dir(data_dir_of(tmp_path / "a"), 1) / "tokens.parquet"
    blob = bytearray(path.read_bytes())
    for i in range(4, len(blob) // 2):  # scramble data pages, keep the footer
        blob[i] ^= 0x5A
    path.write_bytes(bytes(blob))
    r = RunReader(tmp_path)
    try:
        counts = token_counts(r, "a")
    except duckdb.Error as err:  # pragma: no cover - only if the damage cannot be pinned on a file
        pytest.fail(f"query failed instead of skipping the damaged file: {err}")
    assert counts[0] == 12
    assert any("tokens.parquet" in p for p in r.problems)


def test_newer_schema_damaged_run_json_and_missing_run(tmp_path):
    write_run(tmp_path, "ok", 1)
    write_run(tmp_path, "future", 1)
    meta = json.loads((tmp_path / "future" / "run.json").read_text())
    meta["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "future" / "run.json").write_text(json.dumps(meta))
    write_run(tmp_path, "broken", 1)
    (tmp_path / "broken" / "run.json").write_text("{not json")
    (tmp_path / "stray-folder").mkdir()
    r = RunReader(tmp_path)
    assert r.sql("SELECT run FROM runs").run.tolist() == ["ok"]
    assert token_counts(r, "ok") == {0: 12}
    text = "\n".join(r.problems)
    assert "'future' was written with run-log schema version 2" in text
    assert "broken/run.json: damaged run.json" in text
    assert "stray-folder" in text
    with pytest.raises(RunLogError, match="newer than this PolicyLens"):
        RunReader(tmp_path, runs="future")
    with pytest.raises(RunLogError, match=r"damaged run\.json"):
        RunWriter.resume(tmp_path, "broken")
    with pytest.raises(RunLogError, match="no run named 'nope'"):
        RunReader(tmp_path, runs=["nope"])
    with pytest.raises(RunLogError, match="no run named 'nope'"):
        RunWriter.resume(tmp_path, "nope")
    assert [r["run"] for r in list_runs(tmp_path)] == ["ok"]


def scramble_data_pages(path: Path) -> None:
    """Flip every byte between the magic number and the footer: the footer (schema, row counts, statistics)
    still reads fine, so only a query that decodes the pages can tell."""
    blob = bytearray(path.read_bytes())
    footer_start = len(blob) - 8 - int.from_bytes(blob[-8:-4], "little")
    for i in range(4, footer_start):
        blob[i] ^= 0x5A
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("table", ["steps", "rollouts", "tokens", "token_passes"])
@pytest.mark.parametrize("damaged_when", ["before the reader opens", "while the reader is open"])
def test_corrupt_data_pages_cost_only_that_file(tmp_path, table, damaged_when):
    write_run(tmp_path, "good", 2)
    write_run(tmp_path, "bad", 3, compact_every=0)
    victim = step_dir(data_dir_of(tmp_path / "bad"), 1) / f"{table}.parquet"
    if damaged_when == "before the reader opens":
        scramble_data_pages(victim)
    r = RunReader(tmp_path)
    if damaged_when == "while the reader is open":
        assert len(r.sql(f"SELECT * FROM {table}")) > 0  # the file was checked and read once already
        scramble_data_pages(victim)
    full = {"steps": 1, "rollouts": 3, "tokens": 12, "token_passes": 24}[table]
    # Another run's rows, and the other steps of the damaged run, are all still there.
    counts = r.sql(f"SELECT run, step, count(*) AS n FROM {table} GROUP BY ALL ORDER BY ALL")
    assert list(counts.itertuples(index=False, name=None)) == [
        ("bad", 0, full), ("bad", 2, full), ("good", 0, full), ("good", 1, full)]
    assert r.sql(f"SELECT count(*) AS n FROM {table} WHERE run = 'good'").n[0] == 2 * full
    [problem] = [p for p in r.problems if str(victim) in p]
    assert "damaged" in problem and "skipped" in problem
    overview = r.runs_overview()
    assert overview.run.tolist() == ["good", "bad"]


def test_queries_that_fail_for_the_query_s_own_reasons_are_not_blamed_on_files(tmp_path):
    write_run(tmp_path, "a", 2)
    r = RunReader(tmp_path)
    with pytest.raises(duckdb.Error):
        r.sql("SELECT CAST(token_text AS INTEGER) FROM tokens")
    with pytest.raises(duckdb.Error):
        r.sql("SELECT nope FROM tokens")
    assert r.problems == []
    assert token_counts(r, "a") == {0: 12, 1: 12}


@pytest.mark.parametrize("where", ["step folder", "chunk folder", "run=X folder", "data folder"])
def test_a_regular_file_where_a_folder_belongs_is_skipped(tmp_path, where):
    write_run(tmp_path, "good", 2)
    write_run(tmp_path, "bad", 3, compact_every=0)
    data = data_dir_of(tmp_path / "bad")
    if where == "step folder":
        shutil.rmtree(step_dir(data, 1))
        stray = data / "step-000000001.rank0.s1"
        expected = {0: 12, 2: 12}
    elif where == "chunk folder":
        stray = data / "chunk-000000000-000000009-000000.rank0"  # would win over the step folders if read
        expected = {0: 12, 1: 12, 2: 12}
    elif where == "run=X folder":
        shutil.rmtree(data)
        stray = data
        expected = {}
    else:
        shutil.rmtree(data.parent)
        stray = data.parent
        expected = {}
    stray.write_text("not a folder")
    r = RunReader(tmp_path)
    assert token_counts(r, "good") == {0: 12, 1: 12}
    assert token_counts(r, "bad") == expected
    assert any(str(stray) in p and "not a folder" in p for p in r.problems), r.problems
    assert token_counts(RunReader(tmp_path, runs="bad"), "bad") == expected
    assert [info["run"] for info in list_runs(tmp_path)] == ["good", "bad"]
    if where == "chunk folder":
        w = RunWriter.resume(tmp_path, "bad", compact_every=2)  # the writer's scan ignores it too
        w.log_step(3, **make_step(3))
        w.close()
        assert token_counts(RunReader(tmp_path), "bad") == {s: 12 for s in range(4)}


def test_a_logs_dir_that_is_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "logs").write_text("")
    for read in (lambda: RunReader(tmp_path / "logs"), lambda: RunReader(tmp_path / "logs", runs="a"),
                 lambda: list_runs(tmp_path / "logs")):
        with pytest.raises(RunLogError, match="is not a folder"):
            read()


def test_readers_and_list_runs_agree_on_which_folders_are_runs(tmp_path):
    logs = tmp_path / "logs"
    write_run(logs, "ok", 1)
    write_run(tmp_path, "elsewhere", 1)
    (logs / "link").symlink_to(tmp_path / "elsewhere")  # a run folder outside the logs folder
    odd_names = ["a..b", "con", "name.", "nl\n"]  # left by a hand or an older version; not accepted now
    for odd in odd_names:
        shutil.copytree(logs / "ok", logs / odd)
    problems: list[str] = []
    assert [info["run"] for info in list_runs(logs, problems)] == ["ok"]
    r = RunReader(logs)
    assert r.run_names() == ["ok"]
    assert token_counts(r, "ok") == {0: 12}
    assert sorted(problems) == sorted(r.problems)
    for name in [*odd_names, "link"]:
        assert sum(str(logs / name).replace("\n", "\\n") in p for p in problems) == 1, (name, problems)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "../x", "a/../../etc", "/etc/passwd", "a/b", "a\\b", "..\\x", ".hidden", "-rf", "a..b",
     "x" * 101, "name.", "a b", "C:\\x", "con", "NUL.txt", "run\x00", "tab\t", "é", "~root", "$HOME", "a*",
     "run\n", "run\r\n", "\nrun"],
)
def test_hostile_run_names_are_refused(tmp_path, name):
    with pytest.raises(RunLogError, match="letters, digits"):
        validate_run_name(name, tmp_path)
    with pytest.raises(RunLogError):
        RunWriter.create(tmp_path, name)
    with pytest.raises(RunLogError):
        RunReader(tmp_path, runs=name)
    assert not any(p.name != name for p in tmp_path.iterdir())  # nothing created anywhere


@pytest.mark.parametrize("name", ["a", "grpo-run_1.2", "R2D2", "x" * 100, "2026-01-01.dapo"])
def test_ordinary_run_names_are_accepted(tmp_path, name):
    assert validate_run_name(name, tmp_path) == name


def test_symlink_out_of_logs_dir_is_refused(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "logs" / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(RunLogError, match="outside the logs folder"):
        validate_run_name("link", tmp_path / "logs")


# ---------------------------------------------------------------- read-only SQL


@pytest.mark.parametrize(
    "attack",
    [
        "COPY (SELECT * FROM tokens) TO '{outside}/copy.csv'",
        "COPY (SELECT * FROM tokens) TO '{run_dir}/data/copy.parquet'",  # inside the run's own folder
        "EXPORT DATABASE '{run_dir}/export'",
        "EXPLAIN ANALYZE COPY (SELECT 1) TO '{run_dir}/explained.csv'",
        "SELECT * FROM read_csv('{outside}/secret.csv')",
        "SELECT * FROM read_text('{run_dir}/../../secret.csv')",
        "SELECT * FROM read_parquet('{other_run}/**/steps.parquet')",  # another run than the one opened
        "ATTACH '{outside}/new.duckdb' AS x",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SELECT * FROM 'https://example.com/data.csv'",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "DROP VIEW tokens",
        "CREATE OR REPLACE VIEW tokens AS SELECT 1 AS x",
        "DROP SCHEMA _runlog CASCADE",
        "DELETE FROM _runlog.runs",
        "SELECT 1; DROP VIEW tokens",
    ],
)
def test_sql_is_read_only_over_the_run_s_data(tmp_path, attack):
    logs, outside = tmp_path / "logs", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.csv").write_text("a,b\n1,2\n")
    settled(write_run(logs, "a", 2))  # the folders the closing merge replaced are gone before the listing
    settled(write_run(logs, "b", 1))
    before = sorted(p for p in tmp_path.rglob("*"))
    r = RunReader(logs, runs="a")
    query = attack.format(outside=outside, run_dir=logs / "a", other_run=logs / "b")
    # Refused as such, not failing on the way (a download that could not connect, say).
    for method in (r.sql, r.arrow):  # the same guards, whichever way the result comes back
        with pytest.raises((duckdb.Error, RunLogError), match=r"Permission Error|read-only|locked|Cannot enable"):
            method(query)
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written anywhere
    assert token_counts(r, "a") == {0: 12, 1: 12}  # and the tables still answer
    assert r.sql("SELECT run, status FROM runs").values.tolist() == [["a", "finished"]]
    assert r.sql("SELECT count(*) AS n FROM tokens").n[0] == 24


def test_reading_statements_are_all_allowed(tmp_path):
    write_run(tmp_path, "a", 2)
    r = RunReader(tmp_path)
    assert r.sql("WITH t AS (SELECT * FROM tokens) SELECT count(*) AS n FROM t").n[0] == 24
    assert "token_text" in r.sql("DESCRIBE tokens").column_name.tolist()
    assert {"steps", "tokens", "runs"} <= set(r.sql("SHOW TABLES").name)
    assert len(r.sql("SUMMARIZE steps")) == len(TABLE_SCHEMAS["steps"])
    assert len(r.sql("EXPLAIN SELECT * FROM tokens")) == 1
    assert r.sql("""SELECT extra->>'custom' AS custom FROM steps ORDER BY step""").custom.tolist() == ["0", "1"]
    query = "SELECT rollout_id, position, token_text, old_logp FROM tokens WHERE step = $step ORDER BY ALL"
    arrow, frame = r.arrow(query, {"step": 1}), r.sql(query, {"step": 1})
    assert arrow.num_rows == 12 and arrow.to_pandas().astype(object).equals(frame.astype(object))


def test_unsafe_reader_is_a_full_shell_whose_tables_come_back(tmp_path):
    write_run(tmp_path / "logs", "a", 2)
    r = RunReader(tmp_path / "logs", unsafe=True)
    r.sql(f"COPY (SELECT * FROM tokens) TO '{tmp_path / 'tokens.csv'}'")
    assert len((tmp_path / "tokens.csv").read_text().splitlines()) == 25
    r.sql("CREATE TABLE mine AS SELECT 1 AS x")
    r.sql("DROP VIEW tokens")
    assert token_counts(r, "a") == {0: 12, 1: 12}  # the run-log tables are restored by the next query
    assert r.sql("SELECT x FROM mine").x.tolist() == [1]  # the user's own tables stay


# ---------------------------------------------------------------- export


def test_export_round_trip(tmp_path):
    write_run(tmp_path / "logs", "a", 3)
    write_run(tmp_path / "logs", "b", 1)
    r = RunReader(tmp_path / "logs", runs="a")
    out = r.export(tmp_path / "a.duckdb")
    con = duckdb.connect(str(out), read_only=True)
    kinds = dict(con.execute("SELECT table_name, table_type FROM information_schema.tables").fetchall())
    assert kinds == {t: "BASE TABLE" for t in ["runs", "steps", "rollouts", "tokens", "token_passes", "prm_steps",
                                               "ref_tokens", "token_summary"]}
    for table in kinds:
        exported = con.execute(f"SELECT * FROM {table} ORDER BY ALL").df()
        live = r.sql(f"SELECT * FROM {table} ORDER BY ALL")
        pd.testing.assert_frame_equal(exported, live)
    assert con.execute("SELECT DISTINCT run FROM tokens").fetchall() == [("a",)]
    con.close()
    with pytest.raises(RunLogError, match="already exists"):
        r.export(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_numeric_run_name_and_key_value_folder_above_logs(tmp_path):
    logs = tmp_path / "sweep=3" / "logs"  # a Hive-looking folder must not add a column
    write_run(logs, "2026", 2)
    r = RunReader(logs)
    df = r.sql("SELECT * FROM tokens WHERE run = ?", ["2026"])
    assert list(df.columns) == TABLE_SCHEMAS["tokens"].names and len(df) == 24
    assert r.sql("SELECT DISTINCT run FROM steps").run.tolist() == ["2026"]


def test_resume_deletes_folders_a_chunk_replaced_before_a_crash(tmp_path):
    w = write_run(tmp_path, "a", 5, close=None, compact_every=2)
    w.flush()
    w._lock.release()  # dies before the grace period let it delete the compacted step folders
    data = data_dir_of(tmp_path / "a")
    assert len(list(data.glob("step-*"))) > 1  # superseded ones still there
    assert token_counts(RunReader(tmp_path), "a") == {s: 12 for s in range(5)}  # and not counted twice
    RunWriter.resume(tmp_path, "a").close()
    assert sorted(p.name[:14] for p in data.iterdir()) == ["chunk-00000000", "chunk-00000000", "step-000000004"]
    assert token_counts(RunReader(tmp_path), "a") == {s: 12 for s in range(5)}


def _files_of(run_dir: Path) -> dict[str, tuple]:
    """Every Parquet file of a run by folder (session part of step-folder names dropped): rows per row group,
    column encodings, contents."""
    out = {}
    for path in sorted(data_dir_of(run_dir).glob("*/*.parquet")):
        meta = pq.ParquetFile(path).metadata
        groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
        encodings = [tuple(sorted(g.column(j).encodings)) for g in groups for j in range(g.num_columns)]
        folder = path.parent.name.split(".s")[0]
        out[f"{folder}/{path.name}"] = ([g.num_rows for g in groups], encodings, pq.read_table(path).to_pylist())
    return out


def test_log_many_writes_the_files_log_step_and_compaction_write(tmp_path, monkeypatch):
    monkeypatch.setattr(runlog.files, "_ROW_GROUP_ROWS", 5)  # row groups that straddle steps and chunks

    def step_data(step: int) -> dict:
        data = make_step(step, rollouts=2 + step % 3, prm=step % 4 == 0)
        data["metrics"].update(wall_time=2.0 * step, step_seconds=2.0)
        data["rollouts"]["kind"] = ["eval", "train", None, "train"][: len(data["rollouts"])]
        return data

    one_by_one = RunWriter.create(tmp_path / "a", "run", compact_every=2)
    for step in range(23):
        one_by_one.log_step(step, **step_data(step))
    one_by_one.close()
    bulk = RunWriter.create(tmp_path / "b", "run", compact_every=2)
    for step in range(5):  # a bulk import on top of steps logged one by one (some absorbed into its chunks)
        bulk.log_step(step, **step_data(step))
    bulk.flush()
    bulk.log_many(range(5, 23), step_data)
    bulk.close()
    settled(one_by_one)
    settled(bulk)

    expected, got = _files_of(tmp_path / "a" / "run"), _files_of(tmp_path / "b" / "run")
    assert sorted(got) == sorted(expected)
    assert any(name.startswith("chunk-000000000-000000015-") for name in got)
    parted = set()
    for name, (rows, encodings, content) in expected.items():
        assert got[name] == (rows, encodings, content), name
        table = name.split("/")[1][: -len(".parquet")]
        size = runlog._row_group_rows(table)  # 5, or 20 for per-token tables
        # Rollouts by kind (train, eval, NULL) and the token summary by kind and bucket never share a row group, so
        # a query for one part skips the others; the parts follow each other, each in row groups of `size` but its
        # last.
        columns = {"rollouts": ["kind"], "token_summary": ["kind", "bucket"]}.get(table, [])
        bounds = np.cumsum([0, *rows])
        values = [{tuple(r[c] for c in columns) for r in content[a:b]} for a, b in itertools.pairwise(bounds)]
        assert all(len(v) == 1 for v in values), (name, values)
        part = [v.pop() for v in values]
        runs_of_parts = [key for key, _ in itertools.groupby(part)]
        assert len(runs_of_parts) == len(set(runs_of_parts)), (name, part)  # each part in one piece
        last_of_part = [i == len(rows) - 1 or part[i + 1] != part[i] for i in range(len(rows))]
        assert all(n == size or (last and 0 < n <= size) for n, last in zip(rows, last_of_part, strict=True)), rows
        if len(runs_of_parts) > 1:
            parted.add(table)
    assert parted == {"rollouts", "token_summary"}
    assert list_runs(tmp_path / "b")[0]["last_step"] == 22
    with pytest.raises(RunLogError, match="strictly increasing"):
        RunWriter.resume(tmp_path / "b", "run").log_many([22], step_data)


def test_float_and_integer_columns_round_trip_exactly(tmp_path):
    """The compact encodings (byte-stream-split floats, delta integers) change bytes on disk, not values: per-token
    floats read back as exactly their float32 rounding (-1e300 as -inf, 5e-324 as 0)."""
    rng = np.random.default_rng(3)
    values = np.concatenate([-rng.gamma(1.0, 0.6, 996), [0.0, -0.0, np.finfo(float).tiny, -1e300, 5e-324, np.nan]])
    ids = np.concatenate([rng.integers(-2**62, 2**62, 1000), [0, -1]])
    with RunWriter.create(tmp_path, "exact", background=False) as w:
        w.log_step(0, tokens={"rollout_id": np.zeros(1002, int), "position": np.arange(1002),
                              "token_id": ids, "old_logp": values})
    df = RunReader(tmp_path).sql("SELECT token_id, old_logp FROM tokens ORDER BY position")
    assert df.token_id.tolist() == ids.tolist()
    with np.errstate(over="ignore"):
        as_float32 = values.astype(np.float32).astype(np.float64)
    assert np.array_equal(df.old_logp.to_numpy(), as_float32, equal_nan=True)
    assert np.signbit(df.old_logp.to_numpy()[997])  # -0.0 kept


def test_refresh_lists_a_data_folder_again_only_when_it_changed(tmp_path, monkeypatch):
    writer = write_run(tmp_path, "quiet", 3, close=None, compact_every=0)
    writer.flush()
    data = data_dir_of(tmp_path / "quiet")
    settled = os.stat(data).st_mtime - 10  # as if the last step was written 10 s ago
    os.utime(data, (settled, settled))
    reader = RunReader(tmp_path)
    listings = []
    real_scan = runlog._scan_segments
    monkeypatch.setattr(runlog.reader, "scan_segments", lambda *a, **k: listings.append(a[0]) or real_scan(*a, **k))
    for _ in range(3):
        assert not reader.refresh()
    assert listings == []  # the poll of a quiet run: a stat, no listing
    writer.log_step(3, **make_step(3))
    writer.flush()  # renaming the step folder into place changes the folder's mtime
    assert reader.refresh()
    assert listings == [data]
    # Changed within the last `_LISTING_SETTLE_SECONDS`: listed at every refresh (a second change in the same
    # clock tick would not move the mtime)
    reader.refresh()
    assert listings == [data] * 2
    assert token_counts(reader, "quiet") == {s: 12 for s in range(4)}
    writer.close()


def test_reader_limited_to_some_tables_opens_no_other_file(tmp_path):
    write_run(tmp_path, "a", 3, compact_every=0)
    data = data_dir_of(tmp_path / "a")
    (step_dir(data, 1) / "tokens.parquet").write_bytes(b"garbage")  # would be reported if it were opened
    reader = RunReader(tmp_path, tables=("steps",))
    assert reader.problems == []
    assert reader.runs_overview()["steps_logged"].tolist() == [3]
    assert reader.sql("SELECT count(*) AS n FROM tokens").n[0] == 0  # left out: an empty view
    assert any("tokens.parquet" in p for p in RunReader(tmp_path).problems)
    with pytest.raises(RunLogError, match="unknown table"):
        RunReader(tmp_path, tables=("token",))


def test_closing_merges_the_remaining_step_folders_into_one_chunk(tmp_path):
    w = write_run(tmp_path, "t", 0, close=None, compact_every=4)
    for step in range(7):  # one 4-step chunk and 3 step folders while running
        w.log_step(step, **make_step(step))
    w.flush()
    data = data_dir_of(tmp_path / "t")
    assert sum(not s.is_chunk for s in runlog._scan_segments(data)) == 3  # (replaced folders linger a moment)
    w.close()
    settled(w)
    assert sorted(p.name[:25] for p in data.iterdir()) == ["chunk-000000000-000000003", "chunk-000000004-000000006"]
    r = RunReader(tmp_path)
    assert token_counts(r, "t") == {s: 12 for s in range(7)}
    with RunWriter.resume(tmp_path, "t", compact_every=4) as w:  # and the run goes on from there
        w.log_step(7, **make_step(7))
    assert token_counts(r, "t") == {s: 12 for s in range(8)}


def test_a_crashed_run_is_not_merged_on_close(tmp_path):
    w = write_run(tmp_path, "t", 3, close=None, compact_every=4)
    w.close("crashed")
    assert len(list(data_dir_of(tmp_path / "t").glob("step-*"))) == 3


def test_the_row_builder_sorts_rows_out_of_key_order_and_leaves_ordered_ones_as_they_are():
    from engine.runlog import table_rows

    def logps(rollout_id: list[int], position: list[int]) -> list[float]:
        columns = {"rollout_id": rollout_id, "position": position, "old_logp": [-1.0, -2.0, -3.0]}
        return table_rows("tokens", columns, "r", 0).column("old_logp").to_pylist()

    assert logps([1, 0, 0], [0, 1, 0]) == [-3.0, -2.0, -1.0]  # out of order on the first key
    assert logps([0, 0, 1], [1, 0, 0]) == [-2.0, -1.0, -3.0]  # only on the second, within equal first keys
    # in order (the second key lower across a change of the first, and a tie): as given
    assert logps([0, 1, 1], [9, 0, 0]) == [-1.0, -2.0, -3.0]
