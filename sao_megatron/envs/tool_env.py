"""Shared multi-turn protocol of the tool-using environments (arith_tool, math_python).

Each action is parsed in the run's tool format (:meth:`ToolEnv.use_tool_format`, which the agent
loop takes from the tokenizer's chat template):

* ``tags`` (:func:`sao_megatron.envs.tool_parse.parse_action`, the tiny template):
  ``<tool>code</tool>`` -> the subclass runs the tool; ``<answer>text</answer>`` -> the episode
  ends and the answer is graded;
* ``json`` (:func:`sao_megatron.envs.tool_parse.parse_native_action`, e.g. Qwen3):
  ``<tool_call>{"name": TOOL, "arguments": {ARG: code}}</tool_call>`` -> the tool runs on
  ``code``; an action without a call is the answer (``<answer>`` body if present);
* anything else (bad JSON, unknown tool, missing arguments, ...) -> the tool-error observation
  ``Error: malformed action: <reason>`` (counted; optional penalty).

Parallel calls (several ``<tool>`` / ``<tool_call>`` blocks in one action, :class:`Parallel`):
each call gets its own output, in call order (the chat template renders them as consecutive
``tool`` messages): the tool's result, ``Error: malformed action: <reason>`` for a bad block
(counted as malformed), and ``Error: call k not run: ...`` for each call beyond
``max_calls_per_turn`` (:meth:`Env.limit_calls_per_turn`; ``StepResult.refused_calls``). The calls
run in order, or concurrently (``asyncio.gather`` in :meth:`astep`) when the env kwarg
``concurrent_calls`` is true, which a subclass allows only when its calls share no state
(:attr:`ToolEnv.calls_independent`).

The single tool is declared as a JSON schema (:attr:`ToolEnv.tools`: ``tool_name``, one string
parameter ``tool_argument``), passed to the chat template as ``tools=``.

After ``max_turns`` actions without an answer the episode ends (``info["truncated"] = True``,
reward 0). Reward = 1.0 for a correct answer, else 0.0, minus ``format_penalty`` if any action
was malformed.
"""

from __future__ import annotations

import asyncio
import json
from abc import abstractmethod
from typing import Any, ClassVar

from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.envs.format import ToolFormat, final_answer, tool_call
from sao_megatron.envs.tool_parse import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Answer,
    Malformed,
    NativeCall,
    Parallel,
    ToolCall,
    parse_action,
    parse_native_action,
    refused_call,
)


