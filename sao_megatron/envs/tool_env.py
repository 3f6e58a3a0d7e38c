"""Shared multi-turn protocol of the tool-using environments (arith_tool, math_python).

Each action is parsed by :func:`sao_megatron.envs.tool_parse.parse_action`:

* ``<tool>code</tool>`` -> the subclass runs the tool; its output is the observation;
* ``<answer>text</answer>`` -> the episode ends and the answer is graded;
* anything else -> observation ``Error: malformed action: <reason>`` (counted; optional penalty).

After ``max_turns`` actions without an answer the episode ends (``info["truncated"] = True``,
reward 0). Reward = 1.0 for a correct answer, else 0.0, minus ``format_penalty`` if any action
was malformed.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.envs.tool_parse import Answer, Malformed, ToolCall, parse_action


class ToolEnv(Env):
    """Base for tool + answer episodes; subclasses implement :meth:`run_tool` and :meth:`check`."""

    def __init__(
        self, max_turns: int = 4, format_penalty: float = 0.0, max_observation_chars: int = 512
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.format_penalty = format_penalty
        self.max_observation_chars = max_observation_chars
        self.sample: Sample | None = None
        self.turns = 0
        self.tool_calls = 0
        self.malformed = 0
        self.answer: str | None = None
        self.done = False

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

    def _begin(self, action: str) -> ToolCall | Answer | Malformed:
        if self.sample is None or self.done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        self.turns += 1
        parsed = parse_action(action)
        if isinstance(parsed, Malformed):
            self.malformed += 1
        return parsed

    def _finish(self, parsed: ToolCall | Answer | Malformed, output: str | None) -> StepResult:
        info: dict[str, Any] = {"turn": self.turns, "kind": type(parsed).__name__.lower()}
        if isinstance(parsed, Answer):
            self.answer, self.done = parsed.text, True
            return StepResult(None, True, info)
        if self.turns >= self.max_turns:
            self.done = True
            return StepResult(None, True, {**info, "truncated": True})
        if isinstance(parsed, Malformed):
            output = f"Error: malformed action: {parsed.reason}"
        text = output or ""
        if len(text) > self.max_observation_chars:
            text = text[: self.max_observation_chars] + "...[truncated]"
        return StepResult(text, False, info)

    def step(self, action: str) -> StepResult:
        parsed = self._begin(action)
        output = None
        if isinstance(parsed, ToolCall) and self.turns < self.max_turns:
            self.tool_calls += 1
            output = self.run_tool(parsed.code)
        return self._finish(parsed, output)

    async def astep(self, action: str) -> StepResult:
        parsed = self._begin(action)
        output = None
        if isinstance(parsed, ToolCall) and self.turns < self.max_turns:
            self.tool_calls += 1
            output = await self.arun_tool(parsed.code)
        return self._finish(parsed, output)

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
