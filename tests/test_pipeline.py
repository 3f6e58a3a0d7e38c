"""The SAO loop end to end: real Ray, real Megatron actor/critic workers, a real CPU SGLang engine.

One started session (module-scoped: Ray, the roles and the engine start once) runs three RL stages
in turn on one run state and run directory, on ``faulty`` (``arith_tool`` with hanging tools,
raising environments and NaN rewards injected into ~40% of the episodes, deterministically per
prompt):

1. three steps from a fresh state: the run completes, each step's failure counts by cause equal
   the injected faults exactly, every prompt is accounted for once;
2. three more: engine logprobs equal the actor's before and after the syncs, the version
   advances, trajectories span updates, nothing is trained twice;
3. because it kills the engine: RL goes on while the engine is SIGKILLed twice; it is
   restarted, re-synced and its episodes retried, and every prompt is accounted for exactly once
   over the three stages;
4. last: the engine is SIGKILLed mid-broadcast of a weight sync; the sender aborts its group, the
   driver restarts the engine and syncs again, ``sync/recovered`` counts it, and the run goes on
   with every prompt accounted for once.

A SIGKILLed run resumes with the same prompt sequence and a SIGTERM checkpoints it:
``tests/test_kill_resume.py`` (every fault point in-process: ``tests/test_kill_points.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from sao_megatron.batch import build_batch
from sao_megatron.config import SAOConfig, load_config
from sao_megatron.driver import stages
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.envs import make_task
from sao_megatron.envs.faulty import CAUSE, injected_fault
from sao_megatron.observe import RunLog, read_metrics
from sao_megatron.pipeline import run_stage
from sao_megatron.records import Trajectory, Turn
from sao_megatron.rollout.client import SamplingParams
from sao_megatron.rollout.manager import RolloutManager
from sao_megatron.weight_sync import SyncAborted
from tests.rollout.test_fault_injection import RATES, TIMEOUT_S, expected_reason

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

SMALL = [
    "model.num_layers=2",
    "algo.batch_size=4",
    "algo.critic_warmup_steps=0",
    "rollout.max_concurrent=8",
    "rollout.loop.max_turns=2",
    "rollout.env_kwargs={max_turns: 2}",
    "rollout.loop.max_new_tokens=16",
    "rollout.loop.max_response_tokens=64",
    "train.eval_prompts=4",
    "train.value_pretrain_steps=0",
    "train.sample_trajectories=1",
]
KILLS = 2
SEED = 42
"""Of the injected faults (``faulty``): each kind occurs among the first 10 prompts."""


async def actor_logprobs(session: Session, prompt: list[int], gen) -> tuple[torch.Tensor, torch.Tensor]:
    """The actor's logprobs of an engine generation's tokens, in order, and the engine's own."""
    n = len(gen.output_ids)
    traj = Trajectory(
        prompt_id="probe",
        prompt_ids=prompt,
        response_ids=gen.output_ids,
        action_mask=[1] * n,
        behavior_logprobs=gen.behavior_logprobs,
        policy_versions=[0] * n,
        turns=[Turn(0, n)],
        reward=0.0,
        status="finished",
    )
    batch = build_batch([traj])
    mask = batch.action_mask > 0
    return (await session.actor.logprobs(batch))[mask], batch.behavior_logprobs[mask]


async def engine_vs_actor(session: Session, prompt: list[int], index: int = 0) -> tuple[float, int, set[str]]:
    """Sample from engine ``index``, then score the same tokens with the actor: max |diff| of logprobs."""
    gen = await session.clients[index].generate(prompt, SamplingParams(max_new_tokens=12, seed=3))
    actor, engine = await actor_logprobs(session, prompt, gen)
    return (actor - engine).abs().max().item(), len(gen.output_ids), set(gen.weight_versions)


class MarkedLog(RunLog):
    """A RunLog that remembers how many episodes had finished when each step was logged."""

    def __init__(self, run_dir: Path, finished: list[Trajectory]):
        super().__init__(run_dir, tensorboard=False, console=False)
        self.finished = finished
        self.marks: dict[tuple[str, int], int] = {}

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        self.marks[stage, step] = len(self.finished)
        super().log(step, stage, metrics)


