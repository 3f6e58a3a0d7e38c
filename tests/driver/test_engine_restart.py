"""Engine faults: a killed engine is restarted, re-synced and its episodes retried; budgets hold.

The first test is a real run (Ray, a Megatron actor and critic, a CPU SGLang engine) whose engine
is SIGKILLed (its whole process group) twice mid-run; the others drive the
:class:`~sao_megatron.driver.session.Session`'s fault handling and the manager's retries on fakes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from sao_megatron.config import load_config
from sao_megatron.driver import stages
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.observe import RunLog, read_metrics
from sao_megatron.pipeline import run_stage
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import EngineClient
from sao_megatron.rollout.manager import EnginesLost, EngineStates, RolloutManager
from tests.rollout.fakes import CountingTask, make_trajectory

KILLS = 2


def kill_engine(session: Session, i: int = 0) -> int:
    """SIGKILL engine ``i``'s server and everything SGLang spawned: its process group, by the PID
    this run started (the server leads its own session). Returns the PID."""
    pid = session.engines[i].proc.pid  # type: ignore[attr-defined]  # a local EngineProcess
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    return pid


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_killed_engine_is_restarted_resynced_and_its_episodes_retried(tmp_path):
    """Two kills, each at least a step after the last restart; the stage ends (its ``done`` rule)
    two steps after the third restart, ``train.steps`` being only an upper bound."""
    from tests.test_pipeline import SMALL, engine_vs_actor

    cfg = load_config(
        None,
        [
            *SMALL,
            "train.steps=30",
            "algo.max_policy_lag=null",
            "train.sft_steps=0",
            "rollout.engine_check_s=1",
            "rollout.loop.generate_timeout_s=120",
        ],
    )
    finished = []  # every trajectory a manager handed on (retries happen before that)
    kills: list[tuple[int, int]] = []  # (pid, step at the kill)
    served: list[tuple[str, int]] = []  # after each restart: the engine's weight label, the session's version
    after_last: list[int] = []  # steps finished once the last restart was done

    async def killer(session: Session, state: RunState) -> None:
        states, last = session.engine_states, -1
        for k in range(KILLS):
            while state.step <= last or not states.up[0] or states.restarts[0] != k:
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)  # episodes are in flight (max_concurrent of them, always)
            last = state.step
            kills.append((kill_engine(session), last))
            while states.restarts[0] == k or not states.up[0]:
                await asyncio.sleep(0.2)
            served.append((await session.clients[0].weight_version(), session.served_version))

    async def go():
        state = RunState(stage="rl")
        log = RunLog(tmp_path, tensorboard=False, console=False)
        session = await Session.start(cfg, tmp_path, state)
        manager = session.manager

        def recording(buffer, version, cursor) -> RolloutManager:
            m = manager(buffer, version, cursor)
            hand_on = m.on_finished
            m.on_finished = lambda t: (finished.append(t), hand_on(t))[1]
            return m

        def done(metrics: dict[str, float]) -> bool:
            if metrics["rollout/engine_restarts"] >= KILLS and session.engine_states.up[0]:
                after_last.append(state.step)
            return len(after_last) >= 2

        session.manager = recording  # type: ignore[method-assign]
        try:
            await session.start_rollouts(state.version)
            kill_task = asyncio.create_task(killer(session, state))
            t0 = time.monotonic()
            stage = dataclasses.replace(stages.rl(cfg, session.critic is not None), done=done)
            await run_stage(session, state, log, stage)
            elapsed = time.monotonic() - t0
            assert kill_task.done(), f"the run ended before {KILLS} kills ({kills})"
            kill_task.result()
            after = await engine_vs_actor(session, [2, 50, 51, 52, 3])
            return state, after, session.engine_states, elapsed
        finally:
            await session.shutdown()

    state, after, engine_states, elapsed = asyncio.run(go())
    print(
        f"run with {KILLS} kills: {elapsed:.0f} s, {state.step} steps; kills (pid, step) {kills}; "
        f"served (label, version) {served}; retries {engine_states.episode_retries}"
    )
    assert len(after_last) == 2 and state.step < 30 and state.version == state.step  # every step trained
    assert len(kills) == KILLS and len({pid for pid, _ in kills}) == KILLS  # a new server each time
    assert all(label == str(version) for label, version in served), served  # current policy once up
    assert after[0] <= 1e-4 and after[2] == {str(state.version)}, after  # engine == actor after the restarts
    # Every prompt exactly once: trained or failed (with a reason), waiting, or to be resubmitted.
    keys = [(t.split, t.sample_index, t.reward_details.get("group_index", 0)) for t in finished]
    assert len(keys) == len(set(keys)), "a submission finished twice"
    trained = [tuple(k[1:]) for k in state.trained_prompts]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    by_key = {k: t for k, t in zip(keys, finished, strict=True)}
    assert all(by_key[k].status != "failed" for k in trained)
    assert all(t.status_reason for t in finished if t.status == "failed")
    resubmit = {tuple(x) for x in state.cursor["resubmit"]}
    assert resubmit.isdisjoint(keys)
    assert set(keys) | resubmit == {("train", i, 0) for i in range(state.cursor["next_index"])}
    rl = [r for r in read_metrics(tmp_path) if r["stage"] == "rl"]
    assert len(rl) == state.step
    assert rl[-1]["rollout/engine_restarts"] == KILLS == sum(engine_states.restarts)
    assert rl[-1]["rollout/engine_dropped"] == 0
    assert rl[-1]["rollout/episode_retries"] >= KILLS  # every kill hit episodes in flight
    assert rl[-1]["rollout/episode_retries"] <= engine_states.episode_retries


# ---- fakes ------------------------------------------------------------------------------------


class EngineLoop:
    """An agent loop whose engine fails the first ``failures`` episodes (``engine:`` reason)."""

    def __init__(self, failures: int, name: str = "engine0", reason: str = "engine: /generate: ClientOSError"):
        self.failures, self.engine_name, self.reason, self.calls = failures, name, reason, 0

    async def run(self, env, sample, split="train", index=-1, submitted_at=None):
        self.calls += 1
        await asyncio.sleep(0)
        if self.calls <= self.failures:
            traj = make_trajectory(sample.prompt_id, index, status="failed")
            traj.status_reason = self.reason
            return traj
        return make_trajectory(sample.prompt_id, index)


def _manage(loops, prompts: int, retries: int, states: EngineStates | None = None):
    async def go():
        got = []
        manager = RolloutManager(
            loops,
            CountingTask(),
            "arith_tool",
            got.append,
            max_concurrent=1,
            engines=states,
            episode_max_retries=retries,
        )
        await manager.run(asyncio.Event(), max_prompts=prompts)
        return got, manager

    return asyncio.run(go())


def test_an_engine_failure_is_retried_within_the_budget_then_counts_as_failed():
    reports = []
    states = EngineStates(1, on_failure=lambda i, reason: reports.append(i))
    got, manager = _manage([EngineLoop(failures=2)], prompts=2, retries=2, states=states)
    assert [t.status for t in got] == ["finished", "finished"]  # prompt 0: two failures, then a success
    assert states.episode_retries == 2 and reports == [0, 0] and manager.stats.failed == 0
    got, manager = _manage([EngineLoop(failures=5)], prompts=2, retries=2)
    assert [(t.sample_index, t.status) for t in got] == [(0, "failed"), (1, "finished")]
    assert manager.engines.episode_retries == 4  # prompt 0: 3 runs, failed; prompt 1: 2 failures, then a success
    assert manager.stats.failed == 1  # only the episode whose budget ran out counts (once)
    # not the engine's fault: no retry
    got, manager = _manage([EngineLoop(failures=1, reason="environment: boom")], prompts=1, retries=2)
    assert [t.status for t in got] == ["failed"] and manager.engines.episode_retries == 0


def test_episodes_go_only_to_engines_that_are_up_and_wait_while_none_is():
    async def go():
        states = EngineStates(2)
        states.mark_down(0)
        loops = [EngineLoop(0, "engine0"), EngineLoop(0, "engine1")]
        got = []
        manager = RolloutManager(
            cast(list[AgentLoop], loops), CountingTask(), "arith_tool", got.append, max_concurrent=2, engines=states
        )
        await manager.run(asyncio.Event(), max_prompts=3)
        assert loops[0].calls == 0 and loops[1].calls == 3
        states.mark_down(1)
        runner = asyncio.create_task(manager.run(asyncio.Event(), max_prompts=2))
        await asyncio.sleep(0.2)
        assert not runner.done() and manager.in_flight == 2  # waiting for an engine
        states.mark_up(0)
        await asyncio.wait_for(runner, 5)
        assert loops[0].calls == 2 and len(got) == 5
        states.mark_down(0)
        states.drop(1, "gone")
        runner = asyncio.create_task(manager.run(asyncio.Event(), max_prompts=1))
        await asyncio.sleep(0.1)
        states.drop(0, "dead after 3 restart(s)")
        with pytest.raises(EnginesLost, match="every engine was dropped"):
            await asyncio.wait_for(runner, 5)

    asyncio.run(go())


class FakeEngine:
    """A local engine stand-in: ``alive`` until killed."""

    started = 0

    def __init__(self, url: str):
        self.url, self.running = url, True
        FakeEngine.started += 1

    def alive(self) -> bool:
        return self.running

    def wait_healthy(self) -> float:
        return 0.0

    def stop(self) -> None:
        self.running = False


class FakeClient:
    def __init__(self, engine: FakeEngine):
        self.engine, self.url, self.label = engine, engine.url, "default"

    async def __aenter__(self):
        return self

    async def close(self) -> None:
        pass

    async def model_info(self, timeout_s=None) -> dict:
        from sao_megatron.rollout.client import EngineError

        if not self.engine.running:
            raise EngineError("/model_info", "ClientConnectorError: Cannot connect")
        return {"weight_version": self.label}

    async def weight_version(self, timeout_s=None) -> str:
        return str((await self.model_info())["weight_version"])


def fake_session(tmp_path: Path, monkeypatch, max_restarts: int, engines: int = 2) -> Session:
    """A Session over FakeEngines: ``start_engines`` and ``EngineClient`` replaced; the actor's sync
    labels every listed engine's weights (and fails if one is dead)."""
    import sao_megatron.driver.engines as engines_mod
    import sao_megatron.driver.session as session_mod

    cfg = load_config(
        None,
        [
            f"rollout.engine_max_restarts={max_restarts}",
            f"rollout.num_engines={engines}",
            "rollout.engine_check_s=0.05",
        ],
    )
    s = Session.__new__(Session)
    s.cfg, s.run_dir = cfg, tmp_path
    fakes = [FakeEngine(f"http://e{i}") for i in range(engines)]
    clients = {e.url: FakeClient(e) for e in fakes}
    s.engines = list(fakes)
    s.clients = cast(list[EngineClient], [clients[e.url] for e in fakes])
    s.loops = [SimpleNamespace(client=c) for c in s.clients]  # type: ignore[list-item]
    s.engine_states = EngineStates(engines, on_failure=s._episode_failed)
    s.weights_lock, s.served_version, s._watchdog, s._recovering = asyncio.Lock(), 0, None, {}
    s.state = RunState()
    s.sync_address, s._engines_ready = "127.0.0.1", None

    async def start_engines(cfg, model_path, run_dir, indices=None, restart=0, load_format="auto"):
        assert (model_path.name, load_format) == ("engine", "dummy")  # random weights, then the sync
        new = [FakeEngine(f"http://e{i}.r{restart}") for i in indices or []]
        clients.update({e.url: FakeClient(e) for e in new})
        return new

    async def sync_weights(urls, version, address):
        if not all(clients[u].engine.running for u in urls):
            raise RuntimeError("gloo: connection closed by peer")
        for u in urls:
            clients[u].label = str(version)
        return {"sync_s": 0.0}

    monkeypatch.setattr(engines_mod, "start_engines", start_engines)
    monkeypatch.setattr(session_mod, "EngineClient", lambda url: clients[url])
    s.actor = SimpleNamespace(sync_weights=sync_weights)  # type: ignore[assignment]
    return s


