"""longtail: a synthetic workload with heavy-tailed episodes, for throughput benchmarks.

Nothing is learned here: every episode's shape is drawn from its prompt, and the model's text is
ignored. Sample ``index`` of a seed fixes::

    turns        1 + round(LogNormal(ln(turns_median - 1), turns_sigma)), clipped to max_turns
    tokens[j]    round(LogNormal(ln(tokens_median), tokens_sigma)), clipped to [1, max_tokens]
                 the action length of turn j, generated exactly (``meta["action_tokens"]``: the
                 agent loop then sets ``min_new_tokens`` = ``max_new_tokens``; the stop tokens
                 are masked until then, so an action never contains the end marker)
    latency[j]   LogNormal(ln(tool_latency_s), tool_sigma) seconds, clipped to max_tool_latency_s:
                 the tool call after turn j (an ``await``: it never holds the event loop)

Each member of a GRPO group draws its own shape (:meth:`LongTailTask.member`; member 0's is the
sample's). The episode ends after its last action; each tool call answers with a short fixed observation.
The reward is a fair coin of ``seed``, the prompt id and the actions' text (so GRPO groups have
variance; nothing else depends on the model). ``sigma`` 0 gives
identical episodes; larger sigmas give the heavy tail asynchronous training exists for.

Use: ``rollout.env=longtail rollout.task_kwargs={turns_median: 3, turns_sigma: 1.0, tokens_median: 24,
tool_latency_s: 0.5, ...}``; ``rollout.env_kwargs={seed: 0}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random

from sao_megatron.envs.base import Env, RewardResult, Sample, Split, StepResult, Task, check_split
from sao_megatron.envs.registry import register_env

OBSERVATION = "ok"


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0)) if sigma > 0 else median


class LongTailTask(Task):
    """Episode shapes by ``(split, index)``; see the module docstring for the distributions."""

    def __init__(
        self,
        turns_median: float = 2.0,
        turns_sigma: float = 0.0,
        max_turns: int = 8,
        tokens_median: float = 16.0,
        tokens_sigma: float = 0.0,
        max_tokens: int = 256,
        tool_latency_s: float = 0.0,
        tool_sigma: float = 0.0,
        max_tool_latency_s: float = 30.0,
        seed: int = 0,
    ) -> None:
        if not 1 <= turns_median <= max_turns:
            raise ValueError(f"longtail: need 1 <= turns_median <= max_turns, got {turns_median}, {max_turns}")
        if not 1 <= tokens_median <= max_tokens:
            raise ValueError(f"longtail: need 1 <= tokens_median <= max_tokens, got {tokens_median}, {max_tokens}")
        if min(turns_sigma, tokens_sigma, tool_sigma, tool_latency_s) < 0 or max_tool_latency_s < tool_latency_s:
            raise ValueError("longtail: sigmas and tool_latency_s must be >= 0, max_tool_latency_s >= tool_latency_s")
        self.turns_median, self.turns_sigma, self.max_turns = turns_median, turns_sigma, max_turns
        self.tokens_median, self.tokens_sigma, self.max_tokens = tokens_median, tokens_sigma, max_tokens
        self.tool_latency_s, self.tool_sigma, self.max_tool_latency_s = (
            tool_latency_s,
            tool_sigma,
            max_tool_latency_s,
        )
        self.seed = seed

    def get(self, split: Split, index: int) -> Sample:
        split = check_split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        return self._draw(split, index, 0)

    def member(self, sample: Sample, group_index: int) -> Sample:
        """Member ``group_index`` of a GRPO group: its own draw (members are independent)."""
        split, index = sample.meta["split"], sample.meta["index"]
        return self._draw(split, index, group_index)

    def shape(self, index: int, member: int = 0) -> tuple[list[int], list[float]]:
        """(action tokens per turn, tool latency after each turn but the last) of training prompt
        ``index``'s group member ``member``: the episode shape the simulator takes."""
        meta = self._draw("train", index, member).meta
        return meta["action_tokens"], meta["tool_latency_s"]

    def _draw(self, split: Split, index: int, member: int) -> Sample:
        rng = random.Random(f"longtail:{self.seed}:{split}:{index}" + (f":{member}" if member else ""))
        extra = 0 if self.turns_median <= 1 else _lognormal(rng, self.turns_median - 1, self.turns_sigma)
        turns = min(self.max_turns, 1 + round(extra))
        tokens = [
            min(self.max_tokens, max(1, round(_lognormal(rng, self.tokens_median, self.tokens_sigma))))
            for _ in range(turns)
        ]
        latency = [
            min(self.max_tool_latency_s, _lognormal(rng, self.tool_latency_s, self.tool_sigma))
            for _ in range(turns - 1)
        ]
        prompt_id = f"longtail:{self.seed}:{split}:{index}"
        return Sample(
            prompt_id=prompt_id,
            question=f"Episode {index}: {turns} turns.",
            answer="",
            meta={"action_tokens": tokens, "tool_latency_s": latency, "split": split, "index": index},
        )


@register_env("longtail")
class LongTailEnv(Env):
    """Runs the episode shape its sample fixes; the reward is a coin of the prompt and actions."""

    task_class = LongTailTask

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.sample: Sample | None = None
        self.turn = 0
        self.actions = hashlib.sha256()

    def reset(self, sample: Sample) -> str:
        if "action_tokens" not in sample.meta:
            raise ValueError(f"longtail: sample {sample.prompt_id} has no meta['action_tokens'] (not a longtail task)")
        self.sample, self.turn = sample, 0
        return sample.question

    def _advance(self) -> tuple[StepResult, float]:
        assert self.sample is not None, "longtail: step before reset"
        self.turn += 1
        if self.turn >= len(self.sample.meta["action_tokens"]):
            return StepResult(None, True), 0.0
        return StepResult(OBSERVATION, False), float(self.sample.meta["tool_latency_s"][self.turn - 1])

    def step(self, action: str) -> StepResult:
        self.actions.update(action.encode())
        return self._advance()[0]

    async def astep(self, action: str) -> StepResult:
        self.actions.update(action.encode())
        result, latency = self._advance()
        if latency > 0:
            await asyncio.sleep(latency)
        return result

    def reward(self) -> RewardResult:
        assert self.sample is not None, "longtail: reward before reset"
        coin = (
            hashlib.sha256(
                f"longtail:{self.seed}:{self.sample.prompt_id}:{self.actions.hexdigest()}".encode()
            ).digest()[0]
            & 1
        )
        return RewardResult(float(coin), bool(coin), {"turns": self.turn})
