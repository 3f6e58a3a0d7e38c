"""The learner loop (``pipeline.run_stage``) on fakes: real RolloutManager, ReadyBuffer, learner_step,
AdvantageEstimator (GAE) and StepObserver; scripted episodes and recording role handles (tests/driver/fakes.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import pytest

from sao_megatron.config import ConfigError, SAOConfig, load_config
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.stages import Stage, rl, value_pretraining
from sao_megatron.observe import RunLog, read_metrics
from sao_megatron.pipeline import run_stage
from tests.driver.fakes import Checkpoint, FakeActor, FakeCritic, FakeSession, ScriptedLoop
from tests.rollout.fakes import CountingTask

pytestmark = pytest.mark.timeout(30)

# No staleness bound unless the test is about it (the buffer order and synchronous tests set one).
BASE = [
    "algo.batch_size=4",
    "algo.group_size=1",
    "rollout.max_concurrent=8",
    "algo.critic_warmup_steps=0",
    "algo.max_policy_lag=null",
    "algo.synchronous=false",
    "critic.updates_per_step=2",
    "train.eval_every=0",
    "train.save_every=0",
    "train.sample_trajectories=0",
]


def config(*overrides: str) -> SAOConfig:
    return load_config(None, [*BASE, *overrides])


async def watch(s: FakeSession, *aws, timeout: float = 10.0) -> set[asyncio.Future]:
    """Wait for the first of ``aws`` to finish; fail at once if admitting a trajectory raised (in the
    real manager that only kills the episode's task, and the learner would wait forever)."""
    futures = [asyncio.ensure_future(a) for a in aws]
    deadline = time.monotonic() + timeout
    while True:
        done, _ = await asyncio.wait(futures, timeout=0.02, return_when=asyncio.FIRST_COMPLETED)
        if s.errors:
            raise AssertionError(f"ReadyBuffer.admit raised {s.errors[0]!r}") from s.errors[0]
        if done:
            return done
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing finished within {timeout} s")


async def _finish(task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def run(s: FakeSession, stage: Stage, run_dir: Path, state: RunState | None = None) -> tuple[RunState, list[dict]]:
    """One stage to its end (deadline 10 s); the state and the metrics lines written."""
    state = state if state is not None else RunState(stage="rl")
    log = RunLog(run_dir, tensorboard=False, console=False)

    async def go() -> None:
        task = asyncio.create_task(run_stage(s, state, log, stage))
        try:
            await watch(s, task)
            task.result()
        finally:
            await _finish(task)

    try:
        asyncio.run(go())
    finally:
        log.close()
    return state, read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def cancel_when(s: FakeSession, stage: Stage, run_dir: Path, state: RunState, ready) -> float:
    """Run ``stage`` in a task, cancel it once ``await ready(task)`` returns; expects CancelledError.
    Returns the time of the cancel (monotonic)."""
    log = RunLog(run_dir, tensorboard=False, console=False)

    async def go() -> float:
        task = asyncio.create_task(run_stage(s, state, log, stage))
        try:
            waiting = asyncio.ensure_future(ready(task))
            done = await watch(s, waiting, task)
            if waiting not in done:
                waiting.cancel()
                raise AssertionError(f"run_stage ended before the stop: {task!r}")
            cancelled_at = time.monotonic()
            task.cancel()
            await watch(s, asyncio.wait([task]))
            with pytest.raises(asyncio.CancelledError):
                task.result()
            return cancelled_at
        finally:
            await _finish(task)

    try:
        return asyncio.run(go())
    finally:
        log.close()


def trained(s: FakeSession) -> list[int]:
    return [i for u in s.actor.updates for i in u.indices]


def assert_accounted(ckpt: Checkpoint, trained_indices: list[int], first: int = 0) -> None:
    """No drops: every prompt the cursor passed is trained, waiting in the buffer or to be resubmitted."""
    assert ckpt.cursor is not None and ckpt.buffer is not None
    waiting = [t["sample_index"] for t in ckpt.buffer["waiting"]]
    resubmit = [index for _, index, _ in ckpt.cursor["resubmit"]]
    everything = trained_indices + waiting + resubmit
    assert sorted(everything) == list(range(first, ckpt.cursor["next_index"])), (
        trained_indices,
        waiting,
        resubmit,
    )
    assert ckpt.buffer["stats"]["handed_out"] == len(trained_indices)


def test_batches_are_handed_out_as_they_become_ready(tmp_path):
    """Every 4th prompt takes 2 s: batches of fast ones train long before the slow ones finish."""
    cfg = config("train.steps=3")
    s = FakeSession(cfg, ScriptedLoop(duration=lambda i: 2.0 if i % 4 == 0 else 0.01))
    t0 = time.monotonic()
    state, rows = run(s, rl(cfg, True), tmp_path)
    batches = [u.indices for u in s.actor.updates]
    assert len(batches) == 3 and [r["step"] for r in rows] == [1, 2, 3]
    assert s.actor.updates[0].start - t0 < 1.0, "the first batch waited for the 2 s episodes"
    assert s.actor.updates[-1].end - t0 < 1.8
    for batch in batches:
        assert len(batch) == len(set(batch)) == cfg.algo.batch_size
        assert all(i % 4 for i in batch), f"a slow prompt in {batch}"
    flat = [i for b in batches for i in b]
    assert len(set(flat)) == len(flat), "a trajectory was trained twice"
    assert [c.indices for c in s.critic.values_calls] == batches  # critic and actor saw the same batch
    assert state.step == 3 and state.version == 3 and s.syncs == [1, 2, 3]
    assert state.trained_prompts == [[k + 1, "train", i, 0] for k, b in enumerate(batches) for i in b]
    assert all(r["rollout/in_flight_at_take"] > 0 for r in rows)  # slow episodes still running
    assert [r["rollout/prompt_index"] for r in rows] == pytest.approx([sum(b) / len(b) for b in batches])


def test_buffer_order_backpressure_and_lag_bound(tmp_path):
    """Slow learner (0.25 s updates), max_policy_lag=1, every 5th episode 0.9 s: trajectories train in
    admission order, at most max_concurrent episodes run, stale ones are dropped (on admission and
    while waiting) and none beyond the bound is trained."""
    cfg = config("train.steps=5", "algo.max_policy_lag=1")
    loop = ScriptedLoop(duration=lambda i: 0.9 if i % 5 == 0 else 0.05)
    s = FakeSession(cfg, loop, actor=FakeActor(update_s=0.25))
    state, rows = run(s, rl(cfg, True), tmp_path)
    updates = s.actor.updates
    assert len(updates) == 5

    assert loop.max_running == cfg.rollout.max_concurrent  # saturated, never above

    admitted = [a.index for a in s.admissions if a.admitted]
    position = {index: k for k, index in enumerate(admitted)}
    order = [position[i] for i in trained(s)]
    assert order == sorted(order) and len(set(order)) == len(order), "not trained in admission order"
    assert updates[0].indices == admitted[:4]

    # the buffer kept accepting while the learner was busy
    assert any(u.start < a.at < u.end for u in updates for a in s.admissions if a.admitted)

    b = s.buffer
    assert b is not None
    dropped_on_admission = sum(not a.admitted for a in s.admissions)  # no failures here: all stale
    discarded_waiting = b.stats.dropped_stale - dropped_on_admission
    assert dropped_on_admission > 0 and discarded_waiting > 0, (dropped_on_admission, discarded_waiting)
    assert max(r["buffer/dropped_stale"] for r in rows) > 0
    assert len(admitted) == len(trained(s)) + len(b) + discarded_waiting  # nothing else got lost

    started = {e.index: e.version for e in loop.episodes}
    assert all(u.version - started[i] <= 1 for u in updates for i in u.indices)
    assert all(u.max_lag <= 1 for u in updates) and any(u.max_lag == 1 for u in updates)
    assert max(r["lag/max"] for r in rows) <= 1
    assert not any(i % 5 == 0 for i in trained(s))  # the 0.9 s episodes all arrived too stale


def test_critic_warmup(tmp_path):
    cfg = config("algo.critic_warmup_steps=2", "train.steps=4")
    s = FakeSession(cfg)
    state, rows = run(s, rl(cfg, True), tmp_path)
    assert [u.step for u in s.actor.updates] == [3, 4]
    assert [u.version for u in s.actor.updates] == [0, 1]
    assert [u.indices for u in s.actor.updates] == [c.indices for c in s.critic.values_calls[2:]]
    assert [r["policy_version"] for r in rows] == [0, 0, 1, 2]
    assert s.syncs == [1, 2]
    assert [c.step for c in s.critic.updates] == [1, 1, 2, 2, 3, 3, 4, 4]  # K = 2 per step, every step
    assert state.step == 4 and state.version == 2
    assert not any(k.startswith("actor/") for r in rows[:2] for k in r)
    assert all("actor/loss" in r for r in rows[2:])


def test_value_pretraining_stops_at_target_explained_variance(tmp_path):
    """Values exact from the critic's 3rd update on (K = 1): EV 0, 0, 0, then 1 at step 4 -> stop."""
    cfg = config("train.value_pretrain_steps=10", "train.value_pretrain_target_ev=0.5", "critic.updates_per_step=1")
    s = FakeSession(cfg, critic=FakeCritic(accurate_after=3))
    state = RunState(stage="value_pretrain")
    state, rows = run(s, value_pretraining(cfg), tmp_path, state)
    rows = [r for r in rows if r["stage"] == "value_pretrain"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["critic/explained_var"] for r in rows] == pytest.approx([0.0, 0.0, 0.0, 1.0])
    assert len(s.critic.updates) == 4
    assert s.actor.started == [] and s.syncs == []
    assert [r["policy_version"] for r in rows] == [0, 0, 0, 0]
    assert state.version == 0 and state.step == 0 and state.trained_prompts == [] and state.cursor == {}
    assert s.checkpoints == []  # not resumable
    assert all(i >= 1 << 40 for c in s.critic.values_calls for i in c.indices)  # beyond the RL cursor


@pytest.mark.parametrize("stop_on", ["explained_var", "explained_var_first"])
def test_value_pretraining_stops_on_the_chosen_explained_variance_over_a_window(tmp_path, stop_on):
    """A critic exact at each first action token only, from its 3rd update on (K = 1): there the
    first-token EV is 0, 0, 0, 1, 1, ... and the all-token EV stays below 0.75. A window of 2 steps
    and a target of 0.75 stop at step 5 (means 0.5 at step 4, 1.0 at step 5) on the first-token EV,
    and never on the all-token one."""
    cfg = config(
        "train.value_pretrain_steps=7",
        "train.value_pretrain_target_ev=0.75",
        f"train.value_pretrain_stop_on={stop_on}",
        "train.value_pretrain_stop_window=2",
        "critic.updates_per_step=1",
    )
    s = FakeSession(cfg, critic=FakeCritic(accurate_after=3, first_only=True))
    state, rows = run(s, value_pretraining(cfg), tmp_path, RunState(stage="value_pretrain"))
    rows = [r for r in rows if r["stage"] == "value_pretrain"]
    assert [r["critic/explained_var_first"] for r in rows[:5]] == pytest.approx([0.0, 0.0, 0.0, 1.0, 1.0])
    assert all(r["critic/explained_var"] < 0.75 for r in rows)
    assert len(rows) == (5 if stop_on == "explained_var_first" else 7)


def test_stop_during_actor_update_completes_the_step(tmp_path):
    cfg = config("train.steps=10")
    s = FakeSession(cfg, actor=FakeActor(update_s=0.4))
    state = RunState(stage="rl")

    async def in_second_update(task):
        while len(s.actor.started) < 2:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # well inside the 0.4 s update

    cancelled_at = cancel_when(s, rl(cfg, True), tmp_path, state, in_second_update)
    updates = s.actor.updates
    assert len(s.actor.started) == len(updates) == 2, "the interrupted update did not finish"
    assert updates[1].start < cancelled_at < updates[1].end
    assert s.syncs == [1, 2] and state.version == 2 and state.step == 2
    assert state.trained_prompts == [[k + 1, "train", i, 0] for k, u in enumerate(updates) for i in u.indices]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["policy_version"] == 2
    assert [(c.step, c.version) for c in s.checkpoints] == [(2, 2)]
    ckpt = s.checkpoints[0]
    assert ckpt.at >= updates[1].end and ckpt.trained_prompts == state.trained_prompts
    assert_accounted(ckpt, trained(s))


def test_stop_while_waiting_for_a_batch(tmp_path):
    """Prompts 0-3 are fast, the rest take 5 s: after step 1 the learner waits; a stop checkpoints
    step 1 with the in-flight episodes to resubmit, and does not wait for them."""
    cfg = config("train.steps=10")
    loop = ScriptedLoop(duration=lambda i: 0.01 if i < 4 else 5.0)
    s = FakeSession(cfg, loop)
    state = RunState(stage="rl")

    async def waiting(task):
        while not (state.step == 1 and loop.running == cfg.rollout.max_concurrent):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)

    t0 = time.monotonic()
    cancel_when(s, rl(cfg, True), tmp_path, state, waiting)
    assert time.monotonic() - t0 < 3.0
    assert state.step == 1 and state.version == 1 and len(s.actor.updates) == 1
    assert [(c.step, c.version) for c in s.checkpoints] == [(1, 1)]
    ckpt = s.checkpoints[0]
    assert ckpt.cursor == {
        "split": "train",
        "next_index": 12,
        "resubmit": [["train", i, 0] for i in range(4, 12)],
    }
    assert_accounted(ckpt, trained(s))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


@pytest.mark.parametrize(
    ("failing", "expected"),
    [
        (None, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]),
        # 2 fails: 4 completes step 1's batch; 5-7 were submitted before update 1, so are dropped (lag 0)
        (2, [[0, 1, 3, 4], [8, 9, 10, 11], [12, 13, 14, 15]]),
    ],
)
def test_synchronous_batches_are_the_prompts_submitted_after_the_last_update(tmp_path, failing, expected):
    cfg = config("algo.synchronous=true", "algo.max_policy_lag=0", "train.steps=3")
    loop = ScriptedLoop(duration=lambda i: 0.01 * (1 + i % 4), failed=lambda i: i == failing)
    s = FakeSession(cfg, loop, actor=FakeActor(update_s=0.05))
    state, rows = run(s, rl(cfg, True), tmp_path)
    updates = s.actor.updates
    assert [sorted(u.indices) for u in updates] == expected
    assert [u.max_lag for u in updates] == [0, 0, 0]
    assert [r["lag/max"] for r in rows] == [0, 0, 0]
    start = {e.index: e.start for e in loop.episodes}
    for before, u in zip(updates, updates[1:], strict=False):
        assert all(start[i] > before.end for i in u.indices)
    assert not any(u.start < e.start < u.end for u in updates for e in loop.episodes), "submitted mid-update"
    assert s.buffer is not None
    assert sum(s.buffer.stats.dropped_failed.values()) == (failing is not None)
    assert s.buffer.stats.dropped_stale == (3 if failing is not None else 0)
    assert failing not in trained(s)


