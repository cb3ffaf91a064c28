"""The contract between the trainer and the run log: tensors -> long rows, and long rows -> tensors again.

Writing (engine.train): each optimizer pass becomes a `PassRecord` (`pass_record`), and one training step becomes
the column dicts `engine.runlog.RunWriter.log_step` takes:

    totals = step_totals(batch, records, group_size)   # the step's sums (added over the ranks: .reduced(world))
    metrics = step_metrics(totals, records, ev, algo=..., lr=..., groups_kept=...)   # one `steps` row
    tables = step_tables(batch, records, ev, tt, group_size=..., log_tokens=...)     # rollouts, tokens, passes, prm

With several ranks (engine.distributed) each rank writes its own rows, numbered by `RankIds` so that ids stay
unique across ranks, and rank 0 writes the metrics of the whole batch from the ranks' summed `StepTotals`.

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

from engine.algorithms import objective
from engine.clip_codes import CLIP_EVENTS, RULE_EVENTS, clip_fractions, count_clip_events, fraction_column
from engine.corrections import BatchCorrection, LossInputs, offpolicy_metrics
from engine.objectives import PolicyLossOutput
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
    """This process's share of the pass's loss (with several ranks the shares add up to the loss)."""
    grad_norm: float
    # with a sampler/trainer mismatch correction on (engine.corrections), else None:
    is_weight: torch.Tensor | None = None  # (b, T) the batch's IS weight of each token, None when IS is off
    rejected: torch.Tensor | None = None  # (b, T) int8 reason code (engine.correction_settings REJECT_*)
    correction_metrics: dict[str, float] | None = None  # the batch's correct_batch metrics (the same every pass)


def _pad_right(x: torch.Tensor, T: int, dtype=torch.float32) -> torch.Tensor:
    """(b, t) -> (b, T) on CPU, zero-padded on the right (mini-batches are trimmed to their longest completion)."""
    full = torch.zeros(x.shape[0], T, dtype=dtype)  # (b, T)
    full[:, : x.shape[1]] = x.detach().to("cpu", dtype)
    return full


def pass_record(idx: torch.Tensor, T: int, logp: torch.Tensor, out: PolicyLossOutput, grad_norm: float,
                correction: BatchCorrection | None = None, corrected: LossInputs | None = None) -> PassRecord:
    """The record of one pass over the rows `idx`: `logp` (b, t) and policy_loss's diagnostics, padded to (b, T);
    with a correction, the batch's (`correction`, engine.corrections.correct_batch) IS weights of these rows and
    this pass's rejection codes (`corrected`, engine.corrections.loss_inputs)."""
    weight = None
    if correction is not None and correction.weight is not None:
        weight = _pad_right(correction.weight[idx, : logp.shape[1]], T)
    return PassRecord(
        idx=idx.cpu(), new_logp=_pad_right(logp, T), ratio=_pad_right(out.ratio, T),
        clip=_pad_right(out.clip, T, torch.int8), grad_weight=_pad_right(out.grad_weight, T),
        token_loss=_pad_right(out.token_loss, T), kl=_pad_right(out.kl, T) if out.kl is not None else None,
        seq_ratio=out.seq_ratio.cpu() if out.seq_ratio is not None else None, loss=float(out.loss.detach()),
        grad_norm=grad_norm, is_weight=weight,
        rejected=_pad_right(corrected.rejected, T, torch.int8) if corrected is not None else None,
        correction_metrics=correction.metrics if correction is not None else None,
    )


# ----------------------------------------------------------------------------- tensors -> rows


