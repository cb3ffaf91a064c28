"""Token trajectories and token statistics: the engine's teacher-forced scoring of the held-out reference solutions
(`ref_tokens`), the dashboard's queries over the logged rows, and the two views under AppTest on engine-trained runs.

Expected values are computed here independently: a plain forward pass per problem for the scoring, pandas over the
raw Parquet rows for the queries.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from engine.tasks import get_task

# ---------------------------------------------------------------- engine: answer classes and reference scoring


def test_answer_classes_split_by_the_sign_of_the_answer():
    for name in ("linear", "chain"):
        task = get_task(name, seed=0)
        assert task.answer_classes == ("negative", "non-negative")
        for p in task.heldout:
            assert task.answer_class(p) == ("negative" if int(p.answer) < 0 else "non-negative")
        assert {task.answer_class(p) for p in task.heldout} == set(task.answer_classes)
    linear = get_task("linear", seed=0)
    zero = next(p for p in linear.heldout + linear.train if p.answer == "0")
    assert linear.answer_class(zero) == "non-negative"


@pytest.fixture(scope="module")
def random_policy():
    from engine.policy import ModelConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(tok, ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), seed=3)
    return model.eval(), tok


def manual_scores(model, tok, prompt: str, completion: str, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """Log-prob and entropy of each completion token (then EOS) from one unpadded forward of one sequence."""
    prompt_ids = tok(prompt).input_ids
    ids = prompt_ids + tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double() / temperature  # (L, V)
    logp_all = torch.log_softmax(logits, -1)
    logp, entropy = [], []
    for t in range(len(prompt_ids), len(ids)):
        row = logp_all[t - 1]  # the distribution that predicts token t
        logp.append(float(row[ids[t]]))
        entropy.append(float(-(row.exp() * row).sum()))
    return np.array(logp), np.array(entropy)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_scoring_equals_a_manual_forward_pass(random_policy, temperature):
    from engine.rollout import TokenText, score_references

    model, tok = random_policy
    task = get_task("linear", seed=0)
    # Different prompt and solution lengths, so both paddings matter.
    problems = sorted(task.heldout[:40], key=lambda p: (len(p.prompt), len(task.solution_text(p))))
    problems = [problems[0], problems[-1], problems[len(problems) // 2]]
    scores = score_references(model, tok, task, problems, temperature)
    rows = pd.DataFrame(scores.rows(task, TokenText(tok)))
    for problem in problems:
        solution = task.solution_text(problem)
        logp, entropy = manual_scores(model, tok, problem.prompt, solution, temperature)
        mine = rows[rows.prompt_id == problem.prompt_id].sort_values("position")
        assert mine.position.tolist() == list(range(len(solution) + 1))
        assert mine.token_text.tolist() == [*solution, "<eos>"]
        assert (mine.answer_class == task.answer_class(problem)).all()
        np.testing.assert_allclose(mine.logp.to_numpy(), logp, atol=2e-5)
        np.testing.assert_allclose(mine.entropy.to_numpy(), entropy, atol=2e-5)


def logged(logs_dir, table: str) -> pd.DataFrame:
    """Every row of a table straight from the run's Parquet files with pandas (not the run-log reader)."""
    files = sorted(p for p in Path(logs_dir).glob(f"*/data/**/{table}.parquet")
                   if not any(part.startswith(".") for part in p.relative_to(logs_dir).parts))
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    return frame.drop_duplicates(subset=[c for c in frame.columns if frame[c].map(np.isscalar).all()])


def test_training_logs_the_reference_scores_of_every_evaluation(tiny_run, warm_cache):
    from engine.policy import SFTConfig, load_policy
    from engine.rollout import TokenText, score_references
    from engine.train import CHECKPOINT_DIR, CHECKPOINT_FILE, model_config

    logs_dir, run = tiny_run
    cfg = json.loads((Path(logs_dir) / run / "run.json").read_text())["config"]
    task = get_task(cfg["task"], seed=cfg["task_seed"])
    ref = logged(logs_dir, "ref_tokens")
    steps = logged(logs_dir, "steps")
    eval_steps = sorted(steps.loc[steps.heldout_accuracy.notna(), "step"])
    assert sorted(ref.step.unique()) == eval_steps == [0, 2, 3]
    heldout = task.heldout[: cfg["eval_size"]]
    for _step, frame in ref.groupby("step"):
        assert sorted(frame.prompt_id.unique()) == [p.prompt_id for p in heldout]
        for p in heldout:
            mine = frame[frame.prompt_id == p.prompt_id].sort_values("position")
            assert "".join(mine.token_text) == task.solution_text(p) + "<eos>"
            assert set(mine.answer_class) == {task.answer_class(p)}
        assert (frame.logp <= 0).all() and (frame.entropy >= 0).all()

    # The last evaluation scored the final policy: the run's checkpoint gives the same numbers.
    model, tok, _ = load_policy(task, cache_dir=warm_cache, seed=cfg["task_seed"],
                                model_config=model_config(cfg["model_size"]),
                                sft=SFTConfig(steps=cfg["sft_steps"], warmup_steps=min(20, cfg["sft_steps"]),
                                              num_threads=1), device="cpu")
    tt = TokenText(tok)
    warm = pd.DataFrame(score_references(model.eval(), tok, task, heldout, cfg["temperature"]).rows(task, tt))
    first = ref[ref.step == 0].sort_values(["prompt_id", "position"])
    np.testing.assert_allclose(first.logp.to_numpy(), warm.sort_values(["prompt_id", "position"]).logp, atol=1e-5)
    ckpt = torch.load(Path(logs_dir) / run / CHECKPOINT_DIR / CHECKPOINT_FILE, weights_only=False)
    assert ckpt["step"] == 3
    model.load_state_dict(ckpt["model"])
    final = pd.DataFrame(score_references(model.eval(), tok, task, heldout, cfg["temperature"]).rows(task, tt))
    last = ref[ref.step == 3].sort_values(["prompt_id", "position"])
    np.testing.assert_allclose(last.logp.to_numpy(), final.sort_values(["prompt_id", "position"]).logp, atol=1e-5)
    assert np.abs(last.logp.to_numpy() - first.logp.to_numpy()).max() > 1e-4  # training moved them
