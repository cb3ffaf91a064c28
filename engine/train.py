"""The training loop: sample -> reward -> advantage -> update -> evaluate -> log, one flat function.

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

Step 0 is the warm start: only the held-out evaluation is logged there, so every curve starts at the warm start.

Under torchrun (`policylens train --nproc N`) the same loop runs on every rank, data-parallel: each rank samples
its share of the global batch, DDP all-reduces the gradients, rank 0 evaluates and checkpoints (engine.distributed
says how a step is split).

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
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from engine.config import TrainConfig, resolve_device
from engine.critic import PPOCritic
from engine.distributed import World, check_world, close_world, init_world, rank_seed, world_size_from_env
from engine.logrows import PassRecord, RankIds, eval_tables, pass_record, step_metrics, step_tables, step_totals
from engine.objectives import BatchTotals, policy_loss
from engine.rollout import Batch, EvalResult, PromptSampler, TokenText, collect_batch, evaluate, token_logprobs


def model_config(size: str):
    """engine.policy.ModelConfig of a built-in model size (TrainConfig.model_size)."""
    from engine import policy as pol

    if size == "tiny":  # for tests and smoke runs: ~90k parameters, warm-started in seconds
        return pol.ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    return pol.ModelConfig()


CHECKPOINT_DIR = "checkpoints"
LEGACY_CHECKPOINT_FILE = "latest.pt"


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
    B, T = batch.token_mask.shape
    P = batch.prompt_len
    params = [p for p in policy.parameters() if p.requires_grad]
    overrides = cfg.objective_overrides()
    # Outcome advantages are one number per sequence: pass them as (B,) so sequence-level objectives use A_i.
    # A critic's advantages (GAE, whitened) differ token by token whatever the supervision.
    seq_level_adv = cfg.supervision == "outcome" and batch.loss_advantages is None
    token_adv = batch.advantages if batch.loss_advantages is None else batch.loss_advantages  # (B, T)
    seq_adv = torch.tensor([r.advantage for r in batch.rollouts], device=batch.advantages.device)  # (B,)
    records = []
    for _epoch in range(cfg.epochs):
        perm = torch.randperm(B, generator=generator)
        for idx in perm.tensor_split(cfg.minibatches):
            idx = idx.sort().values.to(batch.input_ids.device)
            # Trim right padding shared by the whole mini-batch: shorter sequences, faster forward.
            t_mb = int(batch.token_mask[idx].sum(-1).max().item())
            sl = slice(0, t_mb)
            logp, entropy = token_logprobs(
                policy, batch.input_ids[idx, : P + t_mb], batch.attention_mask[idx, : P + t_mb], P, cfg.temperature
            )  # (b, t_mb) each
            mask = batch.loss_mask[idx, sl]  # (b, t_mb)
            old_logp = batch.old_logp[idx, sl]  # (b, t_mb)
            ref_logp = batch.ref_logp[idx, sl] if batch.ref_logp is not None else None
            adv = seq_adv[idx] if seq_level_adv else token_adv[idx, sl]
            totals = None
            if world.distributed:
                rows, tokens = world.all_reduce([len(idx), float(mask.sum())])
                totals = BatchTotals(rows=rows, tokens=tokens, width=world.all_reduce([t_mb], "max")[0])
            out = policy_loss(cfg.algo, logp, old_logp, adv, mask, ref_logp=ref_logp, entropy=entropy.detach(),
                              totals=totals, **overrides)
            optimizer.zero_grad(set_to_none=True)
            (out.loss * world.size).backward()  # DDP all-reduces the gradients as a mean over the ranks
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            optimizer.step()

            records.append(pass_record(idx, T, logp, out, grad_norm))  # padded back to (b, T) for logging
    return records


# ----------------------------------------------------------------------------- checkpoints
# A checkpoint is written after every step (`checkpoint_every`, default 1), named by its step, while that step's
# log is still being written on the run log's writer thread. A checkpoint counts only once its step is in the log:
# resume takes the newest checkpoint whose step has been logged, deletes any newer one (its step's log was lost
# in the kill) and any logged step after it. The previous checkpoint is kept until the next one is written, so a
# kill at any moment costs at most the step in flight.


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:09d}.pt"


def checkpoint_steps(run_dir: Path) -> dict[int, Path]:
    """The run's complete checkpoints by step (a checkpoint being written has a temporary name and is not listed;
    `latest.pt` is the single checkpoint of runs logged before per-step checkpoints)."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    found = {}
    for path in ckpt_dir.glob("step-*.pt"):
        if (m := re.fullmatch(r"step-(\d{9})\.pt", path.name)) is not None:
            found[int(m[1])] = path
    legacy = ckpt_dir / LEGACY_CHECKPOINT_FILE
    if legacy.is_file():
        found.setdefault(int(torch.load(legacy, map_location="cpu", weights_only=False)["step"]), legacy)
    return found


