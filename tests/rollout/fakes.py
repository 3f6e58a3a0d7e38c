"""Fakes for async plumbing tests: an agent loop with scripted durations, a trivial task."""

from __future__ import annotations

import asyncio
import time

from sao_megatron.envs.base import Sample, Task
from sao_megatron.records import Trajectory, Turn


class CountingTask(Task):
    def get(self, split, index):
        return Sample(prompt_id=f"{split}-{index}", question=f"q{index}", answer=str(index))


def make_trajectory(prompt_id: str, index: int, version: int = 0, status: str = "finished",
                    finished_at: float | None = None) -> Trajectory:  # fmt: skip
    return Trajectory(
        prompt_id=prompt_id, prompt_ids=[2, 3], response_ids=[7, 8, 9], action_mask=[1, 1, 0],
        behavior_logprobs=[-0.1, -0.2, 0.0], policy_versions=[version, version, -1], turns=[Turn(0, 2)],
        reward=1.0, status=status, status_reason="" if status != "failed" else "engine: boom",
        sample_index=index, finished_at=time.time() if finished_at is None else finished_at,
    )  # fmt: skip


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
