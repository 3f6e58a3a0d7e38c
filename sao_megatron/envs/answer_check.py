"""Robust comparison of a model's final answer with the ground truth.

:func:`answers_match` accepts the usual spellings of the same value: integers (``1,000``),
decimals (``0.75``), fractions (``3/4``, ``\\frac{3}{4}``, ``\\dfrac34``), ``\\boxed{...}``,
``$...$``, ``x = 5``, units in ``\\text{...}``, percent and degree signs, roots
(``2\\sqrt{3}`` equals ``sqrt(12)``), ``\\pi``, tuples (elementwise, ordered) and polynomials
in single-letter variables (compared at fixed sample points).

Evaluation uses the bounded AST evaluator of :mod:`sao_megatron.envs.safe_eval`, so every
comparison is fast and safe. sympy is deliberately not used even when installed:
``sympy.parse_expr`` evaluates model text with ``eval`` and ``simplify`` has no time bound.
Rationals written without a decimal point compare exactly (``2/6`` equals ``1/3``); when
either side has a decimal literal or an irrational value, they compare with ``rel_tol``
(default 1e-6) and ``abs_tol`` 1e-9, so ``0.3333333`` matches ``\\frac{1}{3}``, ``0.33`` does not.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from sao_megatron.envs.safe_eval import CONSTANTS, FUNCTIONS, EvalError, Number, evaluate

_SAMPLE_POINTS = (Fraction(37, 100), Fraction(-113, 50), Fraction(271, 100))
_REMOVE = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\ ", r"\displaystyle", "^\\circ", "^{\\circ}")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The contents of the ``{...}`` group opening at ``text[start]`` and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    return None


def extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), or None."""
    pos = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if pos < 0:
        return None
    got = _braced(text, text.index("{", pos))
    return got[0] if got else None


def normalize_answer(text: str) -> str:
    """Strip presentation (boxes, dollars, spacing macros, units, trailing period)."""
    s = text.strip()
    boxed = extract_boxed(s)
    s = (boxed if boxed is not None else s).strip().strip("$").strip()
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\%", "").replace("%", "").replace("°", "")
    text_group = r"\\(?:text|mathrm|mbox)\{([^{}]*)\}"
    without_units = re.sub(text_group, "", s).strip()
    s = without_units if without_units else re.sub(text_group, r"\1", s)
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return re.sub(r"\s+", " ", s)


def _latex_group(s: str, i: int) -> tuple[str, int]:
    """One argument of a LaTeX macro at ``s[i]``: a ``{group}`` or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    got = _braced(s, i)
    if got is not None:
        return got
    if i < len(s):
        return s[i], i + 1
    raise EvalError("missing macro argument")


def latex_to_python(s: str) -> str:
    """Translate the LaTeX subset used in answers into the evaluator's Python syntax."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _latex_group(s, i + 5)
            den, i = _latex_group(s, i)
            out.append(f"(({latex_to_python(num)})/({latex_to_python(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            root = "2"
            if i < len(s) and s[i] == "[":
                close = s.find("]", i)
                if close < 0:
                    raise EvalError("unclosed root index")
                root, i = s[i + 1 : close], close + 1
            arg, i = _latex_group(s, i)
            out.append(f"(({latex_to_python(arg)})**(1/({latex_to_python(root)})))")
        elif s[i] == "\\":
            name = re.match(r"\\([A-Za-z]+)", s[i:])
            macro = name.group(1) if name else ""
            table = {"pi": "pi", "cdot": "*", "times": "*", "div": "/"}
            if macro not in table:
                raise EvalError(f"unsupported macro \\{macro}")
            out.append(f" {table[macro]} ")
            i += 1 + len(macro)
        else:
            out.append({"{": "(", "}": ")", "^": "**"}.get(s[i], s[i]))
            i += 1
    return "".join(out)


_TOKEN = re.compile(r"\d+\.?\d*|\.\d+|[A-Za-z]+|\*\*|[-+*/()]|\S")


def _implicit_products(expr: str) -> tuple[str, set[str]]:
    """Insert ``*`` for juxtaposition (``2sqrt(3)``, ``2x``, ``)(``); returns variables used."""
    tokens: list[str] = []
    for tok in _TOKEN.findall(expr):
        if tok.isalpha() and tok not in FUNCTIONS and tok not in CONSTANTS:
            tokens.extend(tok)  # "xy" is x*y
        else:
            tokens.append(tok)
    out: list[str] = []
    variables = set()
    for tok in tokens:
        if out:
            prev = out[-1]
            left = prev[0].isdigit() or prev[0] == "." or prev == ")" or (prev.isalpha() and prev not in FUNCTIONS)
            right = tok[0].isdigit() or tok[0] == "." or tok == "(" or tok.isalpha()
            if left and right:
                out.append("*")
        if tok.isalpha() and tok not in FUNCTIONS and tok not in CONSTANTS:
            variables.add(tok)
        out.append(tok)
    return "".join(out), variables


def _to_expr(text: str) -> tuple[str, set[str]]:
    return _implicit_products(latex_to_python(text))


def _close(a: Number, b: Number, rel_tol: float, exact: bool) -> bool:
    if exact and isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-9)


def _matching_close(s: str) -> int:
    """Index of the bracket closing ``s[0]``, or -1."""
    depth = 0
    for i, ch in enumerate(s):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            return i
    return -1


def _split_top_level(s: str) -> list[str]:
    s = s.strip()
    if len(s) >= 2 and s[0] + s[-1] in ("()", "[]") and _matching_close(s) == len(s) - 1:
        s = s[1:-1]
    parts, depth, cur = [], 0, []
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _scalar_match(pred: str, truth: str, rel_tol: float) -> bool:
    if pred.replace(" ", "").lower() == truth.replace(" ", "").lower():
        return True
    try:
        (pe, pv), (te, tv) = _to_expr(pred), _to_expr(truth)
        if pv != tv:
            return False
        exact = "." not in pe and "." not in te  # a decimal literal is a rounded value
        if not pv:
            names: dict[str, Number] = dict(CONSTANTS)
            return _close(evaluate(pe, names, FUNCTIONS), evaluate(te, names, FUNCTIONS), rel_tol, exact)
        for point in _SAMPLE_POINTS:
            names = {**CONSTANTS, **{v: point + j * Fraction(7, 10) for j, v in enumerate(sorted(pv))}}
            if not _close(evaluate(pe, names, FUNCTIONS), evaluate(te, names, FUNCTIONS), rel_tol, exact):
                return False
        return True
    except (EvalError, ArithmeticError, TypeError, ValueError, RecursionError):
        return False


def answers_match(pred: str, truth: str, rel_tol: float = 1e-6) -> bool:
    """True when ``pred`` and ``truth`` denote the same value (see the module docstring)."""
    a, b = normalize_answer(pred), normalize_answer(truth)
    if not a or not b:
        return False
    if a == b:
        return True
    pa, pb = _split_top_level(a), _split_top_level(b)
    if len(pa) != len(pb):
        return False
    return all(_scalar_match(x, y, rel_tol) for x, y in zip(pa, pb, strict=True))
