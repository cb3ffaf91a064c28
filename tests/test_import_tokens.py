"""`policylens import prime-rl|nemo-rl|slime`: per-token dumps, written by tests/token_dump_fixtures.py in each
writer's format (the commits are cited there and in each fixture folder's SOURCE.md), imported and compared with
every value the generator wrote."""

from __future__ import annotations

import json
import math

import pytest
from token_dump_fixtures import (
    expected,
    make_samples,
    train_tokenizer,
    write_nemo_rl,
    write_prime_rl,
    write_slime,
)

from engine import runlog
from engine.cli import main
from engine.importers import import_run
from engine.runlog import RunLogError, RunReader

WRITERS = {"prime-rl": write_prime_rl, "nemo-rl": write_nemo_rl, "slime": write_slime}
# the framework fields each dump holds besides the contract columns (kept, typed, in tokens.dump)
EXTRA = {"prime-rl": ("is_masked",), "nemo-rl": (), "slime": ("kl",)}
COLUMNS = {"prime-rl": ("sampler_logp", "old_logp", "entropy", "advantage"),
           "nemo-rl": ("sampler_logp", "old_logp", "advantage"),
           "slime": ("sampler_logp", "old_logp", "entropy", "advantage", "ref_logp", "value", "return")}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def samples(tokenizer_dir):
    from transformers import AutoTokenizer

    return make_samples(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))


def _order(source: str, samples, step: int) -> list[int]:
    n = sum(s.step == step for s in samples)
    if source == "prime-rl":  # rank 0's file (samples 0, 2, ...) is read before rank 1's
        return [*range(0, n, 2), *range(1, n, 2)]
    return list(range(n))


def _tokens(reader, run, step):
    return reader.sql("SELECT * FROM tokens WHERE run = ? AND step = ? ORDER BY rollout_id, position",
                      [run, step]).to_dict("records")


@pytest.mark.parametrize("source", list(WRITERS))
def test_every_token_column_holds_what_the_dump_wrote(source, samples, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from engine.rollout import TokenText

    folder = WRITERS[source](tmp_path / source, samples)
    report = import_run(source, folder, tmp_path / "logs", "run", tokenizer_dir)
    assert report.imported == [1, 2]
    text = TokenText(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))
    with RunReader(tmp_path / "logs") as reader:
        for step in (1, 2):
            want = expected(samples, step, _order(source, samples, step))
            got = _tokens(reader, "run", step)
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert (g["rollout_id"], g["position"], g["token_id"]) == (w["rollout_id"], w["position"],
                                                                           w["token_id"])
                assert g["token_text"] == text.token(w["token_id"])
                for column in COLUMNS[source]:
                    # per-token floats are stored as float32
                    assert g[column] == pytest.approx(w[column], rel=2**-23, abs=1e-12), column
                for column in {"sampler_logp", "old_logp", "entropy", "ref_logp", "value", "return"} - set(
                        COLUMNS[source]):
                    assert g[column] is None or math.isnan(g[column]), column
                dump = g["dump"]
                assert dump["loss_mask"] == w["loss_mask"]
                for name in EXTRA[source]:
                    assert dump[name] == pytest.approx(w[name]), name
                assert g["extra"] is None  # every field of these formats has its typed place in `dump`
                if source == "prime-rl":  # not stored: derived from the two log-probs as prime-rl derives it
                    assert math.exp(g["old_logp"] - g["sampler_logp"]) == pytest.approx(w["importance_ratio"])


