"""Task `chain`: evaluate an arithmetic chain such as `3+4*2-5`, one operation per line.

    from engine.tasks import get_task
    task = get_task("chain", seed=0)
    p = task.heldout[2]
    p.prompt                           # e.g. "7-2*3+4\\n"
    task.solution_text(p)              # "7-6+4\\n1+4\\n5"

Why this task exists: its solutions vary a lot in length. A chain has 1 to 8 operations (+, -, *) on the digits
1..9, and the reference solution has one line per operation, so a completion is anything from 1 to about 90
characters. That is what makes length bias (GRPO's per-sequence mean vs DAPO's token mean), overlong shaping and
truncation at `max_new_tokens` really happen.

Order of evaluation in the reference: the leftmost `*` first, then the leftmost `+`/`-` (ordinary precedence,
left to right). Chains whose intermediate values leave -99..99 are rejected at generation, so every number is at
most two digits. Because every `*` is done before any `+`/`-`, a negative number can only ever appear first on a
line (`3-8+4` -> `-5+4`).

Held-out problems cycle through 1..8 operations (equal numbers of each length); training problems draw the number
of operations uniformly. Prompts are unique across both splits.

Step verifier: a line is parsed exactly as an expression without x (engine.tasks.algebra). It is equivalent when
its value is the answer; its complexity is its number of operations, so any correct line with fewer operations
than the last good one is progress (doing two operations in one line is allowed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.tasks.algebra import parse_expression
from engine.tasks.base import Problem, Task

MIN_OPS, MAX_OPS = 1, 8
MAX_ABS = 99
"""Largest absolute value allowed for any intermediate result."""


def _render(nums: list[int], ops: list[str]) -> str:
    out = str(nums[0])
    for op, n in zip(ops, nums[1:], strict=True):
        out += f"{op}{n}"
    return out


def solve_chain(nums: list[int], ops: list[str]) -> list[str]:
    """The reference solution lines of the chain nums[0] ops[0] nums[1] ...: one operation per line."""
    nums, ops = list(nums), list(ops)
    lines = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, b = nums[i], nums[i + 1]
        value = a * b if ops[i] == "*" else a + b if ops[i] == "+" else a - b
        nums[i : i + 2] = [value]
        del ops[i]
        lines.append(_render(nums, ops))
    return lines


def random_chain(rng: random.Random, n_ops: int) -> tuple[list[int], list[str], list[str]]:
    """Draw (numbers, operators, solution lines) with n_ops operations and every intermediate within MAX_ABS."""
    while True:
        nums = [rng.randint(1, 9) for _ in range(n_ops + 1)]
        ops = [rng.choice("+-*") for _ in range(n_ops)]
        lines = solve_chain(nums, ops)
        values = [abs(int(t)) for line in lines for t in _numbers(line)]
        if max(values, default=0) <= MAX_ABS:
            return nums, ops, lines


def _numbers(line: str) -> list[str]:
    """The number literals of a rendered line (a leading minus belongs to the first number, not an operator)."""
    body = line[1:] if line.startswith("-") else line
    for op in "+-*":
        body = body.replace(op, " ")
    return body.split()


@dataclass
class ChainTask(Task):
    """Arithmetic chains with 1..8 operations (see the module docstring)."""

    def __post_init__(self) -> None:
        self.name = "chain"
        rng = self._rng(self.seed, "chain")
        seen: set[str] = set()

        def draw(prompt_id: int, n_ops: int) -> Problem:
            while True:
                nums, ops, lines = random_chain(rng, n_ops)
                prompt = _render(nums, ops)
                if prompt not in seen:
                    seen.add(prompt)
                    return Problem(prompt_id, prompt + "\n", lines[-1], tuple(lines))
                # Short chains run out of unique prompts first; draw another length rather than loop forever.
                n_ops = rng.randint(MIN_OPS, MAX_OPS)

        span = MAX_OPS - MIN_OPS + 1
        held = [draw(i, MIN_OPS + i % span) for i in range(self.n_heldout)]
        train = [draw(i, rng.randint(MIN_OPS, MAX_OPS)) for i in range(self.n_train)]
        self._finish(held, train)

    def answer_line(self, problem: Problem) -> str:
        return problem.answer

    def _initial_complexity(self, problem: Problem) -> tuple[int, ...]:
        return (parse_expression(problem.prompt.strip(), allow_x=False).ops,)

    def _judge(self, problem: Problem, line: str) -> tuple[bool, tuple[int, ...]]:
        expr = parse_expression(line, allow_x=False)
        return expr.const == int(problem.answer), (expr.ops,)
