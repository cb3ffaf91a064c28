"""Tests of the policy: character tokenizer, tiny model, SFT warm start, warm-start cache, local model loading.

Run: .venv/bin/pytest tests/test_policy.py -q   (tiny models and a few SFT steps: a few seconds)
"""

from __future__ import annotations

import pytest
import torch

from engine import policy
from engine.policy import (
    ModelConfig,
    SFTConfig,
    build_model,
    build_tokenizer,
    count_parameters,
    generate_greedy,
    load_local_model,
    load_policy,
    warm_start,
)
from engine.tasks import get_task

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
QUICK = SFTConfig(steps=3, batch_size=8, warmup_steps=1, num_threads=1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def linear():
    return get_task("linear", seed=0, n_train=300, n_heldout=20)


@pytest.fixture(scope="module")
def chain():
    return get_task("chain", seed=0, n_train=300, n_heldout=16)


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_on_both_tasks(tokenizer, linear, chain):
    texts = ["", " ", "\n", "  x = 2 \n\n", "2x+3=7\n2x=7-3\n2x=4\nx=2", "3+4*2-5\n3+8-5\n11-5\n6"]
    for task in (linear, chain):
        for p in task.heldout:
            texts += [p.prompt, task.solution_text(p), p.prompt + task.solution_text(p)]
    for text in texts:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert len(ids) == len(text) + 1  # one token per character
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.unk_token_id not in ids
        # Every token shows as its own character, spaces and newlines included.
        assert "".join(tokenizer.convert_ids_to_tokens(ids[1:])) == text
        assert "".join(tokenizer.decode([i]) for i in ids[1:]) == text


def test_tokenizer_special_tokens_and_save(tokenizer, tmp_path):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer("x=2", add_special_tokens=False).input_ids == tokenizer("x=2").input_ids[1:]
    assert tokenizer.decode(tokenizer("é").input_ids[1:]) == "<unk>"
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "7=2x+3\n 2x=4\nx=2"
    assert again(text).input_ids == tokenizer(text).input_ids
    assert again.decode(again(text).input_ids, skip_special_tokens=True) == text


def test_token_offsets(tokenizer):
    ids = [*tokenizer("2x=4\nx=2", add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    from engine.rollout import TokenText, step_token_ends

    ends = TokenText(tokenizer).char_ends(ids, "2x=4\nx=2")
    assert ends == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    task = get_task("linear", n_train=10, n_heldout=2)
    from engine.tasks.linear import make_problem

    steps = task.process_reward(make_problem(0, 2, 3, 2, 0), "2x=4\nx=2")
    assert step_token_ends(steps, ends) == [3, 7]


# ---------------------------------------------------------------- model and warm start


def test_default_model_is_small(tokenizer):
    model = build_model(tokenizer)
    n = count_parameters(model)
    assert 100_000 < n < 5_000_000
    assert model.config.eos_token_id == tokenizer.eos_token_id
    a, b = build_model(tokenizer, TINY, seed=1), build_model(tokenizer, TINY, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_sft_lowers_the_loss_and_is_deterministic(tokenizer, linear):
    sft = SFTConfig(steps=25, batch_size=16, warmup_steps=2, lr=3e-3, num_threads=1)
    model = build_model(tokenizer, TINY, seed=0)
    stats = warm_start(linear, tokenizer, model, sft, seed=0)
    losses = stats["losses"]
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    again = warm_start(linear, tokenizer, build_model(tokenizer, TINY, seed=0), SFTConfig(
        steps=3, batch_size=16, warmup_steps=2, lr=3e-3, num_threads=1), seed=0)
    assert again["losses"] == losses[:3]


def test_sft_batch_masks_the_prompt(tokenizer):
    batch = policy.sft_batch(tokenizer, ["2x+3=7\n", "x=1\n"], ["x=2", "x=1"])
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape == (2, 1 + 7 + 3 + 1)
    assert labels[0].tolist() == [-100] * 8 + ids[0, 8:].tolist()
    assert ids[0, -1].item() == tokenizer.eos_token_id
    assert labels[1].tolist() == [-100] * 5 + ids[1, 5:9].tolist() + [-100] * 3  # padding ignored
    assert mask[1].tolist() == [1] * 9 + [0] * 3


def test_greedy_batched_equals_unbatched(tokenizer, linear):
    model = build_model(tokenizer, TINY, seed=0)
    warm_start(linear, tokenizer, model, QUICK)
    prompts = [p.prompt for p in linear.heldout[:6]] + ["3+4*2-5\n"]
    batched = generate_greedy(model, tokenizer, prompts, max_new_tokens=12)
    single = [generate_greedy(model, tokenizer, [p], max_new_tokens=12)[0] for p in prompts]
    assert batched == single
    acc = policy.greedy_accuracy(model, tokenizer, linear, linear.heldout[:6], max_new_tokens=12)
    assert 0.0 <= acc <= 1.0


# ---------------------------------------------------------------- cache and local models


def test_warm_start_cache_is_reused(tmp_path, linear, monkeypatch):
    cache = tmp_path / ".cache"
    m1, tok1, desc1 = load_policy(linear, cache_dir=cache, model_config=TINY, sft=QUICK, seed=0, device="cpu")
    (entry,) = [d for d in cache.iterdir()]
    assert entry.name.startswith("warmstart-") and (entry / "warmstart.json").is_file()
    mtime = entry.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("warm start ran again instead of using the cache")

    monkeypatch.setattr(policy, "warm_start", no_training)
    m2, tok2, desc2 = load_policy(linear, cache_dir=cache, model_config=TINY, sft=QUICK, seed=0, device="cpu")
    assert "cached" in desc2 and "cached" not in desc1
    assert entry.stat().st_mtime_ns == mtime and sorted(cache.iterdir()) == [entry]  # no temp dirs left
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert tok2("x=2").input_ids == tok1("x=2").input_ids
    # Another seed or SFT setting is another cache entry (and trains).
    monkeypatch.undo()
    load_policy(linear, cache_dir=cache, model_config=TINY, sft=QUICK, seed=1, device="cpu")
    assert len(list(cache.iterdir())) == 2


def test_load_local_model_round_trip(tmp_path, tokenizer):
    model = build_model(tokenizer, TINY, seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, tok = load_local_model(tmp_path)
    ids = torch.tensor([tok("2x+3=7\n").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits)
    m, _, desc = load_policy(None, model_dir=tmp_path, device="cpu")
    assert "local model" in desc and count_parameters(m) == count_parameters(model)


def test_load_local_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_local_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="no transformers model"):
        load_local_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weights"):
        load_local_model(tmp_path)


@pytest.mark.parametrize(
    ("solution", "slipped"),
    [
        ("2x=-7-3\n2x=-10\nx=-5", "2x=-7-3\n2x=-10\nx=5"),  # only the final answer's sign is dropped
        ("x=-3", "x=3"),
        ("6-14+1\n-8+1\n-7", "6-14+1\n-8+1\n7"),  # chain task: a bare negative number
        ("2x=7-3\n2x=4\nx=2", "2x=7-3\n2x=4\nx=2"),  # a positive answer has no sign to forget
        ("7-3", "7-3"),  # a subtraction is not a sign
        ("no number", "no number"),
    ],
)
def test_answer_slip_drops_only_the_sign_of_a_negative_final_answer(solution, slipped):
    from engine.policy import slip_answer_sign

    assert slip_answer_sign(solution) == slipped


def test_warmstart_command_builds_the_cache_that_train_then_uses(tmp_path, capsys):
    """`policylens warmstart FLAGS` trains the warm start `policylens train FLAGS` looks up, reports its SFT progress
    in the progress file, and a second call (or the run) reuses it instead of training again."""
    import json

    from engine.cli import main
    from engine.runlog import list_runs

    flags = ["--model-size", "tiny", "--sft-steps", "30", "--eval-size", "4", "--logs-dir", str(tmp_path / "logs"),
             "--cache-dir", str(tmp_path / "cache")]
    progress_file = tmp_path / "progress.json"
    assert main(["warmstart", *flags, "--threads", "1", "--progress-file", str(progress_file)]) == 0
    out = capsys.readouterr().out
    assert "sft step    30/30" in out and "held-out greedy accuracy" in out and "on 4 prompts" in out
    progress = json.loads(progress_file.read_text())
    assert progress["step"] == progress["steps"] == 30 and progress["loss"] > 0
    (cached,) = (tmp_path / "cache").glob("warmstart-*")

    progress_file.unlink()
    assert main(["warmstart", *flags, "--threads", "1", "--progress-file", str(progress_file)]) == 0
    assert "sft step" not in capsys.readouterr().out and not progress_file.exists()  # reused: nothing trained

    assert main(["train", *flags, "--steps", "1", "--batch-size", "8", "--group-size", "4", "--eval-every", "0",
                 "--run-name", "uses-cache", "--no-progress"]) == 0
    (info,) = list_runs(tmp_path / "logs")
    assert f"cached {cached.name}" in info["model"]


def test_warmstart_command_refuses_a_local_model(tmp_path, capsys):
    from engine.cli import main

    assert main(["warmstart", "--model", str(tmp_path), "--logs-dir", str(tmp_path)]) == 2
    assert "only the built-in model has a warm start" in capsys.readouterr().err
