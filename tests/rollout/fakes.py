"""Fakes for async plumbing tests: an agent loop with scripted durations, a trivial task, an
environment that sleeps (env worker tests load it in the workers as ``tests.rollout.fakes:SleepyEnv``)."""

from __future__ import annotations

import asyncio
import os
import time

from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult, Task
from sao_megatron.records import Status, Trajectory, Turn


class CountingTask(Task):
    def get(self, split, index):
        return Sample(prompt_id=f"{split}-{index}", question=f"q{index}", answer=str(index))


def make_trajectory(
    prompt_id: str, index: int, version: int = 0, status: Status = "finished", finished_at: float | None = None
) -> Trajectory:
    return Trajectory(
        prompt_id=prompt_id,
        prompt_ids=[2, 3],
        response_ids=[7, 8, 9],
        action_mask=[1, 1, 0],
        behavior_logprobs=[-0.1, -0.2, 0.0],
        policy_versions=[version, version, -1],
        turns=[Turn(0, 2)],
        reward=1.0,
        status=status,
        status_reason="" if status != "failed" else "engine: boom",
        sample_index=index,
        finished_at=time.time() if finished_at is None else finished_at,
    )


class FakeLoop:
    """Episode i of prompt index k lasts ``durations(k, call)`` seconds."""

    def __init__(self, durations, name="fake"):
        self.durations = durations
        self.engine_name = name
        self.calls = 0
        self.running = 0
        self.max_running = 0

    async def run(self, env, sample, split="train", index=-1, submitted_at=None):
        self.calls += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.durations(index, self.calls))
        finally:
            self.running -= 1
        return make_trajectory(sample.prompt_id, index)


class ScriptedClient:
    """An engine client stub for the agent loop: answers call k with ``actions[k]`` (token ids).

    Records every prompt it was sent in ``inputs``; behavior logprobs are -0.5, versions "3".
    ``finish_reasons[k]`` (default ``stop``) is reported for call k.
    """

    def __init__(self, actions, finish_reasons=None, url="scripted"):
        self.actions = [list(a) for a in actions]
        self.finish_reasons = list(finish_reasons or [])
        self.url = url
        self.inputs: list[list[int]] = []
        self.sampling: list = []

    async def generate(self, input_ids, sampling, rid=None, timeout_s=None):
        from sao_megatron.rollout.client import Generation

        k = len(self.inputs)
        self.inputs.append(list(input_ids))
        self.sampling.append(sampling)
        ids = self.actions[k][: sampling.max_new_tokens]
        reason = self.finish_reasons[k] if k < len(self.finish_reasons) else "stop"
        return Generation(
            output_ids=ids,
            behavior_logprobs=[-0.5] * len(ids),
            weight_versions=["3"] * len(ids),
            finish_reason=reason,
            prompt_tokens=len(input_ids),
            latency_s=0.0,
        )


class SleepyEnv(Env):
    """One step that sleeps ``delay_s`` and ends the episode. Counts the SleepyEnvs of this process
    open at once (built, not yet closed); the reward reports the most so far and the pid."""

    task_class = CountingTask
    open_now = 0
    max_open = 0

    def __init__(self, delay_s: float = 0.2):
        self.delay_s = delay_s
        SleepyEnv.open_now += 1
        SleepyEnv.max_open = max(SleepyEnv.max_open, SleepyEnv.open_now)

    def reset(self, sample: Sample) -> str:
        return sample.question

    def step(self, action: str) -> StepResult:
        return StepResult(None, True)

    async def astep(self, action: str) -> StepResult:
        await asyncio.sleep(self.delay_s)
        return self.step(action)

    def reward(self) -> RewardResult:
        return RewardResult(1.0, True, {"max_open": SleepyEnv.max_open, "pid": os.getpid()})

    def close(self) -> None:
        SleepyEnv.open_now -= 1
