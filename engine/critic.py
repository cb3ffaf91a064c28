"""PPO's critic: a value model next to the policy, per-token rewards with the KL inside, GAE, the value loss.

What GRPO removed (arXiv 2402.03300, Sec. 4.1.1), put back so that the two can be compared on the same tokens:

    critic = PPOCritic.build(policy, cfg)       # value head on a deep copy of the warm-started transformer
    critic.targets(batch, supervision="outcome", kl_coef=0.05, gamma=1.0, lam=0.95, whiten=True)
                                                # values, per-token rewards, GAE -> batch.values/returns/advantages
    stats = critic.update(batch, gen, epochs=2, minibatches=2, value_clip=0.2, value_coef=0.5, max_grad_norm=1.0)
                                                # epochs x minibatches AdamW steps on the clipped value loss

Per-token reward (Ziegler et al. 2019, arXiv 1909.08593; the GRPO paper's eq. 2):
    r_t = score_t - kl_coef * (log pi_old(o_t) - log pi_ref(o_t))      on every completion token,
where score_t is the outcome reward on the completion's last token (outcome supervision) or each step's score on
that step's last token (process supervision), 0 elsewhere. `kl_reward` is the second term.
Advantages: `engine.advantages.gae_advantages` (gamma, lambda); the loss uses them whitened over the batch's loss
tokens (`masked_whiten`) when `whiten_advantages` is on. The critic's value of token t is read from the hidden state
that predicts token t (the state before the token is chosen), the same position the policy's logits come from.

Value loss (the clipped form of Ziegler et al.'s code and TRL's PPO trainer):
    L_V = value_coef * 0.5 * token-mean over loss tokens of max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)
with R the GAE return and V_old the value at sampling time.

Measured per step: the critic's extra wall time (its forward for the targets plus its update) and its memory:
parameters, gradients and AdamW state (4 x parameter bytes) plus the largest activation footprint of one update pass
(the memory blocks autograd keeps for backward, each counted once, found with saved-tensor hooks; on CPU there is no
allocator to ask). It is what the critic needs at its peak, not what it adds to the process's peak: its update runs
after the policy's and reuses the memory the policy's activations freed (benchmarks/bench_ppo.py measures both).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass

import torch

from engine.advantages import gae_advantages, masked_mean_std
from engine.minibatches import minibatches as minibatch_passes
from engine.minibatches import optimizer_step

__all__ = [
    "CriticStats",
    "PPOCritic",
    "ValueHead",
    "explained_variance",
    "score_rewards",
    "token_rewards",
    "value_loss",
]


# ----------------------------------------------------------------------------- pure functions


def score_rewards(rollouts, T: int, supervision: str) -> torch.Tensor:
    """(B, T) the task's reward placed where PPO's reward model speaks: the outcome reward (correctness plus any
    overlong term) on the completion's last token, or under process supervision each step's score on the last token
    of that step. 0 everywhere else (and for an empty completion)."""
    out = torch.zeros(len(rollouts), T)  # (B, T)
    for b, r in enumerate(rollouts):
        if supervision == "process":
            for step, last in zip(r.steps, r.step_last_token, strict=True):
                if last < T:
                    out[b, last] += step.score
        elif r.length:
            out[b, min(r.length, T) - 1] = r.reward
    return out


def token_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, kl_reward), both (B, T) and 0 off the mask: kl_reward = -kl_coef * (logp - ref_logp) on every
    token, rewards = scores + kl_reward. `logp` is the sampling policy's (pi_old), so the reward is fixed for the
    step."""
    m = mask.to(logp.dtype)
    kl_reward = -kl_coef * (logp - ref_logp) * m  # (B, T)
    return scores.to(logp.dtype) * m + kl_reward, kl_reward


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * token-mean of max((V - R)^2, (V_clip - R)^2), V_clip = clamp(V, V_old +- clip).

    values (differentiable), old_values, returns, mask: (B, T). Returns (loss (), clipped fraction ()): the share
    of mask tokens where the clipped error is the larger one (those tokens get no gradient when V is outside the
    range). Without the `value_coef` factor.
    """
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1.0)
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # (B, T)
    err, err_clipped = (values - returns) ** 2, (clipped - returns) ** 2  # (B, T)
    loss = 0.5 * (torch.maximum(err, err_clipped) * m).sum() / n
    clip_frac = ((err_clipped > err).to(values.dtype) * m).sum() / n
    return loss, clip_frac.detach()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the mask tokens: 1 is a perfect critic, 0 no better than a constant, < 0 worse.
    NaN when the returns do not vary."""
    m = mask.to(torch.float64) > 0
    r, v = returns.detach().to(torch.float64)[m], values.detach().to(torch.float64)[m]
    if r.numel() < 2 or float(r.var(unbiased=False)) == 0.0:
        return math.nan
    return float(1.0 - (r - v).var(unbiased=False) / r.var(unbiased=False))


