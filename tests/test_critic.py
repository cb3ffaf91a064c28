"""PPO's critic (engine.critic): rewards with the KL inside, the clipped value loss against autograd, a real run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from engine.critic import explained_variance, masked_moments, score_rewards, token_rewards, value_loss
from engine.rollout import Rollout
from engine.runlog import RunReader
from engine.tasks.base import Problem, StepScore

F64 = torch.float64


def rollout(n_tokens: int, correct: float = 0.0, step_ends=(), step_scores=()) -> Rollout:
    problem = Problem(prompt_id=0, prompt="2x=4\n", answer="2", solution=("x=2",))
    steps = [StepScore(text="s", start=0, end=1, score=s) for s in step_scores]
    return Rollout(problem=problem, group_id=0, index_in_group=0, completion_ids=[5] * n_tokens, completion="",
                   truncated=False, reward_correct=correct, steps=steps, step_last_token=list(step_ends))


# ----------------------------------------------------------------------------- where the reward lands


def test_outcome_reward_sits_on_the_last_token_and_process_rewards_on_each_steps_last_token():
    rollouts = [rollout(3, correct=1.0), rollout(5, correct=0.0), rollout(4, step_ends=(1, 3), step_scores=(0.5, -1))]
    outcome = score_rewards(rollouts, 5, "outcome")
    expected = torch.zeros(3, 5)
    expected[0, 2] = 1.0  # the third and last token of a 3-token completion; a wrong one (row 1) gets 0 everywhere
    torch.testing.assert_close(outcome, expected)
    process = score_rewards(rollouts[2:], 5, "process")
    torch.testing.assert_close(process, torch.tensor([[0.0, 0.5, 0.0, -1.0, 0.0]]))


def test_kl_part_of_the_reward_is_on_every_token_and_nowhere_else():
    # r_t = score_t - kl_coef * (logp - ref_logp): with kl_coef 0.1, log ratios [0.5, -1.0, 2.0] and the score 1 on
    # the last token: kl_reward = [-0.05, 0.1, -0.2], rewards = [-0.05, 0.1, 0.8]; the padded 4th token gets 0.
    logp = torch.tensor([[-1.0, -2.0, -0.5, -9.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -2.5, -1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    rewards, kl_reward = token_rewards(scores, logp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl_reward, torch.tensor([[-0.05, 0.1, -0.2, 0.0]], dtype=F64))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 0.8, 0.0]], dtype=F64))


# ----------------------------------------------------------------------------- the value loss


def test_value_loss_by_hand():
    # clip 0.2, returns 1: token 0 V 0.5 (old 0.45, inside the range): both errors 0.25;
    # token 1 V 0.9 (old 0.5: clipped to 0.7, error 0.09 > 0.01, the clipped one counts);
    # token 2 V 0.0 (old 0.5: clipped to 0.3, error 0.49 < 1.0, the unclipped one counts); token 3 masked.
    # loss = 0.5 * (0.25 + 0.09 + 1.0) / 3; clipped fraction 1/3.
    values = torch.tensor([[0.5, 0.9, 0.0, 4.0]], dtype=F64)
    old = torch.tensor([[0.45, 0.5, 0.5, 0.0]], dtype=F64)
    returns = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, frac = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.09 + 1.0) / 3)
    assert frac.item() == pytest.approx(1 / 3)
    # one rank's share of a mini-batch spread over ranks, 12 mask tokens in all: the same sums over 12, not 3
    share, share_frac = value_loss(values, old, returns, mask, clip=0.2, tokens=12)
    assert share.item() == pytest.approx(0.5 * (0.25 + 0.09 + 1.0) / 12)
    assert share_frac.item() == pytest.approx(1 / 12)


def test_masked_moments_by_hand():
    # masked entries 1, 2, 3 and 4: mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25;
    # the second column is the first plus 1e8 in float64: the same variance (E[x^2] - E[x]^2 would lose it all)
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, -7.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    n, [(mean, var), (mean_far, var_far)] = masked_moments([x, x.double() + 1e8], mask)
    assert n == 4 and mean == pytest.approx(2.5) and var == pytest.approx(1.25)
    assert mean_far == pytest.approx(1e8 + 2.5) and var_far == pytest.approx(1.25, rel=1e-9)


def test_value_loss_gradient_matches_autograd_and_the_closed_form():
    gen = torch.Generator().manual_seed(3)
    B, T, clip = 4, 6, 0.2
    old = torch.randn(B, T, generator=gen, dtype=F64)
    values = (old + 0.5 * torch.randn(B, T, generator=gen, dtype=F64)).requires_grad_(True)
    returns = torch.randn(B, T, generator=gen, dtype=F64)
    mask = (torch.rand(B, T, generator=gen) > 0.2).to(F64)
    loss, _ = value_loss(values, old, returns, mask, clip)
    (grad,) = torch.autograd.grad(loss, values)
    # d/dV of 0.5 * max(e, e_clip) / n: (V - R) / n where the unclipped error is the larger one; where the clipped one
    # is, (V_clip - R) / n if V is inside [old - clip, old + clip] (there V_clip = V) and 0 outside (V_clip constant).
    v = values.detach()
    n = mask.sum()
    v_clip = old + (v - old).clamp(-clip, clip)
    inside = ((v - old).abs() < clip).to(F64)
    use_clipped = (v_clip - returns) ** 2 > (v - returns) ** 2
    expected = torch.where(use_clipped, (v_clip - returns) * inside, v - returns) * mask / n
    torch.testing.assert_close(grad, expected)
    assert bool(((grad == 0) & (mask > 0)).any()), "the random values never left the clip range on the losing side"
    # and the whole thing against a plain per-token loop
    total = 0.0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                vc = min(max(v[b, t].item(), old[b, t].item() - clip), old[b, t].item() + clip)
                total += 0.5 * max((v[b, t].item() - returns[b, t].item()) ** 2, (vc - returns[b, t].item()) ** 2)
    assert loss.item() == pytest.approx(total / n.item())


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 0.0, 1.0, 0.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # Var(R) = 0.25; values 0.5 everywhere: Var(R - V) = 0.25 -> 0; perfect values -> 1; V = 1 - R -> 1 - 1 / 0.25
    assert explained_variance(torch.full((1, 5), 0.5), returns, mask) == pytest.approx(0.0)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(1 - returns, returns, mask) == pytest.approx(-3.0)
    assert math.isnan(explained_variance(returns, torch.ones(1, 5), mask))


# ----------------------------------------------------------------------------- config


def test_ppo_loop_settings_come_from_the_registry_and_others_refuse_them():
    from engine.config import ConfigError, TrainConfig
    from engine.objectives import OBJECTIVES, uses_critic

    cfg = TrainConfig(algo="ppo")
    assert uses_critic("ppo") and not uses_critic("grpo")
    for name, value in OBJECTIVES["ppo"].loop:
        assert getattr(cfg, name) == value
    assert (cfg.gae_gamma, cfg.gae_lambda, cfg.beta) == (1.0, 0.95, 0.0)  # the KL is in the reward, not the loss
    assert cfg.critic_lr == 10 * cfg.lr
    assert TrainConfig(algo="grpo").gae_lambda is None
    with pytest.raises(ConfigError, match="gae_lambda only apply to algorithms with a critic"):
        TrainConfig(algo="grpo", gae_lambda=0.5)
    with pytest.raises(ConfigError, match=r"gae_lambda must be in \[0, 1\]"):
        TrainConfig(algo="ppo", gae_lambda=1.5)


# ----------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, run_tiny):
    logs_dir = tmp_path_factory.mktemp("ppo")
    assert run_tiny(logs_dir, "tiny-ppo", algo="ppo", steps=2, eval_every=2, checkpoint_every=1) == "finished"
    return logs_dir, "tiny-ppo"


def test_two_step_ppo_run_logs_values_returns_and_the_kl_reward(ppo_run):
    logs_dir, run = ppo_run
    with RunReader(logs_dir) as r:
        cfg = json.loads(r.sql("SELECT config FROM runs WHERE run = ?", [run]).config[0])
        tok = r.sql("""SELECT t.*, r.kind, r.length, r.reward FROM tokens t JOIN rollouts r
                       USING (run, step, rollout_id) WHERE t.run = ? ORDER BY step, rollout_id, position""", [run])
        steps = r.sql("SELECT * FROM steps WHERE run = ? AND step > 0 ORDER BY step", [run])
    train = tok[tok.kind == "train"]
    assert len(train) and train[["value", "return", "kl_reward"]].notna().all().all()
    assert tok[tok.kind == "eval"][["value", "return", "kl_reward"]].isna().all().all()  # held-out: no critic
    # returns = GAE advantage (logged before whitening) + value; the KL part of the reward on every token
    np.testing.assert_allclose(train["return"], train.advantage + train.value, atol=1e-5)
    np.testing.assert_allclose(train.kl_reward, -cfg["kl_coef"] * (train.old_logp - train.ref_logp), atol=1e-6)
    # GAE recomputed from the logged rows (the outcome reward on each completion's last token) gives the same numbers
    from engine.advantages import gae_advantages

    for (_, _), g in train.groupby(["step", "rollout_id"]):
        rewards = g.kl_reward.to_numpy().copy()
        rewards[-1] += g.reward.iloc[0]
        adv, _ = gae_advantages(torch.tensor(rewards[None]), torch.tensor(g.value.to_numpy()[None]),
                                torch.ones(1, len(g)), cfg["gae_gamma"], cfg["gae_lambda"])
        np.testing.assert_allclose(adv[0].numpy(), g.advantage, atol=1e-5)
    assert steps.step.tolist() == [1, 2]
    for column in ("value_loss", "explained_variance", "critic_grad_norm", "critic_seconds", "critic_memory_mb"):
        assert steps[column].notna().all(), column
    assert (steps.critic_memory_mb > 0).all() and (steps.critic_seconds > 0).all()
    assert (steps.advantage_std > 0).all()  # whitening statistics of the GAE advantages


def test_ppo_run_resumes_with_its_critic(ppo_run, run_tiny):
    from engine.train import checkpoint_steps

    logs_dir, run = ppo_run
    (saved,) = checkpoint_steps(logs_dir / run).values()  # a finished run keeps its newest checkpoint
    saved = torch.load(saved, weights_only=False)["critic"]
    assert saved["optimizer"]["state"], "the critic's optimizer state was not saved"
    assert run_tiny(logs_dir, run, resume=True, algo="ppo", steps=3, eval_every=2, checkpoint_every=1) == "finished"
    with RunReader(logs_dir) as r:
        steps = r.sql("SELECT step, value_loss FROM steps WHERE run = ? AND step > 0 ORDER BY step", [run])
    assert steps.step.tolist() == [1, 2, 3] and steps.value_loss.notna().all()


def test_ppo_without_kl_or_token_logging_needs_no_reference(tmp_path, run_tiny):
    # kl_coef 0 and no per-token rows: the reference forward is skipped, and the critic must not ask for it
    status = run_tiny(tmp_path, "ppo-no-ref", algo="ppo", steps=1, eval_every=0, kl_coef=0.0, log_tokens=False)
    assert status == "finished"
    with RunReader(tmp_path) as r:
        assert r.sql("SELECT value_loss FROM steps WHERE run = 'ppo-no-ref'").value_loss.notna().all()
