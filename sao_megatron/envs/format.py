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

import re
from collections.abc import Iterable, Sequence
from typing import Literal

from jinja2 import TemplateError

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


# ---------------------------------------------------------------------------------------------
# The tokenizer's chat template: token-in/token-out rendering of live episodes and demonstrations.

ToolFormat = Literal["tags", "json"]
"""How actions call tools: ``tags`` = ``<tool>code</tool>`` / ``<answer>..</answer>`` (the tiny
template); ``json`` = the native ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` of
templates that render tool schemas (Qwen3, Hermes-style)."""


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
"""A reasoning block of an action (Qwen3, DeepSeek-R1)."""
_THINK_BLOCK = re.compile(re.escape(THINK_OPEN) + r".*?" + re.escape(THINK_CLOSE), re.DOTALL)


def outline(text: str) -> str:
    """``text`` without its reasoning blocks and whitespace: what a template's re-rendering of earlier
    turns must keep (:meth:`ChatFormat.continuation_text`)."""
    return "".join(_THINK_BLOCK.sub("", text).split())


def _after_nth(text: str, marker: str, n: int) -> int:
    """The index right after the ``n``-th occurrence of ``marker`` in ``text``; -1 if there are fewer."""
    at = -len(marker)
    for _ in range(n):
        at = text.find(marker, at + len(marker))
        if at < 0:
            return -1
    return at + len(marker)


class ChatTemplateError(ValueError):
    """The chat template breaks the suffix assumption (see :meth:`ChatFormat.observation_ids`)."""


def tool_format_of(chat_template: str | None) -> ToolFormat:
    """``json`` when the template speaks ``<tool_call>``, else ``tags``."""
    return "json" if chat_template and "<tool_call>" in chat_template else "tags"