@dataclass
class Started:
    """A started session, its run state and log (one run directory), and its own event loop."""

    cfg: SAOConfig
    session: Session
    state: RunState
    log: MarkedLog
    run_dir: Path
    finished: list[Trajectory]
    """Every trajectory a rollout manager of the session handed on (retries happen before that)."""
    loop: asyncio.AbstractEventLoop

    def run[R](self, work: Coroutine[Any, Any, R]) -> R:
        return self.loop.run_until_complete(work)


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> Iterator[Started]:
    """Asynchronous RL (lag unbounded, no SFT) on ``faulty`` (a hanging tool times out after 1 s),
    with an engine watchdog of 1 s; rollouts started."""
    kwargs = ", ".join(f"{k}: {v}" for k, v in RATES.items())
    cfg = load_config(
        None,
        [
            *SMALL,
            "rollout.env=faulty",
            f"rollout.env_kwargs={{{kwargs}, seed: {SEED}, max_turns: 2}}",
            "rollout.loop.env_step_timeout_s=1",
            "train.steps=3",
            "algo.max_policy_lag=null",
            "train.sft_steps=0",
            "train.eval_every=0",
            "rollout.engine_check_s=1",
            "rollout.loop.generate_timeout_s=120",
            "rollout.max_failed_fraction=0.9",  # ~40% fail by design; over many steps a window may pass 50%
        ],
    )
    assert cfg.rollout.env_kwargs == {**RATES, "seed": SEED, "max_turns": 2}
    run_dir = tmp_path_factory.mktemp("run")
    loop = asyncio.new_event_loop()
    state, finished = RunState(stage="rl"), []
    log = MarkedLog(run_dir, finished)
    session = loop.run_until_complete(Session.start(cfg, run_dir, state))
    manager = session.manager

    def recording(buffer, version, cursor) -> RolloutManager:
        m = manager(buffer, version, cursor)
        hand_on = m.on_finished
        m.on_finished = lambda t: (finished.append(t), hand_on(t))[1]
        return m

    session.manager = recording  # type: ignore[method-assign]
    try:
        loop.run_until_complete(session.start_rollouts(state.version))
        yield Started(cfg, session, state, log, run_dir, finished, loop)
    finally:
        loop.run_until_complete(session.shutdown())
        log.close()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def test_pipeline_survives_injected_faults_and_its_metrics_count_them(started):
    """First on the shared session, from a fresh run state: 3 steps with ~40% faulty episodes. It
    completes; each step's ``buffer/dropped_failed/<cause>`` equals the injected faults among the
    episodes finished by then; no prompt is trained twice; trained + waiting + failed + in flight at
    the stop = submitted."""
    s, state = started.session, started.state
    assert state.step == 0, "the shared session's first stage"
    t0 = time.monotonic()
    started.run(run_stage(s, state, started.log, stages.rl(started.cfg, s.critic is not None)))
    elapsed = time.monotonic() - t0
    assert state.step == 3

    task = make_task("faulty")
    fault: dict[int | None, str | None] = {
        i: injected_fault(task.get("train", i).prompt_id, SEED, RATES) for i in range(state.cursor["next_index"])
    }
    finished = started.finished
    done = [t.sample_index for t in finished]
    assert len(done) == len(set(done)), "an episode was handed on twice"
    for t in finished:  # every injected fault fails its episode with its cause; nothing else fails
        f = fault[t.sample_index]
        assert (t.status == "failed") == (f is not None), (t.sample_index, f, t.status, t.status_reason)
        if f is not None:
            assert t.status_reason.startswith(expected_reason(f).replace(f"{TIMEOUT_S:g}s", "1s")), (
                f,
                t.status_reason,
            )
    rl = [r for r in read_metrics(started.run_dir) if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for r in rl:  # each step's metrics count exactly the faults of the episodes finished by then
        want = Counter(CAUSE[f] for i in done[: started.log.marks["rl", r["step"]]] if (f := fault[i]))
        got = {
            k.removeprefix("buffer/dropped_failed/"): v for k, v in r.items() if k.startswith("buffer/dropped_failed/")
        }
        assert got == {k: float(v) for k, v in want.items()}, (r["step"], got, want)
        assert r["buffer/dropped_failed"] == sum(want.values())
    final = Counter(CAUSE[f] for i in done if (f := fault[i]))
    assert state.buffer["stats"]["dropped_failed"] == dict(final)  # the checkpoint, at the stop
    assert {f for i in done if (f := fault[i])} == {
        "hang",
        "raise_reset",
        "raise_step",
        "reward_raise",
        "nan",
    }

    trained = [(split, index, member) for _, split, index, member in state.trained_prompts]
    assert len(trained) == 12 and len(set(trained)) == 12, "a trajectory was trained twice"
    waiting = [Trajectory.from_dict(d).sample_index for d in state.buffer["waiting"]]
    in_flight = [index for _, index, _ in state.cursor["resubmit"]]
    failed = [i for i in done if fault[i]]
    stats = state.buffer["stats"]
    assert stats["dropped_stale"] == stats["dropped_no_actions"] == 0
    accounted = [i for _, i, _ in trained] + waiting + failed + in_flight
    assert sorted(accounted) == list(range(state.cursor["next_index"])), "a prompt was lost or counted twice"
    print(
        f"\nsubmitted {state.cursor['next_index']}: trained {len(trained)}, waiting {len(waiting)}, "
        f"failed {len(failed)} {dict(final)} (kinds {dict(Counter(fault[i] for i in failed))}), in flight at "
        f"the stop {len(in_flight)}, lost 0; {elapsed:.0f}s"
    )


def test_async_loop_versions_sync_and_buffer(started):
    """Three more steps on the shared session, continuing its run state."""
    s, state = started.session, started.state
    step0, version0, trained0 = state.step, state.version, len(state.trained_prompts)
    before = started.run(engine_vs_actor(s, [2, 40, 41, 42, 3]))
    stage = dataclasses.replace(stages.rl(started.cfg, s.critic is not None), steps=step0 + 3)
    started.run(run_stage(s, state, started.log, stage))
    after = started.run(engine_vs_actor(s, [2, 50, 51, 52, 3]))

    assert state.version == version0 + 3 and state.step == step0 + 3
    assert before[0] <= 1e-4 and before[2] == {str(version0)}, before  # engine == Megatron actor, same weights
    assert after[0] <= 1e-4 and after[2] == {str(version0 + 3)}, after  # ... and again after three syncs
    keys = [tuple(k[1:]) for k in state.trained_prompts]
    assert len(keys) == trained0 + 12 and len(set(keys)) == len(keys), "a trajectory was trained twice"
    rl = [r for r in read_metrics(started.run_dir) if r["stage"] == "rl" and r["step"] > step0]
    assert [r["policy_version"] for r in rl] == [version0 + 1.0, version0 + 2.0, version0 + 3.0]
    assert any(r["rollout/multi_version"] > 0 or r["lag/max"] > 0 for r in rl[1:]), "no trajectory spanned an update"
    assert all("actor/kept_frac" in r and "critic/explained_var" in r for r in rl)
    assert all(any(k.startswith("dis/kept_frac/lag") for k in r) for r in rl)


def kill_engine(session: Session, i: int = 0) -> int:
    """SIGKILL engine ``i``'s server and everything SGLang spawned: its process group, by the PID
    this run started (the server leads its own session). Returns the PID."""
    pid = session.engines[i].proc.pid  # type: ignore[attr-defined]  # a local EngineProcess
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    return pid


def test_a_killed_engine_is_restarted_resynced_and_its_episodes_retried(started):
    """Last on the shared session (it kills its engine), continuing its run state. Two kills, each at
    least a step after the last restart; the stage ends (its ``done`` rule) two steps after the
    last restart, 30 steps being only an upper bound."""
    s, state = started.session, started.state
    kills: list[tuple[int, int]] = []  # (pid, step at the kill)
    served: list[tuple[str, int]] = []  # after each restart: the engine's weight label, the session's version
    after_last: list[int] = []  # steps finished once the last restart was done

    async def killer() -> None:
        states, last = s.engine_states, -1
        for k in range(KILLS):
            while state.step <= last or not states.up[0] or states.restarts[0] != k:
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)  # episodes are in flight (max_concurrent of them, always)
            last = state.step
            kills.append((kill_engine(s), last))
            while states.restarts[0] == k or not states.up[0]:
                await asyncio.sleep(0.2)
            served.append((await s.clients[0].weight_version(), s.served_version))

    def done(metrics: dict[str, float]) -> bool:
        if metrics["rollout/engine_restarts"] >= KILLS and s.engine_states.up[0]:
            after_last.append(state.step)
        return len(after_last) >= 2

    async def go():
        kill_task = asyncio.create_task(killer())
        t0 = time.monotonic()
        stage = dataclasses.replace(stages.rl(started.cfg, s.critic is not None), steps=30, done=done)
        try:
            await run_stage(s, state, started.log, stage)
        finally:
            if not kill_task.done():
                kill_task.cancel()
        elapsed = time.monotonic() - t0
        assert kill_task.done() and not kill_task.cancelled(), f"the run ended before {KILLS} kills ({kills})"
        kill_task.result()
        return await engine_vs_actor(s, [2, 50, 51, 52, 3]), elapsed

    after, elapsed = started.run(go())
    engine_states = s.engine_states
    print(
        f"run with {KILLS} kills: {elapsed:.0f} s, {state.step} steps; kills (pid, step) {kills}; "
        f"served (label, version) {served}; retries {engine_states.episode_retries}"
    )
    assert len(after_last) == 2 and state.step < 30 and state.version == state.step  # every step trained
    assert len(kills) == KILLS and len({pid for pid, _ in kills}) == KILLS  # a new server each time
    assert all(label == str(version) for label, version in served), served  # current policy once up
    assert after[0] <= 1e-4 and after[2] == {str(state.version)}, after  # engine == actor after the restarts
    assert_each_prompt_once(started)
    rl = [r for r in read_metrics(started.run_dir) if r["stage"] == "rl"]
    assert len(rl) == state.step
    assert rl[-1]["rollout/engine_restarts"] == KILLS == sum(engine_states.restarts)
    assert rl[-1]["rollout/engine_dropped"] == 0
    assert rl[-1]["rollout/episode_retries"] >= KILLS  # every kill hit episodes in flight
    assert rl[-1]["rollout/episode_retries"] <= engine_states.episode_retries


