"""The contract between the trainer and the run log: tensors -> long rows, and long rows -> tensors again.

Writing (engine.train): each optimizer pass becomes a `PassRecord` (`pass_record`), and one training step becomes
the column dicts `engine.runlog.RunWriter.log_step` takes:

    metrics = step_metrics(batch, records, ev, cfg)          # one `steps` row
    tables = step_tables(batch, records, ev, cfg, tt)        # rollouts, tokens, token_passes, prm_steps

Reading (dashboard.recompute): `batch_from_tokens(rows)` turns long token rows (one row per completion token, with
the new log-prob of one pass) back into padded (B, T) tensors, ready for engine.objectives.policy_loss.

Id numbering within a step: rollout ids are the kept batch (row b of the batch tensors is rollout b), then the
groups dynamic sampling dropped, then the held-out rollouts; group ids likewise, so both are unique within the
step. A token row's `position` is its index in the completion, i.e. its column in the (B, T) tensors.
tests/test_logrows.py checks that a batch written as rows and read back gives the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.objectives import CLIP_CAP, CLIP_EVENTS, CLIP_HIGH, CLIP_LOW, PolicyLossOutput
from engine.rollout import Batch, EvalResult, Rollout, TokenText

if TYPE_CHECKING:
    import pandas as pd

# ----------------------------------------------------------------------------- one optimizer pass


@dataclass
class PassRecord:
    """What one optimizer pass did, on the rows `idx` of the batch (tensors on CPU, (b, T))."""

    idx: torch.Tensor  # (b,) rows of the batch in this mini-batch
    new_logp: torch.Tensor  # (b, T) log-probs the loss used (before this pass's optimizer step)
    ratio: torch.Tensor  # (b, T)
    clip: torch.Tensor  # (b, T) int8 clip code (engine.objectives)
    grad_weight: torch.Tensor  # (b, T)
    token_loss: torch.Tensor  # (b, T)
    kl: torch.Tensor | None  # (b, T) k3 KL to pi_ref, None without a reference
    seq_ratio: torch.Tensor | None  # (b,) the sequence ratio of sequence-level objectives, else None
    loss: float
    grad_norm: float


def _pad_right(x: torch.Tensor, T: int, dtype=torch.float32) -> torch.Tensor:
    """(b, t) -> (b, T) on CPU, zero-padded on the right (mini-batches are trimmed to their longest completion)."""
    full = torch.zeros(x.shape[0], T, dtype=dtype)  # (b, T)
    full[:, : x.shape[1]] = x.detach().to("cpu", dtype)
    return full


def pass_record(idx: torch.Tensor, T: int, logp: torch.Tensor, out: PolicyLossOutput, grad_norm: float) -> PassRecord:
    """The record of one pass over the rows `idx`: `logp` (b, t) and policy_loss's diagnostics, padded to (b, T)."""
    return PassRecord(
        idx=idx.cpu(), new_logp=_pad_right(logp, T), ratio=_pad_right(out.ratio, T),
        clip=_pad_right(out.clip, T, torch.int8), grad_weight=_pad_right(out.grad_weight, T),
        token_loss=_pad_right(out.token_loss, T), kl=_pad_right(out.kl, T) if out.kl is not None else None,
        seq_ratio=out.seq_ratio.cpu() if out.seq_ratio is not None else None, loss=float(out.loss.detach()),
        grad_norm=grad_norm,
    )


# ----------------------------------------------------------------------------- tensors -> rows


def _rollout_rows(rollouts: list[Rollout], kind: str, first_id: int, group_offset: int,
                  seq_ratios=None) -> dict[str, list]:
    cols: dict[str, list] = {k: [] for k in (
        "rollout_id", "group_id", "index_in_group", "kind", "prompt_id", "prompt", "completion", "answer", "reward",
        "reward_correct", "reward_process", "reward_length", "advantage", "length", "truncated", "filtered",
        "filter_reason", "seq_ratio")}
    for i, r in enumerate(rollouts):
        cols["rollout_id"].append(first_id + i)
        cols["group_id"].append(group_offset + r.group_id)
        cols["index_in_group"].append(r.index_in_group)
        cols["kind"].append(kind)
        cols["prompt_id"].append(r.problem.prompt_id)
        cols["prompt"].append(r.problem.prompt)
        cols["completion"].append(r.completion)
        cols["answer"].append(r.problem.answer)
        cols["reward"].append(r.reward)
        cols["reward_correct"].append(r.reward_correct)
        cols["reward_process"].append(r.reward_process)
        cols["reward_length"].append(r.reward_length)
        cols["advantage"].append(r.advantage)
        cols["length"].append(r.length)
        cols["truncated"].append(r.truncated)
        cols["filtered"].append(r.filtered)
        cols["filter_reason"].append(r.filter_reason)
        cols["seq_ratio"].append(seq_ratios[i] if seq_ratios is not None else None)
    return cols