@pytest.mark.parametrize("source", list(WRITERS))
def test_rollouts_groups_and_rewards(source, samples, tokenizer_dir, tmp_path):
    folder = WRITERS[source](tmp_path / source, samples)
    import_run(source, folder, tmp_path / "logs", "run", tokenizer_dir)
    with RunReader(tmp_path / "logs") as reader:
        rows = reader.sql("SELECT * FROM rollouts WHERE run = ? AND step = 2 ORDER BY rollout_id",
                          ["run"]).to_dict("records")
    step_samples = [s for s in samples if s.step == 2]
    ordered = [step_samples[i] for i in _order(source, samples, 2)]
    assert len(rows) == len(ordered) == 7
    first_seen: dict[int, int] = {}
    for row, s in zip(rows, ordered, strict=True):
        if source == "prime-rl":  # its export holds no reward since 0be5ac45 (the fixture's format, 289562d2)
            assert row["reward"] is None or math.isnan(row["reward"])
        else:
            assert row["reward"] == s.reward
        assert row["length"] == len(s.token_ids) - s.prompt_len
        assert row["advantage"] == pytest.approx(s.advantage[s.prompt_len])
        first_seen.setdefault(s.group, len(first_seen))
        assert row["group_id"] == first_seen[s.group]  # rebuilt from prompt tokens, or slime's group_index
    tool = rows[[s.group for s in ordered].index(2)]
    assert "calc(17*3)" in tool["completion"] and "<|tool|>51" in tool["completion"]
    assert tool["prompt"].startswith("<|user|>use the calculator")


def test_multi_turn_tool_tokens_stay_in_the_completion_with_their_mask(samples, tokenizer_dir, tmp_path):
    folder = write_prime_rl(tmp_path / "p", samples)
    import_run("prime-rl", folder, tmp_path / "logs", "run", tokenizer_dir)
    tool = next(s for s in samples if s.group == 2)
    with RunReader(tmp_path / "logs") as reader:
        rid = reader.sql("SELECT rollout_id FROM rollouts WHERE run = 'run' AND step = 2 AND prompt LIKE "
                         "'%calculator%'").iloc[0, 0]
        masks = reader.sql("SELECT dump.loss_mask AS m FROM tokens WHERE run = 'run' AND step = 2 AND "
                           "rollout_id = ? ORDER BY position", [int(rid)])["m"].tolist()
    assert masks == tool.loss_mask[tool.prompt_len:]
    assert False in masks and masks[0] is True


@pytest.mark.parametrize("source", list(WRITERS))
def test_damage_costs_only_itself_and_non_training_files_are_left_out(source, samples, tmp_path):
    folder = WRITERS[source](tmp_path / source, samples)
    report = import_run(source, folder, tmp_path / "logs", "run")
    where = {"prime-rl": "step_2/rank_1.jsonl:2", "nemo-rl": "train_data_step1.jsonl:3", "slime": "train_3_0.pt"}
    assert any(where[source] in p for p in report.problems), report.problems
    assert len(report.problems) == 1, report.problems
    with RunReader(tmp_path / "logs") as reader:
        counts = reader.sql("SELECT step, count(*) AS n FROM rollouts WHERE run = 'run' GROUP BY step "
                            "ORDER BY step").values.tolist()
        texts = reader.sql("SELECT token_text FROM tokens WHERE run = 'run' LIMIT 1").iloc[0, 0]
    assert counts == [[1, 6], [2, 7]]  # every good sample; no validation or evaluation sample
    assert texts.startswith("<") and texts.endswith(">")  # without --tokenizer: the id, said as such


@pytest.mark.parametrize("source", list(WRITERS))
def test_import_again_adds_nothing_and_an_empty_folder_creates_nothing(source, samples, tmp_path, monkeypatch):
    folder = WRITERS[source](tmp_path / source, samples)
    merges = []
    monkeypatch.setattr(runlog.repair, "merge", lambda *args, **kwargs: merges.append(args))
    assert import_run(source, folder, tmp_path / "logs", "run").imported == [1, 2]
    assert merges == []  # the steps went straight into their final chunk: every row encoded once
    again = import_run(source, folder, tmp_path / "logs", "run")
    assert again.imported == [] and again.already_there + len(again.problems) >= 0
    with RunReader(tmp_path / "logs") as reader:
        assert reader.sql("SELECT count(*) FROM rollouts WHERE run = 'run'").iloc[0, 0] == 13
        assert reader.sql("SELECT status FROM runs WHERE run = 'run'").iloc[0, 0] == "finished"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RunLogError, match=r"expected|accepted"):
        import_run(source, empty, tmp_path / "logs", "other")
    assert not (tmp_path / "logs" / "other").exists()
    assert main(["import", source, str(empty), "--logs-dir", str(tmp_path / "logs"), "--run-name", "x"]) == 2
    assert not (tmp_path / "logs" / "x").exists()