def assert_each_prompt_once(started: Started) -> None:
    """Every prompt exactly once over the session's stages: trained or failed (with a reason: an
    injected fault, or an engine's after its retries), waiting, or to be resubmitted."""
    state, finished = started.state, started.finished
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


class KillingProxy:
    """Stands between the actor's weight sync and engine ``i``: forwards every call, except that on
    the first ``/update_weights_from_distributed`` it SIGKILLs the engine first. The coordinator
    releases a bucket to its sender as it posts the bucket's request, so the engine dies while the
    sender broadcasts that bucket to it."""

    def __init__(self, session: Session, i: int = 0):
        self.session, self.i, self.target = session, i, session.engines[i].url
        self.killed: int | None = None  # the engine's PID, once killed
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _forward(self, request: web.Request) -> web.Response:
        if request.path == "/update_weights_from_distributed" and self.killed is None:
            self.killed = kill_engine(self.session, self.i)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.request(
                    request.method, self.target + request.path_qs, data=await request.read(), headers=headers
                ) as answer,
            ):
                return web.Response(
                    body=await answer.read(),
                    status=answer.status,
                    headers={"Content-Type": answer.headers.get("Content-Type", "application/json")},
                )
        except aiohttp.ClientError as err:  # the engine is gone
            return web.Response(status=502, text=f"{type(err).__name__}: {err}")


