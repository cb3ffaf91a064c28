"""The task interface shared by every step-structured task: problems, splits, outcome and process rewards.

A task is a fixed set of problems split into `train` and `heldout` from a seed, plus two exact verifiers:

- `outcome_reward(problem, completion)`: 1.0 if the final line of the completion is the right answer, else 0.0
  (the outcome reward model, ORM, of the GRPO paper, here exact).
- `process_reward(problem, completion)`: one `StepScore` per non-empty line of the completion, with the line's
  character span, scored in [-1, 1] by an exact step verifier (the process reward model, PRM, of GRPO section
  4.1.3, here exact). The trainer maps each span's end to the index of the step's last token.

Text conventions (all tasks): the prompt is one line ending in "\\n"; the completion is the solution, one step per
line, "\\n"-separated, no trailing newline, and the last line is the answer. The model ends a completion with the
tokenizer's EOS token, which is not part of the completion text.

Step scores (the same scale for every task):

    STEP_PROGRESS     = +1.0   the step is equivalent to the problem and strictly simpler than the last good step
    STEP_NO_PROGRESS  = +0.25  equivalent, but no simpler (a repeated or merely rearranged line)
    STEP_WRONG        = -1.0   not equivalent, or not parseable (garbage, division by zero, too long ...)

"Simpler" is task-defined (`_judge` returns a complexity compared as a tuple); "last good step" starts as the prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine.tasks.algebra import ParseError

STEP_PROGRESS = 1.0
STEP_NO_PROGRESS = 0.25
STEP_WRONG = -1.0


@dataclass(frozen=True)
class Problem:
    """One problem of a task split."""

    prompt_id: int
    """Stable id of the problem within its split (0..len(split)-1), the same for the same task name and seed."""
    prompt: str
    """What the policy is conditioned on, one line ending in a newline, e.g. "2x+3=7\\n"."""
    answer: str
    """The reference answer as it is written on the final line's right-hand side, e.g. "2" or "-12"."""
    solution: tuple[str, ...]
    """The reference worked solution, one string per step; the last step is the answer line."""


@dataclass(frozen=True)
class StepScore:
    """The verifier's score of one step (one non-empty line) of a completion."""

    text: str
    """The line, without its newline."""
    start: int
    """Character offset of the line's first character in the completion."""
    end: int
    """Character offset one past the line's last character (exclusive), so completion[start:end] == text."""
    score: float
    """STEP_PROGRESS, STEP_NO_PROGRESS or STEP_WRONG."""


SIGN_CLASSES = ("negative", "non-negative")
"""Answer classes of tasks whose answer is an integer: the warm start drops most negative answers' minus sign."""


def sign_class(answer: str) -> str:
    """`negative` for an integer answer below 0 (`-12`), else `non-negative` (`0`, `7`)."""
    return SIGN_CLASSES[0] if int(answer) < 0 else SIGN_CLASSES[1]


def split_lines(completion: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of every non-empty line of `completion` (whitespace-only lines are skipped)."""
    out = []
    start = 0
    for line in completion.split("\n"):
        end = start + len(line)
        if line.strip():
            out.append((start, end, line))
        start = end + 1
    return out


@dataclass
class Task:
    """Base class of all tasks. Subclasses fill the splits in `__post_init__` and implement the `_...` hooks."""

    seed: int = 0
    """Seed of the problem generator and of the train/held-out split."""
    n_train: int = 4000
    """Number of training problems (fewer if the problem space is smaller)."""
    n_heldout: int = 200
    """Number of held-out problems (never among the training prompts)."""
    name: str = field(init=False, default="")
    """Registry name of the task."""
    max_new_tokens: int = field(init=False, default=64)
    """A generation budget that fits the longest reference solution plus slack (character tokens, incl. EOS)."""
    sft_steps: int = field(init=False, default=300)
    """Default number of supervised warm-start steps (engine.policy.SFTConfig), tuned per task so that the warm
    start leaves held-out greedy accuracy around 20-60%."""
    train: list[Problem] = field(init=False, default_factory=list)
    heldout: list[Problem] = field(init=False, default_factory=list)
    answer_classes: tuple[str, ...] = field(init=False, default=())
    """The labels `answer_class` returns, in the order charts show them."""

    # ---------------------------------------------------------------- the public interface

    def solution_text(self, problem: Problem) -> str:
        """The reference completion: the solution steps joined by newlines (no EOS, no trailing newline)."""
        return "\n".join(problem.solution)

    def outcome_reward(self, problem: Problem, completion: str) -> float:
        """1.0 if the last non-empty line, spaces removed, is exactly the answer line (e.g. `x=2`), else 0.0.

        Exact means canonical: `x=4/2` or `2=x` score 0 here (the process reward still credits them as steps).
        """
        lines = split_lines(completion)
        if not lines:
            return 0.0
        return 1.0 if "".join(lines[-1][2].split()) == self.answer_line(problem) else 0.0

    def process_reward(self, problem: Problem, completion: str) -> list[StepScore]:
        """Score every non-empty line of `completion` with the exact step verifier (see the module docstring)."""
        best = self._initial_complexity(problem)
        steps = []
        for start, end, text in split_lines(completion):
            try:
                equivalent, complexity = self._judge(problem, text.strip())
            except (ParseError, ValueError, ZeroDivisionError):
                steps.append(StepScore(text, start, end, STEP_WRONG))
                continue
            if not equivalent:
                score = STEP_WRONG
            elif complexity < best:
                score = STEP_PROGRESS
                best = complexity
            else:
                score = STEP_NO_PROGRESS
            steps.append(StepScore(text, start, end, score))
        return steps

    def answer_line(self, problem: Problem) -> str:
        """The exact text of a correct final line."""
        raise NotImplementedError

    def answer_class(self, problem: Problem) -> str:
        """The class of the problem's answer (one of `answer_classes`): held-out scores are split by it, so a
        habit that fails one kind of answer (the warm start's dropped minus sign) shows as its own curve."""
        raise NotImplementedError

    def alphabet(self) -> str:
        """Every character that can occur in this task's prompts and reference completions."""
        chars = set()
        for p in self.train + self.heldout:
            chars.update(p.prompt)
            chars.update(self.solution_text(p))
        return "".join(sorted(chars))

    # ---------------------------------------------------------------- hooks for subclasses

    def _initial_complexity(self, problem: Problem) -> tuple[int, ...]:
        """Complexity of the problem statement itself (the reference for the first step's progress)."""
        raise NotImplementedError

    def _judge(self, problem: Problem, line: str) -> tuple[bool, tuple[int, ...]]:
        """(is the line equivalent to the problem, its complexity); raise ParseError if malformed."""
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers

    def _finish(self, heldout: list[Problem], train: list[Problem]) -> None:
        """Store the splits and size the generation budget from the longest reference solution."""
        self.heldout, self.train = heldout, train
        longest = max(len(self.solution_text(p)) for p in heldout + train)
        self.max_new_tokens = longest + 1 + 8  # + EOS + slack for a slightly longer policy solution

    @staticmethod
    def _rng(seed: int, salt: str) -> random.Random:
        # String seeds are hashed deterministically by `random` (sha512), unlike hash(), so splits are reproducible
        # across processes and Python versions.
        return random.Random(f"{salt}:{seed}")
