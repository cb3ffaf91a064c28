"""Task `linear`: solve `a x + b = c` for an integer x, one step per line (like `2x + 3 = 7`).

    from engine.tasks import get_task
    task = get_task("linear", seed=0)
    p = task.heldout[0]
    p.prompt                                      # e.g. "-3x+5=-4\\n"
    task.solution_text(p)                         # "-3x=-4-5\\n-3x=-9\\nx=3"
    task.outcome_reward(p, "-3x=-9\\nx=3")          # 1.0
    [s.score for s in task.process_reward(p, "-3x=-4+5\\n-3x=-9\\nx=3")]   # [-1.0, 1.0, 1.0]

Problems: a in -9..9 without 0 (so the coefficients 1 and -1 occur, written `x` and `-x`), b in -9..9 without 0,
x in -9..9, c = a x + b. Each (a, b, x) appears once, written with x on the left or on the right, chosen at
random: `ax+b=c` / `ax-|b|=c` (whichever matches the sign of b) or `c=ax+b` / `c=ax-|b|`. The split is made over
(a, b, x), so a held-out equation never appears in training in another form either.

Reference solution: move b (`2x=7-3`), compute (`2x=4`), divide (`x=2`); the division step is absent when a = 1.

Step verifier: a line is parsed exactly (engine.tasks.algebra) as an equation in x. It is equivalent when its
solution set is exactly {x*}; its complexity is `Equation.complexity()` (operations on the x side, then on the
other side, then whether x stands on the right).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from engine.tasks.algebra import parse_equation
from engine.tasks.base import SIGN_CLASSES, Problem, Task, sign_class

VALUES = list(range(-9, 10))
NONZERO = [v for v in VALUES if v != 0]


def _term(a: int) -> str:
    """`a x` as written: `x`, `-x`, `2x`, `-2x`."""
    return {1: "x", -1: "-x"}.get(a, f"{a}x")


def _signed(b: int) -> str:
    """`+ b` as written after another term: `+3` or `-3`."""
    return f"+{b}" if b > 0 else f"-{-b}"


def make_problem(prompt_id: int, a: int, b: int, x: int, form: int) -> Problem:
    """The problem with coefficient a, constant b (nonzero, either sign), solution x, written in `form` 0 or 1."""
    c = a * x + b
    lhs = _term(a) + _signed(b)
    prompt = f"{lhs}={c}" if form == 0 else f"{c}={lhs}"
    # Moving b across flips its sign: `2x+3=7` -> `2x=7-3`, `2x-3=7` -> `2x=7+3`.
    steps = [f"{_term(a)}={c}{_signed(-b)}", f"{_term(a)}={a * x}"]
    if a != 1:
        steps.append(f"x={x}")
    return Problem(prompt_id=prompt_id, prompt=prompt + "\n", answer=str(x), solution=tuple(steps))


@dataclass
class LinearTask(Task):
    """Linear equations in one unknown with integer solutions (see the module docstring)."""

    def __post_init__(self) -> None:
        self.name = "linear"
        rng = self._rng(self.seed, "linear")
        keys = [(a, b, x) for a in NONZERO for b in NONZERO for x in VALUES]  # 18 * 18 * 19 = 6156
        rng.shuffle(keys)
        forms = [rng.randrange(2) for _ in keys]
        n_heldout = min(self.n_heldout, len(keys) // 2)
        pairs = list(zip(keys, forms, strict=True))
        held = [make_problem(i, *k, f) for i, (k, f) in enumerate(pairs[:n_heldout])]
        rest = pairs[n_heldout:][: self.n_train]
        train = [make_problem(i, *k, f) for i, (k, f) in enumerate(rest)]
        self._finish(held, train)
        self.answer_classes = SIGN_CLASSES
        self.sft_steps = 1000

    def answer_line(self, problem: Problem) -> str:
        return f"x={problem.answer}"

    def answer_class(self, problem: Problem) -> str:
        """`negative` or `non-negative` solution x: the warm start writes most negative solutions without their minus
        sign (`x=3` for `x=-3`), so the negative class is where RL has a habit to unlearn."""
        return sign_class(problem.answer)

    def _initial_complexity(self, problem: Problem) -> tuple[int, ...]:
        return parse_equation(problem.prompt.strip()).complexity()

    def _judge(self, problem: Problem, line: str) -> tuple[bool, tuple[int, ...]]:
        eq = parse_equation(line)
        return eq.solution() == ("one", Fraction(int(problem.answer))), eq.complexity()
