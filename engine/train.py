"""The training loop: sample -> reward -> advantage -> update -> evaluate -> log (`_train_step`), run by `_train`
from the warm start or a checkpoint (engine.checkpoints) to the last step.

    policylens train --algo dapo --task linear --steps 200 --run-name dapo-linear
    policylens train --resume dapo-linear --steps 300          # continue the same run, same step numbering

    from engine.config import TrainConfig
    from engine.train import train
    train(TrainConfig(algo="gspo", steps=50), run_name="gspo-1", logs_dir="logs")

Each step samples one batch of `batch_size` completions (G per prompt) from the current policy, which becomes
pi_old for that step, then runs `epochs x minibatches` AdamW steps on it. From the second pass on, the policy has
moved, so ratios leave 1 and the clip of each objective really acts (on the first pass the policy is pi_old itself,
every ratio is 1 and no clip can act). Everything the objective did is recorded through engine.runlog (the rows are
built by engine.logrows): per token per pass the log-prob the loss used, ratio, clip code, gradient weight, token
loss and KL.

The rollouts come from the sampler (engine.sampler): the policy itself by default, or its own copy in another
precision (`--sampler-dtype`) and/or with the weights of `--sampler-lag` updates ago, refreshed after every update as
a rollout engine is after a weight sync; with `--top-k` / `--top-p` it reports truncated, renormalised log-probs.
The gap between its log-probs and old_logp (the trainer's) is logged per token and per step (`mismatch_*` in the
steps' extra), and the corrections of engine.corrections (`--rollout-is`, `--rollout-rs`, `--off-policy-mask`)
act on it: once per batch `correct_batch`, in every pass `loss_inputs` (the weighted advantages and mask the
objective gets), logged per token and pass as `is_weight` and `rejected`.

Step 0 is the warm start: only the held-out evaluation is logged there, so every curve starts at the warm start.

Under torchrun (`policylens train --nproc N`) the same loop runs on every rank, data-parallel: each rank samples
its share of the global batch, DDP all-reduces the gradients (of the policy and of PPO's critic), rank 0
evaluates and checkpoints (engine.distributed says how a step is split).

Departures from the papers:
1. The entropy passed to ASPO's entropy-dependent clip is the current pass's (detached), as in the Archer2.0 code,
   which computes it in the update forward.
2. The sequence ratio logged per pass (`rollouts.seq_ratio`) is the one the objective used: for GMPO the geometric
   mean of the token ratios after its per-token clip in log space, for GSPO the plain geometric mean.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoints import (  # noqa: F401  (also re-exported: engine.train's names before they moved)
    CHECKPOINT_DIR,
    LEGACY_CHECKPOINT_FILE,
    Checkpointer,
    TrainState,
    checkpoint_for_resume,
    checkpoint_path,
    checkpoint_steps,
    delete_checkpoints_before,
    open_resumed_run,
    rank_rng_state,
    restore_checkpoint,
    save_checkpoint,
    seed_rank_streams,
)
from engine.config import TrainConfig, resolve_device
from engine.correction_settings import CorrectionConfig
from engine.corrections import correct_batch, loss_inputs
from engine.critic import PPOCritic
from engine.distributed import World, check_world, close_world, data_parallel, init_world, world_size_from_env
from engine.logrows import (
    PassRecord,
    RankIds,
    eval_tables,
    mismatch_metrics,
    pass_record,
    step_metrics,
    step_tables,
    step_totals,
)
from engine.minibatches import minibatches, optimizer_step
from engine.objectives import BatchTotals, policy_loss
from engine.rollout import (
    Batch,
    EvalResult,
    PromptSampler,
    Sampling,
    TokenText,
    collect_batch,
    evaluate,
    token_logprobs,
)
from engine.sampler import PolicySampler


def model_config(size: str):
    """engine.policy.ModelConfig of a built-in model size (TrainConfig.model_size)."""
    from engine import policy as pol

    if size == "tiny":  # for tests and smoke runs: ~90k parameters, warm-started in seconds
        return pol.ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    return pol.ModelConfig()


# ----------------------------------------------------------------------------- one update


def update(policy, optimizer, batch: Batch, cfg: TrainConfig, generator: torch.Generator,
           world: World | None = None) -> list[PassRecord]:
    """`epochs x minibatches` AdamW steps on one sampled batch; returns one PassRecord per optimizer step.

    With several ranks (`world`), `policy` is the DistributedDataParallel-wrapped policy and `batch` this rank's
    share; every rank draws the same permutation of its rows (same `generator` state), so the k-th mini-batch is
    the union of the ranks' k-th slices. Its normalisers (rows, loss tokens, width) are all-reduced before the loss,
    so each rank's loss is its share of the union's loss, and scaled by N since DDP averages the gradients: the
    step is the one a single process takes on the union (the same as one rank on the same batch when minibatches
    is 1; with more mini-batches one rank would cut the batch differently)."""
    world = world or World()
    T = batch.token_mask.shape[1]
    P = batch.prompt_len
    params = [p for p in policy.parameters() if p.requires_grad]
    overrides = cfg.objective_overrides()
    # Outcome advantages are one number per sequence: pass them as (B,) so sequence-level objectives use A_i.
    # A critic's advantages (GAE, whitened) differ token by token whatever the supervision.
    seq_level_adv = cfg.supervision == "outcome" and batch.loss_advantages is None
    token_adv = batch.advantages if batch.loss_advantages is None else batch.loss_advantages  # (B, T)
    seq_adv = torch.tensor([r.advantage for r in batch.rollouts], device=batch.advantages.device)  # (B,)
    corrections = CorrectionConfig.of(cfg)
    # once per batch, as verl and TRL do: IS weights and rejections from old_logp vs the sampler's log-probs
    correction = correct_batch(corrections, batch.old_logp, batch.sampler_logp, batch.loss_mask) \
        if corrections.enabled else None
    records = []
    for mb in minibatches(batch.token_mask, cfg.epochs, cfg.minibatches, generator, batch.input_ids.device):
        idx, t_mb = mb.idx, mb.width  # right padding shared by the whole mini-batch trimmed: a faster forward
        logp, entropy = token_logprobs(
            policy, batch.input_ids[idx, : P + t_mb], batch.attention_mask[idx, : P + t_mb], P, cfg.temperature
        )  # (b, t_mb) each
        mask = batch.loss_mask[idx, :t_mb]  # (b, t_mb)
        ref_logp = batch.ref_logp[idx, :t_mb] if batch.ref_logp is not None else None
        adv = seq_adv[idx] if seq_level_adv else token_adv[idx, :t_mb]
        corrected = None
        if correction is not None:
            cols = (idx, slice(None, t_mb))
            corrected = loss_inputs(cfg.algo, corrections, correction.rows(cols), adv, logp,
                                    batch.sampler_logp[cols], mask)
            adv, mask = corrected.advantages, corrected.mask
        totals = None
        if world.distributed:
            rows, tokens = world.all_reduce([len(idx), float(mask.sum())])
            totals = BatchTotals(rows=rows, tokens=tokens, width=world.all_reduce([t_mb], "max")[0])
        out = policy_loss(cfg.algo, logp, batch.old_logp[idx, :t_mb], adv, mask, ref_logp=ref_logp,
                          entropy=entropy.detach(), totals=totals, **overrides)
        # DDP all-reduces the gradients as a mean over the ranks: the loss is scaled by N to make it their sum
        grad_norm = optimizer_step(optimizer, params, out.loss * world.size, cfg.max_grad_norm)
        records.append(pass_record(idx, T, logp, out, grad_norm, correction, corrected))  # padded to (b, T)
    return records

# ----------------------------------------------------------------------------- the loop


class _StopFlag:
    """First Ctrl-C: finish the current step, log it, checkpoint, stop. Second Ctrl-C: abort at once."""

    def __init__(self):
        self.requested = False
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        from tqdm import tqdm

        tqdm.write("Ctrl-C: stopping after the current step (press again to abort now)")

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def default_warm_start_threads() -> int:
    """Threads for a warm start that has the machine to itself: one per core it may use, at most 4 (the model is
    tiny). Counted from the OS, not from torch, whose default follows OMP_NUM_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(4, cores)


