"""`policylens import verl`: verl's rollout JSONL dumps (trainer.rollout_data_dir) as PolicyLens runs.

The files are written here line by line in the format of verl's RayPPOTrainer._dump_generations: one JSON object
per response with input, output, gts, score, step, the reward function's extra keys, and uid when present.
(TRL's format is covered with files written by the real TRL in tests/test_trl.py.)
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.advantages import group_advantages
from engine.cli import main
from engine.importers import import_run, import_verl
from engine.runlog import RunLogError, RunReader

PROMPTS = ["<|user|>2x+1=5<|assistant|>", "<|user|>3x=9<|assistant|>", "<|user|>x-4=0<|assistant|>"]


def verl_lines(step: int, with_uid: bool, seed: int) -> list[dict]:
    """4 responses to each of 3 prompts, shuffled as verl's batch balancing does."""
    rng = random.Random(seed)
    lines = []
    for p, prompt in enumerate(PROMPTS):
        for k in range(4):
            score = float(rng.random() < 0.5)
            line = {"input": prompt, "output": f"x={k + p}", "gts": str(p + 2), "score": score, "step": step,
                    "acc": score, "format_bonus": 0.1 * k}
            if with_uid:
                line["uid"] = f"uid-{step}-{p}"
            lines.append(line)
    rng.shuffle(lines)
    return lines


def write(path, lines, damaged_at: int | None = None):
    text = [json.dumps(x, ensure_ascii=False) for x in lines]
    if damaged_at is not None:
        text.insert(damaged_at, text[damaged_at][:25])  # a half-written line
    path.write_text("\n".join(text) + "\n")


@pytest.fixture
def rollout_dir(tmp_path):
    folder = tmp_path / "rollouts"
    folder.mkdir()
    write(folder / "1.jsonl", verl_lines(1, with_uid=False, seed=1))
    write(folder / "2.jsonl", verl_lines(2, with_uid=True, seed=2), damaged_at=2)
    return folder


def test_verl_dumps_become_groups_by_prompt_with_recomputed_advantages(rollout_dir, tmp_path):
    report = import_verl(rollout_dir, tmp_path / "logs", "verl-run")
    assert report.imported == [1, 2]
    assert len(report.problems) == 1 and "2.jsonl:3" in report.problems[0]  # the damaged line, by file and line
    with RunReader(tmp_path / "logs") as reader:
        rollouts = reader.sql("SELECT * FROM rollouts ORDER BY step, rollout_id")
        steps = reader.sql("SELECT * FROM steps ORDER BY step")
    assert rollouts.groupby("step").size().tolist() == [12, 12]
    for step in (1, 2):
        # file 1 has no damaged line: its rows are its lines in order, every field carried over
        lines = [json.loads(x) for x in (rollout_dir / "1.jsonl").read_text().splitlines()] if step == 1 else None
        got = rollouts[rollouts["step"] == step]
        # a group is one prompt's responses, wherever verl put the lines
        assert got.groupby("group_id")["prompt"].nunique().eq(1).all() and got["group_id"].nunique() == 3
        for _, group in got.groupby("group_id"):
            expected = group_advantages(torch.tensor(group["reward"].tolist(), dtype=torch.float64), len(group))
            assert group["advantage"].tolist() == pytest.approx(expected.tolist())
            assert sorted(group["index_in_group"]) == [0, 1, 2, 3]
        if lines is not None:
            assert got["completion"].tolist() == [x["output"] for x in lines]
            assert got["answer"].tolist() == [x["gts"] for x in lines]
            assert [json.loads(c) for c in got["reward_components"]] == [
                {"acc": x["acc"], "format_bonus": pytest.approx(x["format_bonus"])} for x in lines]
    assert "recomputed" in json.loads(steps["extra"][0])["advantage_source"]
    assert steps["reward_mean"].tolist() == pytest.approx(rollouts.groupby("step")["reward"].mean().tolist())


