"""Sampling and scoring: G completions per prompt, their log-probs, entropies, rewards and advantages.

    sampler = PromptSampler(task.train, seed=cfg.seed)
    batch = collect_batch(policy, ref, tokenizer, task, sampler, cfg)   # a Batch of typed Rollouts + (B, T) tensors
    evals = evaluate(policy, ref, tokenizer, task.heldout[:100], Sampling.of(cfg), seed)  # greedy + sampled held-out

One training batch, in order (the "sample -> reward -> advantage" half of the loop in engine/train.py):
1. draw `batch_size / G` training prompts, sample G completions each (temperature, top-p, max new tokens);
2. score every completion: correctness (the task's exact verifier), the DAPO overlong term, and the task's step
   verifier (process reward), each kept as its own component;
3. DAPO dynamic sampling (when on): a group whose outcome carries no signal is dropped (and recorded as such), and
   further generation batches are drawn until the batch is full; `max_gen_batches` bounds the attempts;
4. advantages: group-normalised outcome rewards, or, under process supervision, normalised step rewards summed from
   each token onwards (engine.advantages);
5. one no-grad forward of the policy (old log-probs, entropy) and one of the reference (ref log-probs) over the batch;
   the sampler's log-probs (engine.sampler) come from the same forward when the sampler is the policy, else from one
   forward of the sampler's copy.

Layout of the tensors: every sequence is `[left-padded prompt | completion | right padding]`, exactly what
`model.generate` returns, so old log-probs and the log-probs of the update passes come from the same computation and
the first pass has ratio == 1. Completion tokens include the EOS token when the model emitted one: the policy must
learn to stop, so EOS is scored like any other token. Log-probs are taken at the sampling temperature (as TRL does),
so that the policy being optimised is the one that was sampled.

Departures from the papers:
1. Dynamic sampling: the first generation batch has batch_size / G prompts, each refill batch twice the number of
   groups still missing (verl regenerates a full batch each time); surplus mixed groups are discarded unlogged.
2. Under process supervision, dynamic sampling drops a group when all its step rewards are equal (its process
   advantages are all zero), and overlong shaping is logged but does not enter the step rewards.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from engine.advantages import group_advantages, normalized_step_rewards, process_advantages
from engine.distributed import World
from engine.rewards import overlong_penalty
from engine.sampler import truncated_logprobs
from engine.tasks import Problem, StepScore, Task

# ----------------------------------------------------------------------------- records


@dataclass
class Rollout:
    """One sampled completion with everything the update and the run log need (token-level data is in Batch)."""

    problem: Problem
    group_id: int
    """Index of the prompt's group within the step (unique within the step)."""
    index_in_group: int
    completion_ids: list[int]
    """Generated tokens, EOS included when emitted; no padding."""
    completion: str
    """Decoded completion text, without EOS."""
    truncated: bool
    """No EOS within max_new_tokens."""
    reward_correct: float = 0.0
    reward_length: float = 0.0
    """DAPO soft overlong punishment (0 when shaping is off)."""
    reward_process: float = 0.0
    """Mean step score of the step verifier (0 when the completion has no steps); logged in both supervision modes."""
    steps: list[StepScore] = field(default_factory=list)
    step_last_token: list[int] = field(default_factory=list)
    """Token index (within the completion) of the last token of each step."""
    step_reward_norm: list[float] = field(default_factory=list)
    """Step scores normalised over all steps of the group (process supervision; else empty)."""
    advantage: float = 0.0
    """Sequence advantage (process supervision: the advantage of the first token)."""
    filtered: bool = False
    filter_reason: str | None = None
    """'all_correct' | 'all_wrong' | 'all_equal' (dynamic sampling) | 'overlong' (overlong filtering)."""

    @property
    def reward(self) -> float:
        """Total outcome reward: correctness plus the overlong term (what outcome advantages are computed from)."""
        return self.reward_correct + self.reward_length

    @property
    def length(self) -> int:
        return len(self.completion_ids)

    @property
    def step_spans(self) -> list[tuple[int, int]]:
        """(first, last) token index of each step: a step starts right after the previous step's last token."""
        firsts = [0] + [last + 1 for last in self.step_last_token]
        return list(zip(firsts, self.step_last_token, strict=False))  # the last `first` has no step