def load_models(cfg: TrainConfig, task, device: torch.device, cache_dir: str | Path | None, progress=None,
                sft_threads: int | None = None):
    """(policy, reference, tokenizer, description): the warm start (or --model DIR) and a frozen copy as pi_ref.

    `progress(step, steps, loss)` follows the warm start's SFT when it has to be trained (engine.policy.warm_start),
    on `sft_threads` threads (None: the current torch setting; 0: default_warm_start_threads(); the setting is
    restored afterwards).
    """
    from engine import policy as pol

    # By default the warm start uses the trainer's thread count: two threads on a busy 2-core machine run 10x
    # slower than one; only a warm start alone on the machine should take more (sft_threads).
    if sft_threads is None:
        sft_threads = torch.get_num_threads()
    sft = pol.SFTConfig(num_threads=sft_threads or default_warm_start_threads())
    sft = dataclasses.replace(sft, steps=cfg.sft_steps, warmup_steps=min(sft.warmup_steps, cfg.sft_steps))
    model, tokenizer, desc = pol.load_policy(task, model_dir=cfg.model, cache_dir=cache_dir, seed=cfg.task_seed,
                                             model_config=model_config(cfg.model_size), sft=sft, device=device,
                                             progress=progress)
    model.eval()  # no dropout anywhere: the first pass must reproduce old_logp exactly (ratio == 1)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    return model, ref, tokenizer, desc


