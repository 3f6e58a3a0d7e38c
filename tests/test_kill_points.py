"""Every fault point of :mod:`sao_megatron.faults`, in-process: what a SIGKILL there leaves on disk,
and that a run resumed from it trains the prompts of an uninterrupted run.

The learner loop runs on fakes (``tests/driver/fakes.py``: real ``run_stage``, RolloutManager,
ReadyBuffer, learner step) with the REAL ``Session.checkpoint`` and ``RunState.publish`` writing
the run directory, and an in-process HTTP stand-in for the engine that the REAL ``EngineClient``
(``/generate``) and ``EngineControl`` (a weight sync's bucket) talk to, so every point is reached
where the package calls it. ``faults._kill_run`` (the SIGKILL) is replaced: at the point the run
directory is copied, which is what a SIGKILL leaves (files written so far, nothing after), and the
run is abandoned. The copy is then checked (which checkpoint is complete, at which step) and resumed
to the end (``RunState.load``, the roles' weights from the checkpoint).

Synchronous with lag 0, an uninterrupted run trains step k on prompts 4(k-1)..4k-1. One real
SIGKILL through real processes (Ray, the engine, a Ray worker taking the driver down):
``tests/test_kill_resume.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from sao_megatron import faults
from sao_megatron.buffer import ReadyBuffer
from sao_megatron.config import REPO_ROOT, load_config
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.driver.stages import rl
from sao_megatron.observe import RunLog, read_metrics
from sao_megatron.pipeline import run_stage
from sao_megatron.rollout.client import EngineClient, SamplingParams
from sao_megatron.weight_sync.transport import BucketSpec, EngineControl
from tests.driver.fakes import Admission, FakeActor, FakeCritic, FakeSession, ScriptedLoop

pytestmark = pytest.mark.timeout(60)

STEPS = 3
CONFIG = [
    "algo.batch_size=4",
    "algo.group_size=1",
    "rollout.max_concurrent=8",
    "algo.critic_warmup_steps=0",
    "algo.synchronous=true",
    "algo.max_policy_lag=0",
    "train.eval_every=0",
    f"train.steps={STEPS}",
    "train.save_every=1",
    "train.sample_trajectories=0",
]
UNINTERRUPTED = {k: {("train", i, 0) for i in range(4 * (k - 1), 4 * k)} for k in range(1, STEPS + 1)}

# SAO_KILL_AT -> (RL step of the complete checkpoint a resume starts from, last RL step logged). Visits are counted from
# the run's start: one /generate per episode (4 per step), one bucket per weight sync (one per step:
# no sync at the start here), a checkpoint per step (the first one has nothing to rename).
POINTS = {
    "rl:after_update@2": (1, 2),  # step 2 trained, synced and logged; its checkpoint never written
    "checkpoint:staged@2": (1, 2),  # step 2's checkpoint staged, not published
    "checkpoint:renaming": (1, 2),  # step 2's publish: checkpoint/ is checkpoint.old/, the new one unplaced
    "weight_sync:bucket@2": (1, 1),  # step 2's update: the engines hold a partly updated model
    "rollout:generate@6": (1, 1),  # mid-episode, the second batch's second episode
}


class Killed(BaseException):
    """The run is dead from here on (a BaseException: nothing in the package catches it)."""


def _package_points() -> set[str]:
    """Every ``kill_point("...")`` the package calls."""
    calls = re.compile(r"""kill_point\(\s*["']([^"']+)["']\s*\)""")
    found = set()
    for path in (REPO_ROOT / "sao_megatron").rglob("*.py"):
        if path.name != "faults.py":
            found |= set(calls.findall(path.read_text()))
    return found


def test_every_fault_point_of_the_package_is_checked():
    assert {spec.partition("@")[0] for spec in POINTS} == _package_points()


class FakeEngine:
    """The engine's HTTP surface for the client and the control plane: a two-token answer to every
    ``/generate``; every control call succeeds."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/{control}", self._control)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _generate(self, request: web.Request) -> web.Response:
        self.calls.append("generate")
        meta = {
            "output_token_logprobs": [[-0.5, 5, None], [-0.5, 6, None]],
            "weight_version": "0",
            "finish_reason": {"type": "stop"},
            "prompt_tokens": len((await request.json())["input_ids"]),
        }
        return web.json_response({"output_ids": [5, 6], "meta_info": meta})

    async def _control(self, request: web.Request) -> web.Response:
        self.calls.append(request.match_info["control"])
        return web.json_response({"success": True, "message": ""})


