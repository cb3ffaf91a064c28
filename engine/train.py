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
from pathlib import Path

import torch

from engine.config import TrainConfig, resolve_device
from engine.critic import PPOCritic
from engine.logrows import PassRecord, eval_tables, pass_record, step_metrics, step_tables
from engine.objectives import policy_loss
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


def update(policy, optimizer, batch: Batch, cfg: TrainConfig, generator: torch.Generator) -> list[PassRecord]:
    """`epochs x minibatches` AdamW steps on one sampled batch; returns one PassRecord per optimizer step."""
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
            out = policy_loss(cfg.algo, logp, old_logp, adv, mask, ref_logp=ref_logp, entropy=entropy.detach(),
                              **overrides)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
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


def save_checkpoint(run_dir: Path, step: int, policy, optimizer, sampler: PromptSampler, update_gen,
                    critic=None) -> Path:
    """Model, optimizer (and PPO's critic) and every RNG state after `step`, written to a temporary name and renamed
    into place: one file per step, so policy and critic can never come from different steps."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": policy.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(),
        "update_rng": update_gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python_rng": random.getstate(),
        "critic": critic.state_dict() if critic is not None else None,
    }
    path = checkpoint_path(run_dir, step)
    tmp = ckpt_dir / f".tmp-{path.name}"
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def restore_checkpoint(ckpt: dict, policy, optimizer, sampler: PromptSampler, update_gen, critic=None) -> None:
    """The inverse of save_checkpoint: the state after `ckpt["step"]`, RNGs included."""
    if critic is not None:
        from engine.runlog import RunLogError

        if ckpt.get("critic") is None:
            raise RunLogError(f"the checkpoint of step {ckpt['step']} has no critic: PPO cannot resume without it")
        critic.load_state_dict(ckpt["critic"])
    policy.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    sampler.load_state_dict(ckpt["sampler"])
    update_gen.set_state(ckpt["update_rng"])
    torch.set_rng_state(ckpt["torch_rng"])
    if ckpt["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
    random.setstate(ckpt["python_rng"])


def checkpoint_for_resume(run_dir: Path, last_logged: int | None) -> dict | None:
    """The newest checkpoint whose step is logged (`last_logged`, None: no step), or None (continue from the warm
    start). Checkpoints of steps never logged, and temporaries of a killed save, are deleted."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    for tmp in ckpt_dir.glob(".tmp-*"):
        tmp.unlink(missing_ok=True)
    found = checkpoint_steps(run_dir)
    usable = [step for step in found if last_logged is not None and step <= last_logged]
    for step, path in found.items():
        if last_logged is None or step > last_logged:
            path.unlink()
    if not usable:
        return None
    return torch.load(found[max(usable)], map_location="cpu", weights_only=False)


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
    from engine.runlog import RunLogError, validate_run_name

    if logs_dir.exists() and not logs_dir.is_dir():
        raise RunLogError(f"the logs folder {logs_dir} is not a folder")
    validate_run_name(run_name, logs_dir)
    run_json = logs_dir / run_name / "run.json"
    if resume and not run_json.is_file():
        raise RunLogError(f"no run {run_name!r} to resume in {logs_dir} (no {run_json.name})")
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
    """
    from tqdm import tqdm

    from engine.runlog import RunWriter
    from engine.tasks import get_task

    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    logs_dir = Path(logs_dir)
    check_run_target(logs_dir, run_name, resume)  # before the warm start, which can take minutes
    cache_dir = Path(cache_dir) if cache_dir is not None else logs_dir / ".cache"
    if num_threads:
        torch.set_num_threads(num_threads)
    device = resolve_device(cfg.device)

    # ------------------------------------------------------------------ setup
    task = get_task(cfg.task, seed=cfg.task_seed)
    from engine.policy import sft_progress_reporter

    policy, ref, tokenizer, model_desc = load_models(
        cfg, task, device, cache_dir, sft_threads=warm_start_threads,
        progress=sft_progress_reporter(warm_start_progress, print_every=0) if warm_start_progress else None)
    need_ref = cfg.log_tokens or bool(cfg.beta) or bool(cfg.kl_coef)
    tt = TokenText(tokenizer)
    eval_problems = list(task.heldout[: cfg.eval_size])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    critic = PPOCritic.build(policy, cfg)  # None unless the algorithm has a critic (engine.objectives)
    sampler = PromptSampler(task.train, cfg.seed)
    update_gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    ckpt = None
    if resume:
        writer = RunWriter.resume(logs_dir, run_name)  # holds the run's writer lock from here on
        ckpt = checkpoint_for_resume(writer.run_dir, writer.last_step)
        # The log never runs ahead of the state it continues from: steps logged after the checkpoint (the step
        # in flight when the run was killed) are deleted and trained again; no checkpoint: from the warm start.
        start = ckpt["step"] + 1 if ckpt is not None else 1
        logged = writer.last_step
        writer.discard_after(start - 1)
        redo = f"; logged steps {start} to {logged} are trained again" if logged is not None and logged >= start else ""
        tqdm.write(f"{run_name}: resuming after step {start - 1}{redo}" if ckpt is not None else
                   f"{run_name}: no checkpoint, resuming from the warm start{redo}", file=sys.stderr)
        if ckpt is not None:
            restore_checkpoint(ckpt, policy, optimizer, sampler, update_gen, critic)
    else:
        writer = RunWriter.create(logs_dir, run_name, algorithm=cfg.algo, task=cfg.task, config=cfg.to_dict(),
                                  model=model_desc)
        start = 1
    run_dir = Path(writer.run_dir)
    saved = start - 1 if resume and ckpt is not None else None  # step of the newest checkpoint on disk

    def checkpoint(step: int) -> None:
        # Written while the step's log is encoded on the writer thread; the previous checkpoint stays until this
        # one is complete (see checkpoint_for_resume).
        nonlocal saved
        save_checkpoint(run_dir, step, policy, optimizer, sampler, update_gen, critic)
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
            if writer.last_step is None and cfg.eval_every:
                # ---- step 0: the warm start's held-out accuracy, so every curve starts there
                ev = run_eval(0)
                heldout = ev.accuracy_greedy
                rollouts, tokens, prm = eval_tables(ev, 0, 0, tt, cfg.log_tokens)
                writer.log_step(0, metrics={"heldout_accuracy": heldout,
                                            "heldout_accuracy_sampled": ev.accuracy_sampled},
                                rollouts=rollouts, tokens=tokens, prm_steps=prm, ref_tokens=reference_rows())
                if cfg.checkpoint_every:
                    checkpoint(0)
            last, final = start - 1, False
            t_train = time.monotonic()
            for step in range(start, cfg.steps + 1):
                t0 = time.perf_counter()
                # ---------------------------------------------------------- sample + reward + advantage
                policy.eval()
                batch = collect_batch(policy, ref if need_ref else None, tokenizer, task, sampler, cfg, tt)
                if critic is not None:  # PPO: values, per-token rewards with the KL inside, GAE advantages
                    critic.targets(batch, cfg)

                # ---------------------------------------------------------- update
                records = update(policy, optimizer, batch, cfg, update_gen)
                critic_stats = critic.update(batch, cfg, update_gen) if critic is not None else None

                # ---------------------------------------------------------- evaluate
                out_of_time = bool(cfg.time_limit_minutes) and time.monotonic() - t_train >= 60 * cfg.time_limit_minutes
                final = step == cfg.steps or out_of_time
                ev = ref_rows = None
                if cfg.eval_every and (step % cfg.eval_every == 0 or final):
                    ev = run_eval(step)
                    ref_rows = reference_rows()
                    heldout = ev.accuracy_greedy

                # ---------------------------------------------------------- log
                metrics = step_metrics(batch, records, ev, cfg, critic_stats)
                tables = step_tables(batch, records, ev, cfg, tt)
                metrics["step_seconds"] = time.perf_counter() - t0
                writer.log_step(step, metrics=metrics, ref_tokens=ref_rows, **tables)

                last = step
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    checkpoint(step)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", acc=f"{metrics['accuracy']:.2f}",
                                heldout=f"{heldout:.2f}", clip=f"{metrics['clip_low_frac']:.3f}/"
                                f"{metrics['clip_high_frac']:.3f}", refresh=False)
                if stop.requested or out_of_time:
                    break
            if last >= start and saved != last:
                checkpoint(last)
            status = "stopped" if stop.requested and not final else "finished"
    except KeyboardInterrupt:
        status = "stopped"
        raise
    finally:
        bar.close()
        writer.close(status=status)
    if saved is not None:  # every step is on disk now: only the newest checkpoint is needed
        delete_checkpoints_before(run_dir, saved)
    return status
