"""Parse one model action into tool calls, a final answer, or a malformed action.

Two formats; the tokenizer's chat template decides which a run uses
(:func:`sao_megatron.envs.format.tool_format_of`).

``tags`` (the tiny template; :func:`parse_action`). Grammar (see :mod:`sao_megatron.envs.format`):
an action contains one or more ``<tool>code</tool>`` blocks separated only by whitespace, or
exactly one ``<answer>text</answer>``; free text before the first tag (for example reasoning) and
whitespace after the last are allowed, as is a trailing ``<|end|>``.
:func:`parse_action` never raises on model output: every other shape is :class:`Malformed`
with a short reason that an environment can show the model.

``json`` (native tool calls, e.g. Qwen3; :func:`parse_native_action`): one or more
``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks (separated only by whitespace),
each validated against the environment's JSON schemas; an action without a call is the final
answer.

One call gives :class:`ToolCall` / :class:`NativeCall` (as before parallel calls existed); two or
more give :class:`Parallel`, whose calls are each parsed on their own: a bad block (empty, bad
JSON, unknown tool, ...) is a :class:`Malformed` item there, so the environment answers it with an
error output and still runs the others. A broken frame (an unclosed block, text between or after
the blocks, a call mixed with an answer) makes the whole action :class:`Malformed`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True)
class Parallel[C]:
    """Two or more calls in one action, in the order written; each parsed, or why it is malformed."""

    calls: tuple[C | Malformed, ...]


Action = ToolCall | Parallel[ToolCall] | Answer | Malformed


def refused_call(index: int, limit: int) -> str:
    """The error text answering call ``index`` (0-based) of an action past its ``limit`` calls."""
    return f"call {index + 1} not run: at most {limit} tool call{'s' if limit > 1 else ''} per turn"


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


def _blocks(text: str, open_tag: str, close_tag: str) -> list[str] | Malformed:
    """The bodies of the ``open_tag ... close_tag`` blocks of ``text``, in order.

    Text before the first block is allowed (it must not hold ``close_tag``); between blocks and
    after the last only whitespace."""
    start = text.find(open_tag)
    bodies: list[str] = []
    while True:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return Malformed(f"unclosed {open_tag}")
        if not bodies and close_tag in text[:start]:
            return Malformed(f"more than one {close_tag}")
        body = text[start + len(open_tag) : end]
        if open_tag in body:
            return Malformed(f"{open_tag} inside {open_tag}")
        bodies.append(body)
        rest = text[end + len(close_tag) :]
        if not rest.strip():
            return bodies
        if rest.lstrip().startswith(open_tag):
            start = len(text) - len(rest.lstrip())
        elif open_tag in rest:
            return Malformed(f"text between {close_tag} and {open_tag}")
        elif close_tag in rest:
            return Malformed(f"more than one {close_tag}")
        else:
            return Malformed(f"text after {close_tag}")


def _tag_call(body: str) -> ToolCall | Malformed:
    return ToolCall(body) if body.strip() else Malformed("empty tool")


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
    if has_tool:
        bodies = _blocks(text, TOOL_OPEN, TOOL_CLOSE)
        if isinstance(bodies, Malformed):
            return bodies
        calls = tuple(_tag_call(b) for b in bodies)
        return calls[0] if len(calls) == 1 else Parallel(calls)
    body = _extract(text, open_tag, close_tag)
    return body if isinstance(body, Malformed) else Answer(body.strip())


# ---------------------------------------------------------------------------------------------
# Native tool calls (templates with ``<tool_call>``, e.g. Qwen3): ``json`` format.

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class NativeCall:
    """``<tool_call>{"name": name, "arguments": {...}}</tool_call>``, validated against the schemas."""

    name: str
    arguments: dict


_TRAILING_SPECIALS = re.compile(r"(?:<\|[^\s<>|]{1,64}\|>\s*)+$")


def _strip_trailing_specials(text: str) -> str:
    """``text`` without trailing special tokens such as ``<|im_end|>`` / ``<|endoftext|>``."""
    return _TRAILING_SPECIALS.sub("", text.rstrip()).rstrip()


def _schema_functions(tools: Sequence[Mapping]) -> dict[str, Mapping]:
    out = {}
    for tool in tools:
        fn = tool.get("function", tool)
        out[str(fn.get("name"))] = fn.get("parameters") or {}
    return out


def parse_native_action(
    action: str, tools: Sequence[Mapping]
) -> NativeCall | Parallel[NativeCall] | Answer | Malformed:
    """Classify an action in the native format; never raises.

    * one ``<tool_call>`` block holding a JSON object ``{"name": .., "arguments": {..}}`` whose
      name is one of ``tools`` (OpenAI-style schemas) and whose arguments are an object with
      every ``required`` parameter -> :class:`NativeCall`;
    * several blocks separated by whitespace -> :class:`Parallel`: each block a
      :class:`NativeCall`, or :class:`Malformed` for the reasons below;
    * no ``<tool_call>`` -> :class:`Answer`: the body of ``<answer>..</answer>`` when present,
      else the text after the reasoning (``</think>``);
    * everything else (bad JSON, unknown tool, missing or non-object arguments, a missing
      required argument, unclosed tags, text between calls, empty answers) -> :class:`Malformed`.
    Text before the first call (reasoning) and trailing special tokens (``<|im_end|>``) are allowed.
    """
    if not isinstance(action, str):
        return Malformed(f"action is {type(action).__name__}, not text")
    text = _strip_trailing_specials(action)
    if TOOL_CALL_OPEN not in text and TOOL_CALL_CLOSE not in text:
        body = text.split(THINK_CLOSE)[-1]
        if ANSWER_OPEN in body or ANSWER_CLOSE in body:
            if ANSWER_OPEN not in body:
                return Malformed(f"{ANSWER_CLOSE} without {ANSWER_OPEN}")
            inner = _extract(body, ANSWER_OPEN, ANSWER_CLOSE)
            return inner if isinstance(inner, Malformed) else Answer(inner.strip())
        return Answer(body.strip()) if body.strip() else Malformed("no tool call and no answer")
    if TOOL_CALL_OPEN not in text:
        return Malformed(f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}")
    bodies = _blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    if isinstance(bodies, Malformed):
        return bodies
    functions = _schema_functions(tools)
    calls = tuple(_native_call(body, functions) for body in bodies)
    return calls[0] if len(calls) == 1 else Parallel(calls)


def _native_call(body: str, functions: Mapping[str, Mapping]) -> NativeCall | Malformed:
    """One ``<tool_call>`` block's body as a call validated against ``functions``."""
    if not body.strip():
        return Malformed("empty tool_call")
    try:
        call = json.loads(body)
    except ValueError as err:
        return Malformed(f"tool call is not valid JSON: {err}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Malformed('tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = call["name"]
    if name not in functions:
        return Malformed(f"unknown tool {name!r}, use {', '.join(sorted(functions)) or 'none'}")
    if "arguments" not in call:
        return Malformed(f"no arguments for {name!r}")
    arguments = call["arguments"]
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return Malformed(f"arguments of {name!r} are not a JSON object")
    if not isinstance(arguments, dict):
        return Malformed(f"arguments of {name!r} are not a JSON object")
    missing = [k for k in functions[name].get("required", ()) if k not in arguments]
    if missing:
        return Malformed(f"missing argument(s): {', '.join(missing)}")
    return NativeCall(name, arguments)
