"""The bounded arithmetic evaluator behind the calculator and the answer checker."""

from __future__ import annotations

from fractions import Fraction

import pytest

from sao_megatron.envs.safe_eval import CONSTANTS, FUNCTIONS, EvalError, calculator, evaluate


@pytest.mark.parametrize(
    ("expr", "out"),
    [
        ("37*12+5", "449"),
        ("2-9", "-7"),
        ("(1+2)*3", "9"),
        ("7/2", "7/2"),
        ("2**10", "1024"),
        ("-(3)", "-3"),
        ("17//5", "3"),
        ("17%5", "2"),
        ("0.5+0.25", "3/4"),
    ],
)
def test_calculator(expr: str, out: str) -> None:
    assert calculator(expr) == out


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('id')",
        "open('/etc/passwd')",
        "x",
        "(lambda: 1)()",
        "[1][0]",
        "1 if 1 else 2",
        "9**9**9",
        "10**400",
        "1" * 500,
        "(" * 300 + "1" + ")" * 300,
        "1/0",
        "True+1",
        "'a'*3",
        "2**0.5j",
    ],
)
def test_hostile_or_invalid_expressions_raise_eval_error(expr: str) -> None:
    with pytest.raises(EvalError):
        evaluate(expr)
    assert calculator(expr).startswith("Error:")


def test_functions_and_constants_are_opt_in() -> None:
    assert evaluate("sqrt(16)", CONSTANTS, FUNCTIONS) == Fraction(4)
    assert abs(evaluate("2*pi", CONSTANTS, FUNCTIONS) - 6.283185307179586) < 1e-12
    with pytest.raises(EvalError):
        evaluate("sqrt(16)")
    with pytest.raises(EvalError):
        evaluate("sqrt(-1)", CONSTANTS, FUNCTIONS)
