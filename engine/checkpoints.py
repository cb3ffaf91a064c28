"""Checkpoints of a training run, and resuming one: what `policylens train --resume` continues from.

A checkpoint is written after every step (`checkpoint_every`, default 1), named by its step, while that step's log
is still being written on the run log's writer thread. A checkpoint counts only once its step is in the log: resume
takes the newest checkpoint whose step has been logged, deletes any newer one (its step's log was lost in the kill)
and any logged step after it. The previous checkpoint is kept until the next one is written, so a kill at any
moment costs at most the step in flight.

    state = TrainState(policy, optimizer, sampler, update_gen, critic)
    writer, start = open_resumed_run(logs_dir, name, world, state, seed)   # restores `state`, trims the log
    saver = Checkpointer(writer.run_dir, world, state, saved=start - 1)
    saver.save(step)
"""

from __future__ import annotations

import os
import random
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.distributed import World, rank_seed

if TYPE_CHECKING:
    from engine.rollout import PromptSampler

CHECKPOINT_DIR = "checkpoints"
LEGACY_CHECKPOINT_FILE = "latest.pt"


@dataclass
class TrainState:
    """What a checkpoint holds besides the step: the models, their optimizers and the RNG streams."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: PromptSampler
    update_gen: torch.Generator  # the mini-batch permutations: the same on every rank
    critic: Any = None  # engine.critic.PPOCritic, for algorithms with a critic
    rollout_model: Any = None  # engine.sampler.PolicySampler: its lag window is saved with the policy


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
                    critic=None, rank_states: list[dict] | None = None, rollout_model=None) -> Path:
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
        # the sampler's weights of the last `lag` updates: without them a resumed run would sample on-policy again
        "rollout_model": rollout_model.state_dict() if rollout_model is not None else None,
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


class Checkpointer:
    """Saves `state` after a step (every rank's RNG states gathered, rank 0 writes) and keeps only what resume
    needs: the previous checkpoint stays until the next one is complete (see `checkpoint_for_resume`)."""

    def __init__(self, run_dir: Path, world: World, state: TrainState, saved: int | None = None):
        self.run_dir, self.world, self.state = Path(run_dir), world, state
        self.saved = saved  # step of the newest checkpoint on disk

    def save(self, step: int) -> None:
        """Called by every rank (a collective). Written while the step's log is encoded on the writer thread."""
        s = self.state
        rank_states = self.world.all_gather(rank_rng_state(s.sampler))
        if self.world.is_main:
            save_checkpoint(self.run_dir, step, s.policy, s.optimizer, s.sampler, s.update_gen, s.critic, rank_states,
                            s.rollout_model)
            if self.saved is not None:
                delete_checkpoints_before(self.run_dir, self.saved)
        self.saved = step

    def keep_newest_only(self) -> None:
        """Once every step is on disk (the writer closed), only the newest checkpoint is needed."""
        if self.saved is not None and self.world.is_main:
            delete_checkpoints_before(self.run_dir, self.saved)


def open_resumed_run(logs_dir: Path, run_name: str, world: World, state: TrainState, seed: int):
    """(writer, first step to train, whether a checkpoint was restored) of a resumed run: the newest checkpoint
    whose step every rank logged is restored into `state`, and the log is cut back to it (no checkpoint: back to
    the warm start, keeping step 0's evaluation)."""
    from tqdm import tqdm

    from engine.runlog import RunWriter, last_steps_by_rank

    writer = RunWriter.resume(logs_dir, run_name, rank=world.rank)  # every rank holds its own writer lock from here
    ckpt, ckpt_path = None, None
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
    # The log never runs ahead of the state it continues from: steps logged after the checkpoint (the step in
    # flight when the run was killed) are deleted and trained again; no checkpoint: from the warm start.
    start = ckpt["step"] + 1 if ckpt is not None else 1
    logged = writer.last_step
    writer.discard_after(start - 1)
    redo = f"; logged steps {start} to {logged} are trained again" if logged is not None and logged >= start else ""
    if world.is_main:
        tqdm.write(f"{run_name}: resuming after step {start - 1}{redo}" if ckpt is not None else
                   f"{run_name}: no checkpoint, resuming from the warm start{redo}", file=sys.stderr)
    if ckpt is not None:
        restore_checkpoint(ckpt, state.policy, state.optimizer, state.sampler, state.update_gen, state.critic,
                           world.rank, seed)
        if state.rollout_model is not None:
            state.rollout_model.restart(state.policy, ckpt.get("rollout_model"))
    return writer, start, ckpt is not None
