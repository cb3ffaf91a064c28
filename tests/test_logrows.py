"""Tests of engine/logrows.py: a training batch written as run-log rows and read back gives the same tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_config

from engine.logrows import pass_record, step_metrics, step_tables, step_totals
from engine.objectives import CLIP_HIGH, CLIP_LOW, policy_loss
from engine.rollout import Batch, Rollout, TokenText
from engine.runlog import RunWriter
from engine.tasks import Problem, StepScore

LENGTHS = [5, 7, 3, 6]  # B = 4 completions, two groups of two; T = 9 leaves two columns of padding everywhere
T = 9
MINIBATCHES = [torch.tensor([0, 2]), torch.tensor([1, 3])]


def _tokenizer():
    from engine.policy import build_tokenizer

    return build_tokenizer()


def _batch(tokenizer) -> Batch:
    """A batch as engine.rollout.collect_batch builds it, with random but fixed numbers and two steps per rollout."""
    gen = torch.Generator().manual_seed(0)
    B = len(LENGTHS)
    token_mask = torch.zeros(B, T)
    for b, n in enumerate(LENGTHS):
        token_mask[b, :n] = 1.0
    rewards = [1.0, 0.0, 0.0, 1.0]
    rollouts = []
    for b, n in enumerate(LENGTHS):
        ids = torch.randint(4, tokenizer.vocab_size, (n,), generator=gen).tolist()
        r = Rollout(problem=Problem(b // 2, "2x+3=7\n", "2", ("2x=4", "x=2")), group_id=b // 2, index_in_group=b % 2,
                    completion_ids=ids, completion=tokenizer.decode(ids), truncated=False, reward_correct=rewards[b])
        r.steps = [StepScore("first", 0, 1, 0.5), StepScore("second", 1, 2, -1.0 + b)]
        r.step_last_token = [1, n - 1]
        r.step_reward_norm = [0.1 * b, -0.2 * b]
        r.advantage = rewards[b] - 0.5
        rollouts.append(r)
    old_logp = -torch.rand(B, T, generator=gen) * token_mask  # (B, T)
    advantages = torch.tensor([r.advantage for r in rollouts])[:, None] * token_mask  # (B, T)
    return Batch(
        rollouts=rollouts, dropped=[], gen_batches=1, input_ids=torch.zeros(B, 3 + T, dtype=torch.long),
        attention_mask=torch.ones(B, 3 + T, dtype=torch.long), prompt_len=3, token_mask=token_mask,
        loss_mask=token_mask.clone(), old_logp=old_logp,
        ref_logp=old_logp - 0.3 * torch.rand(B, T, generator=gen),  # not masked, as the trainer keeps it
        entropy=torch.rand(B, T, generator=gen) * token_mask, advantages=advantages,
    )


def _passes(batch: Batch, algo: str):
    """One pass per mini-batch, with log-probs moved away from old_logp so ratios and clips are not trivial."""
    gen = torch.Generator().manual_seed(1)
    records, used = [], torch.zeros(len(LENGTHS), T)
    for idx in MINIBATCHES:
        t = int(batch.token_mask[idx].sum(-1).max())  # the trainer trims each mini-batch to its longest completion
        logp = batch.old_logp[idx, :t] + 0.4 * torch.randn(len(idx), t, generator=gen) * batch.token_mask[idx, :t]
        out = policy_loss(algo, logp, batch.old_logp[idx, :t], batch.advantages[idx, :t], batch.loss_mask[idx, :t],
                          ref_logp=batch.ref_logp[idx, :t], entropy=batch.entropy[idx, :t])
        records.append(pass_record(idx, T, logp, out, grad_norm=1.0))
        used[idx, :t] = logp
    return records, used


@pytest.mark.parametrize("algo", ["gspo", "grpo"])
def test_a_batch_written_as_rows_reads_back_as_the_same_tensors(tmp_path, algo):
    from dashboard.queries import weighed_passes, weighed_tokens
    from dashboard.recompute import StepInputs

    tokenizer = _tokenizer()
    batch = _batch(tokenizer)
    records, used_logp = _passes(batch, algo)
    cfg = tiny_config(algo=algo, batch_size=4, group_size=2, epochs=1, minibatches=2)
    tables = step_tables(batch, records, None, TokenText(tokenizer), group_size=cfg.group_size,
                         log_tokens=cfg.log_tokens)
    with RunWriter.create(tmp_path, "round-trip", algorithm=algo, task="linear", config=cfg.to_dict()) as log:
        log.log_step(1, metrics=step_metrics(step_totals(batch, records, cfg.group_size), records, None,
                                           algo=cfg.algo, lr=cfg.lr, groups_kept=cfg.prompts_per_step), **tables)

    key = (str(tmp_path), "round-trip", 1, (0, 1, 2, 3))  # what the weighting page reads, at the first update
    logged = StepInputs(weighed_tokens(*key)).at_update(0, lambda update: weighed_passes(*key, update))

    n = max(LENGTHS)  # the log has no padding: the tensors come back (B, longest completion)
    assert logged.rollout_ids == [0, 1, 2, 3]
    assert logged.lengths.tolist() == LENGTHS
    on = batch.token_mask[:, :n] > 0
    torch.testing.assert_close(logged.mask, batch.token_mask[:, :n].double(), rtol=0, atol=0)
    assert not batch.token_mask[:, n:].any()
    for name in ("old_logp", "entropy", "advantages"):
        torch.testing.assert_close(getattr(logged, name), getattr(batch, name)[:, :n].double(), rtol=0, atol=0)
    torch.testing.assert_close(logged.ref_logp[on], batch.ref_logp[:, :n][on].double(), rtol=0, atol=0)
    # new_logp is stored as given where the ratio is not the token's (GSPO), else derived as old + ln(ratio)
    # (engine.runlog.derived): equal at float32 precision
    torch.testing.assert_close(logged.logp[on], used_logp[:, :n][on].double(), rtol=0, atol=1e-6)

    # Asking the objective again on what was read back gives what the trainer's pass computed.
    for rec, idx in zip(records, MINIBATCHES, strict=True):
        t = int(logged.lengths[idx].max())
        again = policy_loss(algo, logged.logp[idx, :t], logged.old_logp[idx, :t], logged.advantages[idx, :t],
                            logged.mask[idx, :t], ref_logp=logged.ref_logp[idx, :t], entropy=logged.entropy[idx, :t])
        mask = logged.mask[idx, :t] > 0
        np.testing.assert_array_equal(again.clip[mask].numpy(), rec.clip[:, :t][mask].numpy())
        torch.testing.assert_close(again.ratio[mask].float(), rec.ratio[:, :t][mask], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(again.grad_weight[mask].float(), rec.grad_weight[:, :t][mask], rtol=1e-4, atol=1e-6)


def test_step_rows_number_ids_and_carry_the_objectives_diagnostics(tmp_path):
    tokenizer = _tokenizer()
    batch = _batch(tokenizer)
    records, _ = _passes(batch, "gspo")
    cfg = tiny_config(algo="gspo", batch_size=4, group_size=2, epochs=1, minibatches=2)
    tables = step_tables(batch, records, None, TokenText(tokenizer), group_size=cfg.group_size,
                         log_tokens=cfg.log_tokens)

    # Rollout b of the batch is rollout id b; its sequence ratio per pass is the one policy_loss reported.
    assert tables["rollouts"]["rollout_id"] == [0, 1, 2, 3]
    for rec, idx in zip(records, MINIBATCHES, strict=True):
        for i, s in zip(idx.tolist(), rec.seq_ratio.tolist(), strict=True):
            assert tables["rollouts"]["seq_ratio"][i] == [s]
    # Token-level objectives have no sequence ratio.
    grpo_records, _ = _passes(batch, "grpo")
    grpo_tables = step_tables(batch, grpo_records, None, TokenText(tokenizer), group_size=cfg.group_size,
                              log_tokens=cfg.log_tokens)
    assert all(s is None for s in grpo_tables["rollouts"]["seq_ratio"])

    # Step spans: step 0 covers tokens 0-1, step 1 the rest, in prm_steps and in each token's prm_step.
    prm = tables["prm_steps"]
    assert prm["first_pos"] == [0, 2] * 4 and prm["last_pos"] == [p for n in LENGTHS for p in (1, n - 1)]
    expected = [j for n in LENGTHS for j in [0, 0] + [1] * (n - 2)]
    assert tables["tokens"]["prm_step"] == expected

    # KL is logged even with beta = 0 (GSPO): k3 of the reference, over the tokens of each pass.
    passes = tables["token_passes"]
    for rec, idx in zip(records, MINIBATCHES, strict=True):
        for row, b in enumerate(idx.tolist()):
            n = LENGTHS[b]
            sel = passes["rollout_id"] == b
            delta = (batch.ref_logp[b, :n] - rec.new_logp[row, :n]).double()
            np.testing.assert_allclose(passes["kl"][sel], (torch.exp(delta) - delta - 1).numpy(), rtol=1e-5,
                                       atol=1e-6)  # float32 k3 near 0

    # Clip fractions count the objective's codes over the loss tokens of every pass: here one epoch of two
    # mini-batches, so each token once (the count used to be the batch's tokens times the mini-batches per epoch).
    metrics = step_metrics(step_totals(batch, records, cfg.group_size), records, None, algo=cfg.algo, lr=cfg.lr,
                           groups_kept=cfg.prompts_per_step)
    n_tokens = sum(LENGTHS)
    assert metrics["clip_low_frac"] == pytest.approx(float((passes["clip"] == CLIP_LOW).sum()) / n_tokens)
    assert metrics["clip_high_frac"] == pytest.approx(float((passes["clip"] == CLIP_HIGH).sum()) / n_tokens)
