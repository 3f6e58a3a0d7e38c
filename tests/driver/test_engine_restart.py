"""Engine faults: a killed engine is restarted, re-synced and its episodes retried; budgets hold.

These drive the :class:`~sao_megatron.driver.session.Session`'s fault handling and the manager's
retries on fakes. A real run (Ray, a Megatron actor and critic, a CPU SGLang engine) whose engine
is SIGKILLed twice mid-run is the last test of the shared session in ``tests/test_pipeline.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from sao_megatron.config import load_config
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import EngineClient
from sao_megatron.rollout.manager import EnginesLost, EngineStates, RolloutManager
from sao_megatron.weight_sync import SyncAborted
from tests.rollout.fakes import CountingTask, make_trajectory


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
        s.state.version = 1  # the actor trained version 1 (the run state records it; restarts sync it)
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
            s.state.version = 2
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


def test_an_aborted_sync_group_restarts_every_engine_of_it_and_counts_the_recovery(tmp_path, monkeypatch):
    """A sync whose sender aborted its broadcast group (:class:`SyncAborted`: under NCCL an engine
    that died mid-broadcast shows up only as the sender's timeout) restarts every engine of the
    group, live ones included (each may still hold the aborted collective), and syncs again to the
    new servers; ``sync/recovered`` counts it. Any other failure with every engine answering is
    raised, as before."""
    s = fake_session(tmp_path, monkeypatch, max_restarts=2)
    synced = s.actor.sync_weights
    calls: list[list[str]] = []

    async def aborted_once(urls, version, address):
        calls.append(list(urls))
        if len(calls) == 1:
            raise SyncAborted(
                "weight sync to version 1 failed: trainer rank 0: SyncAborted: nccl group sao_weight_sync: "
                "a broadcast failed or did not complete within rollout.weight_sync_timeout_s=120"
            )
        return await synced(urls, version, address)

    s.actor = SimpleNamespace(sync_weights=aborted_once)  # type: ignore[assignment]

    async def go():
        async with s.weights_lock:
            metrics = await s.sync_weights(1)
        assert metrics["sync/recovered"] == 1.0
        assert calls == [["http://e0", "http://e1"], ["http://e0.r1", "http://e1.r1"]]  # both restarted
        assert s.engine_states.restarts == [1, 1] and s.engine_states.up == [True, True]
        assert [await c.weight_version() for c in s.clients] == ["1", "1"]
        async with s.weights_lock:  # the count is the run's: the next (clean) sync reports it again
            assert (await s.sync_weights(2))["sync/recovered"] == 1.0

        async def refused(urls, version, address):
            raise RuntimeError("weight sync to version 3 failed: an engine refused the session")

        s.actor = SimpleNamespace(sync_weights=refused)  # type: ignore[assignment]
        async with s.weights_lock:
            with pytest.raises(RuntimeError, match="refused the session"):
                await s.sync_weights(3)
        assert s.engine_states.restarts == [1, 1] and s.sync_recoveries == 1

    asyncio.run(go())