class ChatFormat:
    """Renders one conversation through ``tokenizer.apply_chat_template``, token-in/token-out.

    * :meth:`prompt_ids`: ``apply_chat_template([system?, user], tools=tools,
      add_generation_prompt=True, tokenize=True)`` (``enable_thinking`` passed only when set and
      the template reads it).
    * Actions are never re-rendered: the trajectory keeps the ids the engine generated.
    * :meth:`observation_ids`: the template's rendering of a tool result up to the next
      generation prompt, as a suffix (see there).

    User and tool text is escaped (:func:`escape_specials`), so neither can spell a special token.
    ``end_marker`` is the tokenizer's eos token, which ends an assistant turn in the template
    (``<|end|>`` tiny, ``<|im_end|>`` Qwen3); ``stop_token_ids`` are its id(s).
    """

    def __init__(
        self,
        tokenizer,
        tools: Sequence[dict] | None = None,
        system: str | None = None,
        enable_thinking: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.system = system
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ChatTemplateError("the tokenizer has no chat template")
        self.template = template
        self.tool_format: ToolFormat = tool_format_of(template)
        self.enable_thinking = enable_thinking if "enable_thinking" in template else None
        self.end_marker: str = tokenizer.eos_token
        if not self.end_marker:
            raise ChatTemplateError("the tokenizer has no eos token to end assistant turns")
        self.stop_token_ids: tuple[int, ...] = (int(tokenizer.convert_tokens_to_ids(self.end_marker)),)
        self._renders: dict[tuple[str, bool], bool] = {}

    # -- rendering -------------------------------------------------------------------------
    def renders(self, role: str, first: bool) -> bool:
        """Whether the template renders a message of ``role`` first in the conversation (``first``) or
        after a user and an assistant turn: a probe message's text appears in the rendering (a template
        may raise on a role, the tiny template does, or drop it silently, as Qwen3's drops
        ``developer``). Probed once per role and place."""
        if (role, first) not in self._renders:
            probe = {"role": role, "content": "sao-role-probe"}
            user = {"role": "user", "content": "u"}
            messages = [probe, user] if first else [user, {"role": "assistant", "content": "a"}, probe, user]
            try:
                self._renders[role, first] = probe["content"] in self.render(messages)
            except TemplateError:
                self._renders[role, first] = False
        return self._renders[role, first]

    def _kwargs(self, add_generation_prompt: bool) -> dict:
        kwargs: dict = {"tools": self.tools, "add_generation_prompt": add_generation_prompt}
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, **self._kwargs(add_generation_prompt))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_messages(self, question: str) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": escape_specials(question)}]

    def prompt_ids(self, question: str) -> list[int]:
        """The first prompt: system prompt, tool schemas, user turn, generation prompt."""
        return self.messages_ids(self.prompt_messages(question))

    def messages_ids(self, messages: Sequence[dict]) -> list[int]:
        """``messages`` (already escaped) rendered with the tool schemas and the generation prompt."""
        ids = self.tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False, **self._kwargs(True))
        return [int(i) for i in ids]

    @staticmethod
    def tool_message(output: str) -> dict:
        """The template's ``tool`` message for a tool result (escaped)."""
        return {"role": "tool", "content": escape_specials(output)}

    def assistant_message(self, action_text: str) -> dict:
        """The template's ``assistant`` message for a generated action (decoded text)."""
        return {"role": "assistant", "content": self.action_content(action_text)}

    def action_content(self, action_text: str) -> str:
        """The assistant message content of a generated action: its text without the end marker."""
        text = action_text
        while text.endswith(self.end_marker):
            text = text[: -len(self.end_marker)]
        return text

    def observation_text(self, history: Sequence[dict], outputs: str | Sequence[str]) -> str:
        """The template's text for the tool result(s) ``outputs`` after ``history`` (see below).

        ``history`` is the conversation so far and ends with the assistant's last action;
        ``outputs`` is one tool result, or one per call of that action in call order (parallel
        calls), given to the template as consecutive ``tool`` messages (Qwen3 renders them as one
        user turn of several ``<tool_response>`` blocks; the tiny template as consecutive
        ``<|tool|>..<|assistant|>`` observations).
        Method (suffix rendering): ``after`` = render(history + the tool messages,
        add_generation_prompt=True). The observation is the part of ``after`` following the last
        action's end marker (``<|end|>`` / ``<|im_end|>``; found by counting end markers, see
        :meth:`continuation_text`), up to and including the next generation prompt.

        Assumptions, checked (:class:`ChatTemplateError` otherwise): the rendering of the history
        alone ends the action with the end marker after the unchanged conversation before it, the
        action's own text holds no end marker, and appending the new messages changes the rendering
        of the history before them at most in :func:`outline` (see :meth:`continuation_text`). The
        action's rendering itself may differ from what was generated (Qwen3 drops empty ``<think>``
        blocks of earlier turns): only the part after its end marker is used, the trajectory keeps
        the generated ids.
        """
        return self.continuation_text(history, self.tool_messages(outputs))

    def continuation_text(self, history: Sequence[dict], new_messages: Sequence[dict]) -> str:
        """The template's text for ``new_messages`` (tool results, a user turn) after ``history``,
        which ends with the assistant's last action, up to and including the next generation prompt.

        The rule: with ``k`` the number of end markers in ``render(history)`` up to and including the
        action's, the text is what follows the ``k``-th end marker of ``render(history +
        new_messages, add_generation_prompt=True)``. The history's part of that rendering (before the
        cut) may differ from ``render(history)``'s only inside reasoning blocks and in whitespace
        (their :func:`outline` s are equal): Qwen3's template drops every ``<think>`` block of the
        assistant turns before the last user message, so a user turn after an answer re-renders the
        earlier turns without their reasoning. The session keeps the ids the engine saw for them.
        Any other difference (a turn added, removed or edited by the template) is a
        :class:`ChatTemplateError`."""
        if not history or history[-1].get("role") != "assistant":
            raise ChatTemplateError("the history must end with the assistant's action")
        if self.end_marker in str(history[-1].get("content", "")):
            raise ChatTemplateError(f"the action's text contains the end marker {self.end_marker!r}")
        before = self.render(history[:-1])
        alone = self.render(history)
        if not alone.startswith(before) or self.end_marker not in alone[len(before) :]:
            raise ChatTemplateError(
                "the chat template does not render the action as a turn ending with "
                f"{self.end_marker!r} after the unchanged conversation before it"
            )
        action_end = alone.find(self.end_marker, len(before)) + len(self.end_marker)
        turns = alone.count(self.end_marker, 0, action_end)
        after = self.render([*history, *new_messages], True)
        cut = _after_nth(after, self.end_marker, turns)
        if cut < 0 or outline(after[:cut]) != outline(alone[:action_end]):
            raise ChatTemplateError(
                "the chat template renders the conversation before the new messages differently once they "
                "follow it (beyond dropped reasoning and whitespace)"
            )
        return after[cut:]

    def observation_ids(self, history: Sequence[dict], outputs: str | Sequence[str]) -> list[int]:
        """:meth:`observation_text` tokenised on its own. Exact in context because it starts right
        after the end marker, a special token at which the tokenizer always splits."""
        return self.encode(self.observation_text(history, outputs))

    @classmethod
    def tool_messages(cls, outputs: str | Sequence[str]) -> list[dict]:
        """One ``tool`` message per output (a single string is one output)."""
        return [cls.tool_message(o) for o in ((outputs,) if isinstance(outputs, str) else outputs)]

    def ensure_end(self, action: str) -> str:
        """A demonstration action with exactly one trailing end marker (as the engine stops)."""
        return action if action.endswith(self.end_marker) else action + self.end_marker
