"""The environment plugin interface: a :class:`Task` (the prompts) and an :class:`Env` (one episode).

Dataflow of one episode (the rollout worker drives it)::

    sample = task.get("train", index)        # deterministic: same (split, index) -> same sample
    env = make_env(name, **env_kwargs)       # one Env instance per episode; it holds the state
    env.use_tool_format(fmt)                 # from the tokenizer's chat template (tags / json)
    env.limit_calls_per_turn(n)              # rollout.loop.max_calls_per_turn
    question = env.reset(sample)             # prompt: the chat template with env.tools
    loop: action = model(...)                # text ending with <|end|>
          step = env.step(action)            # or `await env.astep(action)` in async workers
          if step.done: break
          append the template's rendering of step.outputs (format.ChatFormat)
    result = env.reward()                    # RewardResult(reward, correct, details)
    env.close()                              # always, even after a failure: release resources

The agent loop calls the async forms (``areset``, ``astep``, ``areward``, ``aclose``), whose
defaults run the sync ones inline; with ``rollout.env_workers`` > 0 it drives a
:class:`~sao_megatron.rollout.env_workers.RemoteEnv` that forwards them to a worker process.

Tasks index prompts by ``(split, index)`` with ``index >= 0``: a resumable cursor is just the
next index. ``train`` and ``heldout`` never share a question.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from sao_megatron.envs.format import ToolFormat, Turn

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")


@dataclass(frozen=True)
class Sample:
    """One prompt. ``prompt_id`` is unique and stable across runs; ``answer`` may be empty."""

    prompt_id: str
    question: str
    answer: str
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """What the environment returns after one action.

    ``observation`` is the tool output to append (rendered by the chat template as a ``tool``
    message), or a tuple of outputs, one per call of an action that made several (parallel
    calls; rendered as consecutive ``tool`` messages, in call order); it is None exactly when
    ``done`` (answer given, single-turn task, or turn limit reached).
    """

    observation: str | tuple[str, ...] | None
    done: bool
    info: dict[str, Any] = field(default_factory=dict)
    refused_calls: int = 0
    """Calls of this action beyond ``max_calls_per_turn``: not run, each answered by an error
    output (counted in the trajectory's :class:`~sao_megatron.records.EpisodeStats`)."""

    @property
    def outputs(self) -> tuple[str, ...]:
        """The tool outputs to render: ``()`` when done, else one per call (a single string is one)."""
        if self.observation is None:
            return ()
        return (self.observation,) if isinstance(self.observation, str) else tuple(self.observation)


@dataclass(frozen=True)
class RewardResult:
    """Episode reward. ``correct`` is None for tasks without a ground truth (e.g. preferences)."""

    reward: float
    correct: bool | None
    details: dict[str, Any] = field(default_factory=dict)


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {SPLITS}")
    return split


class Task(ABC):
    """The prompt side of an environment: deterministic ``(split, index) -> Sample``."""

    @abstractmethod
    def get(self, split: Split, index: int) -> Sample:
        """The sample at ``index`` (>= 0) of ``split``; finite tasks wrap around their size."""

    def member(self, sample: Sample, group_index: int) -> Sample:
        """The sample member ``group_index`` of a GRPO group runs; the same for all by default (a
        synthetic workload varies its members' episode shapes here)."""
        return sample

    def size(self, split: Split) -> int | None:
        """Number of distinct samples in ``split``; None when unlimited."""
        return None

    def iterate(self, split: Split, start: int = 0) -> Iterator[tuple[int, Sample]]:
        """Yield ``(index, sample)`` from ``start`` on, forever; resume with ``start=last + 1``."""
        index = start
        while True:
            yield index, self.get(split, index)
            index += 1

    def sample_prompts(self, split: Split, n: int, seed: int) -> list[Sample]:
        """``n`` samples drawn by a seeded RNG (distinct while ``n`` <= size); deterministic."""
        rng = random.Random(f"sample_prompts:{seed}")
        size = self.size(split)
        if size is None:
            indices = rng.sample(range(1 << 40), n)
        else:
            indices = []
            while len(indices) < n:
                indices += rng.sample(range(size), min(size, n - len(indices)))
        return [self.get(split, i) for i in indices]


class Env(ABC):
    """One episode of an environment. Create a fresh instance per episode.

    Subclasses set ``task_class`` (built by ``make_task``) and implement :meth:`reset`,
    :meth:`step` and :meth:`reward`. ``step`` must never raise on model output: malformed
    actions become an observation or end the episode. The agent loop calls the async forms
    (:meth:`areset`, :meth:`astep`, :meth:`areward`, :meth:`aclose`), which subclasses with slow
    tools (sandboxes, judges) override to avoid blocking the event loop. Environments holding
    resources release them in :meth:`close`.
    """

    task_class: ClassVar[type[Task]]
    max_calls_per_turn: int = 1
    """Tool calls of one action the environment runs (:meth:`limit_calls_per_turn`); environments
    that parse several calls per action answer the ones beyond it with an error output."""

    @abstractmethod
    def reset(self, sample: Sample) -> str:
        """Start the episode on ``sample``; returns the user question text."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one model action (text, with or without the trailing ``<|end|>``)."""

    async def astep(self, action: str) -> StepResult:
        """Async :meth:`step`; the default runs it inline (fine for fast, CPU-light tools)."""
        return self.step(action)

    @abstractmethod
    def reward(self) -> RewardResult:
        """The episode's reward; valid once :meth:`step` returned ``done``."""

    async def areset(self, sample: Sample) -> str:
        """Async :meth:`reset`; the default runs it inline."""
        return self.reset(sample)

    async def areward(self) -> RewardResult:
        """Async :meth:`reward`; override when grading is slow (hidden tests, a judge model)."""
        return self.reward()

    def close(self) -> None:  # noqa: B027  (an optional hook: most environments hold nothing)
        """Release the episode's resources (a workspace directory, a container); the default holds
        none. Called once when the episode ends, finished or failed; must tolerate any state."""

    async def aclose(self) -> None:
        """Async :meth:`close`; the default runs it inline."""
        self.close()

    @property
    def tools(self) -> list[dict]:
        """The environment's tools as OpenAI-style JSON schemas (``apply_chat_template(tools=)``)."""
        return []

    @property
    def system_prompt(self) -> str | None:
        """A system message for the chat template, or None (the tiny template has no system role)."""
        return None

    def use_tool_format(self, tool_format: ToolFormat) -> None:
        """Called before :meth:`reset` with the run's format (from the tokenizer's template).

        Environments without tools ignore it; tool environments parse and demonstrate in it.
        """
        if tool_format not in ("tags", "json"):
            raise ValueError(f"unknown tool format {tool_format!r}: use 'tags' or 'json'")

    def limit_calls_per_turn(self, max_calls: int) -> None:
        """Called before :meth:`reset` with ``rollout.loop.max_calls_per_turn``; environments
        with one call per action (or none) can ignore it."""
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"max_calls_per_turn must be an integer >= 1, got {max_calls!r}")
        self.max_calls_per_turn = max_calls

    def demonstration(self, sample: Sample) -> list[Turn]:
        """An expert trajectory for SFT (actions end with ``<|end|>``); optional."""
        raise NotImplementedError(f"{type(self).__name__} provides no demonstrations")
