"""Hanging tools, raising environments and NaN rewards at set rates: the run completes, every
prompt is accounted for once, and the failure counts by cause equal the injected faults exactly.

The faults come from ``sao_megatron.envs.faulty`` (deterministic per prompt id), so the expected
counts are recomputed here with :func:`injected_fault`: the real manager and agent loop with a
scripted engine. The real pipeline (CPU SGLang engine, Megatron actor and critic) on injected
faults is the first stage of the shared session in ``tests/test_pipeline.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import ray

from sao_megatron.buffer import ReadyBuffer
from sao_megatron.config import AgentLoopConfig, ConfigError, load_config
from sao_megatron.driver.observer import buffer_metrics
from sao_megatron.envs import make_env, make_task
from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.envs.faulty import CAUSE, injected_fault
from sao_megatron.records import Trajectory
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.env_workers import EnvFactory
from sao_megatron.rollout.manager import RolloutManager
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.fakes import CountingTask
from tests.rollout.test_env_workers import ArithClient

RATES = {"hang_rate": 0.1, "raise_rate": 0.1, "reward_raise_rate": 0.1, "nan_rate": 0.1}
TIMEOUT_S = 0.5
TIMED_OUT = f"timed out after {TIMEOUT_S:g}s (rollout.loop.env_step_timeout_s)"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def loop_config(timeout_s: float = TIMEOUT_S) -> AgentLoopConfig:
    return AgentLoopConfig(
        max_turns=4, max_new_tokens=64, max_response_tokens=1024, max_context_tokens=2048, env_step_timeout_s=timeout_s
    )


def expected_reason(fault: str) -> str:
    return {
        "hang": f"environment: tool {TIMED_OUT}",
        "nan": "reward: non-finite reward nan",
        "raise_reset": "environment: InjectedFault: injected fault in reset of ",
        "raise_step": "environment: InjectedFault: injected fault in the tool call of ",
        "reward_raise": "reward: InjectedFault: injected fault in the reward of ",
    }[fault]


def test_injected_faults_are_deterministic_and_at_the_set_rates():
    ids = [f"arith_tool:0:train:{i}" for i in range(4000)]
    faults = [injected_fault(p, 0, RATES) for p in ids]
    assert faults == [injected_fault(p, 0, RATES) for p in ids]
    share = Counter(CAUSE[f] if f else None for f in faults)
    assert abs(share["environment"] / 4000 - 0.2) < 0.03 and abs(share["reward"] / 4000 - 0.2) < 0.03, share
    assert {f for f in faults} == {None, "hang", "raise_reset", "raise_step", "reward_raise", "nan"}
    assert faults != [injected_fault(p, 1, RATES) for p in ids]  # the seed matters
    assert all(injected_fault(p, 0, {}) is None for p in ids[:100])
    with pytest.raises(ValueError, match="sum to at most 1"):
        injected_fault("x", 0, {"hang_rate": 0.6, "nan_rate": 0.6})


def run_faulty(tokenizer, factory: EnvFactory, prompts: int) -> tuple[list[Trajectory], ReadyBuffer, RolloutManager]:
    """``prompts`` episodes of ``faulty`` through the real manager and agent loop (scripted engine);
    every trajectory handed on is kept and admitted to a ready buffer that never fills."""

    async def go() -> tuple[list[Trajectory], ReadyBuffer, RolloutManager]:
        got: list[Trajectory] = []
        buffer = ReadyBuffer(batch_size=prompts)

        def finished(t: Trajectory) -> None:
            got.append(t)
            buffer.admit(t, 1)

        loops = [AgentLoop(ArithClient(tokenizer, skew=False), tokenizer, loop_config())]  # type: ignore[arg-type]
        manager = RolloutManager(loops, make_task("faulty"), "faulty", finished, max_concurrent=16, env_factory=factory)
        await asyncio.wait_for(manager.run(asyncio.Event(), max_prompts=prompts), 60)
        return got, buffer, manager

    return asyncio.run(go())


def check_faults(
    got: list[Trajectory], buffer: ReadyBuffer, manager: RolloutManager, prompts: int, seed: int
) -> tuple[Counter, Counter]:
    """Every prompt came back once; exactly the injected faults failed, each with its cause, and
    the manager, buffer and step metrics count them. Returns the faults by kind and by cause."""
    assert sorted(-1 if t.sample_index is None else t.sample_index for t in got) == list(range(prompts)), (
        "a prompt was lost or ran twice"
    )
    assert manager.stats.submitted == manager.stats.finished == prompts and manager.in_flight == 0
    injected = {t.sample_index: injected_fault(t.prompt_id, seed, RATES) for t in got}
    for t in got:
        fault = injected[t.sample_index]
        if fault is None:
            assert t.status == "finished" and t.correct and t.reward == 1.0, (t.prompt_id, t.status_reason)
        else:
            assert t.status == "failed" and t.reward == 0.0, (t.prompt_id, fault, t.status)
            assert t.status_reason.startswith(expected_reason(fault)), (fault, t.status_reason)
    want = Counter(CAUSE[f] for f in injected.values() if f)
    kinds = Counter(f for f in injected.values() if f)
    assert set(kinds) == {"hang", "raise_reset", "raise_step", "reward_raise", "nan"}, kinds
    assert Counter(t.status_reason.split(":")[0] for t in got if t.status == "failed") == want
    assert buffer.stats.dropped_failed == want and buffer.stats.admitted == prompts - sum(want.values())
    metrics = buffer_metrics(buffer)
    assert metrics["buffer/dropped_failed/environment"] == want["environment"]
    assert metrics["buffer/dropped_failed/reward"] == want["reward"]
    assert manager.stats.failed == sum(want.values())
    return kinds, want


def test_manager_survives_injected_faults_and_counts_each_exactly(tokenizer):
    """60 prompts, ~10% of each fault, 0.5 s step limit: all 60 come back once, every injected fault
    is a failed episode with its cause, nothing else fails, and every environment is closed."""
    prompts, seed = 60, 21  # a seed under which each kind of fault occurs 5 or 6 times in 60 prompts
    env_kwargs = {**RATES, "seed": seed, "max_turns": 3}
    made: list[Env] = []
    closed: list[Env] = []

    async def factory() -> Env:
        env = make_env("faulty", **env_kwargs)
        made.append(env)
        aclose = env.aclose

        async def counted_close() -> None:
            closed.append(env)
            await aclose()

        env.aclose = counted_close  # type: ignore[method-assign]
        return env

    t0 = time.monotonic()
    got, buffer, manager = run_faulty(tokenizer, factory, prompts)
    elapsed = time.monotonic() - t0
    kinds, want = check_faults(got, buffer, manager, prompts, seed)
    assert len(made) == len(closed) == prompts and {id(e) for e in closed} == {id(e) for e in made}, (
        "an environment was not closed (once)"
    )
    assert elapsed < 3 * TIMEOUT_S + 10, elapsed  # hung tools cost one time limit each, concurrently
    print(
        f"\nfaults injected {dict(kinds)} -> by cause {dict(want)}; survived {len(got) - sum(want.values())}/"
        f"{prompts}; lost 0; {elapsed:.1f}s"
    )


def test_faults_on_env_workers_are_contained_and_the_workers_slots_freed(tokenizer):
    """The same on an env worker (a Ray actor loading ``faulty`` by its dotted path): the driver's
    limit ends a tool hanging in the worker, the worker's exceptions come back as the episodes'
    failures, every timed-out call is cancelled in the worker too, and every slot is free again."""
    from sao_megatron.driver.env_pool import EnvWorkerPool
    from sao_megatron.driver.roles import init_ray

    prompts, seed = 30, 42  # each kind of fault occurs among the first 10 prompts
    started_here = not ray.is_initialized()
    init_ray(num_cpus=2)
    pool = asyncio.run(EnvWorkerPool.start(1, episodes_per_worker=4, cpus=0.5, timeout_s=60))
    try:
        factory = pool.factory("sao_megatron.envs.faulty:FaultyArithEnv", {**RATES, "seed": seed}, "tags")
        got, buffer, manager = run_faulty(tokenizer, factory, prompts)
        kinds, _ = check_faults(got, buffer, manager, prompts, seed)
        deadline = time.monotonic() + 10
        while (info := asyncio.run(pool.info())[0])["running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert info["running"] == 0, f"{info['running']} timed-out calls still run in the worker"
        assert info["open"] == 0 and info["calls"]["open"] == info["calls"]["close"] == prompts, info
        assert info["max_open"] == 4
        assert all(t.reward_details["env_calls"][0][1] == info["pid"] for t in got if t.status != "failed")
    finally:
        pool.shutdown()
        if started_here:
            ray.shutdown()


class SlowEnv(Env):
    """One step; ``where`` (reset, step, reward or close) sleeps ``delay_s``, by ``await`` or by
    blocking the thread (``blocking``); ``own_timeout`` makes the step raise its own TimeoutError."""

    task_class = CountingTask

    def __init__(self, where: str = "", delay_s: float = 10.0, blocking: bool = False, own_timeout: bool = False):
        self.where, self.delay_s, self.blocking, self.own_timeout = where, delay_s, blocking, own_timeout
        self.closed = False

    async def _maybe_sleep(self, where: str) -> None:
        if where == self.where:
            if self.blocking:
                time.sleep(self.delay_s)
            else:
                await asyncio.sleep(self.delay_s)

    def reset(self, sample: Sample) -> str:
        return sample.question

    def step(self, action: str) -> StepResult:
        return StepResult(None, True)

    def reward(self) -> RewardResult:
        return RewardResult(1.0, True)

    async def areset(self, sample: Sample) -> str:
        await self._maybe_sleep("reset")
        return self.reset(sample)

    async def astep(self, action: str) -> StepResult:
        await self._maybe_sleep("step")
        if self.own_timeout:
            raise TimeoutError("the sandbox's own 3 s limit")
        return self.step(action)

    async def areward(self) -> RewardResult:
        await self._maybe_sleep("reward")
        return self.reward()

    async def aclose(self) -> None:
        await self._maybe_sleep("close")
        self.closed = True


def run_one(tokenizer, env: SlowEnv, timeout_s: float) -> tuple[Trajectory, float]:
    loop = AgentLoop(ArithClient(tokenizer, skew=False), tokenizer, loop_config(timeout_s))  # type: ignore[arg-type]
    t0 = time.monotonic()
    traj = asyncio.run(loop.run(env, CountingTask().get("train", 0)))
    return traj, time.monotonic() - t0


@pytest.mark.parametrize(
    ("where", "reason"), [("reset", "environment: reset"), ("step", "environment: tool"), ("reward", "reward:")]
)
def test_each_environment_call_is_bounded_and_the_env_still_closed(tokenizer, where, reason):
    env = SlowEnv(where, delay_s=30.0)
    traj, elapsed = run_one(tokenizer, env, timeout_s=0.2)
    assert traj.status == "failed", traj.status_reason
    assert traj.status_reason == f"{reason} timed out after 0.2s (rollout.loop.env_step_timeout_s)"
    assert env.closed and elapsed < 15, elapsed  # far below the 30-s hang, on a loaded machine


def test_a_hanging_close_is_bounded_and_does_not_fail_the_episode(tokenizer):
    traj, elapsed = run_one(tokenizer, SlowEnv("close", delay_s=30.0), timeout_s=0.2)
    assert traj.status == "finished" and elapsed < 15, (traj.status_reason, elapsed)


def test_the_environments_own_timeout_error_is_its_failure_not_the_limit(tokenizer):
    traj, _ = run_one(tokenizer, SlowEnv(own_timeout=True), timeout_s=5.0)
    assert traj.status_reason == "environment: TimeoutError: the sandbox's own 3 s limit"


def test_a_step_that_blocks_the_event_loop_cannot_be_timed_out(tokenizer):
    """The documented limit: a sync (blocking) tool holds the event loop; the time limit cannot
    interrupt it, and the episode ends only when the call returns (here even as finished)."""
    traj, elapsed = run_one(tokenizer, SlowEnv("step", delay_s=1.0, blocking=True), timeout_s=0.1)
    assert elapsed >= 1.0, elapsed
    assert traj.status == "finished", traj.status_reason


def test_env_step_timeout_is_validated():
    assert load_config(None, ["rollout.loop.env_step_timeout_s=2.5"]).rollout.loop.env_step_timeout_s == 2.5
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=r"rollout\.loop\.env_step_timeout_s"):
            load_config(None, [f"rollout.loop.env_step_timeout_s={bad}"])