def check_run_target(logs_dir: Path, run_name: str, resume: bool) -> None:
    """Raise RunLogError unless `run_name` is a valid name for a new run in `logs_dir` (or, with `resume`, an
    existing run there): checked before any heavy work."""
    from engine.runlog.layout import RUN_JSON, RunInfo, RunLogError, validate_run_name

    if logs_dir.exists() and not logs_dir.is_dir():
        raise RunLogError(f"the logs folder {logs_dir} is not a folder")
    validate_run_name(run_name, logs_dir)
    if resume and not (logs_dir / run_name / RUN_JSON).is_file():
        raise RunLogError(f"no run {run_name!r} to resume in {logs_dir} (no {RUN_JSON})")
    if resume:
        RunInfo.read(logs_dir / run_name)  # damaged, or of a newer release: said now, not after the warm start
    if not resume and (logs_dir / run_name).exists():
        raise RunLogError(f"run {run_name!r} already exists in {logs_dir}; pick another name or resume it")


def train(cfg: TrainConfig, run_name: str, logs_dir: str | Path = "logs", *, resume: bool = False,
          cache_dir: str | Path | None = None, progress: bool = True, num_threads: int | None = None,
          warm_start_threads: int | None = None, warm_start_progress: str | Path | None = None) -> str:
    """Train (or resume) the run `run_name` under `logs_dir`; returns the final status.

    `cache_dir` holds the warm-started models (default `<logs_dir>/.cache`). On resume, `cfg` is the run's saved
    config (with any overrides, e.g. more steps) and training continues after the newest checkpoint whose step is
    logged, or from the warm start when there is none (see checkpoint_for_resume). When the warm start is not
    cached yet it trains on `warm_start_threads` threads (None: `num_threads`; 0: one per core, at most 4) and
    reports its SFT progress into the JSON file `warm_start_progress` (engine.policy.sft_progress_reporter).

    Started by torchrun (engine.distributed), this process is one rank of a data-parallel run: rank 0 trains the
    warm start while the others wait, writes run.json, the metrics, the evaluation and the checkpoints; every rank
    samples and logs its own share of the batch.
    """
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    logs_dir = Path(logs_dir)
    check_world(cfg, world_size_from_env())
    check_run_target(logs_dir, run_name, resume)  # before the warm start, which can take minutes
    cache_dir = Path(cache_dir) if cache_dir is not None else logs_dir / ".cache"
    if num_threads:
        torch.set_num_threads(num_threads)
    world = init_world(resolve_device(cfg.device))
    try:
        with _TerminateAsCrash(world):
            status = _train(cfg, run_name, logs_dir, world, resume=resume, cache_dir=cache_dir,
                            progress=progress and world.is_main, warm_start_threads=warm_start_threads,
                            warm_start_progress=warm_start_progress)
        world.barrier()  # no rank tears the process group down while another still uses it
        return status
    finally:
        close_world(world)


class _TerminateAsCrash:
    """With several ranks, SIGTERM (torchrun stopping the other ranks when one failed) unwinds like an exception,
    so this rank closes its log and rank 0 records the run as crashed instead of leaving it `running`."""

    def __init__(self, world: World):
        self.world, self.previous = world, None

    def __enter__(self):
        if self.world.distributed and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


