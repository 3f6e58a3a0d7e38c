"""A small, bounded arithmetic evaluator over Python's AST (no ``eval``, no attribute access).

Used as the arith_tool calculator and by the answer checker. Numbers are exact
:class:`fractions.Fraction` values while possible and fall back to ``float`` for irrational
results (``sqrt(2)``, ``pi``). Every operation is bounded (expression length, exponent, number
size), so any input finishes in microseconds or raises :class:`EvalError`.
"""

from __future__ import annotations

import ast
import math
import warnings
from collections.abc import Callable, Mapping
from fractions import Fraction

Number = Fraction | float

MAX_EXPR_CHARS = 400
MAX_EXPONENT = 256
MAX_DIGITS = 300


class EvalError(ValueError):
    """The expression is not allowed, too large, or undefined (e.g. division by zero)."""


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise EvalError("sqrt of a negative number")
    if isinstance(x, Fraction):
        n, d = math.isqrt(x.numerator), math.isqrt(x.denominator)
        if n * n == x.numerator and d * d == x.denominator:
            return Fraction(n, d)
    return math.sqrt(x)


FUNCTIONS: Mapping[str, Callable[[Number], Number]] = {
    "sqrt": _sqrt,
    "abs": abs,
    "exp": lambda x: math.exp(x),
    "log": lambda x: math.log(x),
    "ln": lambda x: math.log(x),
    "sin": lambda x: math.sin(x),
    "cos": lambda x: math.cos(x),
    "tan": lambda x: math.tan(x),
}
CONSTANTS: Mapping[str, Number] = {"pi": math.pi, "e": math.e}


def _check_size(x: Number) -> Number:
    if isinstance(x, Fraction):
        if max(abs(x.numerator), x.denominator) >= 10**MAX_DIGITS:
            raise EvalError("number too large")
    elif not math.isfinite(x):
        raise EvalError("result is not finite")
    return x


def _power(base: Number, exp: Number) -> Number:
    if isinstance(exp, Fraction) and exp.denominator == 1:
        if abs(exp) > MAX_EXPONENT:
            raise EvalError(f"exponent larger than {MAX_EXPONENT}")
        if isinstance(base, Fraction):
            if base == 0 and exp < 0:
                raise EvalError("division by zero")
            if math.log10(max(abs(base.numerator), base.denominator) + 1) * abs(exp) > MAX_DIGITS + 1:
                raise EvalError("number too large")
            return base ** int(exp)
    try:
        result = float(base) ** float(exp)
    except (OverflowError, ZeroDivisionError) as exc:
        raise EvalError(str(exc)) from None
    if isinstance(result, complex):
        raise EvalError("complex result")
    return result


# Lambdas rather than operator.add & co: typeshed's overloads of those do not fit a Number union.
_BINOPS: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: _power,
}


def evaluate(
    expr: str,
    names: Mapping[str, Number] | None = None,
    functions: Mapping[str, Callable[[Number], Number]] | None = None,
) -> Number:
    """Evaluate ``expr`` (Python syntax: ``+ - * / // % **``, parentheses, numbers, names).

    ``names`` maps identifiers to values (default: none) and ``functions`` maps identifiers to
    one-argument functions (default: none); pass :data:`CONSTANTS`/:data:`FUNCTIONS` to allow
    ``pi``, ``sqrt(...)`` and friends. Raises :class:`EvalError` for anything else.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise EvalError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        with warnings.catch_warnings():  # e.g. "invalid decimal literal" on model text such as "2x"
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise EvalError(f"invalid expression: {getattr(exc, 'msg', exc)}") from None
    try:
        return _eval(tree.body, names or {}, functions or {})
    except RecursionError:
        raise EvalError("expression nested too deeply") from None


def _eval(node: ast.AST, names: Mapping[str, Number], funcs: Mapping[str, Callable]) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
        return _check_size(Fraction(value) if isinstance(value, int) else Fraction(repr(value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        val = _eval(node.operand, names, funcs)
        return -val if isinstance(node.op, ast.USub) else val
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, names, funcs), _eval(node.right, names, funcs)
        try:
            return _check_size(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise EvalError("division by zero") from None
        except (OverflowError, ValueError) as exc:
            raise EvalError(str(exc)) from None
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in funcs:
        if len(node.args) != 1 or node.keywords:
            raise EvalError(f"{node.func.id}() takes one argument")
        try:
            return _check_size(funcs[node.func.id](_eval(node.args[0], names, funcs)))
        except (OverflowError, ValueError, ZeroDivisionError) as exc:
            raise EvalError(f"{node.func.id}: {exc}") from None
    if isinstance(node, ast.Name):
        raise EvalError(f"unknown name {node.id!r}")
    raise EvalError(f"unsupported syntax: {type(node).__name__}")


def format_number(x: Number) -> str:
    """Canonical text: ``449``, ``-3/4`` for non-integral fractions, ``repr`` for floats."""
    if isinstance(x, Fraction):
        return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"
    return repr(x)


def calculator(expr: str) -> str:
    """The arith_tool tool: evaluate with exact numbers and return the observation text."""
    try:
        return format_number(evaluate(expr))
    except EvalError as exc:
        return f"Error: {exc}"
