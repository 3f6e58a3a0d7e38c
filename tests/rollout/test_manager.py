"""The manager streams trajectories without a batch barrier; GRPO's group wait is real."""

import asyncio
import time

from sao_megatron.buffer import ReadyBuffer
from sao_megatron.rollout.manager import RolloutManager
from tests.rollout.fakes import CountingTask, FakeLoop


def long_tail(index, call):
    return 20.0 if index % 4 == 0 else 0.05  # every 4th prompt is 400x slower


def sibling_tail(index, call):
    return 0.3 if call % 2 == 0 else 0.02  # one sibling of each group is slow


def run_learner(group_size, batches=2, batch_size=4, durations=long_tail):
    """Take ``batches`` batches as soon as they are ready; record what was still running."""

    async def go():
        buf = ReadyBuffer(batch_size=batch_size, group_size=group_size)
        loop = FakeLoop(durations)
        manager = RolloutManager(
            [loop], CountingTask(), "arith_tool", lambda t: buf.admit(t, 0), group_size=group_size, max_concurrent=16
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(manager.run(stop))
        taken, in_flight_at_take, t0 = [], [], time.monotonic()
        while len(taken) < batches and time.monotonic() - t0 < 30:
            batch = buf.take()
            if batch is None:
                await asyncio.sleep(0.01)
                continue
            taken.append(batch)
            in_flight_at_take.append(manager.in_flight)
        stop.set()
        await runner
        await manager.drain(cancel=True)
        return taken, in_flight_at_take, buf, time.monotonic() - t0

    return asyncio.run(go())


def test_sao_learner_consumes_while_slow_episodes_still_run():
    taken, in_flight, buf, elapsed = run_learner(group_size=1)
    assert len(taken) == 2
    assert all(n > 0 for n in in_flight), "slow episodes must still be running when batches are taken"
    slow = [t.sample_index for b in taken for t in b if t.sample_index % 4 == 0]
    assert slow == [], "fast trajectories are not held back by slow ones"
    assert elapsed < 20.0, elapsed  # a barrier would wait for the 20-s slow episodes


def test_grpo_group_wait_is_measured_and_nonzero():
    taken, _, buf, _ = run_learner(group_size=2, batches=1, durations=sibling_tail)
    groups = [t.group_id for t in taken[0]]
    assert len(groups) == 4 and all(groups.count(g) == 2 for g in groups)
    waits = buf.stats.group_waits_s
    assert len(waits) == 2 and min(waits) > 0.2, waits  # the fast sibling waited for the slow one


def test_manager_state_resubmits_in_flight_prompts():
    async def go():
        finished = []
        loop = FakeLoop(lambda index, call: 0.01 if index < 3 else 5.0)
        manager = RolloutManager([loop], CountingTask(), "arith_tool", finished.append, max_concurrent=4)
        stop = asyncio.Event()
        runner = asyncio.create_task(manager.run(stop))
        await asyncio.sleep(0.3)
        manager.pause()
        state = manager.state_dict()
        stop.set()
        await asyncio.wait_for(runner, 5)
        await manager.drain(cancel=True)
        return finished, state

    finished, state = asyncio.run(go())
    done = {t.sample_index for t in finished}
    resubmit = {index for _, index, _ in state["resubmit"]}
    assert done.isdisjoint(resubmit)
    assert done | resubmit == set(range(state["next_index"])), (done, resubmit, state)


def test_a_checkpoint_at_hand_off_never_lists_the_handed_episode_for_a_rerun():
    """The learner may checkpoint between an episode's hand-off and its task's done-callback (one
    event-loop turn later): the prompt must then count as finished, not as one to re-run."""
    seen: list[tuple[int, set[int]]] = []

    async def go():
        manager: RolloutManager

        def on_finished(traj):
            seen.append((traj.sample_index, {i for _, i, _ in manager.state_dict()["resubmit"]}))

        manager = RolloutManager(
            [FakeLoop(lambda index, call: 0.01)], CountingTask(), "arith_tool", on_finished, max_concurrent=2
        )
        await manager.run(asyncio.Event(), max_prompts=6)

    asyncio.run(go())
    assert len(seen) == 6 and all(index not in resubmit for index, resubmit in seen), seen


class FlakyTask(CountingTask):
    """Record ``index`` breaks when ``index % 5 == 3``."""

    def get(self, split, index):
        if index % 5 == 3:
            raise KeyError(f"record {index} has no 'question'")
        return super().get(split, index)


def _run_manager(task, env_name="arith_tool", prompts=20, **kwargs):
    async def go():
        got = []
        manager = RolloutManager([FakeLoop(lambda i, c: 0.0)], task, env_name, got.append, max_concurrent=4, **kwargs)
        try:
            await manager.run(asyncio.Event(), max_prompts=prompts)
            return got, None
        except Exception as err:  # the manager's verdict
            return got, err
        finally:
            await manager.drain(cancel=True)

    return asyncio.run(go())


def test_a_broken_task_record_or_environment_becomes_a_failed_episode_not_a_crash():
    got, err = _run_manager(FlakyTask())
    assert err is None and len(got) == 20  # every prompt accounted for
    failed = [t for t in got if t.status == "failed"]
    assert sorted(t.sample_index for t in failed) == [3, 8, 13, 18]
    assert all(t.status_reason.startswith("task: KeyError") and not t.prompt_ids for t in failed)
    got, err = _run_manager(CountingTask(), env_name="no_such_env", prompts=5)
    assert err is None and len(got) == 5
    assert all(t.status == "failed" and t.status_reason.startswith("environment: ") for t in got)


def test_the_run_stops_with_the_causes_when_failures_cross_the_threshold():
    got, err = _run_manager(FlakyTask(), max_failed_fraction=0.1, failure_window=10)  # 20% fail
    assert type(err).__name__ == "TooManyFailures", err
    assert "rollout.max_failed_fraction=0.1" in str(err) and "('task', 2)" in str(err)
    got, err = _run_manager(FlakyTask(), max_failed_fraction=0.25, failure_window=10)  # below: runs on
    assert err is None and len(got) == 20