def test_a_dead_engine_is_restarted_and_synced_then_dropped_after_max_restarts(tmp_path, monkeypatch):
    s = fake_session(tmp_path, monkeypatch, max_restarts=2)

    async def go():
        states = s.engine_states
        async with s.weights_lock:
            await s.sync_weights(1)
        s._watchdog = asyncio.create_task(s._watch())
        for k in range(2):  # each death: a restart from the current version, then up
            s.engines[0].stop()
            await asyncio.sleep(0.5)
            assert states.restarts == [k + 1, 0] and states.up == [True, True]
            assert await s.clients[0].weight_version() == "1" and s.loops[0].client is s.clients[0]
        async with s.weights_lock:  # a sync that fails on a dead engine restarts it; its budget is spent: dropped
            s.engines[0].stop()
            await s.sync_weights(2)
        assert states.dropped == {0} and states.up == [False, True]
        assert await s.clients[1].weight_version() == "2"
        assert states.metrics() == {
            "rollout/engine_restarts": 2.0,
            "rollout/engine_dropped": 1.0,
            "rollout/episode_retries": 0.0,
        }
        s._episode_failed(1, "engine: /generate: ServerDisconnectedError: Server disconnected")
        assert states.up == [False, False]  # marked down at once, before the retry picks an engine
        s.engines[1].stop()
        s.cfg.rollout.engine_max_restarts = 0  # the last engine's budget is spent too: the run stops
        await asyncio.sleep(0.3)
        assert isinstance(states.error, EnginesLost)
        with pytest.raises(EnginesLost):
            await states.wait_up()
        s._watchdog.cancel()

    asyncio.run(go())