def test_stop_right_after_a_batch_is_taken_loses_nothing(tmp_path):
    """The stop lands in the event-loop turn after the batch became ready: the batch may already be
    taken from the buffer, but it is never trained; it must wait in the checkpoint, not vanish."""
    cfg = config("train.steps=10")
    s = FakeSession(cfg)
    state = RunState(stage="rl")
    holder: dict = {}

    def cancel_once_ready(buffer, admission):
        if buffer.ready() and "task" in holder and not holder.get("fired"):
            holder["fired"] = True
            asyncio.get_running_loop().call_soon(holder["task"].cancel)

    s.on_admit = cancel_once_ready
    log = RunLog(tmp_path, tensorboard=False, console=False)

    async def go() -> None:
        holder["task"] = task = asyncio.create_task(run_stage(s, state, log, rl(cfg, True)))
        try:
            await watch(s, asyncio.wait([task]))
            with pytest.raises(asyncio.CancelledError):
                task.result()
        finally:
            await _finish(task)

    try:
        asyncio.run(go())
    finally:
        log.close()
    assert holder.get("fired")
    assert trained(s) == []
    ckpt = s.checkpoints[-1]
    assert_accounted(ckpt, trained(s))
    assert len(ckpt.buffer["waiting"]) >= cfg.algo.batch_size