@dataclass
class Batch:
    """A training batch of B = batch_size rollouts (G per prompt, groups contiguous) and its (B, T) tensors."""

    rollouts: list[Rollout]
    dropped: list[Rollout]
    """Rollouts of groups dropped by dynamic sampling (no tensors; logged with filtered = True)."""
    gen_batches: int
    """Generation batches it took to fill the batch."""
    input_ids: torch.Tensor  # (B, P + T) long: left-padded prompt | completion | right padding
    attention_mask: torch.Tensor  # (B, P + T) long
    prompt_len: int  # P
    token_mask: torch.Tensor  # (B, T) float: 1 on completion tokens (EOS included)
    loss_mask: torch.Tensor  # (B, T) float: token_mask, with overlong-filtered rollouts zeroed
    old_logp: torch.Tensor  # (B, T) float
    ref_logp: torch.Tensor | None  # (B, T) float, None when no reference is needed
    entropy: torch.Tensor  # (B, T) float, entropy of the sampling distribution at each position
    advantages: torch.Tensor  # (B, T) float; PPO: the GAE advantage before whitening
    # Algorithms with a critic only (engine.critic fills them in; None otherwise):
    values: torch.Tensor | None = None  # (B, T) the critic's value of each token at sampling time
    returns: torch.Tensor | None = None  # (B, T) GAE returns = advantages + values, the critic's targets
    kl_reward: torch.Tensor | None = None  # (B, T) the KL part of the per-token reward, -kl_coef * (old - ref)
    loss_advantages: torch.Tensor | None = None  # (B, T) what the policy loss uses when it is not `advantages`
    # What the sampler (engine.sampler) reported for each sampled token; None when unknown:
    sampler_logp: torch.Tensor | None = None  # (B, T) under its top-k / top-p truncated, renormalised distribution
    sampler_logp_full: torch.Tensor | None = None  # (B, T) under its full distribution (at the temperature)

    @property
    def completion_ids(self) -> torch.Tensor:  # (B, T)
        return self.input_ids[:, self.prompt_len :]


# ----------------------------------------------------------------------------- prompts


class PromptSampler:
    """Draws training prompts with its own seeded RNG, so the prompt stream is reproducible and checkpointable."""

    def __init__(self, problems: Sequence[Problem], seed: int, rank: int = 0):
        self.problems = problems
        # each rank of a data-parallel run draws its own stream (rank 0's is the single-process run's)
        self.rng = random.Random(f"prompts:{seed}" if rank == 0 else f"prompts:{seed}:rank{rank}")

    def draw(self, n: int) -> list[Problem]:
        return self.rng.sample(list(self.problems), n) if n <= len(self.problems) else self.rng.choices(
            list(self.problems), k=n
        )

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])


