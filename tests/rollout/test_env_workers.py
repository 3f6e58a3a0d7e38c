"""Environments on env workers (Ray actors), not the driver: same episodes as in the driver, every
call in a worker, the per-worker episode bound, a killed worker fails only its episodes, config."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import time

import pytest
import ray

from sao_megatron.config import AgentLoopConfig, ConfigError, load_config
from sao_megatron.config.agent import GatewayConfig, OpenAIAgentConfig
from sao_megatron.driver.env_pool import EnvWorkerPool
from sao_megatron.driver.roles import init_ray
from sao_megatron.driver.session import Session
from sao_megatron.envs import make_task
from sao_megatron.envs.agent_sandbox import GatewayEndpoint
from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.envs.openai_agent import AgentError
from sao_megatron.envs.safe_eval import calculator
from sao_megatron.envs.sandbox import detect_isolation
from sao_megatron.records import Trajectory
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import Generation
from sao_megatron.rollout.env_workers import EnvFactory, EnvWorker, RemoteEnv, local_env_factory
from sao_megatron.rollout.gateway import Gateway
from sao_megatron.rollout.manager import EngineStates, RolloutManager
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.fakes import CountingTask
from tests.rollout.gateway_fakes import SAMPLE, scripted_loop

CFG = AgentLoopConfig(max_turns=4, max_new_tokens=64, max_response_tokens=1024, max_context_tokens=2048)
SLEEPY = "tests.rollout.fakes:SleepyEnv"
SAME = (
    "prompt_ids",
    "response_ids",
    "action_mask",
    "behavior_logprobs",
    "policy_versions",
    "turns",
    "reward",
    "correct",
)


class ArithClient:
    """An engine stub for arith_tool whose answer depends only on the context, so episodes come out
    the same under any interleaving: a calculator call, then the result as the answer (off by one
    when the expression's length is odd, so rewards differ)."""

    url = "arith"

    def __init__(self, tokenizer, skew: bool = True):
        self.tokenizer, self.skew = tokenizer, skew  # skew=False: always the right answer

    async def generate(self, input_ids, sampling, rid=None, timeout_s=None) -> Generation:
        await asyncio.sleep(0.01)
        text = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        match = re.search(r"What is (.+?)\?", text)
        expr = match.group(1) if match else "1"
        if "<tool>" not in text:
            action = f"<tool>{expr}</tool><|end|>"
        else:
            value = int(calculator(expr)) + (len(expr) % 2 if self.skew else 0)
            action = f"<answer>{value}</answer><|end|>"
        ids = self.tokenizer.encode(action, add_special_tokens=False)[: sampling.max_new_tokens]
        return Generation(
            output_ids=ids,
            behavior_logprobs=[-0.5] * len(ids),
            weight_versions=["1"] * len(ids),
            finish_reason="stop",
            prompt_tokens=len(input_ids),
            latency_s=0.0,
        )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray whose node belongs to the rollout group (advertises ``sao_rollout``)."""
    started_here = not ray.is_initialized()
    init_ray(num_cpus=2, resources={"sao_rollout": 1.0})
    yield "rollout" if "sao_rollout" in ray.cluster_resources() else None
    if started_here:
        ray.shutdown()


@pytest.fixture(scope="module")
def pool(local_ray):
    """Two workers of two episodes each, on the rollout node group."""
    pool = asyncio.run(EnvWorkerPool.start(2, episodes_per_worker=2, cpus=0.5, node_group=local_ray, timeout_s=60))
    yield pool
    pool.shutdown()


def run_manager(factory: EnvFactory, loops, task, prompts: int, max_concurrent: int, during=None) -> list[Trajectory]:
    """``prompts`` episodes through the real manager; ``during(manager)`` runs alongside."""

    async def go() -> list[Trajectory]:
        got: list[Trajectory] = []
        manager = RolloutManager(loops, task, "unused", got.append, max_concurrent=max_concurrent, env_factory=factory)
        runner = asyncio.ensure_future(manager.run(asyncio.Event(), max_prompts=prompts))
        if during is not None:
            await asyncio.wait_for(during(manager), 60)
        await asyncio.wait_for(runner, 120)
        return got

    return asyncio.run(go())


def by_index(trajectories: list[Trajectory]) -> dict[int, Trajectory]:
    return {t.sample_index: t for t in trajectories if t.sample_index is not None}


def test_remote_episodes_equal_local_ones_and_every_call_runs_in_a_worker(pool, tokenizer):
    loops = [AgentLoop(ArithClient(tokenizer), tokenizer, CFG)]  # type: ignore[arg-type]
    task = make_task("arith_tool")
    local = by_index(run_manager(local_env_factory("arith_tool"), loops, task, prompts=12, max_concurrent=6))
    remote = by_index(run_manager(pool.factory("arith_tool", {}, "tags"), loops, task, prompts=12, max_concurrent=6))
    assert sorted(local) == sorted(remote) == list(range(12))
    assert {t.reward for t in local.values()} == {0.0, 1.0}  # both outcomes occur
    for i, want in local.items():
        got = remote[i]
        assert got.status == want.status == "finished", (got.status_reason, want.status_reason)
        for name in SAME:
            assert getattr(got, name) == getattr(want, name), (i, name)
        assert "env_calls" not in want.reward_details
    pids = {w.pid for w in pool.workers}
    assert len(pids) == 2 and os.getpid() not in pids
    served = set()
    for t in remote.values():
        calls = t.reward_details["env_calls"]
        assert [c[0] for c in calls] == ["open", "reset", "step", "step", "reward"]
        assert len({(pid, host) for _, pid, host in calls}) == 1  # one episode, one worker
        assert all(pid in pids for _, pid, _ in calls)
        served.add(calls[0][1])
    assert served == pids, "both workers served episodes"
    infos = asyncio.run(pool.info())
    assert all(info["open"] == 0 for info in infos), "every episode was closed on its worker"
    assert sum(info["calls"].get("close", 0) for info in infos) == 12


def test_an_env_worker_holds_at_most_its_episodes_at_once(pool, tokenizer):
    loops = [AgentLoop(ArithClient(tokenizer), tokenizer, CFG)]  # type: ignore[arg-type]
    factory = pool.factory(SLEEPY, {"delay_s": 0.3}, "tags")
    t0 = time.monotonic()
    got = run_manager(factory, loops, CountingTask(), prompts=12, max_concurrent=12)
    elapsed = time.monotonic() - t0
    assert len(got) == 12 and all(t.status == "finished" for t in got), [t.status_reason for t in got]
    assert {t.reward_details["pid"] for t in got} == {w.pid for w in pool.workers}
    assert max(t.reward_details["max_open"] for t in got) == 2  # the bound was reached, never passed
    assert all(info["max_open"] <= 2 for info in asyncio.run(pool.info()))
    assert elapsed >= 3 * 0.3  # 12 episodes through 2 x 2 slots: at least 3 rounds of 0.3 s


def test_a_killed_worker_fails_its_episodes_and_the_manager_goes_on(local_ray, tokenizer, caplog):
    pool = asyncio.run(EnvWorkerPool.start(2, episodes_per_worker=2, cpus=0.5, timeout_s=60))
    try:
        victim_pid = asyncio.run(pool.info())[0]["pid"]  # from the worker itself
        assert victim_pid == pool.workers[0].pid != os.getpid()
        loops = [AgentLoop(ArithClient(tokenizer), tokenizer, CFG)]  # type: ignore[arg-type]

        async def kill_mid_step(manager: RolloutManager) -> None:
            while pool.workers[0].load < 2:  # both of worker 0's slots hold an episode
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # their steps (1.5 s) are under way
            os.kill(victim_pid, signal.SIGKILL)

        factory = pool.factory(SLEEPY, {"delay_s": 1.5}, "tags")
        with caplog.at_level(logging.WARNING, logger="sao_megatron.rollout.agent_loop"):
            got = run_manager(factory, loops, CountingTask(), prompts=8, max_concurrent=4, during=kill_mid_step)
        assert len(got) == 8, "every prompt accounted for"
        failed = [t for t in got if t.status == "failed"]
        finished = [t for t in got if t.status == "finished"]
        assert len(failed) == 2 and len(finished) == 6
        for t in failed:
            reason = t.status_reason
            assert reason.startswith(f"environment: env worker 0 (pid {victim_pid} on "), reason
            assert re.search(r"died during (open|reset|step): ", reason), reason
        assert {t.reward_details["pid"] for t in finished} == {pool.workers[1].pid}
        assert pool.workers[0].died
        assert "closing the environment" in caplog.text  # the dead worker's close: logged, not raised
        info = asyncio.run(pool.info())
        assert info[0]["died"] and info[1]["open"] == 0
    finally:
        pool.shutdown()


def test_a_pool_that_cannot_be_placed_fails_naming_what_it_needs(local_ray):
    with pytest.raises(RuntimeError, match=r"no node advertises sao_critic.*rollout.env_node_group"):
        asyncio.run(EnvWorkerPool.start(1, node_group="critic", timeout_s=2))
    with pytest.raises(RuntimeError, match=r"could not place 1 env workers within 2 s: each needs \{'CPU': 64.0\}"):
        asyncio.run(EnvWorkerPool.start(1, cpus=64, timeout_s=2))


def test_evaluation_runs_its_environments_on_the_pool(pool, tokenizer):
    cfg = load_config(
        None,
        [
            "rollout.env=arith_tool",
            "rollout.env_workers=2",
            "train.eval_prompts=4",
            "rollout.loop.max_turns=4",
            "rollout.loop.max_new_tokens=64",
        ],
    )
    session = object.__new__(Session)  # no actor or engines: evaluate needs clients, task and pool
    session.cfg, session.tokenizer = cfg, tokenizer
    session.task = make_task("arith_tool")
    session.clients = [ArithClient(tokenizer)]  # type: ignore[list-item]
    session.engine_states = EngineStates(1)  # the one engine, up
    before = sum(info["calls"].get("reset", 0) for info in asyncio.run(pool.info()))
    with pytest.raises(RuntimeError, match="env workers are not started"):
        session.env_factory()
    session.env_pool = pool
    metrics = asyncio.run(session.evaluate())
    assert metrics["eval/failed"] == 0.0 and 0.0 <= metrics["eval/accuracy"] <= 1.0
    after = sum(info["calls"].get("reset", 0) for info in asyncio.run(pool.info()))
    assert after - before == 4


AGENT = (
    "import os, sys, openai\n"
    "api = openai.OpenAI(base_url=os.environ['OPENAI_BASE_URL'], api_key=os.environ['OPENAI_API_KEY'], max_retries=0)\n"
    "r = api.chat.completions.create(model='sao-policy', messages=[{'role': 'user', 'content': sys.stdin.read()}])\n"
    "sys.exit(0 if r.choices[0].message.content == '5' else 3)\n"
)


@pytest.mark.skipif(
    not detect_isolation().full, reason="the sandbox's namespaces and uid drop (root, a kernel allowing them)"
)
def test_a_command_agent_runs_sandboxed_on_the_env_worker_of_its_episode(pool, tmp_path):
    """rollout.env=openai_agent with env workers: the task, the agent (in the sandbox, reaching the gateway
    through the worker's relay) and the grading of its answer all run on the worker holding the episode."""
    (tmp_path / "agent.py").write_text(AGENT)
    tmp_path.chmod(0o755)
    gateway = Gateway(GatewayConfig(), OpenAIAgentConfig(command=[sys.executable, str(tmp_path / "agent.py")]))
    loop = scripted_loop(["<answer>5</answer><|end|>"])
    loop.gateway = gateway

    async def go() -> tuple[Trajectory, RemoteEnv]:
        env = await pool.open("openai_agent", {}, loop.tool_format)
        try:
            [traj] = await loop.run_segments(env, SAMPLE)
        finally:
            await gateway.close()
        return traj, env

    traj, env = asyncio.run(go())
    assert (traj.status, traj.reward, traj.correct) == ("finished", 1.0, True), traj.status_reason
    workers = {(w.pid, w.host) for w in pool.workers}
    assert [c[0] for c in env.calls] == ["open", "reset", "run_agent", "grade", "close"]
    assert {(pid, host) for _, pid, host in env.calls} <= workers and os.getpid() not in {w[0] for w in workers}


# ---- without Ray: the proxy and the hooks ----------------------------------------------------


def in_process(worker: EnvWorker):
    """A WorkerCall straight into ``worker`` (same process)."""

    async def call(method: str, *args):
        return await getattr(worker, method)(*args)

    return call


@pytest.mark.skipif(
    not detect_isolation().full, reason="the sandbox's namespaces and uid drop (root, a kernel allowing them)"
)
def test_an_env_worker_that_cannot_reach_the_gateway_fails_the_episode_naming_it(tmp_path):
    """The worker's relay to the gateway's TCP address finds nothing listening: the agent's failure says so."""
    (tmp_path / "agent.py").write_text(AGENT)
    tmp_path.chmod(0o755)
    unused = socket.socket()  # bound, never listening, held to the end: connecting is refused, and no
    unused.bind(("127.0.0.1", 0))  # other test's server can take the port meanwhile (a released one can be)
    port = unused.getsockname()[1]
    worker = EnvWorker(1)
    cfg = OpenAIAgentConfig(command=[sys.executable, str(tmp_path / "agent.py")])
    endpoint = GatewayEndpoint(f"http://127.0.0.1:{port}/sessions/s1/v1", "key", "/sessions/s1/v1")

    async def go() -> None:
        episode, *_ = await worker.open("openai_agent", {}, "tags")
        try:
            await worker.run_agent(episode, cfg, "What is 2+3?", endpoint, 120.0)  # a bound, not a wait: it fails in
        finally:  # ~2 s alone, but the sandbox runs the agent at nice 10, and beside CI's load importing openai took >25 s
            await worker.close(episode)

    relays = set(glob.glob(os.path.join(tempfile.gettempdir(), "sao_gw_relay_*")))
    with unused, pytest.raises(AgentError) as failure:
        asyncio.run(go())
    assert (
        set(glob.glob(os.path.join(tempfile.gettempdir(), "sao_gw_relay_*"))) == relays
    )  # the episode's relay is gone
    message = str(failure.value)
    assert message.startswith(f"{sys.executable} exited with code 1: ")
    assert message.endswith(
        f"; env worker on {socket.gethostname()} could not reach the gateway at http://127.0.0.1:{port} "
        "(ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', " + f"{port}))"
    )


def test_remote_env_is_async_only_and_keeps_its_tool_format():
    async def go() -> RemoteEnv:
        return await RemoteEnv.open(in_process(EnvWorker(1)), "arith_tool", {}, "tags")

    env = asyncio.run(go())
    assert env.tools and env.calls[0][1] == os.getpid()
    for call in (lambda: env.reset(Sample("p", "q", "a")), lambda: env.step("x"), env.reward, env.close):
        with pytest.raises(RuntimeError, match="async methods"):
            call()
    env.use_tool_format("tags")
    with pytest.raises(ValueError, match="opened with tool format 'tags'"):
        env.use_tool_format("json")


class BrokenCloseEnv(Env):
    """Finishes in one step; its close raises."""

    task_class = CountingTask
    closed = 0

    def reset(self, sample: Sample) -> str:
        return sample.question

    def step(self, action: str) -> StepResult:
        return StepResult(None, True)

    def reward(self) -> RewardResult:
        return RewardResult(1.0, True)

    def close(self) -> None:
        BrokenCloseEnv.closed += 1
        raise OSError("workspace busy")


def test_the_agent_loop_always_closes_and_a_close_error_does_not_fail_the_episode(tokenizer, caplog):
    loop = AgentLoop(ArithClient(tokenizer), tokenizer, CFG)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="sao_megatron.rollout.agent_loop"):
        traj = asyncio.run(loop.run(BrokenCloseEnv(), Sample("p0", "q", "1")))
    assert traj.status == "finished" and traj.reward == 1.0 and BrokenCloseEnv.closed == 1
    assert "closing the environment of p0 failed: OSError: workspace busy" in caplog.text


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.env_workers=-1", "rollout.env_workers=-1 must be >= 0"),
        ("rollout.env_worker_episodes=0", "rollout.env_worker_episodes must be >= 1"),
        ("rollout.env_worker_cpus=0", "rollout.env_worker_cpus=0.0 must be > 0"),
        (
            "rollout.env_node_group=gpu",
            "rollout.env_node_group: 'gpu' is not one of 'actor', 'critic', 'rollout'",
        ),
    ],
)
def test_env_worker_settings_are_validated(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])
