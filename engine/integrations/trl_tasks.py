"""A PolicyLens task (engine.tasks) as a TRL prompt dataset and TRL reward functions.

    task = get_task("linear")
    dataset = task_dataset(task)                         # columns: prompt, prompt_id
    reward_funcs = task_reward_funcs(task, max_completion_length=32)
    trainer = PolicyLensGRPOTrainer(model=..., reward_funcs=reward_funcs, train_dataset=dataset, ...)

The reward functions follow TRL's signature (completions plus the dataset's columns as keyword arguments) and
return one float per completion; TRL logs each under its function name, PolicyLens in `rollouts.reward_components`.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.rewards import overlong_penalty


def task_dataset(task, split: str = "train"):
    """The task's prompts (train or heldout split) as a `datasets.Dataset` with columns prompt and prompt_id."""
    from datasets import Dataset

    problems = task.train if split == "train" else task.heldout
    return Dataset.from_dict({"prompt": [p.prompt for p in problems], "prompt_id": [p.prompt_id for p in problems]})


def task_reward_funcs(task, max_completion_length: int, overlong_cache: int | None = None) -> list[Callable]:
    """[correct, overlong]: the task's outcome reward (1 for an exact final answer line, else 0) and DAPO's soft
    overlong punishment (engine.rewards) over the last `overlong_cache` tokens of the budget (default a quarter).

    TRL passes the dataset's `prompt_id` column to each call, which finds the problem (and its answer)."""
    problems = {p.prompt_id: p for p in (*task.train, *task.heldout)}
    cache = overlong_cache or max(1, max_completion_length // 4)

    def correct(completions, prompt_id, **_):
        return [task.outcome_reward(problems[i], c) for c, i in zip(completions, prompt_id, strict=True)]

    def overlong(completion_ids, **_):
        return [overlong_penalty(len(ids), max_completion_length, cache) for ids in completion_ids]

    return [correct, overlong]


def engine_matched_config(cfg, output_dir, steps: int, num_processes: int = 1, **overrides):
    """A TRL GRPOConfig with the geometry and optimiser of a PolicyLens TrainConfig `cfg` (resolved, grpo):
    `cfg.batch_size` completions per generation in groups of `cfg.group_size`, `cfg.epochs` passes of
    `cfg.minibatches` mini-batches (one optimizer step each), the same lr (constant), AdamW betas, weight decay,
    gradient clipping, temperature, response budget, eps and beta with the plain k3 KL, for `steps` generations.

    With `num_processes` ranks each process holds 1/num_processes of every mini-batch. `overrides` win."""
    from trl import GRPOConfig

    minibatch = cfg.batch_size // cfg.minibatches
    if minibatch % num_processes:
        raise ValueError(f"a mini-batch of {minibatch} completions does not split over {num_processes} processes")
    settings = dict(
        per_device_train_batch_size=minibatch // num_processes, steps_per_generation=cfg.minibatches,
        gradient_accumulation_steps=1, num_iterations=cfg.epochs, num_generations=cfg.group_size,
        max_steps=steps * cfg.epochs * cfg.minibatches, max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature, top_p=cfg.top_p, learning_rate=cfg.lr, lr_scheduler_type="constant",
        warmup_steps=0, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, loss_type="grpo", epsilon=cfg.eps_low, epsilon_high=cfg.eps_high,
        beta=cfg.beta, use_bias_correction_kl=False, scale_rewards="group", logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, seed=cfg.seed, disable_tqdm=True, log_completions=False)
    settings.update(overrides)
    return GRPOConfig(str(output_dir), **settings)
