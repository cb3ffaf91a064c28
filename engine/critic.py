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

With several ranks (engine.distributed) the critic is data-parallel like the policy: each rank computes the targets
of its share of the batch, with the whitening statistics and the explained variance taken over every rank's tokens
(`masked_moments`), and its update is wrapped in DistributedDataParallel with the value loss normalised by the loss
tokens of the global mini-batch and scaled by N (DDP averages gradients): N ranks take the step one process takes
on the union of their rows. `distribute` wraps it once the checkpoint is restored.

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

from engine.advantages import gae_advantages
from engine.distributed import World, data_parallel
from engine.minibatches import minibatches as minibatch_passes
from engine.minibatches import optimizer_step

__all__ = [
    "CriticStats",
    "PPOCritic",
    "ValueHead",
    "explained_variance",
    "masked_moments",
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
               clip: float, tokens: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * token-mean of max((V - R)^2, (V_clip - R)^2), V_clip = clamp(V, V_old +- clip).

    values (differentiable), old_values, returns, mask: (B, T). Returns (loss (), clipped fraction ()): the share
    of mask tokens where the clipped error is the larger one (those tokens get no gradient when V is outside the
    range). Without the `value_coef` factor. `tokens`: the mean's denominator when the mini-batch is spread over
    ranks (its mask tokens on every rank; default: this mask's), so that the ranks' losses add up to the loss.
    """
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1.0) if tokens is None else max(float(tokens), 1.0)
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # (B, T)
    err, err_clipped = (values - returns) ** 2, (clipped - returns) ** 2  # (B, T)
    loss = 0.5 * (torch.maximum(err, err_clipped) * m).sum() / n
    clip_frac = ((err_clipped > err).to(values.dtype) * m).sum() / n
    return loss, clip_frac.detach()


def masked_moments(columns: list[torch.Tensor], mask: torch.Tensor, world: World | None = None
                   ) -> tuple[float, list[tuple[float, float]]]:
    """(n, [(mean, population variance)] of each (B, T) column) over the mask tokens of every rank of `world`.

    Two passes (means, then squared deviations from them), each one all-reduce: the same numbers as one process's
    `masked_mean_std` on the whole batch, without the cancellation of E[x^2] - E[x]^2."""
    world = world or World()
    m = mask.detach().to(torch.float64)  # (B, T)
    xs = [x.detach().to(torch.float64) for x in columns]  # (B, T) each
    n, *sums = world.all_reduce([float(m.sum()), *(float((x * m).sum()) for x in xs)])
    means = [total / max(n, 1.0) for total in sums]
    squares = world.all_reduce([float((((x - mu) * m) ** 2).sum()) for x, mu in zip(xs, means, strict=True)])
    return n, [(mu, sq / max(n, 1.0)) for mu, sq in zip(means, squares, strict=True)]


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       world: World | None = None) -> float:
    """1 - Var(R - V) / Var(R) over the mask tokens (of every rank of `world`): 1 is a perfect critic, 0 no better
    than a constant, < 0 worse. NaN when the returns do not vary."""
    n, [(_, var_r), (_, var_err)] = masked_moments([returns, returns.double() - values.double()], mask, world)
    if n < 2 or var_r == 0.0:
        return math.nan
    return 1.0 - var_err / var_r


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
        self.world = World()
        self.trained: torch.nn.Module = model  # what the update's forward goes through (DDP-wrapped with ranks)
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

    def distribute(self, world: World, device: torch.device) -> None:
        """Make the critic one of `world`'s data-parallel replicas: its update's gradients are all-reduced by
        DistributedDataParallel (which broadcasts rank 0's weights: called after a checkpoint is restored), and its
        targets' statistics are taken over every rank."""
        self.world = world
        self.trained = data_parallel(self.model, world, device)

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
        if whiten:  # masked_whiten's statistics (eps 1e-8), of the whole batch on every rank; recorded per step
            _, [(mean, var)] = masked_moments([adv], batch.loss_mask, self.world)
            std = math.sqrt(var + 1e-8)
            batch.loss_advantages = (adv - mean) / std * batch.loss_mask
            self._whiten = (mean, std)
        else:
            batch.loss_advantages = adv * batch.loss_mask
            self._whiten = (0.0, 1.0)
        for r, a in zip(batch.rollouts, adv[:, 0].tolist(), strict=True):
            r.advantage = a
        self._explained = explained_variance(values, returns, batch.loss_mask, self.world)
        self._target_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ after the policy update
    def update(self, batch, generator: torch.Generator, *, epochs: int, minibatches: int, value_clip: float,
               value_coef: float, max_grad_norm: float) -> CriticStats:
        """`epochs x minibatches` AdamW steps on the clipped value loss towards batch.returns, cut like the policy's
        (engine.minibatches, the same `generator`). With several ranks, as engine.train.update: the k-th mini-batch
        is the union of the ranks' k-th slices, its loss tokens are counted over the ranks, and the loss and clipped
        fraction reported are the union's (the ranks' shares added up)."""
        t0 = time.perf_counter()
        P, world = batch.prompt_len, self.world
        params = [p for p in self.model.parameters() if p.requires_grad]
        static_bytes = 4 * sum(p.numel() * p.element_size() for p in params)  # weights, grads, AdamW m and v
        weights = {p.untyped_storage().data_ptr() for p in params}
        losses, clip_fracs, norms, peak_saved = [], [], [], 0
        self.model.train(False)  # no dropout: the first pass reproduces the sampling-time values
        for mb in minibatch_passes(batch.token_mask, epochs, minibatches, generator, batch.input_ids.device):
            idx, t_mb = mb.idx, mb.width
            mask = batch.loss_mask[idx, :t_mb]  # (b, t_mb)
            tokens = world.all_reduce([float(mask.sum())])[0] if world.distributed else None
            saved: dict[int, int] = {}
            with _saved_storages(saved, weights):
                values = self.trained(batch.input_ids[idx, : P + t_mb], batch.attention_mask[idx, : P + t_mb], P)
                loss, clip_frac = value_loss(values, batch.values[idx, :t_mb], batch.returns[idx, :t_mb], mask,
                                             value_clip, tokens)
                loss = value_coef * loss
            # DDP averages the gradients over the ranks: scaled by N, they are the gradient of the union's loss
            norms.append(optimizer_step(self.optimizer, params, loss * world.size, max_grad_norm))
            losses.append(float(loss.detach()))
            clip_fracs.append(float(clip_frac))
            peak_saved = max(peak_saved, sum(saved.values()))
        passes = len(losses)
        losses_and_clips = world.all_reduce([*losses, *clip_fracs])
        return CriticStats(
            value_loss=sum(losses_and_clips[:passes]) / passes, value_clip_frac=sum(losses_and_clips[passes:]) / passes,
            explained_variance=self._explained, grad_norm=sum(norms) / passes,  # of the all-reduced gradients
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
