"""parse_action: the outcomes (one call, parallel calls, answer, malformed), every malformed shape,
per-call errors of parallel calls, and no exception on any input."""

from __future__ import annotations

import random

import pytest

from sao_megatron.envs.format import END, TAG_TOKENS
from sao_megatron.envs.tool_parse import Answer, Malformed, Parallel, ToolCall, parse_action


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<tool>37*12+5</tool>", ToolCall("37*12+5")),
        ("<tool>37*12+5</tool><|end|>", ToolCall("37*12+5")),
        ("Let me compute.\n<tool>print(1)\nprint(2)</tool>  <|end|>", ToolCall("print(1)\nprint(2)")),
        ("<answer>449</answer><|end|>", Answer("449")),
        ("<answer>  \\frac{3}{4} </answer>", Answer("\\frac{3}{4}")),
        ("The result is <answer>449</answer>\n", Answer("449")),
        ("<tool>1</tool><tool>2</tool>", Parallel((ToolCall("1"), ToolCall("2")))),
        (
            "Two at once.\n<tool>1+1</tool>\n<tool>2*3</tool> <tool>7</tool>\n<|end|>",
            Parallel((ToolCall("1+1"), ToolCall("2*3"), ToolCall("7"))),
        ),
        ("<tool></tool><tool>2</tool>", Parallel((Malformed("empty tool"), ToolCall("2")))),
    ],
)
def test_valid_actions(text: str, expected: object) -> None:
    assert parse_action(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "no <tool> call and no <answer>"),
        ("449<|end|>", "no <tool> call and no <answer>"),
        ("<tool>1+1", "unclosed <tool>"),
        ("<answer>2", "unclosed <answer>"),
        ("1+1</tool>", "</tool> without <tool>"),
        ("<tool></tool>", "empty tool"),
        ("<tool>   \n</tool>", "empty tool"),
        ("<answer> </answer>", "empty answer"),
        ("<tool>1</tool><answer>1</answer>", "both a tool call and an answer"),
        ("<tool>1</tool></tool>", "more than one </tool>"),
        ("<tool>1</tool> then <tool>2</tool>", "text between </tool> and <tool>"),
        ("<tool>1</tool><tool>2</tool> done", "text after </tool>"),
        ("<tool>1</tool><tool>2", "unclosed <tool>"),
        ("<tool>1<tool>2</tool>", "<tool> inside <tool>"),
        ("</tool> x <tool>1</tool>", "more than one </tool>"),
        ("<tool>1</tool><tool>2</tool><answer>3</answer>", "both a tool call and an answer"),
        ("<tool>1</tool> and more", "text after </tool>"),
        ("<answer>1</answer><|end|>junk", "text after </answer>"),
        ("</tool><tool>1", "unclosed <tool>"),
    ],
)
def test_malformed_actions(text: str, reason: str) -> None:
    result = parse_action(text)
    assert isinstance(result, Malformed)
    assert result.reason == reason


def test_non_text_input_is_malformed() -> None:
    assert isinstance(parse_action(None), Malformed)  # type: ignore[arg-type]
    assert isinstance(parse_action(b"<tool>1</tool>"), Malformed)  # type: ignore[arg-type]


def test_fuzz_never_raises() -> None:
    rng = random.Random(0)
    pieces = [*TAG_TOKENS, END, "<", ">", "/", "tool", "answer", "1+1", " ", "\n", "\x00", "\ud800", "é"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        result = parse_action(text)
        assert isinstance(result, ToolCall | Parallel | Answer | Malformed)
        calls = result.calls if isinstance(result, Parallel) else (result,)
        assert isinstance(result, ToolCall | Answer | Malformed) or len(calls) >= 2
        for call in calls:
            if isinstance(call, ToolCall):
                assert call.code.strip() and "<tool>" not in call.code and "</tool>" not in call.code