def test_an_engine_killed_mid_broadcast_aborts_the_group_and_the_run_recovers(started):
    """Last on the shared session, continuing its run state: two more steps, the first step's weight
    sync routed to the engine through a :class:`KillingProxy`, which SIGKILLs it as its first
    bucket is broadcast. The sender's wait on the broadcast raises (gloo at once; NCCL, where a
    broadcast only enqueues, at ``rollout.weight_sync_timeout_s``: the same code), it aborts its
    group and the actor raises :class:`SyncAborted`; the driver restarts the engine (every engine
    of the group) and syncs again. Both steps train, ``sync/recovered`` counts the recovery in the
    run's metrics, the restarted engine serves the actor's weights, and every prompt is accounted
    for once: no trajectory lost or trained twice."""
    s, state = started.session, started.state
    step0, restarts0, recovered0 = state.step, s.engine_states.restarts[0], s.sync_recoveries
    proxy = KillingProxy(s)
    raised: list[BaseException] = []
    sync = s.actor.sync_weights

    async def through_proxy(urls: list[str], version: int, addresses, port: int = 0) -> dict[str, float]:
        if proxy.killed is None:
            urls = [proxy.url if u == proxy.target else u for u in urls]
        try:
            return await sync(urls, version, addresses, port)
        except BaseException as err:
            raised.append(err)
            raise

    async def go():
        await proxy.start()
        s.actor.sync_weights = through_proxy  # type: ignore[method-assign]
        try:
            stage = dataclasses.replace(stages.rl(started.cfg, s.critic is not None), steps=step0 + 2)
            await run_stage(s, state, started.log, stage)
        finally:
            del s.actor.sync_weights  # the class's again
            await proxy.stop()
        return await engine_vs_actor(s, [2, 60, 61, 62, 3])

    after = started.run(go())
    assert proxy.killed is not None, "the sync never reached the proxy"
    assert len(raised) == 1 and isinstance(raised[0], SyncAborted), raised  # through Ray, typed
    assert "rollout.weight_sync_timeout_s" in str(raised[0]) and "the group was aborted" in str(raised[0])
    assert state.step == step0 + 2 and state.version == state.step  # both steps trained
    assert s.engine_states.restarts[0] == restarts0 + 1 and s.engine_states.up == [True]
    assert s.engines[0].proc.pid != proxy.killed  # type: ignore[attr-defined]  # a new server
    assert s.sync_recoveries == recovered0 + 1
    assert after[0] <= 1e-4 and after[2] == {str(state.version)}, after  # engine == actor after the recovery
    rl = [r for r in read_metrics(started.run_dir) if r["stage"] == "rl" and r["step"] > step0]
    assert [r["sync/recovered"] for r in rl] == [recovered0 + 1.0] * 2  # counted in the run's metrics
    assert rl[-1]["rollout/engine_restarts"] == float(sum(s.engine_states.restarts))
    assert_each_prompt_once(started)
