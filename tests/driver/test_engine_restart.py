"""Engine faults: a killed engine is restarted, re-synced and its episodes retried; budgets hold.

These drive the :class:`~sao_megatron.driver.session.Session`'s fault handling and the manager's
retries on fakes. A real run (Ray, a Megatron actor and critic, a CPU SGLang engine) whose engine
is SIGKILLed twice mid-run is the last test of the shared session in ``tests/test_pipeline.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from sao_megatron.config import load_config
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.driver.stages import rl
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import EngineClient
from sao_megatron.rollout.manager import EnginesLost, EngineStates, RolloutManager
from sao_megatron.weight_sync import SyncAborted
from tests.driver.fakes import FakeActor, FakeSession, ScriptedLoop
from tests.driver.test_loop import assert_accounted, config, run, trained
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


def fake_session(
    tmp_path: Path,
    monkeypatch,
    max_restarts: int,
    engines: int = 2,
    window: int = 20,
    restart_s: float = 0.0,
    restarts: list[tuple[float, float]] | None = None,
) -> Session:
    """A Session over FakeEngines: ``start_engines`` and ``EngineClient`` replaced; the actor's sync
    labels every listed engine's weights (and fails if one is dead). A restart's health wait blocks a
    thread for ``restart_s`` seconds, as a real server's does; each restart's (start, end) in
    ``time.monotonic()`` is appended to ``restarts``."""
    import sao_megatron.driver.engines as engines_mod
    import sao_megatron.driver.session as session_mod

    cfg = load_config(
        None,
        [
            f"rollout.engine_max_restarts={max_restarts}",
            f"rollout.num_engines={engines}",
            f"rollout.engine_restart_window_steps={window}",
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
    s._restart_steps, s.sync_recoveries = {}, 0
    s.state = RunState()
    s.sync_address, s._engines_ready = "127.0.0.1", None

    async def start_engines(cfg, model_path, run_dir, indices=None, restart=0, load_format="auto"):
        assert (model_path.name, load_format) == ("engine", "dummy")  # random weights, then the sync
        start = time.monotonic()
        if restart_s:
            await asyncio.to_thread(time.sleep, restart_s)
        if restarts is not None:
            restarts.append((start, time.monotonic()))
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


def _aborted_at(s: Session, calls: set[int]) -> list[list[str]]:
    """Make the actor's sync of ``s`` raise :class:`SyncAborted` on its calls numbered ``calls``
    (1-based); returns the URLs of every call, in order."""
    synced, urls_of_calls = s.actor.sync_weights, []

    async def sync_weights(urls, version, address):
        urls_of_calls.append(list(urls))
        if len(urls_of_calls) in calls:
            raise SyncAborted(f"weight sync to version {version} failed: a broadcast did not complete in time")
        return await synced(urls, version, address)

    s.actor = SimpleNamespace(sync_weights=sync_weights)  # type: ignore[assignment]
    return urls_of_calls


def test_the_engines_of_an_aborted_sync_restart_in_parallel(tmp_path, monkeypatch):
    """Both engines of an aborted group restart at once: the outage, from the sync's start to both
    serving the version again, is one restart plus the sync. Each fake restart blocks a thread for
    3 s, as a real server's health wait does; one after the other they would take 6 s or more."""
    windows: list[tuple[float, float]] = []
    s = fake_session(tmp_path, monkeypatch, max_restarts=2, restart_s=3.0, restarts=windows)
    calls = _aborted_at(s, {1})

    async def go():
        t0 = time.monotonic()
        async with s.weights_lock:
            metrics = await s.sync_weights(1)
        outage = time.monotonic() - t0
        # serial restarts take 6 s at least; the overlap below is the real check (no upper bound that
        # a loaded machine could break beyond "less than two restarts")
        assert 3.0 <= outage < 6.0, f"outage {outage:.1f} s for two 3-s restarts"
        assert max(start for start, _ in windows) < min(end for _, end in windows)  # they overlapped
        assert calls == [["http://e0", "http://e1"], ["http://e0.r1", "http://e1.r1"]]
        assert metrics["sync/recovered"] == 1.0 and s.engine_states.up == [True, True]
        assert [await c.weight_version() for c in s.clients] == ["1", "1"]

    asyncio.run(go())