def _rollout_rows(rollouts: list[Rollout], kind: str, first_id: int, group_offset: int,
                  seq_ratios=None, rank: int = 0) -> dict[str, list]:
    cols: dict[str, list] = {k: [] for k in (
        "rollout_id", "group_id", "index_in_group", "kind", "prompt_id", "prompt", "completion", "answer", "reward",
        "reward_correct", "reward_process", "reward_length", "advantage", "length", "truncated", "filtered",
        "filter_reason", "seq_ratio")}
    cols["rank"] = [rank] * len(rollouts)
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
                advantages, critic: tuple | None = None, sampler: tuple | None = None) -> dict:
    """Token rows of rollouts whose (n, T) tensors are given (rows in the same order as `rollouts`); `critic` is
    (values, returns, kl_reward) of a critic algorithm's batch, `sampler` (sampler_logp, sampler_logp_full) of a
    training batch (else those columns are NULL)."""
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
        **({"sampler_logp": flat(sampler[0]), "sampler_logp_full": flat(sampler[1])} if sampler else {}),
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


def _pass_rows(records: list[PassRecord], batch: Batch, first_id: int = 0) -> dict[str, np.ndarray]:
    parts: dict[str, list] = {k: [] for k in (
        "pass", "rollout_id", "position", "new_logp", "ratio", "clip", "grad_weight", "token_loss", "kl")}
    for p, rec in enumerate(records):
        keep = batch.token_mask[rec.idx].cpu() > 0  # (b, T)
        rows, cols = keep.nonzero(as_tuple=True)
        parts["pass"].append(np.full(len(rows), p, dtype=np.int64))
        parts["rollout_id"].append(first_id + rec.idx[rows].numpy().astype(np.int64))
        parts["position"].append(cols.numpy().astype(np.int64))
        for name in ("new_logp", "ratio", "grad_weight", "token_loss"):
            parts[name].append(getattr(rec, name)[keep].numpy().astype(np.float64))
        parts["clip"].append(rec.clip[keep].numpy())
        parts["kl"].append(rec.kl[keep].numpy().astype(np.float64) if rec.kl is not None
                           else np.full(len(rows), np.nan))
        if rec.rejected is not None:  # a correction is on (the same for every pass): else both columns stay NULL
            parts.setdefault("rejected", []).append(rec.rejected[keep].numpy())
            parts.setdefault("is_weight", []).append(rec.is_weight[keep].numpy().astype(np.float64)
                                                     if rec.is_weight is not None else np.full(len(rows), np.nan))
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


@dataclass
class StepTotals:
    """The additive sums and counts of one step (and two maxima) that its metrics are computed from.

    With several ranks each rank fills in its own share (`step_totals`) and `reduced` adds the shares up over the
    ranks, so the metrics are those of the whole global batch, not of rank 0's part of it."""

    sums: dict[str, float]
    maxima: dict[str, float]

    def reduced(self, world) -> StepTotals:
        """Sums added and maxima taken over the ranks of `world` (engine.distributed.World)."""
        sums = world.all_reduce(list(self.sums.values()), "sum")
        maxima = world.all_reduce(list(self.maxima.values()), "max")
        return StepTotals(dict(zip(self.sums, sums, strict=True)), dict(zip(self.maxima, maxima, strict=True)))


