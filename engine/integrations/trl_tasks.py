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