@pytest.mark.parametrize(
    ("failures", "stops"),
    [
        ((5, 25, 45), False),  # more steps apart than the window: the budget refills
        ((5, 14, 15), False),  # step 5's restart counts at steps 5..14 only
        ((5, 6, 7), True),  # three within one window: the third finds the budget of 2 spent
        ((5, 10, 14), True),
    ],
)
def test_the_restart_budget_counts_restarts_within_a_window_of_steps(tmp_path, monkeypatch, failures, stops):
    """Aborted syncs at the learner steps ``failures`` of a 60-step run, each restarting both engines,
    under ``rollout.engine_max_restarts=2`` per ``rollout.engine_restart_window_steps=10``: spread out,
    the run goes on; within one window, both engines are dropped and the run stops, the message
    naming both keys."""
    s = fake_session(tmp_path, monkeypatch, max_restarts=2, window=10)
    calls: list[int] = []  # the step of each call of the actor's sync
    synced = s.actor.sync_weights

    async def sync_weights(urls, version, address):
        calls.append(s.state.step)
        if s.state.step in failures and calls.count(s.state.step) == 1:  # the step's first try fails
            raise SyncAborted(f"weight sync to version {version} failed: a broadcast did not complete in time")
        return await synced(urls, version, address)

    s.actor = SimpleNamespace(sync_weights=sync_weights)  # type: ignore[assignment]

    async def go():
        for step in range(1, 61):
            s.state.step = s.state.version = step
            async with s.weights_lock:
                await s.sync_weights(step)

    if not stops:
        asyncio.run(go())
        assert s.engine_states.dropped == set() and s.sync_recoveries == 3
        assert s.engine_states.restarts == [3, 3]  # the metric still counts every restart of the run
        return
    with pytest.raises(EnginesLost) as err:
        asyncio.run(go())
    message = str(err.value)
    assert "rollout.engine_max_restarts" in message and "rollout.engine_restart_window_steps" in message, message
    assert "dead after 2 restart(s) within 10 step(s)" in message, message
    assert s.state.step == failures[-1] and s.engine_states.dropped == {0, 1}


class EngineBoundLoop(ScriptedLoop):
    """A scripted episode on engine ``i`` of ``session``; it fails as one whose server went away (a
    connection error, retried elsewhere by the manager) when that engine was stopped while it ran."""

    def __init__(self, session: Session, i: int):
        super().__init__(duration=lambda index: 0.2, name=f"engine{i}")
        self.session, self.i, self.lost = session, i, 0

    async def run(self, env, sample, split="train", index=-1, submitted_at=None):
        engine = self.session.engines[self.i]
        traj = await super().run(env, sample, split, index, submitted_at)
        traj.engine = self.engine_name
        if engine is not self.session.engines[self.i] or not engine.alive():
            self.lost += 1
            traj.status, traj.status_reason = (
                "failed",
                "engine: /generate: ServerDisconnectedError: Server disconnected",
            )
        return traj


def test_the_loop_loses_no_trajectory_and_trains_none_twice_across_an_aborted_sync(tmp_path, monkeypatch):
    """The learner loop (real manager, buffer and learner step) over the session's real engine-fault
    handling on two fake engines: the sync after the second step is aborted, both engines restart
    at once while episodes are in flight on them. Those episodes fail as their servers go and run
    again once an engine is back; every prompt the cursor passed is trained once or still waiting,
    and ``sync/recovered`` in the step metrics counts the recovery from that step on."""
    windows: list[tuple[float, float]] = []
    real = fake_session(tmp_path / "engines", monkeypatch, max_restarts=2, restart_s=1.0, restarts=windows)
    calls = _aborted_at(real, {2})
    cfg = config("train.steps=5")
    state = RunState(stage="rl")
    real.state = state  # the restart budget's clock is the loop's step
    loops = [EngineBoundLoop(real, 0), EngineBoundLoop(real, 1)]
    fake = FakeSession(cfg, loops[0], actor=FakeActor(update_s=0.05), engines=real.engines)
    fake.weights_lock = real.weights_lock  # the learner step holds it through the sync, as Session's does

    def manager(buffer, version, cursor):
        for loop in loops:
            loop.version = lambda: real.served_version  # as an engine: the weights it was last synced to
        fake.rollout_manager = RolloutManager(
            cast(list[AgentLoop], loops),
            fake.task,
            cfg.rollout.env,
            lambda t: buffer.admit(t, version()),
            group_size=cfg.algo.group_size,
            max_concurrent=cfg.rollout.max_concurrent,
            cursor=cursor,
            engines=real.engine_states,
            episode_max_retries=cfg.rollout.episode_max_retries,
        )
        return fake.rollout_manager

    fake.manager = manager  # type: ignore[method-assign]
    fake.sync_weights = real.sync_weights  # type: ignore[method-assign]
    state, lines = run(fake, rl(cfg, True), tmp_path / "run", state)
    assert state.step == 5 and len(calls) == 6  # five syncs, the second twice
    assert calls[2] == ["http://e0.r1", "http://e1.r1"] and real.engine_states.restarts == [1, 1]
    assert max(start for start, _ in windows) < min(end for _, end in windows)  # the restarts overlapped
    assert sum(loop.lost for loop in loops) >= 1  # episodes were in flight on the stopped servers
    indices = trained(fake)
    assert len(indices) == len(set(indices)) == 5 * cfg.algo.batch_size  # none trained twice
    assert_accounted(fake.checkpoints[-1], indices)  # none lost
    assert [line["sync/recovered"] for line in lines if line.get("stage") == "rl"] == [0.0, 1.0, 1.0, 1.0, 1.0]
