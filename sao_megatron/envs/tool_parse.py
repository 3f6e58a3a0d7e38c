"""Parse one model action into a tool call, a final answer, or a malformed action.

Grammar (see :mod:`sao_megatron.envs.format`): an action contains exactly one
``<tool>code</tool>`` or exactly one ``<answer>text</answer>``; free text before the tag (for
example reasoning) and whitespace after it are allowed, as is a trailing ``<|end|>``.
:func:`parse_action` never raises on model output: every other shape is :class:`Malformed`
with a short reason that an environment can show the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.envs.format import ANSWER_CLOSE, ANSWER_OPEN, TOOL_CLOSE, TOOL_OPEN, strip_end


@dataclass(frozen=True)
class ToolCall:
    """``<tool>code</tool>``; ``code`` is the raw text between the tags."""

    code: str


@dataclass(frozen=True)
class Answer:
    """``<answer>text</answer>``; ``text`` is stripped of surrounding whitespace."""

    text: str


@dataclass(frozen=True)
class Malformed:
    """Anything else; ``reason`` is one short human-readable line."""

    reason: str


Action = ToolCall | Answer | Malformed


def _extract(text: str, open_tag: str, close_tag: str) -> str | Malformed:
    """The body of the single ``open_tag ... close_tag`` block in ``text``."""
    name = open_tag.strip("<>")
    start = text.find(open_tag)
    if text.count(open_tag) > 1:
        return Malformed(f"more than one {open_tag}")
    end = text.find(close_tag, start + len(open_tag))
    if end < 0:
        return Malformed(f"unclosed {open_tag}")
    if text.count(close_tag) > 1:
        return Malformed(f"more than one {close_tag}")
    trailing = text[end + len(close_tag) :]
    if trailing.strip():
        return Malformed(f"text after {close_tag}")
    body = text[start + len(open_tag) : end]
    if not body.strip():
        return Malformed(f"empty {name}")
    return body


def parse_action(action: str) -> Action:
    """Classify ``action`` (with or without its trailing ``<|end|>``); never raises."""
    if not isinstance(action, str):
        return Malformed(f"action is {type(action).__name__}, not text")
    text = strip_end(action)
    has_tool = TOOL_OPEN in text or TOOL_CLOSE in text
    has_answer = ANSWER_OPEN in text or ANSWER_CLOSE in text
    if has_tool and has_answer:
        return Malformed("both a tool call and an answer")
    if not has_tool and not has_answer:
        return Malformed(f"no {TOOL_OPEN} call and no {ANSWER_OPEN}")
    open_tag, close_tag = (TOOL_OPEN, TOOL_CLOSE) if has_tool else (ANSWER_OPEN, ANSWER_CLOSE)
    if open_tag not in text:
        return Malformed(f"{close_tag} without {open_tag}")
    body = _extract(text, open_tag, close_tag)
    if isinstance(body, Malformed):
        return body
    return ToolCall(body) if has_tool else Answer(body.strip())
