"""Task `chain`: evaluate a chain of additions and subtractions such as `6-4+8-3`, one operation per line.

    from engine.tasks import get_task
    task = get_task("chain", seed=0)
    p = task.heldout[3]
    p.prompt                           # e.g. "6+1+4+4+2\\n"
    task.solution_text(p)              # "6+1+4+6\\n6+1+10\\n6+11\\n17"

Why this task exists: its solutions vary a lot in length. A chain has 1 to 8 operations on the digits 1..9, and
the reference solution has one line per operation, so a completion is anything from 1 to about 80 characters.
That is what makes length bias (GRPO's per-sequence mean vs DAPO's token mean), overlong shaping and truncation
at `max_new_tokens` really happen.

The reference solution combines the last two signed terms on every line (`6-4+8-3` -> `6-4+5` -> `6+1` -> `7`):
each line is the previous line with its tail replaced, so a line starts with a verbatim copy of the previous
line's beginning. Design note: the first version also had `*` with ordinary precedence (`3+4*2-5` -> `3+8-5`),
which needs copying around a change in the middle of the line; the tiny warm-started policy could not learn that
within a short SFT budget (2-5% held-out accuracy after 400-800 steps, loss stuck near 1.3-1.4 nats/token), and
with the change only at the end of the line the loss falls faster (0.8 after 600 steps, 0.4 after 1200). Even so
the default warm start (600 steps) leaves held-out greedy accuracy at only about 5% on this task.
Intermediate values stay within -99..99 (longer draws are rejected).

Held-out problems cycle through 1..8 operations (equal numbers of each length); training problems draw the number
of operations uniformly. Prompts are unique across both splits.

Step verifier: a line is parsed exactly as an expression without x (engine.tasks.algebra). It is equivalent when
its value is the answer; its complexity is its number of operations, so any correct line with fewer operations
than the last good one is progress (any order of evaluation, and several operations in one line, are allowed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.tasks.algebra import parse_expression
from engine.tasks.base import SIGN_CLASSES, Problem, Task, sign_class

MIN_OPS, MAX_OPS = 1, 8
MAX_ABS = 99
"""Largest absolute value allowed for any intermediate result."""


def render_terms(terms: list[int]) -> str:
    """Signed terms as a chain: [6, -4, 5] -> `6-4+5` (a zero term after the first is written `+0`)."""
    return str(terms[0]) + "".join(f"+{t}" if t >= 0 else f"-{-t}" for t in terms[1:])


def solve_chain(nums: list[int], ops: list[str]) -> list[str]:
    """The reference solution lines of nums[0] ops[0] nums[1] ...: combine the last two signed terms per line."""
    terms = [nums[0]] + [n if op == "+" else -n for op, n in zip(ops, nums[1:], strict=True)]
    lines = []
    while len(terms) > 1:
        terms = [*terms[:-2], terms[-2] + terms[-1]]
        lines.append(render_terms(terms))
    return lines


def random_chain(rng: random.Random, n_ops: int) -> tuple[list[int], list[str], list[str]]:
    """Draw (numbers, operators, solution lines) with n_ops operations and every intermediate within MAX_ABS."""
    while True:
        nums = [rng.randint(1, 9) for _ in range(n_ops + 1)]
        ops = [rng.choice("+-") for _ in range(n_ops)]
        lines = solve_chain(nums, ops)
        if all(abs(v) <= MAX_ABS for line in lines for v in _numbers(line)):
            return nums, ops, lines


def _numbers(line: str) -> list[int]:
    """The absolute values of the number literals of a rendered line."""
    return [int(t) for t in line.replace("-", "+").split("+") if t]


@dataclass
class ChainTask(Task):
    """Chains of + and - with 1..8 operations (see the module docstring)."""

    def __post_init__(self) -> None:
        self.name = "chain"
        rng = self._rng(self.seed, "chain")
        seen: set[str] = set()

        def draw(prompt_id: int, n_ops: int) -> Problem:
            while True:
                nums, ops, lines = random_chain(rng, n_ops)
                prompt = render_terms([nums[0]] + [n if op == "+" else -n for op, n in zip(ops, nums[1:],
                                                                                            strict=True)])
                if prompt not in seen:
                    seen.add(prompt)
                    return Problem(prompt_id, prompt + "\n", lines[-1], tuple(lines))
                # Short chains run out of unique prompts first; draw another length rather than loop forever.
                n_ops = rng.randint(MIN_OPS, MAX_OPS)

        span = MAX_OPS - MIN_OPS + 1
        held = [draw(i, MIN_OPS + i % span) for i in range(self.n_heldout)]
        train = [draw(i, rng.randint(MIN_OPS, MAX_OPS)) for i in range(self.n_train)]
        self._finish(held, train)
        self.answer_classes = SIGN_CLASSES
        # Longer completions than `linear`, so more warm-start steps (see SFT numbers in engine.policy).
        self.sft_steps = 1500

    def answer_line(self, problem: Problem) -> str:
        return problem.answer

    def answer_class(self, problem: Problem) -> str:
        """`negative` or `non-negative` value of the chain (the warm start's sign slip hits negative results)."""
        return sign_class(problem.answer)

    def _initial_complexity(self, problem: Problem) -> tuple[int, ...]:
        return (parse_expression(problem.prompt.strip(), allow_x=False).ops,)

    def _judge(self, problem: Problem, line: str) -> tuple[bool, tuple[int, ...]]:
        expr = parse_expression(line, allow_x=False)
        return expr.const == int(problem.answer), (expr.ops,)
