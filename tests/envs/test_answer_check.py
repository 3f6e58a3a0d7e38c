"""answers_match: equivalent spellings match, different values do not, nothing executes."""

from __future__ import annotations

import pytest

from sao_megatron.envs.answer_check import answers_match, extract_boxed, normalize_answer

SAME = [
    ("449", "449"),
    ("1,000", "1000"),
    ("0.75", "3/4"),
    (r"\frac{3}{4}", "0.75"),
    (r"\dfrac34", "3/4"),
    (r"\boxed{2\sqrt{3}}", "sqrt(12)"),
    ("6.928203230275509", r"4\sqrt{3}"),
    ("x = 5", "5"),
    (r"$\frac{\pi}{2}$", "1.5707963"),
    ("2x+3", "3+2*x"),
    ("x^2+2x+1", "(x+1)^2"),
    ("(1, 2)", "(1,2)"),
    ("Yes", "yes"),
    (r"50\%", "50"),
    ("(1+2)*(3)", "9"),
    (r"\frac{1}{3}", "0.3333333"),
    (r"5\text{ cm}", "5"),
    ("-7/2", r"-\frac{7}{2}"),
    ("2/6", "1/3"),
    (r"\sqrt[3]{27}", "3"),
    ("The answer is \\boxed{42}.", "42"),
    ("90^\\circ", "90"),
    (r"\left(\frac{1}{2}\right)", "0.5"),
]
DIFFERENT = [
    ("5", "6"),
    ("", "5"),
    ("(1,2)", "(2,1)"),
    ("0.33", "1/3"),
    ("abc", "x"),
    ("9**9**9", "1"),
    ("1/0", "1"),
    ("2x", "2y"),
    ("(1,2,3)", "(1,2)"),
    ("__import__('os')", "0"),
    (r"\unknown{1}", "1"),
    ("x^2", "2x"),
]


@pytest.mark.parametrize(("pred", "truth"), SAME)
def test_equivalent_answers_match(pred: str, truth: str) -> None:
    assert answers_match(pred, truth)


@pytest.mark.parametrize(("pred", "truth"), DIFFERENT)
def test_different_answers_do_not_match(pred: str, truth: str) -> None:
    assert not answers_match(pred, truth)


def test_helpers() -> None:
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert extract_boxed("none") is None
    assert normalize_answer(r" $\boxed{1,234}$. ") == "1234"
