"""Exact parsing of one solution line: a linear expression or equation in x, over rationals.

This is the heart of the step verifiers. A line such as `2x=7-3`, `x=(7-3)/2` or `3+8-5` is parsed by a small
recursive-descent parser into a linear form `coef * x + const` with `fractions.Fraction` coefficients, so
equivalence is decided exactly (no floats, never `eval`). Each side also carries an operation count, the measure of
"how far from solved" a line is that the verifiers use to decide whether a step made progress.

    from engine.tasks.algebra import parse_equation, parse_expression
    eq = parse_equation("2x=7-3")      # Equation(left=Linear(2, 0, ops=1, has_x=True), right=Linear(0, 4, ops=1, ...))
    eq.solution()                        # ("one", Fraction(2))

Grammar (spaces ignored):

    equation := expr '=' expr
    expr     := term (('+' | '-') term)*
    term     := unary (('*' | '/') unary | implicit)*     implicit: a number directly followed by 'x' or '('
    unary    := '-' unary | atom
    atom     := NUMBER | 'x' | '(' expr ')'

Departures from school algebra, on purpose:
1. Only linear forms: `x*x`, `x/x` or `1/x` raise `ParseError` (the tasks never need them).
2. Division by zero, literals longer than `MAX_DIGITS` digits and lines longer than `MAX_LINE` characters raise
   `ParseError`, so a policy cannot make the verifier slow or crash it with huge numbers.
3. A minus sign directly on a number literal (`-4`) is part of the literal and costs no operation, so `x=-4` counts
   as solved while `-x=4` does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

MAX_LINE = 80
"""Longest line (characters) the parser accepts; longer lines are rejected as malformed."""

MAX_DIGITS = 12
"""Longest number literal (digits) the parser accepts."""


class ParseError(ValueError):
    """The line is not a well-formed linear expression/equation in x (or divides by zero, or is too large)."""


@dataclass(frozen=True)
class Linear:
    """A parsed expression `coef * x + const`.

    `ops` counts the operations written in the text (binary + - * /, implicit multiplication `2x`, and unary minus
    on anything but a number literal); `has_x` says whether the text mentions x at all (even `x-x`).
    """

    coef: Fraction
    const: Fraction
    ops: int
    has_x: bool


@dataclass(frozen=True)
class Equation:
    """A parsed equation `left = right`."""

    left: Linear
    right: Linear

    def solution(self) -> tuple[str, Fraction | None]:
        """The solution set: ("one", value), ("all", None) for an identity, ("none", None) for a contradiction."""
        a = self.left.coef - self.right.coef
        b = self.right.const - self.left.const
        if a != 0:
            return "one", b / a
        return ("all", None) if b == 0 else ("none", None)

    def complexity(self) -> tuple[int, int, int]:
        """How far from `x=<number>` the equation is; smaller is more solved (compared as a tuple).

        (operations on the side(s) mentioning x, operations on the other side, 1 if x appears only on the right).
        `2x+3=7` -> (2, 0, 0); `2x=7-3` -> (1, 1, 0); `2x=4` -> (1, 0, 0); `x=2` -> (0, 0, 0); `7=x` -> (0, 0, 1).
        When both sides mention x, every operation counts as an x-side operation, plus one for the split.
        """
        left, right = self.left, self.right
        if left.has_x and right.has_x:
            return left.ops + right.ops + 1, 0, 0
        if right.has_x:
            return right.ops, left.ops, 1
        if left.has_x:
            return left.ops, right.ops, 0
        # No x at all (e.g. `4=4`): the solution set is everything or nothing, never a unique x.
        return left.ops + right.ops + 1, 0, 0


class _Parser:
    def __init__(self, text: str, allow_x: bool):
        if len(text) > MAX_LINE:
            raise ParseError(f"line longer than {MAX_LINE} characters")
        self.s = text.replace(" ", "")
        self.i = 0
        self.allow_x = allow_x

    # -- helpers
    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def eat(self, ch: str) -> bool:
        if self.peek() == ch:
            self.i += 1
            return True
        return False

    def fail(self, why: str) -> ParseError:
        return ParseError(f"{why} at position {self.i} in {self.s!r}")

    # -- grammar
    def expr(self) -> Linear:
        left = self.term()
        while self.peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            right = self.term()
            sign = 1 if op == "+" else -1
            left = Linear(
                left.coef + sign * right.coef,
                left.const + sign * right.const,
                left.ops + right.ops + 1,
                left.has_x or right.has_x,
            )
        return left

    def term(self) -> Linear:
        left = self.unary()
        while True:
            ch = self.peek()
            if ch == "*":
                self.i += 1
                left = _mul(left, self.unary(), self)
            elif ch == "/":
                self.i += 1
                left = _div(left, self.unary(), self)
            elif ch in ("x", "(") and self._prev_is_digit():
                # Implicit multiplication: `2x`, `3(x+1)`.
                left = _mul(left, self.atom(), self)
            else:
                return left

    def _prev_is_digit(self) -> bool:
        return self.i > 0 and self.s[self.i - 1].isdigit()

    def unary(self) -> Linear:
        if self.eat("-"):
            if self.peek().isdigit():
                # `-4`: a negative literal, no operation (but `-4x` still counts its implicit product).
                lit = self.number()
                return Linear(-lit.coef, -lit.const, lit.ops, lit.has_x)
            inner = self.unary()
            return Linear(-inner.coef, -inner.const, inner.ops + 1, inner.has_x)
        return self.atom()

    def atom(self) -> Linear:
        ch = self.peek()
        if ch.isdigit():
            return self.number()
        if ch == "x":
            if not self.allow_x:
                raise self.fail("x is not allowed here")
            self.i += 1
            return Linear(Fraction(1), Fraction(0), 0, True)
        if ch == "(":
            self.i += 1
            inner = self.expr()
            if not self.eat(")"):
                raise self.fail("missing ')'")
            return inner
        raise self.fail("expected a number, x or '('")

    def number(self) -> Linear:
        start = self.i
        while self.peek().isdigit():
            self.i += 1
        digits = self.s[start : self.i]
        if len(digits) > MAX_DIGITS:
            raise self.fail(f"number longer than {MAX_DIGITS} digits")
        return Linear(Fraction(0), Fraction(int(digits)), 0, False)


def _mul(a: Linear, b: Linear, p: _Parser) -> Linear:
    if a.coef != 0 and b.coef != 0:
        raise p.fail("not linear (x times x)")
    return Linear(
        a.coef * b.const + b.coef * a.const,
        a.const * b.const,
        a.ops + b.ops + 1,
        a.has_x or b.has_x,
    )


def _div(a: Linear, b: Linear, p: _Parser) -> Linear:
    if b.coef != 0:
        raise p.fail("not linear (division by an expression in x)")
    if b.const == 0:
        raise p.fail("division by zero")
    return Linear(a.coef / b.const, a.const / b.const, a.ops + b.ops + 1, a.has_x or b.has_x)


def parse_expression(text: str, allow_x: bool = True) -> Linear:
    """Parse a whole line as one expression; raise `ParseError` if anything is left over or malformed."""
    p = _Parser(text, allow_x)
    if not p.s:
        raise ParseError("empty line")
    out = p.expr()
    if p.i != len(p.s):
        raise p.fail("unexpected character")
    return out


def parse_equation(text: str) -> Equation:
    """Parse a whole line `lhs=rhs` (exactly one '='); raise `ParseError` if malformed."""
    if len(text) > MAX_LINE:
        raise ParseError(f"line longer than {MAX_LINE} characters")
    if text.count("=") != 1:
        raise ParseError(f"expected exactly one '=' in {text!r}")
    lhs, rhs = text.split("=")
    return Equation(parse_expression(lhs), parse_expression(rhs))