class GeneratingLoop(ScriptedLoop):
    """A scripted episode that first asks the engine for a turn (the real ``EngineClient.generate``)."""

    def __init__(self, engine: EngineClient, duration: Callable[[int], float] = lambda i: 0.01):
        super().__init__(duration=duration)
        self.engine = engine

    async def run(self, env, sample, split="train", index=-1, submitted_at=None):
        await self.engine.generate([1, index], SamplingParams(max_new_tokens=2))
        return await super().run(env, sample, split, index, submitted_at)


class SavingActor(FakeActor):
    """Saves and loads its number of updates (its "weights")."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = 0

    def weights(self) -> int:
        return self.loaded + len(self.updates)

    async def save(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "weights.json").write_text(json.dumps(self.weights()))

    async def load(self, path: Path) -> None:
        self.loaded = json.loads((path / "weights.json").read_text())


class SavingCritic(FakeCritic):
    """Saves and loads its number of learner steps (its "weights")."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = 0

    def weights(self) -> int:
        return self.loaded + len(self.values_calls)

    async def save(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "weights.json").write_text(json.dumps(self.weights()))

    async def load(self, path: Path) -> None:
        self.loaded = json.loads((path / "weights.json").read_text())


@dataclass
class CheckpointingSession(FakeSession):
    """A :class:`FakeSession` whose checkpoints are ``Session.checkpoint``'s (files in ``run_dir``) and
    whose weight syncs post a bucket through ``EngineControl``."""

    run_dir: Path = Path()
    engine_url: str = ""
    actor: SavingActor = field(default_factory=SavingActor)
    critic: SavingCritic = field(default_factory=SavingCritic)  # type: ignore[assignment]

    async def checkpoint(self, state, manager=None, buffer=None, advantages=None) -> None:
        await Session.checkpoint(self, state, manager, buffer, advantages)  # type: ignore[arg-type]

    async def sync_weights(self, version: int) -> dict[str, float]:
        async with EngineControl([self.engine_url]) as control:
            await control.load("g", BucketSpec(["w"], ["float32"], [[1]]), version)
        return await super().sync_weights(version)