# ----------------------------------------------------------------------------- model calls


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, do_sample: bool, temperature: float, top_p: float,
             max_new_tokens: int, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sample one completion per prompt. Returns (input_ids (N, P+T), attention_mask (N, P+T), P).
    `top_k` 0: no top-k truncation.

    Positions after a sequence's EOS hold the pad token and have attention_mask 0.
    """
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    prompt_ids = enc["input_ids"].to(device)  # (N, P)
    prompt_mask = enc["attention_mask"].to(device)  # (N, P)
    P = prompt_ids.shape[1]
    kwargs = dict(do_sample=do_sample, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)  # (N, P + T)
    completion = out[:, P:]  # (N, T)
    # A completion ends at its first EOS (inclusive); everything after is padding.
    is_eos = completion == tokenizer.eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # (N, T) strictly after the first EOS
    completion_mask = (~after_eos).long()
    completion = completion.masked_fill(after_eos, tokenizer.pad_token_id)
    input_ids = torch.cat([prompt_ids, completion], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return input_ids, attention_mask, P


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      temperature: float) -> torch.Tensor:
    """(N, T, V) float32 logits at `temperature` predicting each completion token (computed in the model's dtype).

    Position ids count real tokens only, as `generate` does for left-padded prompts, so a prompt's padding does not
    shift its positions.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (N, L)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, prompt_len - 1 : -1].float() / temperature  # (N, T, V)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                   temperature: float, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of every completion token and the entropy of its distribution, both (N, T).

    Differentiable (call under torch.no_grad() for old/ref log-probs). `logits`: the model's `completion_logits`
    when the caller already has them (no second forward).
    """
    if logits is None:
        logits = completion_logits(model, input_ids, attention_mask, prompt_len, temperature)  # (N, T, V)
    logp_all = F.log_softmax(logits, dim=-1)  # (N, T, V)
    targets = input_ids[:, prompt_len:]  # (N, T)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N, T)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N, T)
    return logp, entropy


# ----------------------------------------------------------------------------- text <-> tokens


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE vocabularies (GPT-2 and its descendants): printable Latin-1 bytes stand
    for themselves, the other bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def byte_level_bytes(token: str | None) -> bytes | None:
    """The raw bytes of a byte-level BPE token string (e.g. 'Ã©' -> b'\\xc3\\xa9'), None if it is not one."""
    if not token or any(c not in _BYTE_LEVEL for c in token):
        return None
    return bytes(_BYTE_LEVEL[c] for c in token)


class TokenText:
    """Decodes single tokens (cached) and maps character offsets of a completion to token indices."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The token's text as decoded; a byte-level token holding part of a UTF-8 character (which decodes to
        U+FFFD alone) is shown as its bytes instead, the complete characters as text and the rest as \\xNN."""
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if "\ufffd" in text:
                raw = byte_level_bytes(self.tokenizer.convert_ids_to_tokens(token_id))
                if raw is not None:
                    text = raw.decode("utf-8", errors="backslashreplace")
            self.cache[token_id] = text
        return text

    def completion_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def char_ends(self, ids: list[int], text: str) -> list[int]:
        """ends[k] = number of characters of `text` covered by tokens 0..k (ids without EOS)."""
        pieces = [self.token(i) for i in ids]
        if "".join(pieces) == text:
            ends, total = [], 0
            for p in pieces:
                total += len(p)
                ends.append(total)
            return ends
        # Tokenizers whose single-token decodes do not concatenate (byte-level BPE, added spaces): decode prefixes.
        return [len(self.tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]


def step_token_ends(steps: list[StepScore], char_ends: list[int]) -> list[int]:
    """Token index of the last token of each step: the first token whose end covers the step's last character."""
    out = []
    k = 0
    for s in steps:
        while k < len(char_ends) - 1 and char_ends[k] < s.end:
            k += 1
        out.append(k)
    return out


# ----------------------------------------------------------------------------- scoring


def score(task: Task, rollouts: list[Rollout], tt: TokenText, *, overlong_shaping: bool, l_max: int,
          l_cache: int) -> None:
    """Fill every reward component of each rollout (in place)."""
    for r in rollouts:
        r.reward_correct = task.outcome_reward(r.problem, r.completion)
        r.reward_length = overlong_penalty(r.length, l_max, l_cache) if overlong_shaping else 0.0
        r.steps = task.process_reward(r.problem, r.completion)
        r.reward_process = sum(s.score for s in r.steps) / len(r.steps) if r.steps else 0.0
        if r.steps:
            text_ids = r.completion_ids[:-1] if not r.truncated else r.completion_ids
            r.step_last_token = step_token_ends(r.steps, tt.char_ends(text_ids, r.completion))


def group_signal(group: list[Rollout], supervision: str) -> str | None:
    """None if the group carries a learning signal, else why not ('all_correct' | 'all_wrong' | 'all_equal')."""
    if supervision == "process":
        scores = [tuple(s.score for s in r.steps) for r in group]
        flat = [x for s in scores for x in s]
        if flat and max(flat) != min(flat):
            return None
    elif len({r.reward for r in group}) > 1:
        return None
    correct = {r.reward_correct for r in group}
    if correct == {1.0}:
        return "all_correct"
    if correct == {0.0}:
        return "all_wrong"
    return "all_equal"


