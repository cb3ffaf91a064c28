"""Train PolicyLens's warm-started model on the `linear` task with TRL's GRPOTrainer, logged token by token.

    pip install 'policylens[trl]'
    python examples/trl_grpo.py --steps 20                 # one process, CPU, a few minutes
    accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo.py --steps 20     # two processes (CPU too)
    policylens dashboard                                   # then open the run trl-grpo-linear

The model is the engine's warm start (`policylens warmstart --task linear` builds the same one), saved with
save_pretrained in the logs folder's cache and loaded by TRL from there. The batch geometry, optimiser, eps, beta
and plain k3 KL are those of `policylens train --algo grpo` (engine.integrations.trl_tasks.engine_matched_config),
so the two runs can be compared step for step on the Runs page. Rewards: the task's correctness and DAPO's soft
overlong punishment, two reward functions, shown separately on the Groups page.

Note for accelerate 1.15 on CPU: `--cpu --num_processes 2` starts ONE process; `--multi_gpu --num_processes 2`
starts two real ranks (gloo) when no GPU is present.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def warm_start_folder(logs_dir: Path, model_size: str, sft_threads: int = 0, sft_steps: int | None = None) -> Path:
    """The engine's warm-started model for `linear` (trained once and cached by the engine), saved with
    save_pretrained (model and tokenizer) into a folder TRL loads like any local model. `sft_threads` as
    `policylens train --warm-start-threads` (0: one per core, at most 4), `sft_steps` None: the task's."""
    import torch

    from engine.config import TrainConfig
    from engine.tasks import get_task
    from engine.train import load_models

    folder = logs_dir / ".cache" / (f"trl-linear-{model_size}" + ("" if sft_steps is None else f"-sft{sft_steps}"))
    if not (folder / "config.json").is_file():
        cfg = TrainConfig(task="linear", model_size=model_size, sft_steps=sft_steps)
        model, _, tokenizer, _ = load_models(cfg, get_task(cfg.task, seed=cfg.task_seed), torch.device("cpu"),
                                             logs_dir / ".cache", sft_threads=sft_threads)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="generation batches (PolicyLens steps)")
    parser.add_argument("--logs-dir", default="logs")
    parser.add_argument("--run-name", default="trl-grpo-linear")
    parser.add_argument("--model-dir", help="a save_pretrained folder (default: the engine's warm start)")
    parser.add_argument("--model-size", default="default", choices=["default", "tiny"])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (x 8 completions)")
    parser.add_argument("--log-groups", type=int, help="keep the tokens of only this many groups per step")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    args = parser.parse_args(argv)

    import torch
    from accelerate import PartialState

    from engine.config import TrainConfig
    from engine.integrations.trl import PolicyLensGRPOTrainer
    from engine.integrations.trl_tasks import engine_matched_config, task_dataset, task_reward_funcs
    from engine.tasks import get_task

    torch.set_num_threads(args.threads)
    state = PartialState(cpu=True)  # the same process group TRL (use_cpu=True) joins: gloo on CPU
    logs_dir = Path(args.logs_dir)
    with state.main_process_first():  # rank 0 builds the warm start once, the others then load it
        model_dir = Path(args.model_dir) if args.model_dir else warm_start_folder(logs_dir, args.model_size)
    cfg = TrainConfig(algo="grpo", task="linear", model_size=args.model_size, batch_size=8 * args.prompts)
    task = get_task(cfg.task, seed=cfg.task_seed)
    config = engine_matched_config(cfg, logs_dir / ".trl" / args.run_name, steps=args.steps,
                                   num_processes=state.num_processes)
    trainer = PolicyLensGRPOTrainer(
        model=str(model_dir), reward_funcs=task_reward_funcs(task, cfg.max_new_tokens), args=config,
        train_dataset=task_dataset(task), logs_dir=logs_dir, run_name=args.run_name, log_groups=args.log_groups)
    trainer.train()
    if state.is_main_process:
        print(f"logged run {args.run_name!r} in {logs_dir}: policylens dashboard --logs-dir {logs_dir}")


if __name__ == "__main__":
    main()
