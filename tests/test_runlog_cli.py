"""`policylens runs`, `policylens sql` and `policylens export` (engine/cli.py) on runs written by RunWriter."""

from __future__ import annotations

import io

import duckdb
import pytest

from engine.cli import main
from engine.runlog import RunWriter


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with RunWriter.create(logs, "grpo-a", algorithm="grpo", task="arith", config={"lr": 1e-6}) as w:
        for step in range(3):
            w.log_step(
                step,
                metrics={"reward_mean": step / 10, "heldout_accuracy": 0.25 * step if step != 2 else None},
                rollouts={"rollout_id": [0, 1], "prompt": ["1+1=", "2+2="], "completion": ["2", "5\nno"]},
                tokens={"rollout_id": [0, 1, 1], "position": [0, 0, 1], "token_text": ["2", "5", "no"]},
            )
    with RunWriter.create(logs, "dapo-b", algorithm="dapo", task="countdown") as w:
        w.log_step(0, metrics={"reward_mean": 0.0})
    return logs


def test_runs_lists_runs_with_latest_heldout_accuracy(logs, capsys):
    assert main(["runs", "--logs-dir", str(logs)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "algorithm", "task", "status", "steps", "held-out", "acc", "at", "step"]
    rows = {line.split()[0]: line.split() for line in out[2:-1]}
    assert rows["grpo-a"] == ["grpo-a", "grpo", "arith", "finished", "3", "0.25", "1"]
    assert rows["dapo-b"] == ["dapo-b", "dapo", "countdown", "finished", "1", "NULL", "NULL"]
    assert out[-1] == "(2 rows)"


def test_runs_on_empty_or_missing_logs_dir(tmp_path, capsys):
    assert main(["runs", "--logs-dir", str(tmp_path / "none")]) == 0
    assert "no runs in" in capsys.readouterr().out


def test_sql_query_sees_only_that_run(logs, capsys):
    assert main(["sql", "grpo-a", "SELECT DISTINCT run FROM steps UNION ALL SELECT run FROM runs",
                 "--logs-dir", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "grpo-a" in out and "dapo-b" not in out
    assert main(["sql", "grpo-a", "SELECT completion FROM rollouts ORDER BY rollout_id", "--logs-dir", str(logs)]) == 0
    assert "5\\nno" in capsys.readouterr().out  # newlines shown escaped: one row per line


def test_sql_max_rows(logs, capsys):
    assert main(["sql", "grpo-a", "SELECT * FROM range(5)", "--max-rows", "2", "--logs-dir", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "... 3 more rows" in out and "(5 rows)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sql", "grpo-a", "SELEKT 1"], "syntax error"),
        (["sql", "grpo-a", "SELECT * FROM nope"], "nope"),
        (["sql", "missing", "SELECT 1"], "no run named 'missing'"),
        (["sql", "../etc", "SELECT 1"], "invalid run name"),
        (["export", "missing", "x.duckdb"], "no run named 'missing'"),
        (["export", "/abs", "x.duckdb"], "invalid run name"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(logs, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--logs-dir", str(logs)]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_sql_prompt_reads_statements_ending_in_semicolon(logs, capsys, monkeypatch):
    script = "SELECT count(*) AS n\nFROM tokens;\n.tables\n.schema prm_steps\nSELECT bad;\nSELECT 42 AS answer;\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["sql", "grpo-a", "--logs-dir", str(logs)]) == 2  # piped input with a failed statement
    captured = capsys.readouterr()
    assert "n\n-\n9\n(1 row)" in captured.out
    assert "token_passes" in captured.out and "reward_norm" in captured.out and "42" in captured.out
    assert "error:" in captured.err and "bad" in captured.err
    monkeypatch.setattr("sys.stdin", io.StringIO("SELECT 1 AS one;\n"))
    assert main(["sql", "grpo-a", "--logs-dir", str(logs)]) == 0


def test_export_writes_real_tables_and_never_overwrites(logs, tmp_path, capsys):
    target = tmp_path / "a.duckdb"
    assert main(["export", "grpo-a", str(target), "--logs-dir", str(logs)]) == 0
    assert "3 steps, 9 token rows" in capsys.readouterr().out
    con = duckdb.connect(str(target), read_only=True)
    assert con.execute("SELECT count(*) FROM tokens").fetchone() == (9,)
    assert con.execute("SELECT run, status FROM runs").fetchall() == [("grpo-a", "finished")]
    con.close()
    before = target.read_bytes()
    assert main(["export", "dapo-b", str(target), "--logs-dir", str(logs)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert target.read_bytes() == before
    assert main(["export", "dapo-b", str(target), "--overwrite", "--logs-dir", str(logs)]) == 0
    assert main(["export", "dapo-b", str(tmp_path / "no-dir" / "b.duckdb"), "--logs-dir", str(logs)]) == 2
    assert "does not exist" in capsys.readouterr().err