# ----------------------------------------------------------------------------- the batch


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling could not fill a batch with mixed groups within max_gen_batches."""


@dataclass(frozen=True)
class Sampling:
    """How completions are generated and length-scored: what `sample_groups` and `evaluate` use of a training
    config (engine.config.TrainConfig documents each field), so they do not depend on the rest of it."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    overlong_shaping: bool
    overlong_max_len: int
    overlong_cache_len: int
    eval_temperature: float  # the sampled half of the held-out evaluation

    @classmethod
    def of(cls, cfg: Any) -> Sampling:
        """The sampling settings of a (resolved) training config."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    def score(self, task: Task, rollouts: list[Rollout], tt: TokenText) -> None:
        """`score` with this run's overlong shaping."""
        score(task, rollouts, tt, overlong_shaping=self.overlong_shaping, l_max=self.overlong_max_len,
              l_cache=self.overlong_cache_len)


def sample_groups(model, tokenizer, tt: TokenText, task: Task, problems: list[Problem], sampling: Sampling,
                  group_size: int, first_group_id: int) -> tuple[list[Rollout], torch.Tensor, torch.Tensor, int]:
    """Generate G = `group_size` completions for each problem and score them. Returns rollouts, input_ids,
    attention_mask, P."""
    G = group_size
    prompts = [p.prompt for p in problems for _ in range(G)]
    input_ids, attention_mask, P = generate(model, tokenizer, prompts, do_sample=True,
                                            temperature=sampling.temperature, top_p=sampling.top_p,
                                            top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens)
    completion_mask = attention_mask[:, P:]  # (N, T)
    lengths = completion_mask.sum(-1).tolist()
    comp = input_ids[:, P:].tolist()
    rollouts = []
    for n, problem in enumerate(p for p in problems for _ in range(G)):
        ids = comp[n][: lengths[n]]
        truncated = not ids or ids[-1] != tokenizer.eos_token_id
        rollouts.append(Rollout(
            problem=problem, group_id=first_group_id + n // G, index_in_group=n % G, completion_ids=ids,
            completion=tt.completion_text(ids), truncated=truncated,
        ))
    sampling.score(task, rollouts, tt)
    return rollouts, input_ids, attention_mask, P


def _pad_cat(tensors: list[torch.Tensor], prompt_lens: list[int], pad_id: int) -> tuple[torch.Tensor, int]:
    """Concatenate [prompt | completion] tensors of different P and T into one (N, P_max + T_max) layout."""
    P = max(prompt_lens)
    T = max(t.shape[1] - p for t, p in zip(tensors, prompt_lens, strict=True))
    out = []
    for t, p in zip(tensors, prompt_lens, strict=True):
        left = t.new_full((t.shape[0], P - p), pad_id)
        right = t.new_full((t.shape[0], T - (t.shape[1] - p)), pad_id)
        out.append(torch.cat([left, t, right], dim=1))
    return torch.cat(out, dim=0), P


def collect_batch(policy, ref, tokenizer, task: Task, sampler: PromptSampler, cfg, tt: TokenText | None = None,
                  world: World | None = None, sampler_model=None) -> Batch:
    """Sample, score, (dynamically) filter and compute advantages and old/ref log-probs for one training step.

    `sampler_model` generates the completions and reports their sampler log-probs (engine.sampler.PolicySampler's
    model; None: the policy itself, which then gives old and sampler log-probs in one forward).

    With several ranks (`world`, engine.distributed) this is one rank's share: batch_size / N completions in whole
    groups. Dynamic sampling then fills the global batch: after every generation round the ranks all-reduce how
    many groups they kept and go on until the sum reaches the global count; a rank whose share is full sits the
    next rounds out (draws nothing), and a rank's groups beyond its share are discarded, so every rank ends with
    the same number of rows (and of mini-batches)."""
    tt = tt or TokenText(tokenizer)
    world = world or World()
    G, n_groups = cfg.group_size, cfg.prompts_per_step // world.size  # this rank's groups
    kept, kept_rows, dropped, gen_batches = _sample_kept_groups(sampler_model or policy, tokenizer, tt, task, sampler,
                                                                cfg, world)

    # Renumber kept groups 0..n_groups-1 so that group g holds rows g*G..g*G+G-1 of the batch tensors.
    rollouts = [r for group in kept for r in group]
    for i, group in enumerate(kept):
        for r in group:
            r.group_id = i
    for j, r in enumerate(dropped):
        r.group_id = n_groups + j // G
    input_ids, P = _pad_cat([x[0] for x in kept_rows], [x[2] for x in kept_rows], tokenizer.pad_token_id)
    attention_mask, _ = _pad_cat([x[1] for x in kept_rows], [x[2] for x in kept_rows], 0)
    T = input_ids.shape[1] - P
    token_mask = attention_mask[:, P:].float()  # (B, T)
    advantages = _advantages(rollouts, G, T, cfg.supervision, cfg.scale_adv_by_std) * token_mask  # (B, T)

    loss_mask = token_mask.clone()  # (B, T)
    if cfg.overlong_filter:
        for b, r in enumerate(rollouts):
            if r.truncated:
                loss_mask[b] = 0.0
                r.filtered, r.filter_reason = True, "overlong"

    old_logp, entropy, sampler_logp, sampler_logp_full, ref_logp = _batch_logprobs(
        policy, ref, sampler_model, input_ids, attention_mask, P, cfg.temperature, cfg.top_k, cfg.top_p)
    token_mask_d = token_mask.to(input_ids.device)
    return Batch(
        rollouts=rollouts, dropped=dropped, gen_batches=gen_batches, input_ids=input_ids,
        attention_mask=attention_mask, prompt_len=P, token_mask=token_mask_d,
        loss_mask=loss_mask.to(input_ids.device), old_logp=old_logp * token_mask_d, ref_logp=ref_logp,
        entropy=entropy * token_mask_d, advantages=advantages.to(input_ids.device),
        sampler_logp=sampler_logp * token_mask_d, sampler_logp_full=sampler_logp_full * token_mask_d,
    )