# ----------------------------------------------------------------------------- the model


class ValueHead(torch.nn.Module):
    """A transformer body (a copy of the policy's, without its LM head) and a linear value head, zero-initialised
    so every value starts at 0 (no return is predicted before the critic has seen one)."""

    def __init__(self, body: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """(N, T) value of each completion token: input (N, P + T) laid out like engine.rollout's batches."""
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (N, L) as engine.rollout.token_logprobs
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state  # (N, L, H)
        return self.head(hidden[:, prompt_len - 1 : -1].float()).squeeze(-1)  # (N, T)


@dataclass
class CriticStats:
    """One step of the critic, as `steps` metrics (see engine.logrows.step_metrics)."""

    value_loss: float  # mean over passes, with value_coef
    value_clip_frac: float  # mean over passes
    explained_variance: float  # of the sampling-time values against the GAE returns
    grad_norm: float  # mean over passes, before clipping
    seconds: float  # the critic's extra wall time this step (targets + update)
    memory_mb: float  # parameters + gradients + AdamW state + largest saved-activation footprint of a pass
    advantage_mean: float  # whitening statistics of the GAE advantages (mean 0, std 1 when not whitened)
    advantage_std: float

    def metrics(self) -> dict[str, float]:
        return {"value_loss": self.value_loss, "value_clip_frac": self.value_clip_frac,
                "explained_variance": self.explained_variance, "critic_grad_norm": self.grad_norm,
                "critic_seconds": self.seconds, "critic_memory_mb": self.memory_mb,
                "advantage_mean": self.advantage_mean, "advantage_std": self.advantage_std}


@contextlib.contextmanager
def _saved_storages(storages: dict[int, int], exclude: set[int]):
    """Records in `storages` (address -> bytes) each memory block autograd keeps for backward inside the block, once
    however many saved tensors view it; blocks in `exclude` (the weights, counted apart) are left out."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


class PPOCritic:
    """The value model, its optimizer and the per-step bookkeeping the trainer needs."""

    def __init__(self, model: ValueHead, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self._target_seconds = 0.0
        self._whiten = (0.0, 1.0)
        self._explained = math.nan

    @classmethod
    def build(cls, policy, cfg) -> PPOCritic | None:
        """The critic of an algorithm that has one (engine.objectives.uses_critic), else None: the policy's
        transformer body deep-copied (same warm start, its own memory) with a zero value head."""
        from engine.objectives import uses_critic

        if not uses_critic(cfg.algo):
            return None
        body = copy.deepcopy(getattr(policy, policy.base_model_prefix)).train(False).requires_grad_(True)
        device = next(policy.parameters()).device
        model = ValueHead(body, policy.config.hidden_size).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.critic_lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      weight_decay=cfg.weight_decay)
        return cls(model, optimizer)

    # ------------------------------------------------------------------ before the policy update
    @torch.no_grad()
    def targets(self, batch, *, supervision: str, kl_coef: float, gamma: float, lam: float, whiten: bool) -> None:
        """Fill batch.values, batch.kl_reward, batch.returns, batch.advantages (GAE with `gamma`, `lam`, logged as
        is) and batch.loss_advantages (what the policy loss uses: whitened when `whiten`); each rollout's
        `advantage` becomes its first token's GAE advantage. The settings are TrainConfig's supervision, kl_coef,
        gae_gamma, gae_lambda and whiten_advantages."""
        t0 = time.perf_counter()
        if batch.ref_logp is None and kl_coef:
            raise ValueError("PPO needs the reference log-probs for the KL part of its reward; the batch has none")
        ref_logp = batch.old_logp if batch.ref_logp is None else batch.ref_logp  # kl_coef 0: no KL part
        T = batch.token_mask.shape[1]
        values = self.model(batch.input_ids, batch.attention_mask, batch.prompt_len) * batch.token_mask  # (B, T)
        scores = score_rewards(batch.rollouts, T, supervision).to(values.device)  # (B, T)
        rewards, kl_reward = token_rewards(scores, batch.old_logp, ref_logp, batch.token_mask, kl_coef)
        adv, returns = gae_advantages(rewards, values, batch.token_mask, gamma, lam)
        batch.values, batch.kl_reward, batch.returns, batch.advantages = values, kl_reward, returns, adv
        if whiten:
            mean, std = masked_mean_std(adv, batch.loss_mask)  # masked_whiten's statistics, recorded per step
            batch.loss_advantages = (adv - mean) / std * batch.loss_mask
            self._whiten = (float(mean), float(std))
        else:
            batch.loss_advantages = adv * batch.loss_mask
            self._whiten = (0.0, 1.0)
        for r, a in zip(batch.rollouts, adv[:, 0].tolist(), strict=True):
            r.advantage = a
        self._explained = explained_variance(values, returns, batch.loss_mask)
        self._target_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ after the policy update
    def update(self, batch, generator: torch.Generator, *, epochs: int, minibatches: int, value_clip: float,
               value_coef: float, max_grad_norm: float) -> CriticStats:
        """`epochs x minibatches` AdamW steps on the clipped value loss towards batch.returns, cut like the policy's
        (engine.minibatches, the same `generator`)."""
        t0 = time.perf_counter()
        P = batch.prompt_len
        params = [p for p in self.model.parameters() if p.requires_grad]
        static_bytes = 4 * sum(p.numel() * p.element_size() for p in params)  # weights, grads, AdamW m and v
        weights = {p.untyped_storage().data_ptr() for p in params}
        losses, clip_fracs, norms, peak_saved = [], [], [], 0
        self.model.train(False)  # no dropout: the first pass reproduces the sampling-time values
        for mb in minibatch_passes(batch.token_mask, epochs, minibatches, generator, batch.input_ids.device):
            idx, t_mb = mb.idx, mb.width
            saved: dict[int, int] = {}
            with _saved_storages(saved, weights):
                values = self.model(batch.input_ids[idx, : P + t_mb], batch.attention_mask[idx, : P + t_mb], P)
                loss, clip_frac = value_loss(values, batch.values[idx, :t_mb], batch.returns[idx, :t_mb],
                                             batch.loss_mask[idx, :t_mb], value_clip)
                loss = value_coef * loss
            norms.append(optimizer_step(self.optimizer, params, loss, max_grad_norm))
            losses.append(float(loss.detach()))
            clip_fracs.append(float(clip_frac))
            peak_saved = max(peak_saved, sum(saved.values()))
        return CriticStats(
            value_loss=sum(losses) / len(losses), value_clip_frac=sum(clip_fracs) / len(clip_fracs),
            explained_variance=self._explained, grad_norm=sum(norms) / len(norms),
            seconds=self._target_seconds + time.perf_counter() - t0,
            memory_mb=(static_bytes + peak_saved) / 2**20,
            advantage_mean=self._whiten[0], advantage_std=self._whiten[1],
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The critic and its optimizer, saved inside the run's checkpoint of the same step."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
