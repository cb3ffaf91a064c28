"""TRL's GRPOTrainer: (a) the PolicyLens adapter's overhead, (b) TRL vs `policylens train --algo grpo`, per step.

    python benchmarks/bench_trl.py                          # both, 3 rounds x 6 steps, one thread each
    python benchmarks/bench_trl.py --part overhead --rounds 5

Both parts use the geometry of `policylens train --algo grpo` (engine.integrations.trl_tasks.engine_matched_config):
32 prompts x 8 completions per step, 2 passes of 2 mini-batches (one optimizer step each), the same lr, AdamW
settings, response budget, eps 0.2, beta 0.04 with the plain k3 KL, the task's correctness reward; one torch thread.
A step is one generation batch and everything done with it: sampling, rewards, reference and old log-probs, the four
optimizer steps and, for logged runs, building and writing the run log. Step time is the gap between consecutive
generation boundaries (TRL: every 4th optimizer step, timed by a callback; the engine: `steps.wall_time`); the
first step of each run is dropped (warm-up). Variants alternate order in each round, so load from other processes
hits both alike; reported are medians over all timed steps.

Wall-clock time on a shared machine moves with everyone else's load, so (a) also reports the CPU seconds of the
process per step (`time.process_time`, every thread: the run log's writer thread too), which is what the adapter
costs whatever the load. Both variants sample the same completions (same seed; the adapter draws no random
numbers), so step k of round r of one pairs with step k of round r of the other: also reported are the median of
these paired CPU ratios and the ratio of the totals. Under heavy load even CPU time inflates (caches and cores
are shared), so the adapter's own CPU seconds are also counted where they are spent (`timed_adapter`). A run of
fewer than 33 steps contains no compaction of the run log (its first merge comes after 32 step folders; see
engine/runlog/).

(a) overhead: GRPOTrainer vs PolicyLensGRPOTrainer (every token logged) on the tiny model (the tests' short warm
    start, 200 SFT steps); target <= 5%.
(b) TRL GRPOTrainer vs the engine's trainer on the default warm-started model (built once, about 2 CPU minutes,
    cached in --cache-dir like `policylens train` does); reported as TRL's seconds per step / the engine's.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_train import step_times  # noqa: E402


def timed_adapter(spent: list[float]):
    """A subclass of the adapter that adds to spent[0] the CPU seconds (`time.thread_time`) of its own work, where
    it happens: building the rollouts, recording each pass, building and handing over the step (the training
    thread) and encoding and writing it (the run log's writer thread)."""
    from engine.integrations.trl import PolicyLensGRPOTrainer

    def timed(method):
        def run(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start
        return run

    class TimedAdapter(PolicyLensGRPOTrainer):
        _policylens_rollouts = timed(PolicyLensGRPOTrainer._policylens_rollouts)
        _policylens_pass = timed(PolicyLensGRPOTrainer._policylens_pass)
        _policylens_flush = timed(PolicyLensGRPOTrainer._policylens_flush)

        def _policylens_open(self):
            writer = super()._policylens_open()
            if "_write_step" not in vars(writer):
                writer._write_step = timed(writer._write_step)
            return writer

    return TimedAdapter


def trl_step_times(model_dir: Path, logs_dir: Path, name: str, steps: int, adapter: bool, cfg,
                   cpu: list[float] | None = None, own: list[float] | None = None) -> list[float]:
    """Seconds per generation step of one TRL run (first step dropped). With `cpu`, the process's CPU seconds
    per step (`time.process_time`: every thread, so the run log's writer thread too) are appended to it; with
    `own` (adapter runs), the adapter's own CPU seconds per step over the whole run (`timed_adapter`)."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from engine.integrations.trl_tasks import engine_matched_config, task_dataset, task_reward_funcs
    from engine.tasks import get_task

    updates_per_step = cfg.epochs * cfg.minibatches
    marks: list[tuple[float, float]] = []  # (wall, CPU) at each generation boundary

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % updates_per_step == 0:
                marks.append((time.perf_counter(), time.process_time()))

    task = get_task(cfg.task, seed=cfg.task_seed)
    extra = {"logs_dir": logs_dir, "run_name": name} if adapter else {}
    spent = [0.0]
    trainer = (timed_adapter(spent) if adapter else GRPOTrainer)(
        model=str(model_dir), reward_funcs=task_reward_funcs(task, cfg.max_new_tokens)[:1],
        args=engine_matched_config(cfg, logs_dir / ".trl" / name, steps=steps), train_dataset=task_dataset(task),
        callbacks=[Clock()], **extra)
    trainer.train()
    if cpu is not None:
        cpu += [b[1] - a[1] for a, b in itertools.pairwise(marks)][1:]
    if own is not None:
        own.append(spent[0] / steps)
    return [b[0] - a[0] for a, b in itertools.pairwise(marks)][1:]


def engine_step_times(logs_dir: Path, name: str, cfg, cache_dir: Path) -> list[float]:
    from engine.train import train

    train(cfg, name, logs_dir, cache_dir=cache_dir, progress=False, num_threads=1)
    return step_times(logs_dir, name)


def report(title: str, a_name: str, a: list[float], b_name: str, b: list[float]) -> float:
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{title}: {a_name} {ma:.3f} s/step (n={len(a)}), {b_name} {mb:.3f} s/step (n={len(b)}), "
          f"ratio {ma / mb:.3f}")
    return ma / mb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["overhead", "engine", "both"], default="both")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-dir", default="logs/.cache", help="warm-start cache (shared with policylens train)")
    args = ap.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging
    from trl_grpo import warm_start_folder

    from engine.config import TrainConfig

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    cache = Path(args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        logs = Path(tmp)
        if args.part in ("overhead", "both"):
            cfg = TrainConfig(algo="grpo", task="linear", model_size="tiny", steps=args.steps, eval_every=0,
                              checkpoint_every=0)
            model_dir = warm_start_folder(cache.parent, "tiny", sft_threads=1, sft_steps=200)  # as the tests
            times: dict[bool, list[float]] = {False: [], True: []}
            cpu: dict[bool, list[float]] = {False: [], True: []}
            own: list[float] = []
            for i in range(args.rounds):
                for adapter in ((False, True) if i % 2 == 0 else (True, False)):
                    times[adapter] += trl_step_times(model_dir, logs, f"o{i}-{int(adapter)}", args.steps, adapter,
                                                     cfg, cpu[adapter], own if adapter else None)
            ratio = report("(a) adapter overhead, tiny model, wall", "PolicyLensGRPOTrainer", times[True],
                           "GRPOTrainer", times[False])
            print(f"    overhead {100 * (ratio - 1):+.1f}% (target <= 5%)")
            ratio = report("(a) adapter overhead, tiny model, CPU time of the process", "PolicyLensGRPOTrainer",
                           cpu[True], "GRPOTrainer", cpu[False])
            paired = statistics.median(a / b for a, b in zip(cpu[True], cpu[False], strict=True))
            total = sum(cpu[True]) / sum(cpu[False])
            print(f"    overhead {100 * (ratio - 1):+.1f}% (medians), {100 * (paired - 1):+.1f}% (median of the paired "
                  f"steps), {100 * (total - 1):+.1f}% (totals: {sum(cpu[True]):.1f} s against {sum(cpu[False]):.1f} s);"
                  f" target <= 5%")
            mine, plain = statistics.median(own), statistics.median(cpu[False])
            print(f"    the adapter's own CPU time (training and writer threads, counted where it is spent): "
                  f"{1000 * mine:.1f} ms per step, {100 * mine / plain:.1f}% of GRPOTrainer's {plain:.3f} s")
        if args.part in ("engine", "both"):
            cfg = TrainConfig(algo="grpo", task="linear", steps=args.steps, eval_every=0, checkpoint_every=0)
            model_dir = warm_start_folder(cache.parent, "default", sft_threads=1)
            trl_times, engine_times = [], []
            for i in range(args.rounds):
                for which in (("trl", "engine") if i % 2 == 0 else ("engine", "trl")):
                    if which == "trl":
                        trl_times += trl_step_times(model_dir, logs, f"t{i}", args.steps, False, cfg)
                    else:
                        engine_times += engine_step_times(logs, f"e{i}", cfg, cache)
            report("(b) default model, 32 x 8, 2 x 2 updates", "TRL GRPOTrainer", trl_times,
                   "policylens train --algo grpo", engine_times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