def _sample_kept_groups(model, tokenizer, tt: TokenText, task: Task, sampler: PromptSampler, cfg, world: World):
    """Generation rounds until every rank together kept the global number of groups (one round without dynamic
    sampling). Returns the kept groups (at most this rank's share), per kept group its (input_ids, attention_mask,
    P), the dropped rollouts (marked filtered, with their reason) and the number of rounds."""
    G, n_groups = cfg.group_size, cfg.prompts_per_step // world.size  # this rank's groups
    sampling = Sampling.of(cfg)
    kept: list[list[Rollout]] = []  # groups
    kept_rows: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # per group: input_ids, attention_mask, P
    dropped: list[Rollout] = []
    gen_batches = 0
    group_counter = 0
    kept_everywhere = 0  # groups kept by all ranks together
    while kept_everywhere < n_groups * world.size:
        if gen_batches >= cfg.max_gen_batches:
            reasons: dict[str, int] = {}
            for r in dropped[::G]:
                reasons[r.filter_reason] = reasons.get(r.filter_reason, 0) + 1
            raise DynamicSamplingError(
                f"dynamic sampling kept only {kept_everywhere} of {n_groups * world.size} groups after "
                f"{gen_batches} generation batches (dropped: {reasons or 'none'}): the policy's groups are almost "
                "all correct or all wrong. Raise --max-gen-batches, raise --group-size, use an easier/harder task, "
                "or --no-dynamic-sampling."
            )
        # Refill batches ask for twice the missing groups, not a full batch: most of it would be discarded.
        missing = n_groups - len(kept)
        problems = sampler.draw(n_groups if gen_batches == 0 else min(n_groups, 2 * missing)) if missing else []
        gen_batches += 1
        if problems:
            rollouts, input_ids, attention_mask, P = sample_groups(model, tokenizer, tt, task, problems, sampling,
                                                                   G, group_counter)
            group_counter += len(problems)
        for g in range(len(problems)):
            group = rollouts[g * G : (g + 1) * G]
            reason = group_signal(group, cfg.supervision) if cfg.dynamic_sampling else None
            if reason is not None:
                for r in group:
                    r.filtered, r.filter_reason = True, reason
                dropped.extend(group)
            elif len(kept) < n_groups:
                kept.append(group)
                sl = slice(g * G, (g + 1) * G)
                kept_rows.append((input_ids[sl], attention_mask[sl], P))
        if not cfg.dynamic_sampling:
            break
        kept_everywhere = int(world.all_reduce([len(kept)])[0])
    return kept, kept_rows, dropped, gen_batches


