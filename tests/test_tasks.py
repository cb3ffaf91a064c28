"""Tests of the step-structured tasks: exact verifiers on right, wrong and malformed solutions; splits.

Run: .venv/bin/pytest tests/test_tasks.py -q
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from engine.tasks import STEP_NO_PROGRESS, STEP_PROGRESS, STEP_WRONG, TASKS, get_task
from engine.tasks.algebra import MAX_DIGITS, ParseError, parse_equation, parse_expression
from engine.tasks.base import Problem, split_lines
from engine.tasks.chain import solve_chain
from engine.tasks.linear import make_problem

P, N, W = STEP_PROGRESS, STEP_NO_PROGRESS, STEP_WRONG


@pytest.fixture(scope="module")
def linear():
    return get_task("linear", seed=0)


@pytest.fixture(scope="module")
def chain():
    return get_task("chain", seed=0)


def scores(task, problem, completion):
    return [s.score for s in task.process_reward(problem, completion)]


# ---------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    ("text", "coef", "const", "ops"),
    [
        ("2x+3", 2, 3, 2),
        ("x", 1, 0, 0),
        ("-x", -1, 0, 1),
        ("-4", 0, -4, 0),  # a negative literal costs no operation
        ("-4x", -4, 0, 1),
        ("7--3", 0, 10, 1),
        ("(7-3)/2", 0, 2, 2),
        ("2(x+1)", 2, 2, 2),
        ("3 + 4*2 - 5", 0, 6, 3),
        ("x/3", Fraction(1, 3), 0, 1),
    ],
)
def test_parse_expression(text, coef, const, ops):
    e = parse_expression(text)
    assert (e.coef, e.const, e.ops) == (coef, const, ops)


@pytest.mark.parametrize(
    "text",
    ["", "x*x", "1/x", "4/0", "4/(2-2)", "2x+", "(2", "2)", "x2", "abc", "2.5", "+3", "1" * (MAX_DIGITS + 1),
     "1+" * 50 + "1"],
)
def test_parse_expression_rejects(text):
    with pytest.raises(ParseError):
        parse_expression(text)


def test_equation_solution_sets_and_complexity():
    assert parse_equation("2x=7-3").solution() == ("one", 2)
    assert parse_equation("x+1=x+1").solution() == ("all", None)
    assert parse_equation("0x=4").solution() == ("none", None)
    assert parse_equation("2x+3=7").complexity() == (2, 0, 0)
    assert parse_equation("2x=7-3").complexity() == (1, 1, 0)
    assert parse_equation("x=2").complexity() == (0, 0, 0)
    assert parse_equation("2=x").complexity() == (0, 0, 1)
    with pytest.raises(ParseError):
        parse_equation("x=2=2")
    with pytest.raises(ParseError):
        parse_equation("x2")


# ---------------------------------------------------------------- linear: formats


def test_linear_seed_example():
    p = make_problem(0, a=2, b=3, x=2, form=0)
    assert p.prompt == "2x+3=7\n"
    assert p.solution == ("2x=7-3", "2x=4", "x=2")
    assert p.answer == "2"


@pytest.mark.parametrize(
    ("a", "b", "x", "form", "prompt", "solution"),
    [
        (2, -3, 5, 0, "2x-3=7\n", ("2x=7+3", "2x=10", "x=5")),
        (2, 3, 2, 1, "7=2x+3\n", ("2x=7-3", "2x=4", "x=2")),
        (1, 3, 4, 0, "x+3=7\n", ("x=7-3", "x=4")),  # coefficient 1: no division step
        (-1, 3, -4, 0, "-x+3=7\n", ("-x=7-3", "-x=4", "x=-4")),
        (-3, -5, -2, 1, "1=-3x-5\n", ("-3x=1+5", "-3x=6", "x=-2")),
        (4, 8, 0, 0, "4x+8=8\n", ("4x=8-8", "4x=0", "x=0")),
    ],
)
def test_linear_forms(linear, a, b, x, form, prompt, solution):
    p = make_problem(0, a, b, x, form)
    assert (p.prompt, p.solution) == (prompt, solution)
    assert linear.outcome_reward(p, linear.solution_text(p)) == 1.0
    assert scores(linear, p, linear.solution_text(p)) == [P] * len(solution)


def test_linear_reference_solutions_verify(linear):
    for p in linear.heldout + linear.train[:500]:
        text = linear.solution_text(p)
        assert linear.outcome_reward(p, text) == 1.0
        assert all(s.score == P for s in linear.process_reward(p, text)), p


def test_linear_covers_the_variety(linear):
    prompts = [p.prompt for p in linear.train]
    assert any(p.startswith("x") for p in prompts) and any(p.startswith("-x") for p in prompts)
    assert any("=x" in p for p in prompts) and any("=-x" in p for p in prompts)
    assert any("x-" in p.split("=")[0] for p in prompts)  # the `ax - b = c` form
    answers = {int(p.answer) for p in linear.train}
    assert min(answers) < 0 < max(answers) and 0 in answers


# ---------------------------------------------------------------- linear: verifiers

SEED = make_problem(0, a=2, b=3, x=2, form=0)  # 2x+3=7


@pytest.mark.parametrize(
    ("completion", "outcome", "steps"),
    [
        ("2x=7-3\n2x=4\nx=2", 1.0, [P, P, P]),
        ("x=2", 1.0, [P]),  # answer only: right
        ("x = 2\n", 1.0, [P]),  # spaces and a trailing newline are tolerated
        ("2x=4\nx=3", 0.0, [P, W]),  # wrong answer
        ("2x=7-3\n2x=5\nx=2", 1.0, [P, W, P]),  # wrong intermediate step, right answer
        ("2x=7+3\n2x=10\nx=5", 0.0, [W, W, W]),  # sign error carried through
        ("2x=4\nx=4/2", 0.0, [P, P]),  # right, but the answer is not written canonically
        ("x=(7-3)/2\nx=2", 1.0, [P, P]),
        ("2x+3=7\n2x=4\nx=2", 1.0, [N, P, P]),  # repeating the prompt: equivalent, no progress
        ("2x=4\n2x=4\nx=2", 1.0, [P, N, P]),
        ("7=2x+3\nx=2", 1.0, [N, P]),  # swapping the sides is no simpler
        ("2x=4\n4=2x\nx=2", 1.0, [P, N, P]),
        ("x=2\n2=x", 0.0, [P, N]),  # the answer must be the last line
        ("", 0.0, []),
        ("\n\n", 0.0, []),
        ("garbage", 0.0, [W]),
        ("2x=7-3\n2x=4", 0.0, [P, P]),  # missing answer
        ("x=", 0.0, [W]),
        ("x=2=2", 0.0, [W]),
        ("x=4/0", 0.0, [W]),  # division by zero is malformed, not a crash
        ("0x=4", 0.0, [W]),  # no solution: not equivalent
        ("x+1=x+1", 0.0, [W]),  # every x is a solution: not equivalent either
        ("x*x=4\nx=2", 1.0, [W, P]),  # not linear
        ("x=" + "9" * 5000, 0.0, [W]),  # huge numbers are rejected, quickly
        ("x=" + "9" * 30 + "/" + "9" * 30, 0.0, [W]),
        ("2x=4\n" + "y" * 1000, 0.0, [P, W]),
    ],
)
def test_linear_verifiers(linear, completion, outcome, steps):
    assert linear.outcome_reward(SEED, completion) == outcome
    assert scores(linear, SEED, completion) == steps


def test_step_spans_index_the_completion(linear):
    completion = "2x=7-3\n\n 2x=4 \nx=2\n"
    steps = linear.process_reward(SEED, completion)
    assert [(s.start, s.end) for s in steps] == [(0, 6), (8, 14), (15, 18)]
    for s in steps:
        assert completion[s.start : s.end] == s.text
    assert [s.score for s in steps] == [P, P, P]
    assert split_lines("a\n\nb") == [(0, 1, "a"), (3, 4, "b")]


def test_scores_are_in_range(linear, chain):
    for task in (linear, chain):
        for p in task.heldout[:50]:
            for s in task.process_reward(p, task.solution_text(p) + "\n1+\nx\n=\n" + p.prompt):
                assert -1.0 <= s.score <= 1.0


# ---------------------------------------------------------------- chain


def test_chain_reference_order():
    # The last two signed terms are combined on every line.
    assert solve_chain([6, 4, 8, 3], ["-", "+", "-"]) == ["6-4+5", "6+1", "7"]
    assert solve_chain([3, 8, 4], ["-", "-"]) == ["3-12", "-9"]
    assert solve_chain([7, 4, 4], ["+", "-"]) == ["7+0", "7"]
    assert solve_chain([7, 2], ["-"]) == ["5"]


def test_chain_reference_solutions_verify(chain):
    for p in chain.heldout + chain.train[:500]:
        text = chain.solution_text(p)
        assert chain.outcome_reward(p, text) == 1.0
        assert [s.score for s in chain.process_reward(p, text)] == [P] * len(p.solution)
        # Independent oracle for the answer: Python's own arithmetic on the generated digits-and-operators prompt.
        assert int(p.answer) == eval(p.prompt.strip(), {"__builtins__": {}})
        assert all(abs(int(t)) <= 99 for line in p.solution for t in line.lstrip("-").replace("-", "+").split("+"))


def test_chain_verifiers(chain):
    p = Problem(0, "6-4+8-3\n", "7", ("6-4+5", "6+1", "7"))
    assert chain.outcome_reward(p, "6-4+5\n6+1\n7") == 1.0
    assert scores(chain, p, "6-4+5\n6+1\n7") == [P, P, P]
    assert scores(chain, p, "2+8-3\n10-3\n7") == [P, P, P]  # left to right is just as good
    assert scores(chain, p, "6+1\n7") == [P, P]  # two operations in one line is allowed
    assert scores(chain, p, "6-4+5\n6-4+5\n7") == [P, N, P]
    assert scores(chain, p, "6-4+8-3\n7") == [N, P]  # repeating the prompt
    assert chain.outcome_reward(p, "6-4+5\n6+2\n7") == 1.0
    assert scores(chain, p, "6-4+5\n6+2\n7") == [P, W, P]  # wrong step, right answer
    assert chain.outcome_reward(p, "6-4+5\n6+1\n8") == 0.0
    assert scores(chain, p, "6-4+5\n6+1\n8") == [P, P, W]
    assert chain.outcome_reward(p, "6-4+5\n6+1") == 0.0  # missing answer
    assert scores(chain, p, "6-4+5*1\n7") == [N, P]  # `*` parses too, but 3 operations are no progress
    for bad in ("", "x=7", "7=7", "abc", "7/0", "9" * 100, "6-4+5\n6+1\n7.0", "6+1\n+7"):
        assert chain.outcome_reward(p, bad) == 0.0
    assert scores(chain, p, "x=7\n7=7\n7/0\n" + "9" * 100 + "\n+7") == [W, W, W, W, W]


def test_chain_lengths_vary(chain):
    lengths = [len(chain.solution_text(p)) for p in chain.heldout]
    assert min(lengths) <= 2 and max(lengths) >= 50
    n_steps = {len(p.solution) for p in chain.heldout}
    assert n_steps == set(range(1, 9))
    assert chain.max_new_tokens > max(len(chain.solution_text(p)) for p in chain.train + chain.heldout)


# ---------------------------------------------------------------- splits and registry


def _linear_key(prompt: str) -> tuple:
    """The underlying equation (a, b, c) of `ax+b=c`, whichever side x is written on."""
    eq = parse_equation(prompt.strip())
    xs, other = (eq.left, eq.right) if eq.left.has_x else (eq.right, eq.left)
    return xs.coef, xs.const, other.const


@pytest.mark.parametrize("name", TASKS)
def test_splits_disjoint_and_deterministic(name):
    a, b = get_task(name, seed=0), get_task(name, seed=0)
    assert a.train == b.train and a.heldout == b.heldout
    assert [p.prompt_id for p in a.train] == list(range(len(a.train)))
    assert [p.prompt_id for p in a.heldout] == list(range(len(a.heldout)))
    train_prompts = {p.prompt for p in a.train}
    assert len(train_prompts) == len(a.train)
    assert not train_prompts & {p.prompt for p in a.heldout}
    assert len(a.heldout) == 200 and len(a.train) >= 1000
    c = get_task(name, seed=1)
    assert [p.prompt for p in c.heldout] != [p.prompt for p in a.heldout]
    for p in a.train + a.heldout:
        assert p.prompt.endswith("\n") and p.prompt.count("\n") == 1


def test_linear_heldout_equations_not_trained_in_another_form(linear):
    train_keys = {_linear_key(p.prompt) for p in linear.train}
    assert not train_keys & {_linear_key(p.prompt) for p in linear.heldout}


def test_registry():
    assert TASKS[0] == "linear" and "chain" in TASKS
    small = get_task("chain", seed=3, n_train=50, n_heldout=16)
    assert (len(small.train), len(small.heldout), small.name) == (50, 16, "chain")
    with pytest.raises(ValueError, match="unknown task"):
        get_task("nope")