def _token_rows(rollouts: list[Rollout], first_id: int, tt: TokenText, old_logp, ref_logp, entropy,
                advantages, critic: tuple | None = None) -> dict:
    """Token rows of rollouts whose (n, T) tensors are given (rows in the same order as `rollouts`); `critic` is
    (values, returns, kl_reward) of a critic algorithm's batch (else those columns are NULL)."""
    lengths = [r.length for r in rollouts]
    n = sum(lengths)
    rid = np.repeat(np.arange(first_id, first_id + len(rollouts)), lengths)
    pos = np.concatenate([np.arange(L) for L in lengths]) if n else np.zeros(0, dtype=np.int64)
    token_ids = [t for r in rollouts for t in r.completion_ids]
    keep = torch.zeros(old_logp.shape, dtype=torch.bool)
    for b, L in enumerate(lengths):
        keep[b, :L] = True

    def flat(x):
        return x.detach().cpu()[keep].numpy().astype(np.float64) if x is not None else np.full(n, np.nan)

    prm = np.full(n, -1, dtype=np.int64)
    k = 0
    for r in rollouts:
        for j, (first, last) in enumerate(r.step_spans):
            prm[k + first : k + last + 1] = j
        k += r.length
    return {
        "rollout_id": rid, "position": pos, "token_id": np.asarray(token_ids, dtype=np.int64),
        "token_text": [tt.token(t) for t in token_ids], "old_logp": flat(old_logp), "ref_logp": flat(ref_logp),
        "entropy": flat(entropy), "advantage": flat(advantages) if advantages is not None else np.zeros(n),
        "prm_step": [None if p < 0 else int(p) for p in prm],
        **({"value": flat(critic[0]), "return": flat(critic[1]), "kl_reward": flat(critic[2])} if critic else {}),
    }


def _prm_rows(rollouts: list[Rollout], first_id: int) -> dict[str, list]:
    cols: dict[str, list] = {k: [] for k in (
        "rollout_id", "step_index", "first_pos", "last_pos", "text", "reward_raw", "reward_norm")}
    for i, r in enumerate(rollouts):
        for j, (s, (first, last)) in enumerate(zip(r.steps, r.step_spans, strict=True)):
            cols["rollout_id"].append(first_id + i)
            cols["step_index"].append(j)
            cols["first_pos"].append(first)
            cols["last_pos"].append(last)
            cols["text"].append(s.text)
            cols["reward_raw"].append(s.score)
            cols["reward_norm"].append(r.step_reward_norm[j] if r.step_reward_norm else None)
    return cols


def _pass_rows(records: list[PassRecord], batch: Batch) -> dict[str, np.ndarray]:
    parts: dict[str, list] = {k: [] for k in (
        "pass", "rollout_id", "position", "new_logp", "ratio", "clip", "grad_weight", "token_loss", "kl")}
    for p, rec in enumerate(records):
        keep = batch.token_mask[rec.idx].cpu() > 0  # (b, T)
        rows, cols = keep.nonzero(as_tuple=True)
        parts["pass"].append(np.full(len(rows), p, dtype=np.int64))
        parts["rollout_id"].append(rec.idx[rows].numpy().astype(np.int64))
        parts["position"].append(cols.numpy().astype(np.int64))
        for name in ("new_logp", "ratio", "grad_weight", "token_loss"):
            parts[name].append(getattr(rec, name)[keep].numpy().astype(np.float64))
        parts["clip"].append(rec.clip[keep].numpy())
        parts["kl"].append(rec.kl[keep].numpy().astype(np.float64) if rec.kl is not None
                           else np.full(len(rows), np.nan))
    return {k: np.concatenate(v) for k, v in parts.items()}


