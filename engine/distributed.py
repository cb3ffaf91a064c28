"""Data-parallel training on torch.distributed: which process this is, and the few collectives the trainer needs.

    policylens train --nproc 2 --algo dapo --run-name dapo-2      # starts torchrun (torch.distributed.run) itself
    torchrun --nproc_per_node 2 -m engine.cli train --algo dapo --run-name dapo-2   # the same, by hand

torchrun starts one process per rank and tells each its place through environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `init_world` reads them and joins the process group, with the gloo backend
on CPU and nccl on CUDA. A process started without torchrun is the one-rank world (`World()`): every collective
below is then the identity, so the single-process trainer runs the same code without a process group.

How a step is split (engine.train, engine.rollout, engine.logrows):
- the batch size is global: each rank samples `batch_size / N` completions, in whole groups (a group never
  straddles ranks, so group advantages are exact), from its own prompt stream and sampling RNG;
- the policy is wrapped in DistributedDataParallel, which all-reduces (averages) gradients during backward; the
  loss normalisers (rows, tokens, width of a mini-batch) are all-reduced first, so each rank's loss is its share of
  the loss over the whole mini-batch, scaled by N to undo DDP's average: N ranks take the optimizer step one rank
  would take on the union of their mini-batches;
- step metrics are computed from all-reduced sums and counts (engine.logrows.StepTotals), not rank 0's share;
- PPO's critic (engine.critic) is a DDP replica too, its value loss normalised over the global mini-batch the same
  way; its advantage whitening and explained variance use statistics all-reduced over the ranks.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# The warm start is trained by rank 0 while the others wait for it at a barrier: minutes for the default model.
PROCESS_GROUP_TIMEOUT = dt.timedelta(hours=2)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of a data-parallel run (the defaults: a single process)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    """Rank within this machine: the CUDA device index of the rank."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where collectives' tensors live: CPU for gloo, this rank's GPU for nccl."""

    @property
    def is_main(self) -> bool:
        """Rank 0 writes run.json, the step metrics, the evaluation and the checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Element-wise sum (or max) of `values` over the ranks; every rank passes the same number of values."""
        if not self.distributed:
            return [float(v) for v in values]
        import torch.distributed as dist

        x = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return x.tolist()

    def all_gather(self, obj) -> list:
        """`obj` of every rank, in rank order (picklable objects)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()


def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets torch.distributed's variables)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1


def check_world(cfg, nproc: int) -> None:
    """Raise ConfigError unless the run `cfg` (engine.config.TrainConfig) can be split over `nproc` ranks."""
    from engine.config import ConfigError

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if nproc == 1:
        return
    from engine.correction_settings import CorrectionConfig

    if CorrectionConfig.of(cfg).enabled:
        raise ConfigError(
            "--rollout-is, --rollout-rs and --off-policy-mask are single-process for now (--nproc 1): their "
            "batch-level statistics (sequence rejection rates, batch-normalised IS weights, effective sample size) "
            "would need an all-reduce of per-rank tensors that is not wired in; run with --nproc 1 or drop them")
    groups = cfg.prompts_per_step
    if groups % nproc:
        raise ConfigError(
            f"the batch of {cfg.batch_size} completions ({groups} groups of {cfg.group_size}) cannot be split into "
            f"whole groups over {nproc} processes: batch_size must be a multiple of group_size x nproc = "
            f"{cfg.group_size * nproc} (e.g. --batch-size {max(1, groups // nproc) * nproc * cfg.group_size})")
    if cfg.batch_size // nproc < cfg.minibatches:
        raise ConfigError(
            f"each of the {nproc} processes gets {cfg.batch_size // nproc} completions, fewer than the "
            f"{cfg.minibatches} mini-batches it must cut them into; lower --minibatches or raise --batch-size")


def init_world(device: torch.device) -> World:
    """Join the process group torchrun set up (gloo for a CPU `device`, nccl for CUDA), or the one-rank world.

    On CUDA each rank takes the GPU of its LOCAL_RANK; returns the device the rank trains on with the World."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return World(device=device if device.type == "cuda" else torch.device("cpu"))
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=PROCESS_GROUP_TIMEOUT)
    return World(rank=rank, size=size, local_rank=local_rank,
                 device=device if device.type == "cuda" else torch.device("cpu"))


def data_parallel(model: torch.nn.Module, world: World, device: torch.device) -> torch.nn.Module:
    """`model` wrapped in DistributedDataParallel on a world of several ranks (it broadcasts rank 0's weights, so
    wrap after a checkpoint is restored), else `model` itself. Buffers are not synced at each forward: the models
    have none that training changes."""
    if not world.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   forward_sync_buffers=False)


def close_world(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s sampling RNGs: rank 0 uses the run's seed (a one-rank run is unchanged), other
    ranks a stream derived from (seed, rank)."""
    return seed if rank == 0 else random.Random(f"rank:{seed}:{rank}").getrandbits(62)


def torchrun_command(nproc: int, train_args: Sequence[str]) -> list[str]:
    """The torchrun command line of `policylens train --nproc N ...` on this machine: N ranks of
    `python -m engine.cli train ...` (torch.distributed.run is torchrun's module; a free port is picked)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "engine.cli", "train", *train_args]