@dataclass
class _Loop:
    """What one rank's loop works with (built by `_setup`, the log opened by `_open_log`)."""

    cfg: TrainConfig
    world: World
    task: Any
    policy: torch.nn.Module
    ref: torch.nn.Module | None  # pi_ref, None when nothing needs it (no KL, no token logging)
    tokenizer: Any
    tt: TokenText
    eval_problems: list
    state: TrainState
    model_desc: str
    trained: torch.nn.Module | None = None  # what the update's forward goes through (DDP-wrapped with ranks)
    writer: Any = None  # engine.runlog.RunWriter
    saver: Checkpointer | None = None
    heldout: float = math.nan  # the latest held-out accuracy, for the progress bar

    def evaluate(self, step: int) -> EvalResult:
        # The same prompts every time; the sampled half uses a fixed seed per step, independent of training RNG.
        return evaluate(self.policy, self.ref, self.tokenizer, self.task, self.eval_problems, Sampling.of(self.cfg),
                        seed=1_000_003 * (step + 1) + self.cfg.seed, tt=self.tt)

    def reference_rows(self) -> dict | None:
        # The held-out reference solutions, teacher-forced: how likely the policy finds each right token (one
        # forward), so the dashboard can follow a token's probability over training.
        from engine.rollout import score_references

        if not self.cfg.log_tokens:
            return None
        return score_references(self.policy, self.tokenizer, self.task, self.eval_problems,
                                self.cfg.temperature).rows(self.task, self.tt)


def _setup(cfg: TrainConfig, world: World, device: torch.device, cache_dir: Path, warm_start_threads: int | None,
           warm_start_progress) -> _Loop:
    """The task, the warm-started policy and pi_ref, the optimizer (and critic), the RNG streams of this rank."""
    from engine.policy import sft_progress_reporter
    from engine.tasks import get_task

    task = get_task(cfg.task, seed=cfg.task_seed)
    if not world.is_main:
        world.barrier()  # rank 0 trains (or loads) the warm start first: one SFT, one cache entry
    policy, ref, tokenizer, model_desc = load_models(
        cfg, task, device, cache_dir, sft_threads=warm_start_threads,
        progress=sft_progress_reporter(warm_start_progress, print_every=0) if warm_start_progress else None)
    if world.is_main:
        world.barrier()
    need_ref = cfg.log_tokens or bool(cfg.beta) or bool(cfg.kl_coef)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    critic = PPOCritic.build(policy, cfg)  # None unless the algorithm has a critic (engine.objectives)
    sampler = PromptSampler(task.train, cfg.seed, world.rank)
    update_gen = torch.Generator().manual_seed(cfg.seed)  # the same on every rank: the same mini-batch slices
    seed_rank_streams(sampler, cfg.seed, world.rank)
    rollout_model = PolicySampler(policy, cfg.sampler_dtype, cfg.sampler_lag)  # restarted by a resume
    return _Loop(cfg, world, task, policy, ref if need_ref else None, tokenizer, TokenText(tokenizer),
                 list(task.heldout[: cfg.eval_size]),
                 TrainState(policy, optimizer, sampler, update_gen, critic, rollout_model), model_desc)


def _open_log(loop: _Loop, run_name: str, logs_dir: Path, device: torch.device, resume: bool) -> int:
    """Create the run, or resume it from its newest logged checkpoint; returns the first step to train."""
    from engine.runlog import RunWriter

    cfg, world = loop.cfg, loop.world
    if resume:
        loop.writer, start, restored = open_resumed_run(logs_dir, run_name, world, loop.state, cfg.seed)
    else:
        loop.writer = RunWriter.create(logs_dir, run_name, algorithm=cfg.algo, task=cfg.task, config=cfg.to_dict(),
                                       model=loop.model_desc, rank=world.rank)
        start, restored = 1, False
    loop.saver = Checkpointer(loop.writer.run_dir, world, loop.state, saved=start - 1 if restored else None)
    # DDP all-reduces the gradients; built after a restore (it broadcasts rank 0's weights); PPO's critic likewise
    loop.trained = data_parallel(loop.policy, world, device)
    if loop.state.critic is not None:
        loop.state.critic.distribute(world, device)
    return start


def _log_warm_start(loop: _Loop) -> None:
    """Step 0 (rank 0): the warm start's held-out accuracy, so every curve starts there."""
    if loop.world.is_main:
        ev = loop.evaluate(0)
        loop.heldout = ev.accuracy_greedy
        rollouts, tokens, prm = eval_tables(ev, 0, 0, loop.tt, loop.cfg.log_tokens)
        loop.writer.log_step(0, metrics={"heldout_accuracy": ev.accuracy_greedy,
                                         "heldout_accuracy_sampled": ev.accuracy_sampled},
                             rollouts=rollouts, tokens=tokens, prm_steps=prm, ref_tokens=loop.reference_rows())
    if loop.cfg.checkpoint_every:
        loop.saver.save(0)