def test_stop_during_evaluation_still_logs_the_step(tmp_path):
    cfg = config("train.steps=10", "train.eval_every=1")
    s = FakeSession(cfg, eval_s=0.5)
    state = RunState(stage="rl")

    async def evaluating(task):
        while not (state.step == 1):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)

    cancel_when(s, rl(cfg, True), tmp_path, state, evaluating)
    assert [(c.step, c.version) for c in s.checkpoints] == [(1, 1)]
    rows = read_metrics(tmp_path) if (tmp_path / "metrics.jsonl").exists() else []
    assert [r["step"] for r in rows] == [1]


class NonFiniteActor(FakeActor):
    """Its updates from the ``bad_from``-th on report a skipped optimizer step (non-finite gradients)."""

    def __init__(self, bad_from: int):
        super().__init__()
        self.bad_from = bad_from

    async def update(self, placed, advantages, version):
        m = await super().update(placed, advantages, version)
        return {**m, "updated": 0.0 if len(self.updates) >= self.bad_from else 1.0}


def test_skipped_updates_keep_the_version_and_stop_the_run_after_n_in_a_row(tmp_path):
    from sao_megatron.driver.learner import TrainingDiverged

    s = FakeSession(config("train.max_skipped_steps=2", "train.steps=6"), actor=NonFiniteActor(bad_from=2))
    with pytest.raises(TrainingDiverged, match=r"2 steps in a row .*\(train\.max_skipped_steps=2\)"):
        run(s, rl(s.cfg, True), tmp_path)
    assert s.syncs == [1]  # the good first update; skipped ones neither bump the version nor sync
    assert len(s.actor.updates) == 3  # the third update is the second skipped in a row