def eval_tables(ev: EvalResult, first_id: int, group_offset: int, tt: TokenText, log_tokens: bool):
    """(rollouts, tokens, prm_steps) column dicts of held-out rollouts, numbered from `first_id` / `group_offset`
    (tokens and prm_steps None without `log_tokens`)."""
    rollouts = _rollout_rows(ev.rollouts, "eval", first_id, group_offset)
    if not log_tokens:
        return rollouts, None, None
    tokens = _token_rows(ev.rollouts, first_id, tt, ev.old_logp, ev.ref_logp, ev.entropy, None)
    return rollouts, tokens, _prm_rows(ev.rollouts, first_id)


def _concat(a: dict | None, b: dict | None) -> dict | None:
    """Rows of `a` then rows of `b`; a column only one side has is NaN on the other's rows (e.g. the critic's
    values, which held-out rollouts do not get)."""
    if a is None or b is None:
        return a if b is None else b

    def column(d: dict, k: str):
        return d[k] if k in d else np.full(len(next(iter(d.values()))), np.nan)

    out = {}
    for k in dict.fromkeys([*a, *b]):
        x, y = column(a, k), column(b, k)
        out[k] = list(x) + list(y) if isinstance(x, list) or isinstance(y, list) else np.concatenate([x, y])
    return out


def step_metrics(batch: Batch, records: list[PassRecord], ev: EvalResult | None, cfg, critic_stats=None) -> dict:
    """One `steps` row. Rewards, accuracy and lengths cover every sampled rollout of the step (dropped groups
    included, so DAPO's training accuracy is not biased towards 50%); clip fractions are over loss tokens of all
    passes; KL is the mean per-token k3 KL to pi_ref over the loss tokens of each pass, averaged over passes.
    `critic_stats` (engine.critic.CriticStats) adds the critic's columns."""
    tm = batch.token_mask.cpu()  # (B, T)
    lm = batch.loss_mask.cpu()  # (B, T)
    n_loss_tokens = max(1.0, sum(float(lm[r.idx].sum()) for r in records))  # every pass's own loss tokens
    clip_counts = {c: sum(float(((r.clip == c) & (lm[r.idx] > 0)).sum()) for r in records)
                   for c in CLIP_EVENTS}
    kls = [float((r.kl * lm[r.idx]).sum() / lm[r.idx].sum().clamp(min=1)) for r in records if r.kl is not None]
    every = batch.rollouts + batch.dropped
    rewards = np.array([r.reward for r in every])
    lengths = np.array([r.length for r in every])
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(ddof=1)) if len(rewards) > 1 else 0.0,
        "accuracy": float(np.mean([r.reward_correct for r in every])),
        "heldout_accuracy": ev.accuracy_greedy if ev else None,
        "heldout_accuracy_sampled": ev.accuracy_sampled if ev else None,
        "entropy": float((batch.entropy.cpu() * tm).sum() / tm.sum()),
        "kl": float(np.mean(kls)) if kls else None,
        "clip_low_frac": clip_counts[CLIP_LOW] / n_loss_tokens,
        "clip_high_frac": clip_counts[CLIP_HIGH] / n_loss_tokens,
        "clip_dual_frac": clip_counts[CLIP_CAP] / n_loss_tokens,
        "response_len_mean": float(lengths.mean()),
        "response_len_max": int(lengths.max()),
        "truncated_frac": float(np.mean([r.truncated for r in every])),
        "groups_kept": cfg.prompts_per_step,
        "groups_filtered": len(batch.dropped) // cfg.group_size,
        "gen_batches": batch.gen_batches,
        "loss": float(np.mean([r.loss for r in records])),
        "grad_norm": float(np.mean([r.grad_norm for r in records])),
        "lr": cfg.lr,
        **(critic_stats.metrics() if critic_stats is not None else {}),
    }