def delete_checkpoints_before(run_dir: Path, step: int) -> None:
    for old_step, old in checkpoint_steps(run_dir).items():
        if old_step < step:
            old.unlink(missing_ok=True)


def rank_rng_state(sampler: PromptSampler) -> dict:
    """The RNG states that differ from rank to rank: its prompt stream and its sampling RNGs."""
    return {
        "sampler": sampler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python_rng": random.getstate(),
    }


def seed_rank_streams(sampler: PromptSampler, seed: int, rank: int, after_step: int = 0) -> None:
    """Seed `rank`'s sampling RNGs (rank 0's at step 0 are the single-process run's). `after_step` > 0: a rank that
    joins a resumed run also gets a prompt stream of its own, not a replay of its stream from step 1."""
    if after_step:
        sampler.rng.seed(f"prompts:{seed}:rank{rank}:after{after_step}")
    torch.manual_seed(rank_seed(seed + after_step, rank))
    random.seed(rank_seed(seed + after_step, rank))


def save_checkpoint(run_dir: Path, step: int, policy, optimizer, sampler: PromptSampler, update_gen,
                    critic=None, rank_states: list[dict] | None = None) -> Path:
    """Model, optimizer (and PPO's critic) and every RNG state after `step`, written to a temporary name and renamed
    into place: one file per step, so policy and critic can never come from different steps.

    `rank_states`: every rank's `rank_rng_state` of a data-parallel run (rank 0 writes the file; the model,
    optimizer and update permutation RNG are the same on every rank); the top-level RNG keys are rank 0's."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    rank_states = rank_states or [rank_rng_state(sampler)]
    state = {
        "step": step,
        "model": policy.state_dict(),
        "optimizer": optimizer.state_dict(),
        "update_rng": update_gen.get_state(),
        **rank_states[0],
        "world_size": len(rank_states),
        "rank_states": rank_states,
        "critic": critic.state_dict() if critic is not None else None,
    }
    path = checkpoint_path(run_dir, step)
    tmp = ckpt_dir / f".tmp-{path.name}"
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def restore_checkpoint(ckpt: dict, policy, optimizer, sampler: PromptSampler, update_gen, critic=None,
                       rank: int = 0, seed: int = 0) -> None:
    """The inverse of save_checkpoint: the state after `ckpt["step"]`, RNGs included. Rank `rank` of a resumed
    data-parallel run takes its own RNG states; a rank the checkpointed run did not have (resumed with more ranks)
    gets fresh streams (seed_rank_streams with `seed`)."""
    if critic is not None:
        from engine.runlog import RunLogError

        if ckpt.get("critic") is None:
            raise RunLogError(f"the checkpoint of step {ckpt['step']} has no critic: PPO cannot resume without it")
        critic.load_state_dict(ckpt["critic"])
    policy.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    update_gen.set_state(ckpt["update_rng"])
    states = ckpt.get("rank_states") or [ckpt]  # checkpoints of single-process runs before data parallelism
    if rank >= len(states):
        seed_rank_streams(sampler, seed, rank, after_step=ckpt["step"] + 1)
        return
    own = states[rank]
    sampler.load_state_dict(own["sampler"])
    torch.set_rng_state(own["torch_rng"])
    if own["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(own["cuda_rng"])
    random.setstate(own["python_rng"])


def checkpoint_for_resume(run_dir: Path, last_logged: int | Mapping[int, int] | None) -> dict | None:
    """The newest checkpoint whose step is logged, or None (continue from the warm start). Checkpoints of steps
    never logged, and temporaries of a killed save, are deleted.

    `last_logged`: the run's last logged step (None: no step), or each rank's (engine.runlog.last_steps_by_rank):
    a data-parallel checkpoint counts only once every rank it was taken with has logged its step (step 0, the warm
    start's evaluation, is rank 0's alone)."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    for tmp in ckpt_dir.glob(".tmp-*"):
        tmp.unlink(missing_ok=True)
    logged = dict(last_logged) if isinstance(last_logged, Mapping) else (
        {0: last_logged} if last_logged is not None else {})
    found = checkpoint_steps(run_dir)
    for step in sorted(found, reverse=True):
        if step <= logged.get(0, -1):
            ckpt = torch.load(found[step], map_location="cpu", weights_only=False)
            ranks = range(ckpt.get("world_size", 1)) if step > 0 else range(1)
            if all(logged.get(r, -1) >= step for r in ranks):
                return ckpt
        found[step].unlink()  # its step was not logged by every rank: it is trained again
    return None


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


