"""The README cannot rot: every `policylens` command it shows parses, the cheap ones run on a real run, its SQL
examples run, and its Python logging example runs as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from engine.cli import build_parser, main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def readme_logging_example() -> str:
    """The README's example of logging from your own training loop."""
    (example,) = [block for block in fenced_blocks("python") if "RunWriter.create" in block]
    return example


def readme_commands() -> list[list[str]]:
    """Every `policylens ...` line of the README's shell blocks, as argv (without the program and the comment)."""
    commands = []
    for block in fenced_blocks("sh"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("policylens"):
                commands.append(words[1:])
    return commands


def test_readme_shows_the_two_setup_commands():
    setup = fenced_blocks("sh")[0]
    assert [line.split("#")[0].strip() for line in setup.strip().splitlines()] == ["make run", "make test"]
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert re.search(r"^run:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)


def test_readme_has_commands_for_every_subcommand():
    shown = {argv[0] for argv in readme_commands()}
    assert {"train", "runs", "sql", "export", "dashboard", "demo"} - shown <= {"dashboard", "demo"}
    assert "policylens dashboard" in README and "policylens demo" in README


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(argv)[:60])
def test_every_readme_command_parses(argv):
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


def test_readme_run_log_commands_run_on_a_real_run(tiny_run, tmp_path, monkeypatch, capsys):
    """`runs`, `sql RUN QUERY` and `export` as the README shows them, on an engine-trained run (named for my-dapo)."""
    logs_dir, run = tiny_run
    monkeypatch.chdir(tmp_path)
    for argv in readme_commands():
        if argv[0] not in ("runs", "sql", "export") or (argv[0] == "sql" and len(argv) < 3):
            continue
        argv = [run if word == "my-dapo" else word for word in argv]
        argv = [str(tmp_path / word) if word.endswith(".duckdb") else word for word in argv]
        assert main([*argv, "--logs-dir", str(logs_dir)]) == 0, argv
    out = capsys.readouterr().out
    assert run in out
    assert any(path.suffix == ".duckdb" for path in tmp_path.iterdir())


def test_readme_sql_examples_run(tiny_run):
    from engine.runlog import RunReader

    logs_dir, run = tiny_run
    queries = [q.strip() for block in fenced_blocks("sql") for q in block.split(";") if q.strip()]
    assert len(queries) >= 2
    with RunReader(logs_dir, runs=run) as reader:
        for query in queries:
            reader.sql(query)  # raises on a column or table the schema does not have


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    example = readme_logging_example()
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "reward_mean" in printed and "0.42" in printed
    from engine.runlog import list_runs

    (info,) = list_runs(tmp_path / "logs")
    assert info["run"] == "my-run" and info["status"] == "finished" and info["last_step"] == 3