def test_importing_again_is_idempotent_and_follows_new_files(rollout_dir, tmp_path):
    first = import_verl(rollout_dir, tmp_path / "logs", "verl-run")
    with RunReader(tmp_path / "logs") as reader:
        before = reader.sql("SELECT * FROM rollouts ORDER BY step, rollout_id")
    again = import_verl(rollout_dir, tmp_path / "logs", "verl-run")
    assert first.imported == [1, 2] and again.imported == [] and again.already_there == 2
    write(rollout_dir / "3.jsonl", verl_lines(3, with_uid=True, seed=3))  # the run went on
    assert import_verl(rollout_dir, tmp_path / "logs", "verl-run").imported == [3]
    with RunReader(tmp_path / "logs") as reader:
        after = reader.sql("SELECT * FROM rollouts WHERE step <= 2 ORDER BY step, rollout_id")
        assert reader.sql("SELECT count(*) AS n FROM rollouts")["n"][0] == 36
    assert after.equals(before)
    # another run of that name is never taken over
    with pytest.raises(RunLogError, match="not an import"):
        import_verl(rollout_dir.parent, tmp_path / "logs", "verl-run")


def test_cli_imports_with_a_tokenizer_and_reports_problems(rollout_dir, tmp_path, capsys):
    from engine.policy import build_tokenizer

    tokenizer_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(tokenizer_dir)
    code = main(["import", "verl", str(rollout_dir), "--run-name", "with-tokens", "--tokenizer", str(tokenizer_dir),
                 "--logs-dir", str(tmp_path / "logs")])
    out = capsys.readouterr()
    assert code == 0 and "2 step(s) imported" in out.out and "2.jsonl:3" in out.err
    with RunReader(tmp_path / "logs") as reader:
        joined = reader.sql("""SELECT r.step, r.rollout_id, r.completion, r.length,
                                      string_agg(t.token_text, '' ORDER BY t.position) AS text,
                                      count(t.position) AS n FROM rollouts r JOIN tokens t USING (step, rollout_id)
                               GROUP BY ALL""")
    assert (joined["text"] == joined["completion"]).all() and (joined["n"] == joined["length"]).all()
    assert main(["import", "verl", str(tmp_path / "nowhere"), "--logs-dir", str(tmp_path / "logs")]) == 2
    assert main(["import", "verl", str(rollout_dir), "--run-name", "../escape",
                 "--logs-dir", str(tmp_path / "logs")]) == 2


@pytest.mark.parametrize("page", [None, "token_inspector", "groups", "replay", "prm_steps", "algorithm_weighting"])
def test_every_dashboard_page_renders_an_imported_run(rollout_dir, tmp_path, page, monkeypatch):
    from test_dashboard import groups_text, open_page

    import_verl(rollout_dir, tmp_path / "logs", "verl-run")
    at = open_page(str(tmp_path / "logs"), page, monkeypatch, run="verl-run", step=2, rollout=0)
    shown = " ".join(str(x.value) for x in (*at.markdown, *at.caption, *at.info))
    assert "Imported from verl dumps" in shown and "no optimisation passes" in shown  # what it lacks, on every page
    if page == "token_inspector":  # no tokens in a dump imported without --tokenizer: said why
        assert "imported" in shown and "never log-probs" in shown
    if page == "groups":  # each reward function's value next to each completion
        assert "acc" in groups_text(at) and "format" in groups_text(at)


def test_follow_imports_new_files_once_they_stop_growing(rollout_dir, tmp_path):
    import os
    import time

    from engine.importers import SETTLE_SECONDS, follow

    old = time.time() - 10 * SETTLE_SECONDS
    for path in rollout_dir.iterdir():
        os.utime(path, (old, old))
    write(rollout_dir / "3.jsonl", verl_lines(3, with_uid=False, seed=3))
    future = time.time() + 3600  # still being written (changed "now", however long the first look takes)
    os.utime(rollout_dir / "3.jsonl", (future, future))
    reports = []

    def rounds_done() -> bool:
        if len(reports) == 1:  # between the two looks, the trainer finished writing step 3
            os.utime(rollout_dir / "3.jsonl", (old, old))
        return len(reports) >= 2

    follow("verl", rollout_dir, tmp_path / "logs", "live", interval=0.05, on_report=reports.append, stop=rounds_done)
    assert [r.imported for r in reports] == [[1, 2], [3]]
    assert len(reports[0].problems) == 1 and reports[1].problems == []  # the damaged line is reported once