async def _run(
    run_dir: Path,
    state: RunState,
    killed: asyncio.Event | None = None,
    duration: Callable[[int], float] = lambda i: 0.01,
    on_admit: Callable[[ReadyBuffer, Admission], None] = lambda buffer, admission: None,
) -> CheckpointingSession:
    """The RL stage in ``run_dir`` from ``state`` (resumed: the roles' weights from its checkpoint), until
    it ends or, with ``killed``, until that is set; then the stage's task is cancelled (what a kill
    leaves was copied at the point; for a stop signal this is the stop). Episode ``i`` lasts
    ``duration(i)`` seconds."""
    engine = FakeEngine()
    await engine.start()
    cfg = load_config(None, CONFIG)
    log = RunLog(run_dir, tensorboard=False, console=False)
    try:
        async with EngineClient(engine.url) as client:
            s = CheckpointingSession(
                cfg, GeneratingLoop(client, duration), on_admit=on_admit, run_dir=run_dir, engine_url=engine.url
            )
            s.served_version = state.version  # the engines' sync at the start
            checkpoint = RunState.checkpoint_dir(run_dir)
            if state.step:
                await s.actor.load(checkpoint / "actor")
                await s.critic.load(checkpoint / "critic")
            task = asyncio.create_task(run_stage(s, state, log, rl(cfg, True)))
            waits = [task] + ([asyncio.ensure_future(killed.wait())] if killed else [])
            await asyncio.wait(waits, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            results = await asyncio.gather(*waits, return_exceptions=True)
            if killed is None:
                assert task.done() and not isinstance(results[0], BaseException), results[0]
            else:
                assert killed.is_set(), f"the point was never reached: {results[0]!r}"
            return s
    finally:
        log.close()
        await engine.stop()


def _per_step(state: RunState) -> dict[int, set]:
    steps: dict[int, set] = {}
    for step, split, index, member in state.trained_prompts:
        steps.setdefault(step, set()).add((split, index, member))
    return steps


@pytest.mark.parametrize("point", list(POINTS))
def test_a_kill_at_the_point_leaves_a_complete_checkpoint_and_the_resume_trains_the_same_prompts(
    point, tmp_path, monkeypatch
):
    run_dir, left = tmp_path / "run", tmp_path / "left"
    killed = asyncio.Event()

    def sigkill(pid: int) -> None:  # what is on disk now is what a SIGKILL leaves
        shutil.copytree(run_dir, left)
        killed.set()
        raise Killed(point)

    monkeypatch.setenv("SAO_KILL_AT", point)
    monkeypatch.setattr(faults, "_reached", {})
    monkeypatch.setattr(faults, "_kill_run", sigkill)
    asyncio.run(_run(run_dir, RunState(stage="rl"), killed))
    monkeypatch.delenv("SAO_KILL_AT")

    step, last_logged = POINTS[point]
    checkpoint = RunState.complete_checkpoint(left)
    assert checkpoint is not None, f"{point}: no complete checkpoint left"
    saved = json.loads((checkpoint / "state.json").read_text())
    assert saved["stage"] == "rl" and saved["step"] == saved["version"] == step, (point, checkpoint, saved)
    for role in ("actor", "critic"):  # the roles' weights of that step, next to it
        assert json.loads((checkpoint / role / "weights.json").read_text()) == step, role
    if point.startswith("checkpoint:renaming"):
        assert checkpoint.name == "checkpoint.old" and not (left / "checkpoint").exists()
    else:
        assert checkpoint.name == "checkpoint"
    if point.startswith("checkpoint:"):  # the half-published one is not picked
        assert json.loads((RunState.staging_dir(left) / "state.json").read_text())["step"] == step + 1
    logged = [r["step"] for r in read_metrics(left) if r["stage"] == "rl"]
    assert logged == list(range(1, last_logged + 1)), logged

    state = RunState.load(left)  # restores checkpoint.old/ when the kill came between the renames
    assert state.step == step and _per_step(state) == {k: UNINTERRUPTED[k] for k in range(1, step + 1)}
    resumed = asyncio.run(_run(left, state))
    assert [sorted(u.indices) for u in resumed.actor.updates] == [
        sorted(i for _, i, _ in UNINTERRUPTED[k]) for k in range(step + 1, STEPS + 1)
    ]  # from the step after the checkpoint's
    assert resumed.actor.weights() == resumed.critic.weights() == STEPS
    final = RunState.load(left)
    assert final.step == STEPS and _per_step(final) == UNINTERRUPTED
    keys = [tuple(k[1:]) for k in final.trained_prompts]
    assert len(keys) == len(set(keys)) == 4 * STEPS, "a prompt was trained twice (or lost)"
    # metrics.jsonl: every RL step once (a step re-run after a resume replaces the lost attempt's record)
    assert [r["step"] for r in read_metrics(left) if r["stage"] == "rl"] == list(range(1, STEPS + 1))


def test_a_stop_while_a_batch_is_generated_checkpoints_it_and_the_resume_trains_the_same_prompts(tmp_path):
    """A stop (SIGTERM, Slurm's USR1: the run's task cancelled) while step 2's episodes run, two of
    them finished: the stage checkpoints those (waiting in the buffer) and the other two for
    resubmission; the resumed run completes that batch with exactly them, as the uninterrupted run
    did, then goes on with the next prompts."""
    run_dir = tmp_path / "run"
    stop = asyncio.Event()

    def on_admit(buffer: ReadyBuffer, admission: Admission) -> None:
        if admission.index >= 4 and len(buffer) == 2:
            stop.set()

    def duration(i: int) -> float:  # 6 and 7 run until the stop
        return 5.0 if i in (6, 7) else 0.01

    asyncio.run(_run(run_dir, RunState(stage="rl"), stop, duration, on_admit))
    state = RunState.load(run_dir)
    assert state.step == 1 and _per_step(state) == {1: UNINTERRUPTED[1]}
    waiting = sorted(t["sample_index"] for t in state.buffer["waiting"])
    resubmit = sorted(i for _, i, _ in state.cursor["resubmit"])
    assert (waiting, resubmit) == ([4, 5], [6, 7]), (state.buffer, state.cursor)
    resumed = asyncio.run(_run(run_dir, state))
    assert [sorted(u.indices) for u in resumed.actor.updates] == [[4, 5, 6, 7], [8, 9, 10, 11]]
    final = RunState.load(run_dir)
    assert final.step == STEPS and _per_step(final) == UNINTERRUPTED