class ToolEnv(Env):
    """Base for tool + answer episodes; subclasses implement :meth:`run_tool` and :meth:`check`."""

    tool_name: ClassVar[str] = "tool"
    tool_description: ClassVar[str] = "Run the tool."
    tool_argument: ClassVar[str] = "code"
    tool_argument_description: ClassVar[str] = "The tool input."
    calls_independent: ClassVar[bool] = False
    """True when calls share no state, so the calls of one action may run concurrently
    (``concurrent_calls``); a subclass whose tool keeps state between calls leaves it False."""

    def __init__(
        self,
        max_turns: int = 4,
        format_penalty: float = 0.0,
        max_observation_chars: int = 512,
        concurrent_calls: bool = False,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if concurrent_calls and not self.calls_independent:
            raise ValueError(
                f"rollout.env_kwargs.concurrent_calls=true, but {type(self).__name__}'s tool calls share "
                "state (calls_independent is False): they must run in order; drop concurrent_calls"
            )
        self.concurrent_calls = bool(concurrent_calls)
        self.max_turns = max_turns
        self.format_penalty = format_penalty
        self.max_observation_chars = max_observation_chars
        self.sample: Sample | None = None
        self.turns = 0
        self.tool_calls = 0
        self.malformed = 0
        self.answer: str | None = None
        self.done = False
        self.tool_format: ToolFormat = "tags"

    @property
    def tools(self) -> list[dict]:
        return [
            {
                "type": "function",
                "function": {
                    "name": self.tool_name,
                    "description": self.tool_description,
                    "parameters": {
                        "type": "object",
                        "required": [self.tool_argument],
                        "properties": {
                            self.tool_argument: {"type": "string", "description": self.tool_argument_description}
                        },
                    },
                },
            }
        ]

    @property
    def system_prompt(self) -> str | None:
        if self.tool_format == "tags":
            return None
        return (
            f"Use the {self.tool_name} tool when it helps. When you know the final answer, reply "
            f"without a tool call and put the answer in {ANSWER_OPEN}...{ANSWER_CLOSE}."
        )

    def use_tool_format(self, tool_format: ToolFormat) -> None:
        if tool_format not in ("tags", "json"):
            raise ValueError(f"unknown tool format {tool_format!r}: use 'tags' or 'json'")
        self.tool_format = tool_format

    def call_text(self, code: str) -> str:
        """A demonstration action calling the tool on ``code``, in the run's format.

        ``tags``: ``<tool>code</tool><|end|>``; ``json``: ``<tool_call>\n{"name": .., "arguments":
        {..}}\n</tool_call>`` (the template's own serialisation; the caller adds the end marker).
        """
        if self.tool_format == "tags":
            return tool_call(code)
        payload = json.dumps({"name": self.tool_name, "arguments": {self.tool_argument: code}}, ensure_ascii=False)
        return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"

    def answer_text(self, answer: str) -> str:
        """A demonstration action giving the final answer, in the run's format."""
        return final_answer(answer) if self.tool_format == "tags" else f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"

    @abstractmethod
    def run_tool(self, code: str) -> str:
        """Execute a tool call; returns the observation text (errors as ``Error: ...``)."""

    async def arun_tool(self, code: str) -> str:
        """Async :meth:`run_tool`; override when the tool is slow."""
        return self.run_tool(code)

    @abstractmethod
    def check(self, answer: str, sample: Sample) -> bool:
        """Whether ``answer`` is correct for ``sample``."""

    def reset(self, sample: Sample) -> str:
        self.sample, self.turns, self.tool_calls, self.malformed = sample, 0, 0, 0
        self.answer, self.done = None, False
        return sample.question

    def _begin(self, action: str) -> ToolCall | Parallel[ToolCall] | Answer | Malformed:
        if self.sample is None or self.done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        self.turns += 1
        if self.tool_format == "json":
            parsed = self._from_native(parse_native_action(action, self.tools))
        else:
            parsed = parse_action(action)
        if isinstance(parsed, Malformed):
            self.malformed += 1
        return parsed

    def _from_native(
        self, parsed: NativeCall | Parallel[NativeCall] | Answer | Malformed
    ) -> ToolCall | Parallel[ToolCall] | Answer | Malformed:
        """A native parse with each call as its argument's :class:`ToolCall`."""
        if isinstance(parsed, NativeCall):
            return ToolCall(str(parsed.arguments[self.tool_argument]))
        if isinstance(parsed, Parallel):
            calls = (
                c if isinstance(c, Malformed) else ToolCall(str(c.arguments[self.tool_argument])) for c in parsed.calls
            )
            return Parallel(tuple(calls))
        return parsed

    def _plan(self, parsed: ToolCall | Parallel[ToolCall]) -> tuple[list[ToolCall | str], int]:
        """Per call of the action, in order: the call to run or its error output; and the number
        of calls refused (beyond ``max_calls_per_turn``)."""
        calls = [parsed] if isinstance(parsed, ToolCall) else list(parsed.calls)
        plan: list[ToolCall | str] = []
        for i, call in enumerate(calls):
            if i >= self.max_calls_per_turn:
                plan.append(f"Error: {refused_call(i, self.max_calls_per_turn)}")
            elif isinstance(call, Malformed):
                self.malformed += 1
                plan.append(f"Error: malformed action: {call.reason}")
            else:
                plan.append(call)
        return plan, max(0, len(calls) - self.max_calls_per_turn)

    def _finish(
        self, parsed: ToolCall | Parallel[ToolCall] | Answer | Malformed, outputs: list[str] | None, refused: int = 0
    ) -> StepResult:
        info: dict[str, Any] = {"turn": self.turns, "kind": type(parsed).__name__.lower()}
        if isinstance(parsed, Answer):
            self.answer, self.done = parsed.text, True
            return StepResult(None, True, info)
        if self.turns >= self.max_turns:
            self.done = True
            return StepResult(None, True, {**info, "truncated": True})
        if isinstance(parsed, Malformed):
            outputs = [f"Error: malformed action: {parsed.reason}"]
        texts = [self._clip(o) for o in outputs or [""]]
        observation = tuple(texts) if isinstance(parsed, Parallel) else texts[0]
        return StepResult(observation, False, info, refused_calls=refused)

    def _clip(self, text: str) -> str:
        if len(text) > self.max_observation_chars:
            return text[: self.max_observation_chars] + "...[truncated]"
        return text

    def step(self, action: str) -> StepResult:
        parsed = self._begin(action)
        if isinstance(parsed, Answer | Malformed) or self.turns >= self.max_turns:
            return self._finish(parsed, None)
        plan, refused = self._plan(parsed)
        self.tool_calls += sum(isinstance(p, ToolCall) for p in plan)
        outputs = [self.run_tool(p.code) if isinstance(p, ToolCall) else p for p in plan]
        return self._finish(parsed, outputs, refused)

    async def astep(self, action: str) -> StepResult:
        parsed = self._begin(action)
        if isinstance(parsed, Answer | Malformed) or self.turns >= self.max_turns:
            return self._finish(parsed, None)
        plan, refused = self._plan(parsed)
        self.tool_calls += sum(isinstance(p, ToolCall) for p in plan)

        async def output(p: ToolCall | str) -> str:
            return await self.arun_tool(p.code) if isinstance(p, ToolCall) else p

        if self.concurrent_calls:
            outputs = list(await asyncio.gather(*(output(p) for p in plan)))
        else:
            outputs = [await output(p) for p in plan]
        return self._finish(parsed, outputs, refused)

    def reward(self) -> RewardResult:
        if self.sample is None:
            raise RuntimeError("reward() called before reset()")
        correct = self.answer is not None and self.check(self.answer, self.sample)
        reward = (1.0 if correct else 0.0) - (self.format_penalty if self.malformed else 0.0)
        details = {
            "answer": self.answer,
            "target": self.sample.answer,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "malformed": self.malformed,
            "truncated": self.answer is None,
        }
        return RewardResult(reward, correct, details)