def step_totals(batch: Batch, records: list[PassRecord], group_size: int) -> StepTotals:
    """This process's sums and counts for `step_metrics` (per pass: its loss share, KL and loss tokens)."""
    tm = batch.token_mask.cpu()  # (B, T)
    lm = batch.loss_mask.cpu()  # (B, T)
    every = batch.rollouts + batch.dropped
    rewards = np.array([r.reward for r in every], dtype=np.float64)
    events = [count_clip_events(r.clip, lm[r.idx] > 0, CLIP_EVENTS + RULE_EVENTS) for r in records]
    sums = {
        "rollouts": float(len(every)),
        "reward": float(rewards.sum()),
        "reward_sq": float((rewards**2).sum()),
        "correct": float(sum(r.reward_correct for r in every)),
        "length": float(sum(r.length for r in every)),
        "truncated": float(sum(r.truncated for r in every)),
        "entropy": float((batch.entropy.cpu() * tm).sum()),
        "completion_tokens": float(tm.sum()),
        "loss_tokens": float(sum(float(lm[r.idx].sum()) for r in records)),  # every pass's own loss tokens
        "groups_filtered": float(len(batch.dropped) // group_size),
        **{f"clip_{c}": sum(counts[c] for counts in events) for c in CLIP_EVENTS + RULE_EVENTS},
    }
    for p, rec in enumerate(records):
        sums[f"loss_{p}"] = rec.loss
        if rec.kl is not None:
            sums[f"kl_{p}"] = float((rec.kl * lm[rec.idx]).sum())
            sums[f"kl_tokens_{p}"] = float(lm[rec.idx].sum())
    maxima = {"length": float(max((r.length for r in every), default=0)), "gen_batches": float(batch.gen_batches)}
    return StepTotals(sums, maxima)


def step_metrics(totals: StepTotals, records: list[PassRecord], ev: EvalResult | None, *, algo: str, lr: float,
                 groups_kept: int, critic_stats=None) -> dict:
    """One `steps` row from the step's sums (`step_totals`, over every rank: StepTotals.reduced). Rewards, accuracy
    and lengths cover every sampled rollout of the step (dropped groups included, so DAPO's training accuracy is not
    biased towards 50%); clip fractions are over loss tokens of all passes; KL is the mean per-token k3 KL to pi_ref
    over the loss tokens of each pass, averaged over passes; loss is the mean over passes. `algo` picks the clip
    events counted, `lr` and `groups_kept` (the groups a step trains on) are logged as they are. `critic_stats`
    (engine.critic.CriticStats) adds the critic's columns."""
    s, n = totals.sums, totals.sums["rollouts"]
    # the clips for every algorithm; a covariance rule's selections (clip_cov_frac, in `extra`) for Clip-/KL-Cov
    counted = CLIP_EVENTS + (RULE_EVENTS if objective(algo).covariance else ())
    mean_reward = s["reward"] / n
    # sample variance from the sums (ddof = 1); clamped at 0 against rounding when every reward is equal
    reward_var = max(0.0, s["reward_sq"] - n * mean_reward**2) / (n - 1) if n > 1 else 0.0
    kls = [s[f"kl_{p}"] / max(1.0, s[f"kl_tokens_{p}"]) for p in range(len(records)) if f"kl_{p}" in s]
    return {
        "reward_mean": mean_reward,
        "reward_std": float(np.sqrt(reward_var)),
        "accuracy": s["correct"] / n,
        "heldout_accuracy": ev.accuracy_greedy if ev else None,
        "heldout_accuracy_sampled": ev.accuracy_sampled if ev else None,
        "entropy": s["entropy"] / s["completion_tokens"],
        "kl": float(np.mean(kls)) if kls else None,
        **{fraction_column(c): share
           for c, share in clip_fractions({c: s[f"clip_{c}"] for c in counted}, s["loss_tokens"]).items()},
        "response_len_mean": s["length"] / n,
        "response_len_max": int(totals.maxima["length"]),
        "truncated_frac": s["truncated"] / n,
        "groups_kept": groups_kept,
        "groups_filtered": int(s["groups_filtered"]),
        "gen_batches": int(totals.maxima["gen_batches"]),
        "loss": float(np.mean([s[f"loss_{p}"] for p in range(len(records))])),
        "grad_norm": float(np.mean([r.grad_norm for r in records])),  # of the all-reduced gradient: equal on ranks
        "lr": lr,
        **(critic_stats.metrics() if critic_stats is not None else {}),
    }


SAMPLER_COLUMNS = ("sampler_logp", "sampler_logp_full")
MISMATCH_PREFIX = "mismatch_"  # steps.extra keys of the sampler/trainer mismatch (`mismatch_metrics`)


def mismatch_metrics(batch: Batch, records: list[PassRecord]) -> dict[str, float]:
    """The step's sampler/trainer mismatch, for the `steps` table's `extra` (each key prefixed `mismatch_`): verl's
    off-policy diagnostics of old_logp vs sampler_logp over the loss tokens (engine.corrections.offpolicy_metrics),
    and with a correction on its rejection shares and IS weight mean / max / ESS. Empty without sampler log-probs."""
    if records and records[0].correction_metrics is not None:
        values = records[0].correction_metrics
    elif batch.sampler_logp is not None:
        values = offpolicy_metrics(batch.old_logp, batch.sampler_logp, batch.loss_mask)
    else:
        return {}
    return {MISMATCH_PREFIX + name: value for name, value in values.items()}


@dataclass(frozen=True)
class RankIds:
    """Where one rank's rollouts sit in the step's numbering, so that rollout and group ids are unique across ranks:
    the kept batches of ranks 0..N-1 in rank order, then their dropped groups in rank order, then the held-out
    rollouts. A single process is `RankIds()` with its own counts (the numbering of the module docstring)."""

    rank: int = 0
    kept_before: int = 0  # kept rollouts of the lower ranks
    dropped_before: int = 0  # dropped rollouts of the lower ranks
    kept_total: int | None = None  # kept rollouts of all ranks (None: this batch's own)
    dropped_total: int | None = None

    @classmethod
    def gather(cls, world, batch: Batch) -> RankIds:
        """Every rank's counts, exchanged over `world` (engine.distributed.World)."""
        counts = world.all_gather((len(batch.rollouts), len(batch.dropped)))
        return cls(rank=world.rank, kept_before=sum(k for k, _ in counts[: world.rank]),
                   dropped_before=sum(d for _, d in counts[: world.rank]),
                   kept_total=sum(k for k, _ in counts), dropped_total=sum(d for _, d in counts))


def step_tables(batch: Batch, records: list[PassRecord], ev: EvalResult | None, tt: TokenText, *, group_size: int,
                log_tokens: bool, ids: RankIds | None = None) -> dict:
    """The step's rows for engine.runlog (ids numbered as the module docstring says; `ids`: this rank's place in
    that numbering); without `log_tokens` only the rollouts. A rollout's `seq_ratio` lists its sequence ratio at
    each pass that used it, for sequence-level objectives."""
    ids = ids or RankIds()
    G, B = group_size, len(batch.rollouts)
    kept_total = B if ids.kept_total is None else ids.kept_total
    dropped_total = len(batch.dropped) if ids.dropped_total is None else ids.dropped_total
    first_kept, first_dropped = ids.kept_before, kept_total + ids.dropped_before
    # group ids: kept groups are numbered 0..B/G-1 in the batch, dropped ones from B/G (engine.rollout)
    dropped_groups = kept_total // G + ids.dropped_before // G - B // G
    seq_ratios = None
    if any(rec.seq_ratio is not None for rec in records):
        seq_ratios = [[] for _ in range(B)]
        for rec in records:
            for i, s in zip(rec.idx.tolist(), rec.seq_ratio.tolist(), strict=True):
                seq_ratios[i].append(s)
    rollouts = _rollout_rows(batch.rollouts, "train", first_kept, ids.kept_before // G, seq_ratios, ids.rank)
    rollouts = _concat(rollouts, _rollout_rows(batch.dropped, "train", first_dropped, dropped_groups,
                                               rank=ids.rank))
    tokens = passes = prm = None
    if log_tokens:
        critic = (batch.values, batch.returns, batch.kl_reward) if batch.values is not None else None
        sampler = (batch.sampler_logp, batch.sampler_logp_full) if batch.sampler_logp is not None else None
        tokens = _token_rows(batch.rollouts, first_kept, tt, batch.old_logp, batch.ref_logp, batch.entropy,
                             batch.advantages, critic, sampler)
        passes = _pass_rows(records, batch, first_kept)
        prm = _concat(_prm_rows(batch.rollouts, first_kept), _prm_rows(batch.dropped, first_dropped))
    if ev is not None:
        first = kept_total + dropped_total
        e_roll, e_tok, e_prm = eval_tables(ev, first, (kept_total + dropped_total) // G, tt, log_tokens)
        if e_tok is not None and tokens is not None:  # held-out rollouts come from the policy: no sampler (NULL)
            e_tok.update({name: [None] * len(e_tok["position"]) for name in SAMPLER_COLUMNS if name in tokens})
        rollouts = _concat(rollouts, e_roll)
        tokens, prm = _concat(tokens, e_tok), _concat(prm, e_prm)
    return {"rollouts": rollouts, "tokens": tokens, "token_passes": passes, "prm_steps": prm}


# ----------------------------------------------------------------------------- rows -> tensors


@dataclass
class LoggedBatch:
    """Logged tokens of B completions as padded (B, T) tensors (float64 unless asked otherwise), rows in increasing
    rollout id."""

    rollout_ids: list[int]
    logp: torch.Tensor  # (B, T) new log-prob of the chosen pass (old log-prob where no pass was logged)
    old_logp: torch.Tensor  # (B, T)
    ref_logp: torch.Tensor | None  # (B, T), the new log-prob on padding (KL 0); None when no reference was logged
    entropy: torch.Tensor | None  # (B, T)
    advantages: torch.Tensor  # (B, T) per-token advantage as logged (constant per row for outcome rewards)
    mask: torch.Tensor  # (B, T) 1 on completion tokens
    lengths: np.ndarray  # (B,)


def batch_from_tokens(tokens: pd.DataFrame, dtype: torch.dtype = torch.float64) -> LoggedBatch:
    """Pivot token rows (rollout_id, position, old_logp, advantage; optional new_logp, ref_logp, entropy) into a
    LoggedBatch: the inverse of the `tokens` rows (joined with one pass's `token_passes.new_logp`) written above.
    `dtype`: the tensors' (float32, what a trainer computes in, halves the memory of a step of long completions)."""
    import pandas as pd  # only the reading side needs it; the trainer does not pay for importing it

    ids, rows = np.unique(tokens["rollout_id"].to_numpy(dtype=np.int64), return_inverse=True)
    cols = tokens["position"].to_numpy(dtype=np.int64)
    B, T = len(ids), int(cols.max()) + 1 if len(cols) else 1
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype

    def values(column: str) -> np.ndarray:
        """The column per token row, NaN where it is missing (the long rows: cheaper than a (B, T) grid)."""
        return pd.to_numeric(tokens[column], errors="coerce").to_numpy(dtype=float, na_value=np.nan)

    def grid(per_token: np.ndarray, padding: np.ndarray | float = 0.0) -> torch.Tensor:
        out = np.full((B, T), padding, dtype=np_dtype) if np.isscalar(padding) else padding.copy()  # (B, T)
        out[rows, cols] = per_token
        return torch.from_numpy(out)

    old = np.nan_to_num(values("old_logp"))
    # Eval rollouts or steps without passes: the policy has not moved, so the new log-prob is the old one.
    moved = values("new_logp") if "new_logp" in tokens else np.full(len(old), np.nan)
    new = np.where(np.isnan(moved), old, np.nan_to_num(moved))
    has_ref = "ref_logp" in tokens and tokens["ref_logp"].notna().any()
    has_entropy = "entropy" in tokens and tokens["entropy"].notna().any()
    logp = grid(new)
    mask = grid(np.ones(len(cols)))
    return LoggedBatch(
        rollout_ids=[int(r) for r in ids],
        logp=logp,
        old_logp=grid(old),
        ref_logp=grid(np.nan_to_num(values("ref_logp")), logp.numpy()) if has_ref else None,  # padding: KL 0
        entropy=grid(np.nan_to_num(values("entropy"))) if has_entropy else None,
        advantages=grid(np.nan_to_num(values("advantage"))),
        mask=mask,
        lengths=np.bincount(rows, minlength=B).astype(int),
    )