def _train_step(loop: _Loop, step: int, stop: _StopFlag, deadline: float | None) -> tuple[dict, bool, bool]:
    """Sample, reward, advantage, update, evaluate, log one step; returns (metrics, stopping, final). Whether to
    stop is agreed by every rank after the update: any rank's clock (past `deadline`, time.monotonic) or Ctrl-C
    stops them all after this step."""
    cfg, world, state = loop.cfg, loop.world, loop.state
    t0 = time.perf_counter()
    # ---- sample + reward + advantage
    loop.policy.eval()
    batch = collect_batch(loop.policy, loop.ref, loop.tokenizer, loop.task, state.sampler, cfg, loop.tt, world,
                          sampler_model=state.rollout_model.model)
    if state.critic is not None:  # PPO: values, per-token rewards with the KL inside, GAE advantages
        state.critic.targets(batch, supervision=cfg.supervision, kl_coef=cfg.kl_coef, gamma=cfg.gae_gamma,
                             lam=cfg.gae_lambda, whiten=cfg.whiten_advantages)
    # ---- update
    records = update(loop.trained, state.optimizer, batch, cfg, state.update_gen, world)
    state.rollout_model.refresh(loop.policy)  # the weight sync
    critic_stats = None if state.critic is None else state.critic.update(
        batch, state.update_gen, epochs=cfg.epochs, minibatches=cfg.minibatches, value_clip=cfg.value_clip,
        value_coef=cfg.value_coef, max_grad_norm=cfg.max_grad_norm)
    # ---- evaluate (rank 0 alone; the others wait for its metrics at the next all-reduce)
    out_of_time = deadline is not None and time.monotonic() >= deadline
    out_of_time, stopping = map(bool, world.all_reduce([out_of_time, stop.requested], "max"))
    final = step == cfg.steps or out_of_time
    ev = ref_rows = None
    if world.is_main and cfg.eval_every and (step % cfg.eval_every == 0 or final):
        ev, ref_rows = loop.evaluate(step), loop.reference_rows()
        loop.heldout = ev.accuracy_greedy
    # ---- log
    totals = step_totals(batch, records, cfg.group_size).reduced(world)  # sums over every rank's share
    metrics = step_metrics(totals, records, ev, algo=cfg.algo, lr=cfg.lr, groups_kept=cfg.prompts_per_step,
                           critic_stats=critic_stats)
    if not world.distributed:  # the mismatch metrics are of the whole batch, not sums a rank can add up
        metrics.update(mismatch_metrics(batch, records))
    tables = step_tables(batch, records, ev, loop.tt, group_size=cfg.group_size, log_tokens=cfg.log_tokens,
                         ids=RankIds.gather(world, batch))
    metrics["step_seconds"] = time.perf_counter() - t0
    loop.writer.log_step(step, metrics=metrics if world.is_main else None, ref_tokens=ref_rows, **tables)
    return metrics, stopping, final


def _train(cfg: TrainConfig, run_name: str, logs_dir: Path, world: World, *, resume: bool, cache_dir: Path,
           progress: bool, warm_start_threads: int | None, warm_start_progress) -> str:
    """The body of `train` on one rank of `world`: set up, open the log, step 0, the steps, the last checkpoint."""
    from tqdm import tqdm

    device = world.device if world.device.type == "cuda" else resolve_device(cfg.device)
    loop = _setup(cfg, world, device, cache_dir, warm_start_threads, warm_start_progress)
    start = _open_log(loop, run_name, logs_dir, device, resume)
    status = "crashed"
    bar = tqdm(total=cfg.steps, initial=start - 1, disable=not progress, desc=run_name, unit="step")
    try:
        with _StopFlag() as stop:
            if world.broadcast(loop.writer.last_step is None and bool(cfg.eval_every)):
                _log_warm_start(loop)
            last, final, stopping = start - 1, False, False
            deadline = time.monotonic() + 60 * cfg.time_limit_minutes if cfg.time_limit_minutes else None
            for step in range(start, cfg.steps + 1):
                metrics, stopping, final = _train_step(loop, step, stop, deadline)
                last = step
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    loop.saver.save(step)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", acc=f"{metrics['accuracy']:.2f}",
                                heldout=f"{loop.heldout:.2f}", clip=f"{metrics['clip_low_frac']:.3f}/"
                                f"{metrics['clip_high_frac']:.3f}", refresh=False)
                if stopping or final:
                    break
            if last >= start and loop.saver.saved != last:
                loop.saver.save(last)
            status = "stopped" if stopping and not final else "finished"
    except KeyboardInterrupt:
        status = "stopped"
        raise
    finally:
        bar.close()
        loop.writer.close(status=status)
    loop.saver.keep_newest_only()  # every step is on disk now: only the newest checkpoint is needed
    return status
