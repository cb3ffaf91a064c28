"""Step-structured tasks with exact verifiers, and their registry.

    from engine.tasks import get_task, TASKS
    task = get_task("linear", seed=0)          # or "chain"
    for p in task.train[:3]:
        print(p.prompt_id, repr(p.prompt), task.solution_text(p), task.outcome_reward(p, task.solution_text(p)))

See engine/tasks/base.py for the interface (Problem, StepScore, Task) and the step-score scale.
"""

from __future__ import annotations

from engine.tasks.base import STEP_NO_PROGRESS, STEP_PROGRESS, STEP_WRONG, Problem, StepScore, Task
from engine.tasks.chain import ChainTask
from engine.tasks.linear import LinearTask

_REGISTRY: dict[str, type[Task]] = {"linear": LinearTask, "chain": ChainTask}
TASKS: tuple[str, ...] = tuple(_REGISTRY)
"""Names accepted by `get_task`; the first is the default task."""

DEFAULT_TASK = TASKS[0]


def get_task(name: str = DEFAULT_TASK, seed: int = 0, **sizes: int) -> Task:
    """Build the task `name` (one of TASKS) with its train/held-out split drawn from `seed`.

    `sizes` may set `n_train` and `n_heldout`. Same name, seed and sizes -> identical problems and prompt_ids.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return _REGISTRY[name](seed=seed, **sizes)


__all__ = [
    "DEFAULT_TASK",
    "STEP_NO_PROGRESS",
    "STEP_PROGRESS",
    "STEP_WRONG",
    "TASKS",
    "ChainTask",
    "LinearTask",
    "Problem",
    "StepScore",
    "Task",
    "get_task",
]