def test_buffer_wait_excludes_the_learner_step_and_generating_is_within_occupancy(tmp_path):
    """A 0.3 s actor update: ``buffer/wait_s`` (finish -> taken) must not contain it; the engine's
    generating time is at most its occupancy (an episode in flight)."""
    cfg = config(
        "train.steps=4",
        "algo.group_size=2",
        "algo.batch_size=4",
        "rollout.max_concurrent=4",
        "algo.synchronous=true",
    )  # each batch's rollouts start after the last update
    s = FakeSession(cfg, ScriptedLoop(duration=lambda i: 0.02), actor=FakeActor(update_s=0.3), critic=None)
    s.cfg.algo.advantage = "grpo"
    state, rows = run(s, rl(cfg, True), tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # taken as it finishes; measured after the step (as before) it held the 0.3 s
        assert r["rollout/batch_size"] == 4.0
        assert r["buffer/wait_s"] < 0.1, r
        assert 0.0 <= r["rollout/engine_generating"] <= r["rollout/engine_occupancy"] + 1e-6 <= 1.0 + 1e-6
        assert r["time/interval_s"] > 0.25  # the update's 0.3 s is inside the step interval


def test_delayed_weight_sync_makes_engines_lag_and_evaluation_syncs_first(tmp_path):
    """rollout.weight_sync_every=3: the engines get versions 3 and 6 only, so episodes run on weights
    up to 2 versions behind the actor (the staleness knob); an evaluation at step 4 syncs first."""
    cfg = config("train.steps=6", "rollout.weight_sync_every=3", "train.eval_every=4")
    s = FakeSession(cfg, ScriptedLoop(duration=lambda i: 0.02), actor=FakeActor(update_s=0.05))
    state, rows = run(s, rl(cfg, True), tmp_path)
    assert s.syncs == [3, 4, 6] and state.version == 6 and s.served_version == 6
    assert {e.version for e in s.loop.episodes} <= {0, 3, 4, 6}
    assert max(r["lag/max"] for r in rows) >= 2  # trained on weights two versions old


def test_evaluation_pauses_new_episodes_and_reports_its_stall(tmp_path):
    """No training episode starts while an evaluation runs (the ones in flight finish), so the stall
    does not fill the buffer with batches of one old version; ``time/eval_s`` reports it."""
    cfg = config("train.steps=4", "train.eval_every=2", "rollout.max_concurrent=4")
    s = FakeSession(cfg, ScriptedLoop(duration=lambda i: 0.03), eval_s=0.4)
    state, rows = run(s, rl(cfg, True), tmp_path)
    assert len(s.eval_windows) == 2
    for start, end in s.eval_windows:
        assert not [e.index for e in s.loop.episodes if start + 0.01 < e.start < end], "an episode started"
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(r["time/eval_s"] >= 0.4 for r in evals)
    assert max(r["lag/max"] for r in rows) <= 1  # nothing piled up during the 0.4-s stalls


class RowsTask(CountingTask):
    """A dataset of ``n`` training rows: the cursor's index ``i`` reads row ``i % n``."""

    def __init__(self, n: int):
        self.n = n

    def get(self, split, index):
        sample = super().get(split, index)
        return dataclasses.replace(sample, prompt_id=f"row{index % self.n}")

    def size(self, split):
        return self.n


def test_batches_hold_distinct_prompts_when_the_cursor_wraps_a_small_dataset(tmp_path):
    cfg = config("train.steps=6")
    s = FakeSession(cfg, ScriptedLoop(duration=lambda i: 0.01 + 0.002 * (i % 3)), task=RowsTask(5))
    run(s, rl(cfg, True), tmp_path)
    assert len(s.actor.updates) == 6
    for u in s.actor.updates:
        rows = [i % 5 for i in u.indices]
        assert len(set(rows)) == len(rows) == 4, u.indices  # 8 in flight over 5 rows: repeats wait

    with pytest.raises(ConfigError, match=r"train split has 3 prompts but a batch takes 4 distinct ones"):
        run(FakeSession(cfg, task=RowsTask(3)), rl(cfg, True), tmp_path / "small")


@pytest.mark.parametrize("ahead", [1, 2])
def test_flow_control_keeps_the_engines_at_most_n_batches_ahead_of_a_slow_learner(tmp_path, ahead, caplog):
    """Fast episodes, a 0.2-s learner: with algo.max_batches_ahead=n the k-th fresh episode starts
    only once k <= (updates done + n) x batch, so nothing goes stale; without it the engines run on."""
    cfg = config(
        "train.steps=4",
        f"algo.max_batches_ahead={ahead}",
        "algo.max_policy_lag=1",
        "rollout.max_concurrent=16",
    )
    s = FakeSession(cfg, ScriptedLoop(duration=lambda i: 0.01), actor=FakeActor(update_s=0.2))
    state, rows = run(s, rl(cfg, True), tmp_path)
    ends = sorted(u.end for u in s.actor.updates)
    for k, episode in enumerate(sorted(s.loop.episodes, key=lambda e: e.start)):
        done = sum(end <= episode.start for end in ends)
        assert k < (done + ahead) * 4, (k, done)
    assert len(s.loop.episodes) <= (4 + ahead) * 4
    assert s.buffer is not None and s.buffer.stats.dropped_stale == 0
    assert max(r["lag/max"] for r in rows) <= ahead
    assert all(r["rollout/prompt_index"] < (r["step"] - 1 + ahead) * 4 for r in rows)  # the cursor keeps pace

    free = FakeSession(
        config("train.steps=4", "algo.max_policy_lag=1", "rollout.max_concurrent=16"),
        ScriptedLoop(duration=lambda i: 0.01),
        actor=FakeActor(update_s=0.2),
    )
    assert "ran ahead of the learner" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="sao_megatron.driver.stages"):
        _, free_rows = run(free, rl(free.cfg, True), tmp_path / "free")
    assert caplog.text.count("the engines ran ahead of the learner") == 1  # once a run, naming the fix
    assert "algo.max_batches_ahead=N" in caplog.text
    assert free_rows[-1]["rollout/prompt_index"] > (4 + ahead) * 4  # the cursor ran ahead of steps x batch
    assert len(free.loop.episodes) > 3 * len(s.loop.episodes)  # no cap: generated, then dropped as stale
    assert free.buffer is not None and free.buffer.stats.dropped_stale > 0
