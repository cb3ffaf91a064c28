"""engine.rollout pieces: log-probs equal the sampler's, step spans -> token indices, group signal, batch layout."""

from __future__ import annotations

import pytest
import torch

from engine.rollout import Rollout, TokenText, generate, group_signal, step_token_ends, token_logprobs
from engine.tasks import Problem, StepScore


@pytest.fixture(scope="module")
def tiny_model():
    from engine.policy import ModelConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(tok, ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), seed=1)
    return model.eval(), tok


def test_old_logprobs_are_the_sampling_distribution(tiny_model):
    """Teacher-forced log-probs over the left-padded batch equal what generate() sampled from, token by token."""
    model, tok = tiny_model
    prompts = ["2x+3=7\n", "-12=5x-8\n", "x+1=2\n"]  # different lengths: left padding matters
    torch.manual_seed(0)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**enc, do_sample=True, max_new_tokens=12, top_k=0, top_p=1.0, temperature=1.0,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    P = enc["input_ids"].shape[1]
    gen = out.sequences[:, P:]  # (N, T)
    scores = torch.stack(out.scores, dim=1).log_softmax(-1)  # (N, T, V)
    expected = scores.gather(-1, gen.unsqueeze(-1)).squeeze(-1)  # (N, T)

    torch.manual_seed(0)
    input_ids, attention_mask, P2 = generate(model, tok, prompts, do_sample=True, temperature=1.0, top_p=1.0,
                                             max_new_tokens=12)
    assert P2 == P
    assert torch.equal(input_ids[:, :P], enc["input_ids"])
    with torch.no_grad():
        logp, entropy = token_logprobs(model, input_ids, attention_mask, P, temperature=1.0)
    mask = attention_mask[:, P:].bool()
    torch.testing.assert_close(logp[mask], expected[:, : logp.shape[1]][mask], atol=1e-4, rtol=1e-4)
    assert (entropy[mask] > 0).all()


def test_step_spans_map_to_last_tokens(tiny_model):
    _, tok = tiny_model
    tt = TokenText(tok)
    text = "2x=7-3\n2x=4\nx=2"
    ids = tok(text, add_special_tokens=False).input_ids
    steps = [StepScore("2x=7-3", 0, 6, 1.0), StepScore("2x=4", 7, 11, 1.0), StepScore("x=2", 12, 15, 1.0)]
    ends = tt.char_ends(ids, text)
    assert ends == list(range(1, len(text) + 1))  # one character per token
    assert step_token_ends(steps, ends) == [5, 10, 14]
    # a tokenizer whose pieces do not concatenate falls back to decoding prefixes, same answer
    assert [len(tok.decode(ids[: k + 1])) for k in range(len(ids))] == ends


def _group(rewards, correct=None, scores=None):
    p = Problem(0, "x=1\n", "1", ("x=1",))
    out = []
    for i, r in enumerate(rewards):
        ro = Rollout(problem=p, group_id=0, index_in_group=i, completion_ids=[1], completion="", truncated=False)
        ro.reward_correct = correct[i] if correct else r
        ro.reward_length = r - ro.reward_correct
        ro.steps = [StepScore("", 0, 0, s) for s in (scores[i] if scores else [])]
        out.append(ro)
    return out


def test_group_signal_names_why_a_group_is_dropped():
    assert group_signal(_group([1.0, 0.0, 1.0]), "outcome") is None
    assert group_signal(_group([1.0, 1.0]), "outcome") == "all_correct"
    assert group_signal(_group([0.0, 0.0]), "outcome") == "all_wrong"
    # equal correctness but different overlong penalties: still a signal
    assert group_signal(_group([0.0, -0.5], correct=[0.0, 0.0]), "outcome") is None
    assert group_signal(_group([-0.5, -0.5], correct=[0.0, 0.0]), "outcome") == "all_wrong"
    # process supervision: a group with identical outcomes but different step scores carries a signal
    assert group_signal(_group([1.0, 1.0], scores=[[1.0, 1.0], [1.0, -1.0]]), "process") is None
    assert group_signal(_group([1.0, 1.0], scores=[[1.0], [1.0, 1.0]]), "process") == "all_correct"


def test_step_spans_start_after_the_previous_step():
    r = _group([1.0])[0]
    assert r.step_spans == []  # no steps (e.g. a completion the step verifier finds nothing in)
    r.step_last_token = [1, 4, 5]
    assert r.step_spans == [(0, 1), (2, 4), (5, 5)]