def step_tables(batch: Batch, records: list[PassRecord], ev: EvalResult | None, cfg, tt: TokenText) -> dict:
    """The step's rows for engine.runlog (ids numbered as the module docstring says). A rollout's `seq_ratio` lists
    its sequence ratio at each pass that used it, for sequence-level objectives."""
    B = len(batch.rollouts)
    seq_ratios = None
    if any(rec.seq_ratio is not None for rec in records):
        seq_ratios = [[] for _ in range(B)]
        for rec in records:
            for i, s in zip(rec.idx.tolist(), rec.seq_ratio.tolist(), strict=True):
                seq_ratios[i].append(s)
    rollouts = _rollout_rows(batch.rollouts, "train", 0, 0, seq_ratios)
    rollouts = _concat(rollouts, _rollout_rows(batch.dropped, "train", B, 0))
    tokens = passes = prm = None
    if cfg.log_tokens:
        critic = (batch.values, batch.returns, batch.kl_reward) if batch.values is not None else None
        tokens = _token_rows(batch.rollouts, 0, tt, batch.old_logp, batch.ref_logp, batch.entropy,
                             batch.advantages, critic)
        passes = _pass_rows(records, batch)
        prm = _concat(_prm_rows(batch.rollouts, 0), _prm_rows(batch.dropped, B))
    if ev is not None:
        first = B + len(batch.dropped)
        groups = cfg.prompts_per_step + len(batch.dropped) // cfg.group_size
        e_roll, e_tok, e_prm = eval_tables(ev, first, groups, tt, cfg.log_tokens)
        rollouts = _concat(rollouts, e_roll)
        tokens, prm = _concat(tokens, e_tok), _concat(prm, e_prm)
    return {"rollouts": rollouts, "tokens": tokens, "token_passes": passes, "prm_steps": prm}


# ----------------------------------------------------------------------------- rows -> tensors


@dataclass
class LoggedBatch:
    """Logged tokens of B completions as padded (B, T) tensors (float64), rows in increasing rollout id."""

    rollout_ids: list[int]
    logp: torch.Tensor  # (B, T) new log-prob of the chosen pass (old log-prob where no pass was logged)
    old_logp: torch.Tensor  # (B, T)
    ref_logp: torch.Tensor | None  # (B, T), the new log-prob on padding (KL 0); None when no reference was logged
    entropy: torch.Tensor | None  # (B, T)
    advantages: torch.Tensor  # (B, T) per-token advantage as logged (constant per row for outcome rewards)
    mask: torch.Tensor  # (B, T) 1 on completion tokens
    lengths: np.ndarray  # (B,)


def batch_from_tokens(tokens: pd.DataFrame) -> LoggedBatch:
    """Pivot token rows (rollout_id, position, old_logp, advantage; optional new_logp, ref_logp, entropy) into a
    LoggedBatch: the inverse of the `tokens` rows (joined with one pass's `token_passes.new_logp`) written above."""
    import pandas as pd  # only the reading side needs it; the trainer does not pay for importing it

    rollout_ids = sorted(int(r) for r in tokens["rollout_id"].unique())
    row_of = {r: i for i, r in enumerate(rollout_ids)}
    rows = tokens["rollout_id"].map(row_of).to_numpy()
    cols = tokens["position"].to_numpy(dtype=int)
    B, T = len(rollout_ids), int(cols.max()) + 1 if len(cols) else 1

    def grid(column: str, fill: float = 0.0) -> np.ndarray:
        out = np.full((B, T), fill, dtype=np.float64)  # (B, T)
        out[rows, cols] = pd.to_numeric(tokens[column], errors="coerce").to_numpy(dtype=float)
        return np.nan_to_num(out, nan=fill)

    mask = np.zeros((B, T))
    mask[rows, cols] = 1.0
    old = grid("old_logp")
    # Eval rollouts or steps without passes: the policy has not moved, so the new log-prob is the old one.
    new = np.where(np.isnan(grid("new_logp", np.nan)), old, grid("new_logp")) if "new_logp" in tokens else old
    has_ref = "ref_logp" in tokens and tokens["ref_logp"].notna().any()
    has_entropy = "entropy" in tokens and tokens["entropy"].notna().any()
    return LoggedBatch(
        rollout_ids=rollout_ids,
        logp=torch.tensor(new),
        old_logp=torch.tensor(old),
        ref_logp=torch.tensor(np.where(mask > 0, grid("ref_logp"), new)) if has_ref else None,
        entropy=torch.tensor(grid("entropy")) if has_entropy else None,
        advantages=torch.tensor(grid("advantage")),
        mask=torch.tensor(mask),
        lengths=mask.sum(1).astype(int),
    )
