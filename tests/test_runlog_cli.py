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


# ---------------------------------------------------------------- damaged logs folders, read-only SQL


def damaged_logs(tmp_path):
    """Two good runs beside one of each kind of damage: corrupt data pages under an intact footer, a file where a
    step folder belongs, a run folder whose name an older version accepted (ending in a newline)."""
    from test_runlog import scramble_data_pages, step_dir, write_run

    from engine.runlog import data_dir_of

    logs = tmp_path / "logs"
    write_run(logs, "good-a", 2)
    write_run(logs, "pages", 3, compact_every=0)
    scramble_data_pages(step_dir(data_dir_of(logs / "pages"), 1) / "steps.parquet")
    scramble_data_pages(step_dir(data_dir_of(logs / "pages"), 2) / "rollouts.parquet")
    write_run(logs, "folder", 2, compact_every=0)
    (data_dir_of(logs / "folder") / "step-000000005.rank0.s1").write_text("a file, not a step folder")
    newline = logs / "newline\n"
    newline.mkdir()
    (newline / "run.json").write_text((logs / "good-a" / "run.json").read_text())
    (newline / "data" / "run=newline\n" / "step-000000000.rank0.s1").mkdir(parents=True)
    write_run(logs, "good-b", 1)
    return logs


def test_runs_lists_every_readable_run_and_names_each_damaged_file(tmp_path, capsys):
    logs = damaged_logs(tmp_path)
    assert main(["runs", "--logs-dir", str(logs)]) == 0
    captured = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines()[2:-1]}
    assert set(rows) == {"good-a", "pages", "folder", "good-b"}
    assert rows["good-a"][4] == "2" and rows["pages"][4] == "2" and rows["folder"][4] == "2"  # step 1 left out
    warnings = captured.err.splitlines()
    assert all(line.startswith("policylens runs: warning: ") for line in warnings), warnings
    for damaged in ["run=pages/step-000000001", "run=folder/step-000000005.rank0.s1", "newline\\n"]:
        assert sum(damaged in line for line in warnings) == 1, (damaged, warnings)


def test_sql_and_export_skip_the_damaged_files_of_the_run(tmp_path, capsys):
    logs = damaged_logs(tmp_path)
    assert main(["sql", "pages", "SELECT step, count(*) AS n FROM rollouts GROUP BY step ORDER BY step",
                 "--logs-dir", str(logs)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[2:4] == ["   0  3", "   1  3"]  # step 2's rollouts file is damaged
    assert "rollouts.parquet" in captured.err and "damaged" in captured.err
    target = tmp_path / "pages.duckdb"
    assert main(["export", "pages", str(target), "--logs-dir", str(logs)]) == 0
    assert "steps.parquet" in capsys.readouterr().err
    con = duckdb.connect(str(target), read_only=True)
    assert con.execute("SELECT list(step ORDER BY step) FROM steps").fetchone() == ([0, 2],)
    assert con.execute("SELECT count(*) FROM rollouts").fetchone() == (6,)
    con.close()


def test_a_logs_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "logs").write_text("")
    for argv in (["runs"], ["sql", "a", "SELECT 1"], ["export", "a", str(tmp_path / "a.duckdb")]):
        assert main([*argv, "--logs-dir", str(tmp_path / "logs")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not a folder" in err, err


def test_sql_refuses_writes_and_other_files_unless_unsafe(logs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.csv").write_text("a\n1\n")
    for query in ["COPY (SELECT * FROM tokens) TO 'out.csv'", "SELECT * FROM read_csv('secret.csv')",
                  "ATTACH 'new.duckdb'", "DROP VIEW tokens"]:
        assert main(["sql", "grpo-a", query, "--logs-dir", str(logs)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("policylens sql: error: ") and "--unsafe" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.csv"]
    monkeypatch.setattr("sys.stdin", io.StringIO("DROP VIEW tokens;\nSELECT count(*) AS n FROM tokens;\n"))
    assert main(["sql", "grpo-a", "--logs-dir", str(logs)]) == 2
    assert "n\n-\n9\n(1 row)" in capsys.readouterr().out  # the refused DROP left the table in place
    assert main(["sql", "grpo-a", "COPY (SELECT * FROM tokens) TO 'out.csv'", "--unsafe", "--logs-dir", str(logs)]) == 0
    assert len((tmp_path / "out.csv").read_text().splitlines()) == 10


def test_dashboard_queries_read_a_damaged_logs_folder(tmp_path):
    from dashboard import queries

    logs = str(damaged_logs(tmp_path))
    table = queries.runs_table(logs)
    assert table.run.tolist() == ["good-a", "pages", "folder", "good-b"]
    assert table.steps_logged.tolist() == [2, 2, 2, 1]
    # The latest held-out accuracy is the last one logged (step 0; step 1 did not evaluate), as `policylens runs` says.
    assert table.heldout_accuracy[0] == 0.5 and table.heldout_step[0] == 0
    assert any("run=pages/step-000000001" in p for p in queries.reader_problems(logs))
    replay = queries.eval_prompt_across_runs(logs, "arith", 0, 10)  # reads every run's rollouts
    assert replay.empty  # write_run logs no eval rollouts; the point is that the query answers
    assert len(queries.step_rollouts(logs, "good-a", 1)) == 3
    with pytest.raises(Exception, match="read-only"):
        queries.sql(logs, "DROP VIEW tokens")


@pytest.mark.parametrize("command", [["runs"], ["sql", "r", "SELECT count(*) FROM steps"], ["export", "r", "r.duckdb"]])
def test_reading_commands_start_without_loading_torch(tmp_path, command):
    """Only train and warmstart need the engine (and torch, about a second to import): listing, querying and
    exporting runs must not wait for it (`policylens runs` over 200 runs is a sub-second target)."""
    import subprocess
    import sys

    from engine.runlog import RunWriter

    with RunWriter.create(tmp_path, "r", config={}) as writer:
        writer.log_step(0, metrics={"loss": 1.0})
    script = ("import sys\nfrom engine.cli import main\n"
              f"code = main({[*command, '--logs-dir', str(tmp_path)]!r})\n"
              "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["0", "False"], done.stdout