def test_a_dump_that_runs_code_when_unpickled_is_refused(tmp_path, capsys):
    import pickle

    class Payload:
        def __reduce__(self):
            return (print, ("pickle code ran",))

    folder = tmp_path / "slime"
    folder.mkdir()
    (folder / "rollout_1.pt").write_bytes(pickle.dumps({"rollout_id": 1, "samples": [Payload()]}))
    report = import_run("slime", folder, tmp_path / "logs", "run")
    assert report.imported == [] and "rollout_1.pt" in report.problems[0] and "weights_only" in report.problems[0]
    assert "pickle code ran" not in capsys.readouterr().out
    assert not (tmp_path / "logs" / "run").exists()  # nothing to import: no run


@pytest.mark.parametrize("page", [None, "token_inspector", "groups", "replay", "algorithm_weighting", "token_stats",
                                  "advantages", "mismatch"])
def test_pages_render_an_imported_per_token_run_and_say_what_it_lacks(page, samples, tokenizer_dir, tmp_path,
                                                                      monkeypatch):
    from test_dashboard import open_page, plotly_spec

    import_run("prime-rl", write_prime_rl(tmp_path / "p", samples), tmp_path / "logs", "run", tokenizer_dir)
    at = open_page(str(tmp_path / "logs"), page, monkeypatch, run="run", step=2, rollout=0)
    shown = " ".join(str(x.value) for x in (*at.markdown, *at.caption, *at.info)).replace("\\", "")  # md escapes
    assert "Imported from prime-rl dumps" in shown and "no optimisation passes" in shown
    assert "eval rollouts are never trained on" not in shown  # a train rollout of an import is not an eval one
    assert not at.error, [e.value for e in at.error]  # what the dump lacks is said, not refused
    if page == "groups":  # no correctness and no reward logged: said so, not called "mixed"
        groups = at.dataframe[0].value
        assert set(groups["outcome"]) == {"no reward"} and set(groups["reward_std"]) == {"–"}  # not 0
    if page == "advantages":  # the fixture's prime-rl version writes no rewards: the trainer's advantages instead
        assert "no logged reward" in shown and "logged_advantage" not in shown
        assert "The advantage the trainer logged per token" in json.dumps(plotly_spec(at, "advantage_schemes"))


def test_prime_rl_first_format_one_file_per_rank_for_every_step(samples, tmp_path):
    """prime-rl e971d905 wrote token_exports/rank_<R>.jsonl for all steps, each line naming its step."""
    folder = write_prime_rl(tmp_path / "new", samples)
    old = tmp_path / "old" / "token_exports"
    old.mkdir(parents=True)
    for rank in (0, 1):
        lines = [line for step in (1, 2) for line in
                 (folder / "token_exports" / f"step_{step}" / f"rank_{rank}.jsonl").read_text().splitlines()]
        (old / f"rank_{rank}.jsonl").write_text("\n".join(lines) + "\n")
    report = import_run("prime-rl", tmp_path / "old", tmp_path / "logs", "run")
    assert report.imported == [1, 2] and len(report.problems) == 1 and "rank_1.jsonl:" in report.problems[0]
    with RunReader(tmp_path / "logs") as reader:
        got = reader.sql("SELECT step, count(*) FROM tokens WHERE run = 'run' GROUP BY step ORDER BY step").values
    assert got.tolist() == [[step, len(expected(samples, step))] for step in (1, 2)]