def _advantages(rollouts: list[Rollout], G: int, T: int, supervision: str, scale_by_std: bool) -> torch.Tensor:
    """(B, T) advantages of the kept rollouts (groups of G consecutive rows), before masking; each rollout's
    `advantage` (its first token's) and, under process supervision, `step_reward_norm` are set too."""
    B = len(rollouts)
    if supervision != "process":
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)  # (B,)
        seq_adv = torch.as_tensor(group_advantages(rewards, G, scale_by_std=scale_by_std), dtype=torch.float32)  # (B,)
        for r, a in zip(rollouts, seq_adv.tolist(), strict=True):
            r.advantage = a
        return seq_adv[:, None].expand(B, T).clone()
    advantages = torch.zeros(B, T)  # (B, T)
    for g in range(B // G):
        group = rollouts[g * G : (g + 1) * G]
        step_rewards = [[s.score for s in r.steps] for r in group]
        adv = process_advantages(step_rewards, [r.step_last_token for r in group], [r.length for r in group])
        adv = torch.as_tensor(adv, dtype=torch.float32)  # (G, maxlen)
        width = min(adv.shape[1], T)
        advantages[g * G : (g + 1) * G, :width] = adv[:, :width]
        for i, (r, normalized) in enumerate(zip(group, normalized_step_rewards(step_rewards), strict=True)):
            r.step_reward_norm = normalized
            r.advantage = float(adv[i, 0]) if r.length and adv.shape[1] else 0.0
    return advantages


def _batch_logprobs(policy, ref, sampler_model, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int,
                    temperature: float, top_k: int, top_p: float):
    """Old (the policy's), sampler (after and before top-k / top-p truncation) and reference log-probs and the
    policy's entropy of the completion tokens, each (B, T), without grad; one forward per model."""
    with torch.no_grad():
        logits = completion_logits(policy, input_ids, attention_mask, P, temperature)  # (B, T, V)
        old_logp, entropy = token_logprobs(policy, input_ids, attention_mask, P, temperature, logits)
        separate = sampler_model is not None and sampler_model is not policy
        if separate:  # its own weights or precision: its own forward, as the rollout engine's
            logits = completion_logits(sampler_model, input_ids, attention_mask, P, temperature)
        if separate or top_k or top_p < 1.0:
            sampler_logp, sampler_logp_full = truncated_logprobs(logits, input_ids[:, P:], top_k, top_p)
        else:  # the policy sampled from its full distribution: the sampler's log-probs are the old ones
            sampler_logp = sampler_logp_full = old_logp
        del logits
        ref_logp = None
        if ref is not None:
            ref_logp, _ = token_logprobs(ref, input_ids, attention_mask, P, temperature)
    return old_logp, entropy, sampler_logp, sampler_logp_full, ref_logp


# ----------------------------------------------------------------------------- held-out evaluation


@dataclass
class EvalResult:
    """Held-out rollouts: index_in_group 0 is the greedy completion, 1 the sampled one, for each prompt."""

    rollouts: list[Rollout]
    input_ids: torch.Tensor  # (2E, P + T)
    attention_mask: torch.Tensor  # (2E, P + T)
    prompt_len: int
    old_logp: torch.Tensor  # (2E, T) log-probs of the evaluated policy at the training temperature
    ref_logp: torch.Tensor | None  # (2E, T)
    entropy: torch.Tensor  # (2E, T)
    accuracy_greedy: float
    accuracy_sampled: float


@torch.no_grad()
def evaluate(policy, ref, tokenizer, task: Task, problems: list[Problem], sampling: Sampling, seed: int,
             tt: TokenText | None = None) -> EvalResult:
    """Greedy and sampled accuracy on a fixed prompt set; the sampling RNG is forked so training is unaffected."""
    tt = tt or TokenText(tokenizer)
    E = len(problems)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        greedy = generate(policy, tokenizer, [p.prompt for p in problems], do_sample=False, temperature=1.0,
                          top_p=1.0, max_new_tokens=sampling.max_new_tokens)
        sampled = generate(policy, tokenizer, [p.prompt for p in problems], do_sample=True,
                           temperature=sampling.eval_temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           max_new_tokens=sampling.max_new_tokens)
    input_ids, P = _pad_cat([greedy[0], sampled[0]], [greedy[2], sampled[2]], tokenizer.pad_token_id)
    attention_mask, _ = _pad_cat([greedy[1], sampled[1]], [greedy[2], sampled[2]], 0)
    lengths = attention_mask[:, P:].sum(-1).tolist()
    comp = input_ids[:, P:].tolist()
    rollouts = []
    for n in range(2 * E):
        ids = comp[n][: lengths[n]]
        rollouts.append(Rollout(
            problem=problems[n % E], group_id=n % E, index_in_group=n // E, completion_ids=ids,
            completion=tt.completion_text(ids), truncated=not ids or ids[-1] != tokenizer.eos_token_id,
        ))
    sampling.score(task, rollouts, tt)
    token_mask = attention_mask[:, P:].float()
    old_logp, entropy = token_logprobs(policy, input_ids, attention_mask, P, sampling.temperature)
    ref_logp = None
    if ref is not None:
        ref_logp, _ = token_logprobs(ref, input_ids, attention_mask, P, sampling.temperature)
        ref_logp = ref_logp * token_mask
    return EvalResult(
        rollouts=rollouts, input_ids=input_ids, attention_mask=attention_mask, prompt_len=P,
        old_logp=old_logp * token_mask, ref_logp=ref_logp, entropy=entropy * token_mask,
        accuracy_greedy=sum(r.reward_correct for r in rollouts[:E]) / E,
        accuracy_sampled=sum(r.reward_correct for r in rollouts[E:]) / E,
    )


# ----------------------------------------------------------------------------- reference solutions, teacher-forced


@dataclass
class ReferenceScores:
    """The policy's log-prob and entropy of every token of each problem's reference solution (EOS included)."""

    problems: list[Problem]
    completion_ids: list[list[int]]
    """Per problem: the tokens of the reference completion, then EOS."""
    logp: torch.Tensor  # (E, T) zero after each completion's end
    entropy: torch.Tensor  # (E, T) zero after each completion's end

    def rows(self, task: Task, tt: TokenText) -> dict[str, list]:
        """One `ref_tokens` row per reference token (engine.runlog), in problem then position order."""
        cols: dict[str, list] = {k: [] for k in (
            "prompt_id", "position", "token_id", "token_text", "logp", "entropy", "answer_class")}
        logp, entropy = self.logp.cpu().tolist(), self.entropy.cpu().tolist()
        for e, (problem, ids) in enumerate(zip(self.problems, self.completion_ids, strict=True)):
            answer_class = task.answer_class(problem)
            for t, token in enumerate(ids):
                cols["prompt_id"].append(problem.prompt_id)
                cols["position"].append(t)
                cols["token_id"].append(token)
                cols["token_text"].append(tt.token(token))
                cols["logp"].append(logp[e][t])
                cols["entropy"].append(entropy[e][t])
                cols["answer_class"].append(answer_class)
        return cols


@torch.no_grad()
def score_references(policy, tokenizer, task: Task, problems: list[Problem], temperature: float) -> ReferenceScores:
    """Teacher-force each problem's reference solution through the policy: one batched forward, no sampling.

    The sequences have the rollout layout `[left-padded prompt | solution + EOS | right padding]` and go through
    `token_logprobs` at the training temperature, so a reference token's log-prob is exactly the old_logp it would
    have had if the policy had sampled it.
    """
    device = next(policy.parameters()).device
    prompts = [tokenizer(p.prompt).input_ids for p in problems]  # <bos> + prompt
    completions = [[*tokenizer(task.solution_text(p), add_special_tokens=False).input_ids, tokenizer.eos_token_id]
                   for p in problems]
    P, T = max(map(len, prompts)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (P - len(p)) + p + c + [pad] * (T - len(c))
                              for p, c in zip(prompts, completions, strict=True)], device=device)  # (E, P + T)
    attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c))
                                   for p, c in zip(prompts, completions, strict=True)], device=device)  # (E, P + T)
    logp, entropy = token_logprobs(policy, input_ids, attention_mask, P, temperature)  # (E, T) each
    token_mask = attention_mask[:, P:].float()  # (E, T)
    return ReferenceScores(problems=list(problems), completion_ids=completions, logp=logp * token_mask,
                           entropy=entropy * token_mask)
