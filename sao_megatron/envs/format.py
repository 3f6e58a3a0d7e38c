"""The chat/tool text format shared by the tokenizer, the environments and the rollout engine.

A conversation is one flat string (ids in brackets are the tokenizer's)::

    <|user|>{question}<|assistant|>{action}<|end|><|tool|>{observation}<|assistant|>{action}<|end|>

* ``<|user|>{question}<|assistant|>`` is the prompt; the model generates from there.
* An *action* is model text ending with ``<|end|>`` (the engine's stop token). Inside it, a tool
  call is ``<tool>{code}</tool>`` and a final answer is ``<answer>{answer}</answer>``.
* An *observation* is written by the environment, never by the model:
  ``<|tool|>{output}<|assistant|>``, so the next action follows directly.

Special tokens (single ids, in this order): ``<|pad|>`` (0), ``<|endoftext|>`` (1),
``<|user|>`` (2), ``<|assistant|>`` (3), ``<|tool|>`` (4), ``<|end|>`` (5). The four tag strings
``<tool>``, ``</tool>``, ``<answer>``, ``</answer>`` are ordinary (non-special) added tokens,
one id each, so a tiny model spends one token per tag.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

PAD = "<|pad|>"
EOT = "<|endoftext|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
END = "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOT, USER, ASSISTANT, TOOL, END)
"""In id order: ``SPECIAL_TOKENS[i]`` has token id ``i``."""

TOOL_OPEN = "<tool>"
TOOL_CLOSE = "</tool>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
TAG_TOKENS: tuple[str, ...] = (TOOL_OPEN, TOOL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

Role = Literal["assistant", "tool"]
Turn = tuple[Role, str]
"""One step of a trajectory after the prompt: ``("assistant", action)`` or ``("tool", output)``."""


def escape_specials(text: str) -> str:
    """Make text written by tools or users unable to spell a special token (``<|`` -> ``<\\|``)."""
    return text.replace("<|", "<\\|")


def render_prompt(question: str) -> str:
    """``<|user|>{question}<|assistant|>``."""
    return f"{USER}{escape_specials(question)}{ASSISTANT}"


def render_observation(output: str) -> str:
    """``<|tool|>{output}<|assistant|>``; the output is escaped so it cannot close the turn."""
    return f"{TOOL}{escape_specials(output)}{ASSISTANT}"


def tool_call(code: str) -> str:
    """The action text calling the tool: ``<tool>{code}</tool><|end|>``."""
    return f"{TOOL_OPEN}{code}{TOOL_CLOSE}{END}"


def final_answer(text: str) -> str:
    """The action text giving the final answer: ``<answer>{text}</answer><|end|>``."""
    return f"{ANSWER_OPEN}{text}{ANSWER_CLOSE}{END}"


def ensure_end(action: str) -> str:
    """The action with exactly one trailing ``<|end|>`` (idempotent)."""
    return action if action.endswith(END) else action + END


def strip_end(action: str) -> str:
    """The action without its trailing ``<|end|>`` (and surrounding whitespace), if any."""
    text = action.rstrip()
    return text[: -len(END)].rstrip() if text.endswith(END) else text


def render_turns(turns: Iterable[Turn]) -> str:
    """Everything after the prompt: actions end with ``<|end|>``, observations are wrapped."""
    parts = []
    for role, text in turns:
        if role == "assistant":
            parts.append(ensure_end(text))
        elif role == "tool":
            parts.append(render_observation(text))
        else:
            raise ValueError(f"unknown role {role!r}: use 'assistant' or 'tool'")
    return "".join(parts)


def render_conversation(question: str, turns: Iterable[Turn]) -> str:
    """The whole trajectory text: prompt followed by :func:`render_turns`."""
    return render_prompt(question) + render_turns(turns)


def to_messages(question: str, turns: Sequence[Turn]) -> list[dict[str, str]]:
    """Chat-template messages (roles ``user``/``assistant``/``tool``) for the same conversation."""
    return [{"role": "user", "content": question}, *({"role": r, "content": t} for r, t in turns)]


CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}" + USER + "{{ m['content'] }}" + ASSISTANT + ""
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] }}"
    "{%- if not m['content'].endswith('" + END + "') -%}" + END + "{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}" + TOOL + "{{ m['content'] }}" + ASSISTANT + ""
    "{%- else -%}{{ raise_exception('unsupported role: ' + m['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""Jinja chat template producing exactly :func:`render_conversation` (without escaping).

``add_generation_prompt`` is a no-op: user and tool turns already end with ``<|assistant|>``.
"""
