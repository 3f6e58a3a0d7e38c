"""Records that cross a stage boundary (rollout -> buffer -> learner). Typed, required fields.

Units: token counts are tokens; times are seconds on ``time.time()`` (wall clock, comparable
across processes on one machine); logprobs are natural-log probabilities.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["finished", "truncated", "failed"]

OBSERVATION_VERSION = -1
"""``policy_versions`` entry of tokens the model did not generate (prompt, observations)."""


@dataclass(frozen=True)
class Turn:
    """One action span of the response: ``response_ids[start:end]`` are model-generated."""

    start: int
    end: int


EndCause = Literal["done", "env_max_turns", "max_turns", "context", "response", "observation_budget", "failed"]
"""Why an agent-loop episode ended (:attr:`EpisodeStats.end`):

* ``done``: the environment ended it (an answer, ``finish``, a single-turn task);
* ``env_max_turns``: the environment's own turn limit (``info["truncated"]``; status ``finished``);
* ``max_turns``: ``rollout.loop.max_turns`` actions (the last one possibly cut at ``max_new_tokens``);
* ``context``: no room for another action in ``rollout.loop.max_context_tokens`` (or an
  observation that would fill it);
* ``response``: the same for ``rollout.loop.max_response_tokens``;
* ``observation_budget``: the next observation would pass
  ``rollout.loop.max_observation_tokens_per_episode``;
* ``failed``: status ``failed`` (the reason is ``status_reason``).
"""


@dataclass(frozen=True)
class EpisodeStats:
    """What the agent loop counted in one episode beyond its token arrays (which give the context
    accounting: :attr:`Trajectory.num_prompt_tokens`, ``num_action_tokens``,
    ``num_observation_tokens``). ``end`` is None for trajectories the loop did not run
    (demonstrations, episodes failed before reaching an engine)."""

    end: EndCause | None = None
    tool_outputs: int = 0
    """Tool outputs rendered into observations (one per call answered, error outputs included)."""
    parallel_turns: int = 0
    """Actions answered by two or more outputs (parallel calls)."""
    refused_calls: int = 0
    """Calls beyond ``rollout.loop.max_calls_per_turn``: not run, answered by an error output."""
    clipped_outputs: int = 0
    """Tool outputs cut to ``rollout.loop.max_output_tokens_per_call``."""
    clipped_tokens: int = 0
    """Tokens those cuts removed (counted by the tokenizer on the output text alone)."""


@dataclass
class Trajectory:
    """One finished episode: the prompt, the interleaved response and everything the loss needs.

    ``response_ids``, ``action_mask``, ``behavior_logprobs`` and ``policy_versions`` all have
    one entry per response token. ``action_mask`` is 1 on model-generated tokens (actions,
    including their stop token) and 0 on observation tokens written by tools or the
    environment; ``behavior_logprobs`` is the engine's logprob of each action token when it
    was sampled (0.0 on observations); ``policy_versions`` is the weight version that
    generated each action token (``OBSERVATION_VERSION`` on observations), so one action that
    spans a weight update carries both versions.
    """

    prompt_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    action_mask: list[int]
    behavior_logprobs: list[float]
    policy_versions: list[int]
    turns: list[Turn]
    reward: float
    status: Status
    status_reason: str = ""
    correct: bool | None = None
    reward_details: dict[str, Any] = field(default_factory=dict)
    split: str = "train"
    sample_index: int | None = None
    """The task index of the prompt (the dataset cursor position it came from)."""
    group_id: str = ""
    """Prompts sampled G times share a group id (GRPO); empty for single rollouts (SAO)."""
    submitted_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    engine: str = ""
    stats: EpisodeStats = field(default_factory=EpisodeStats)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        for name in ("action_mask", "behavior_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory {self.prompt_id}: {name} has {len(getattr(self, name))} "
                    f"entries for {n} response tokens"
                )

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_observation_tokens(self) -> int:
        """Response tokens the model did not generate (tool outputs and the template around them)."""
        return len(self.response_ids) - self.num_action_tokens

    @property
    def num_context_tokens(self) -> int:
        """Prompt plus response: the context the episode ended with."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def action_versions(self) -> list[int]:
        """The policy version of each action token, in order."""
        return [v for v, m in zip(self.policy_versions, self.action_mask, strict=True) if m]

    @property
    def min_version(self) -> int:
        return min(self.action_versions, default=OBSERVATION_VERSION)

    @property
    def max_version(self) -> int:
        return max(self.policy_versions, default=OBSERVATION_VERSION)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        data = dict(data)
        data["turns"] = [Turn(**t) if isinstance(t, dict) else Turn(*t) for t in data["turns"]]
        if isinstance(data.get("stats"), dict):
            data["stats"] = EpisodeStats(**data["stats"])
        return cls(**data)
