"""``rollout.episode_retry_from``: an engine that fails mid-episode; the episode resumes at the
failed turn on another engine (``turn``: same environment, tokens so far kept) or starts over
(``scratch``: a fresh environment)."""

from __future__ import annotations

import asyncio

import pytest

from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import EngineError
from sao_megatron.rollout.env_workers import local_env_factory
from sao_megatron.rollout.manager import EngineStates, RolloutManager
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.fakes import CountingTask
from tests.rollout.test_env_workers import CFG, ArithClient


class DyingClient(ArithClient):
    """Answers like :class:`ArithClient` until its ``die_at``-th generate call, which fails the
    way a killed server does (and so does every later one)."""

    url = "dying"

    def __init__(self, tokenizer, die_at: int):
        super().__init__(tokenizer)
        self.calls, self.die_at = 0, die_at

    async def generate(self, input_ids, sampling, rid=None, timeout_s=None):
        self.calls += 1
        if self.calls >= self.die_at:
            raise EngineError("/generate", "ClientConnectorError: connection refused")
        return await super().generate(input_ids, sampling, rid, timeout_s)


def run(retry_from: str, max_retries: int = 2):
    tokenizer = load_tokenizer()
    dying, healthy = DyingClient(tokenizer, die_at=2), ArithClient(tokenizer)
    loops = [
        AgentLoop(dying, tokenizer, CFG, engine_name="engine0"),  # type: ignore[arg-type]
        AgentLoop(healthy, tokenizer, CFG, engine_name="engine1"),
    ]  # type: ignore[arg-type]
    made = []
    factory = local_env_factory("arith_tool", {"max_turns": 4})

    async def counting():
        env = await factory()
        made.append(env)
        return env

    states = EngineStates(2, on_failure=lambda i, reason: states.mark_down(i))  # as the session's watchdog would
    got = []
    manager = RolloutManager(
        loops,
        CountingTask(),
        "arith_tool",
        got.append,
        max_concurrent=1,
        env_factory=counting,
        engines=states,
        episode_max_retries=max_retries,
        retry_from=retry_from,
    )
    asyncio.run(manager.run(asyncio.Event(), max_prompts=1))
    return got, made, states, dying


def test_turn_mode_resumes_the_failed_turn_on_another_engine():
    (traj,), made, states, dying = run("turn")
    assert len(made) == 1, "the environment was rebuilt: the episode started over"
    assert traj.status == "finished" and traj.engine == "engine1", (traj.status, traj.status_reason)
    assert len(traj.turns) == 2 and dying.calls == 2  # turn 1 on engine0 (the tool call), turn 2 on engine1
    assert made[0].tool_calls == 1 and traj.reward_details["turns"] == 2
    assert states.episode_retries == 1


def test_scratch_mode_starts_the_episode_over_with_a_fresh_environment():
    (traj,), made, states, _ = run("scratch")
    assert len(made) == 2 and traj.status == "finished" and traj.engine == "engine1"
    assert len(traj.turns) == 2 and states.episode_retries == 1


def test_turn_mode_gives_up_when_the_budget_is_spent():
    (traj,), made, states, _ = run("turn", max_retries=0)
    assert traj.status == "failed" and traj.status_reason.startswith("engine: /generate"), traj.status_reason
    assert len(made) == 1 and states.episode_retries == 0


def test_an_unknown_retry_mode_is_refused():
    with pytest.raises(ValueError, match="use 'scratch' or 'turn'"):
        RolloutManager(
            [AgentLoop(ArithClient(None), None, CFG)],
            CountingTask(),
            "arith_tool",
            print,  # type: ignore[arg-type]
            retry_from="resume",
        )