def test_a_line_longer_than_the_first_read_limit_is_read_again_with_the_larger_one(samples, tmp_path, monkeypatch):
    """DuckDB reads with its default line limit first (a large one halves its speed); a file with a longer line
    (here 40 MB: a key the importer does not read) is read again with `MAX_LINE_BYTES`, and nothing is lost."""
    from engine.importers import jsonl_dump

    plain = write_prime_rl(tmp_path / "plain", samples)
    padded = write_prime_rl(tmp_path / "padded", samples)
    rank_0 = padded / "token_exports" / "step_1" / "rank_0.jsonl"
    first, rest = rank_0.read_text().split("\n", 1)
    rank_0.write_text(first[:-1] + ',"padding":"' + "x" * (40 << 20) + '"}\n' + rest)
    import_run("prime-rl", plain, tmp_path / "logs", "plain")
    monkeypatch.setattr(jsonl_dump, "MAX_LINE_BYTES", jsonl_dump.LINE_BYTES)
    refused = import_run("prime-rl", padded, tmp_path / "logs", "refused")
    assert any("step_1/rank_0.jsonl" in p and "maximum_object_size" in p for p in refused.problems)
    monkeypatch.undo()
    report = import_run("prime-rl", padded, tmp_path / "logs", "padded")
    assert report.imported == [1, 2] and len(report.problems) == 1  # the truncated line, as in every import
    with RunReader(tmp_path / "logs") as reader:
        columns = "step, rollout_id, position, token_text, sampler_logp, old_logp, entropy, advantage, dump"
        got, plain_rows = (reader.sql(f"SELECT {columns} FROM tokens WHERE run = ? ORDER BY step, rollout_id, "
                                      "position", [run]).to_dict("records") for run in ("padded", "plain"))
    assert len(got) > 0 and got == plain_rows


def test_fields_outside_the_typed_dump_struct_are_kept_as_one_json_object_per_token():
    import pyarrow as pa

    from engine.importers.token_dumps import dump_struct, json_objects

    fields = {"loss_mask": pa.array([True, None, False]), "is_masked": pa.array([False, True, None]),
              "kl": pa.array([1, 2, 3]),  # integers: cast to the member's type (DOUBLE)
              "new_weight": pa.array([0.25, float("nan"), None]), "new_flag": pa.array([True, False, None]),
              "losses": pa.array(['{"rl": {"advantage": 1.5}}', None, "{}"])}
    struct, others = dump_struct(fields)
    rows = struct.to_pylist()
    assert [r["loss_mask"] for r in rows] == [True, None, False]
    assert [r["is_masked"] for r in rows] == [False, True, None]
    assert [r["kl"] for r in rows] == [1.0, 2.0, 3.0]
    assert [r["losses"] for r in rows] == ['{"rl": {"advantage": 1.5}}', None, "{}"]
    assert [r["rl_weights"] for r in rows] == [None] * 3  # a member the dump lacks
    texts = json_objects(others).to_pylist()
    assert texts == ['{"new_weight":0.25,"new_flag":true}', '{"new_weight":null,"new_flag":false}',  # NaN: null
                     '{"new_weight":null,"new_flag":null}']


def test_flattened_tokens_split_at_the_first_trained_token_and_keep_missing_lists_null():
    import pyarrow as pa

    from engine.importers.token_dumps import FlatTokens

    samples = pa.table({
        "token_ids": pa.array([[10, 11, 12, 13], [20, 21], [30, 31, 32]]),
        "loss_mask": pa.array([[False, False, True, False], [False, False], [True, None, True]]),
        "entropy": pa.array([[0.1, 0.2, 0.3, 0.4], None, [0.5, None, 0.7]]),  # sample 1 has none
    })
    flat = FlatTokens(samples)
    assert flat.prompt_len.tolist() == [2, 2, 0]  # sample 1 has no trained token: all prompt
    assert flat.parent.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert flat.position.tolist() == [-2, -1, 0, 1, -2, -1, 0, 1, 2]
    assert flat.completion.to_pylist() == [False, False, True, True, False, False, True, True, True]
    assert flat.values(samples["entropy"]).to_pylist() == [0.1, 0.2, 0.3, 0.4, None, None, 0.5, None, 0.7]
    prompts, completions = flat.joined_texts(pa.array(["a", "b", "c", "d", "e", "f", "g", "h", "i"]))
    assert prompts.to_pylist() == ["ab", "ef", None] and completions.to_pylist() == ["cd", None, "ghi"]