def test_a_line_that_is_not_utf8_or_of_the_wrong_type_costs_only_itself(tmp_path):
    folder = tmp_path / "rollouts"
    folder.mkdir()
    lines = [json.dumps(x).encode() for x in verl_lines(1, with_uid=True, seed=4)]
    lines[3] = lines[3].replace(b'"x=', b'"\xe9x=')  # one latin-1 byte: not UTF-8
    wrong = verl_lines(1, with_uid=True, seed=4)[5]
    lines[5] = json.dumps({**wrong, "score": "high"}).encode()  # a wrong type in one column of one row
    (folder / "1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    report = import_verl(folder, tmp_path / "logs", "run")
    assert report.imported == [1]
    assert [p.split(": ")[0].rsplit("/", 1)[-1] for p in report.problems] == ["1.jsonl:4", "1.jsonl:6"]
    with RunReader(tmp_path / "logs") as reader:
        assert reader.sql("SELECT count(*) FROM rollouts WHERE run = 'run'").iloc[0, 0] == 10


@pytest.mark.parametrize("source", ["verl", "trl"])
def test_a_folder_without_dump_files_is_an_error_that_creates_nothing(source, tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "completions").mkdir(parents=True)
    assert main(["import", source, str(empty), "--logs-dir", str(tmp_path / "logs"), "--run-name", "r"]) == 2
    assert "accepted" in capsys.readouterr().err
    assert not (tmp_path / "logs" / "r").exists()


def test_follow_keeps_one_writer_and_reads_finished_between_looks(rollout_dir, tmp_path):
    import os
    import time

    from engine.importers import SETTLE_SECONDS, follow
    from engine.runlog import RunWriter

    old = time.time() - 10 * SETTLE_SECONDS
    for path in rollout_dir.iterdir():
        os.utime(path, (old, old))
    opened, statuses = [], []
    real_create, real_resume = RunWriter.create, RunWriter.resume

    def counted(real):
        def wrapper(*args, **kwargs):
            opened.append(real.__name__)
            return real(*args, **kwargs)
        return wrapper

    def look(report):
        with RunReader(tmp_path / "logs") as reader:
            statuses.append(reader.sql("SELECT status FROM runs WHERE run = 'live'").iloc[0, 0])

    RunWriter.create, RunWriter.resume = counted(real_create), counted(real_resume)
    try:
        follow("verl", rollout_dir, tmp_path / "logs", "live", interval=0.01, on_report=look,
               stop=lambda: len(statuses) >= 3)
    finally:
        RunWriter.create, RunWriter.resume = real_create, real_resume
    assert opened == ["create"]  # one writer for the whole session, not one per look
    assert statuses == ["finished"] * 3


def test_a_trl_row_without_its_completion_costs_only_that_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "out" / "completions"
    folder.mkdir(parents=True)
    rows = {"step": [1] * 4, "prompt": ["p", "p", "q", "q"], "completion": ["a", None, "c", "d"],
            "accuracy": [1.0, 0.0, 1.0, 0.0], "advantage": [0.7, -0.7, 0.7, -0.7]}
    pq.write_table(pa.table(rows), folder / "completions_00001.parquet")
    report = import_run("trl", tmp_path / "out", tmp_path / "logs", "run")
    assert report.imported == [1] and len(report.problems) == 1 and "row 2" in report.problems[0]
    with RunReader(tmp_path / "logs") as reader:
        assert reader.sql("SELECT completion FROM rollouts WHERE run = 'run' ORDER BY rollout_id")[
            "completion"].tolist() == ["a", "c", "d"]