def _train(cfg: TrainConfig, run_name: str, logs_dir: Path, world: World, *, resume: bool, cache_dir: Path,
           progress: bool, warm_start_threads: int | None, warm_start_progress) -> str:
    """The body of `train` on one rank of `world`."""
    from tqdm import tqdm

    from engine.policy import sft_progress_reporter
    from engine.runlog import RunWriter, last_steps_by_rank
    from engine.tasks import get_task

    device = world.device if world.device.type == "cuda" else resolve_device(cfg.device)

    # ------------------------------------------------------------------ setup
    task = get_task(cfg.task, seed=cfg.task_seed)
    if not world.is_main:
        world.barrier()  # rank 0 trains (or loads) the warm start first: one SFT, one cache entry
    policy, ref, tokenizer, model_desc = load_models(
        cfg, task, device, cache_dir, sft_threads=warm_start_threads,
        progress=sft_progress_reporter(warm_start_progress, print_every=0) if warm_start_progress else None)
    if world.is_main:
        world.barrier()
    need_ref = cfg.log_tokens or bool(cfg.beta) or bool(cfg.kl_coef)
    tt = TokenText(tokenizer)
    eval_problems = list(task.heldout[: cfg.eval_size])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    critic = PPOCritic.build(policy, cfg)  # None unless the algorithm has a critic (engine.objectives)
    sampler = PromptSampler(task.train, cfg.seed, world.rank)
    update_gen = torch.Generator().manual_seed(cfg.seed)  # the same on every rank: the same mini-batch slices
    seed_rank_streams(sampler, cfg.seed, world.rank)

    ckpt = None
    if resume:
        # every rank holds its own writer lock from here on
        writer = RunWriter.resume(logs_dir, run_name, rank=world.rank)
        ckpt_path = None
        if world.is_main:
            logged_by_rank = last_steps_by_rank(writer.run_dir)
            ckpt = checkpoint_for_resume(writer.run_dir, logged_by_rank)
            keep = ckpt["step"] if ckpt is not None else -1
            for rank in sorted(r for r, last in logged_by_rank.items() if r >= world.size and last > keep):
                # ranks the run had before and has no more (resumed with fewer): their log after the checkpoint goes
                RunWriter.resume(logs_dir, run_name, rank=rank, truncate_after=keep, background=False).close()
            ckpt_path = str(checkpoint_steps(writer.run_dir)[ckpt["step"]]) if ckpt is not None else None
        ckpt_path = world.broadcast(ckpt_path)
        if not world.is_main and ckpt_path is not None:
            ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        # The log never runs ahead of the state it continues from: steps logged after the checkpoint (the step
        # in flight when the run was killed) are deleted and trained again; no checkpoint: from the warm start.
        start = ckpt["step"] + 1 if ckpt is not None else 1
        logged = writer.last_step
        writer.discard_after(start - 1)
        redo = f"; logged steps {start} to {logged} are trained again" if logged is not None and logged >= start else ""
        if world.is_main:
            tqdm.write(f"{run_name}: resuming after step {start - 1}{redo}" if ckpt is not None else
                       f"{run_name}: no checkpoint, resuming from the warm start{redo}", file=sys.stderr)
        if ckpt is not None:
            restore_checkpoint(ckpt, policy, optimizer, sampler, update_gen, critic, world.rank, cfg.seed)
    else:
        writer = RunWriter.create(logs_dir, run_name, algorithm=cfg.algo, task=cfg.task, config=cfg.to_dict(),
                                  model=model_desc, rank=world.rank)
        start = 1
    trained = policy  # what the update's forward goes through: with several ranks, DDP all-reduces its gradients
    if world.distributed:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(policy, device_ids=[device.index] if device.type == "cuda" else None,
                                          forward_sync_buffers=False)
    run_dir = Path(writer.run_dir)
    saved = start - 1 if resume and ckpt is not None else None  # step of the newest checkpoint on disk

    def checkpoint(step: int) -> None:
        # Written while the step's log is encoded on the writer thread; the previous checkpoint stays until this
        # one is complete (see checkpoint_for_resume).
        nonlocal saved
        rank_states = world.all_gather(rank_rng_state(sampler))
        if world.is_main:
            save_checkpoint(run_dir, step, policy, optimizer, sampler, update_gen, critic, rank_states)
            if saved is not None:
                delete_checkpoints_before(run_dir, saved)
        saved = step

    def run_eval(step: int) -> EvalResult:
        # The same prompts every time; the sampled half uses a fixed seed per step, independent of training RNG.
        return evaluate(policy, ref if need_ref else None, tokenizer, task, eval_problems, cfg,
                        seed=1_000_003 * (step + 1) + cfg.seed, tt=tt)

    def reference_rows() -> dict | None:
        # The held-out reference solutions, teacher-forced: how likely the policy finds each right token (one
        # forward), so the dashboard can follow a token's probability over training.
        from engine.rollout import score_references

        if not cfg.log_tokens:
            return None
        return score_references(policy, tokenizer, task, eval_problems, cfg.temperature).rows(task, tt)

    status = "crashed"
    bar = tqdm(total=cfg.steps, initial=start - 1, disable=not progress, desc=run_name, unit="step")
    heldout = float("nan")
    try:
        with _StopFlag() as stop:
            # ---- step 0 (rank 0): the warm start's held-out accuracy, so every curve starts there
            if world.broadcast(writer.last_step is None and bool(cfg.eval_every)):
                if world.is_main:
                    ev = run_eval(0)
                    heldout = ev.accuracy_greedy
                    rollouts, tokens, prm = eval_tables(ev, 0, 0, tt, cfg.log_tokens)
                    writer.log_step(0, metrics={"heldout_accuracy": heldout,
                                                "heldout_accuracy_sampled": ev.accuracy_sampled},
                                    rollouts=rollouts, tokens=tokens, prm_steps=prm, ref_tokens=reference_rows())
                if cfg.checkpoint_every:
                    checkpoint(0)
            last, final, stopping = start - 1, False, False
            t_train = time.monotonic()
            for step in range(start, cfg.steps + 1):
                t0 = time.perf_counter()
                # ---------------------------------------------------------- sample + reward + advantage
                policy.eval()
                batch = collect_batch(policy, ref if need_ref else None, tokenizer, task, sampler, cfg, tt, world)
                if critic is not None:  # PPO: values, per-token rewards with the KL inside, GAE advantages
                    critic.targets(batch, cfg)

                # ---------------------------------------------------------- update
                records = update(trained, optimizer, batch, cfg, update_gen, world)
                critic_stats = critic.update(batch, cfg, update_gen) if critic is not None else None

                # ---------------------------------------------------------- evaluate
                out_of_time = bool(cfg.time_limit_minutes) and time.monotonic() - t_train >= 60 * cfg.time_limit_minutes
                # every rank stops after the same step: any rank's clock or Ctrl-C stops them all
                out_of_time, stopping = map(bool, world.all_reduce([out_of_time, stop.requested], "max"))
                final = step == cfg.steps or out_of_time
                ev = ref_rows = None
                # held-out evaluation on rank 0 alone (the others wait for its metrics at the next all-reduce)
                if world.is_main and cfg.eval_every and (step % cfg.eval_every == 0 or final):
                    ev = run_eval(step)
                    ref_rows = reference_rows()
                    heldout = ev.accuracy_greedy

                # ---------------------------------------------------------- log
                totals = step_totals(batch, records, cfg).reduced(world)  # sums over every rank's share
                metrics = step_metrics(batch, records, ev, cfg, critic_stats, totals)
                tables = step_tables(batch, records, ev, cfg, tt, RankIds.gather(world, batch))
                metrics["step_seconds"] = time.perf_counter() - t0
                writer.log_step(step, metrics=metrics if world.is_main else None, ref_tokens=ref_rows, **tables)

                last = step
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    checkpoint(step)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", acc=f"{metrics['accuracy']:.2f}",
                                heldout=f"{heldout:.2f}", clip=f"{metrics['clip_low_frac']:.3f}/"
                                f"{metrics['clip_high_frac']:.3f}", refresh=False)
                if stopping or out_of_time:
                    break
            if last >= start and saved != last:
                checkpoint(last)
            status = "stopped" if stopping and not final else "finished"
    except KeyboardInterrupt:
        status = "stopped"
        raise
    finally:
        bar.close()
        writer.close(status=status)
    if saved is not None and world.is_main:  # every step is on disk now: only the newest checkpoint is needed
        delete_checkpoints_before(run_dir, saved)
    return status