def test_dump_fields_read_through_policylens_sql_and_a_run_imported_before_them_reads_null(samples, tmp_path,
                                                                                           capsys):
    from synthetic_runs import write_run_before_columns

    import_run("prime-rl", write_prime_rl(tmp_path / "p", samples), tmp_path / "logs", "run")
    capsys.readouterr()
    query = "SELECT count(*) FILTER (WHERE dump.loss_mask) AS trained, count(*) AS n FROM tokens"
    assert main(["sql", "run", query, "--logs-dir", str(tmp_path / "logs")]) == 0
    stored = [w for step in (1, 2) for w in expected(samples, step)]
    trained = sum(w["loss_mask"] for w in stored)
    lines = capsys.readouterr().out.splitlines()
    row = lines[next(i for i, line in enumerate(lines) if line.startswith("---")) + 1]
    assert row.split() == [str(trained), str(len(stored))]
    assert 0 < trained < len(stored)  # the tool output tokens are completion tokens, not trained on
    write_run_before_columns(tmp_path / "logs", "old", "tokens", {"rollout_id": [0, 0], "position": [0, 1],
                                                                  "extra": ['{"loss_mask":true}'] * 2}, ["dump"])
    with RunReader(tmp_path / "logs", runs="old") as reader:
        got = reader.sql("SELECT dump, extra->>'loss_mask' AS m FROM tokens ORDER BY position")
    assert got["dump"].isna().all() and got["m"].tolist() == ["true", "true"]


def test_slime_values_that_are_not_finite_numbers_are_null_and_a_malformed_list_costs_its_sample(tmp_path):
    import torch

    folder = tmp_path / "slime"
    folder.mkdir()
    rollout = [{"group_index": 0, "index": i, "tokens": [7, 8, 9, 10, 11], "response_length": 3, "reward": 1.0,
                "rollout_log_probs": logp} for i, logp in enumerate([[-0.5, None, float("nan")], [[1, 2], [3, 4]]])]
    train = [{"rollout_position": 0, "response_lengths": 3, "loss_masks": torch.tensor([True, False, True]),
              "log_probs": torch.tensor([-1.0, -2.0, float("inf")], dtype=torch.bfloat16),
              "entropy": [1, True, "x"], "advantages": torch.tensor([0.25, -0.5, 2.0])}]
    torch.save({"rollout_id": 1, "samples": rollout}, folder / "rollout_1.pt")
    torch.save({"format_version": 2, "rollout_id": 1, "rank": 0, "samples": train}, folder / "train_1_0.pt")
    report = import_run("slime", folder, tmp_path / "logs", "run")
    assert report.imported == [1]
    assert report.problems == ["rollout_1.pt: sample 1: a per-token list that is not one list of numbers "
                               "(2-dimensional); sample skipped"]
    with RunReader(tmp_path / "logs") as reader:
        got = _tokens(reader, "run", 1)
    assert [g["token_id"] for g in got] == [9, 10, 11]
    column = {name: [None if g[name] is None or math.isnan(g[name]) else g[name] for g in got]
              for name in ("sampler_logp", "old_logp", "entropy", "advantage")}
    assert column == {"sampler_logp": [-0.5, None, None], "old_logp": [-1.0, -2.0, None],
                      "entropy": [1.0, 1.0, None], "advantage": [0.25, -0.5, 2.0]}
    assert [g["dump"]["loss_mask"] for g in got] == [True, False, True]
