"""The ready buffer: admission by lag, failures, distinct prompts, groups, never twice, state."""

import pytest

from sao_megatron.buffer import ReadyBuffer
from tests.rollout.fakes import make_trajectory


def traj(i, version=0, status="finished", group=None, member=0, finished_at=None):
    t = make_trajectory(f"p{i}", i, version, status, finished_at)
    t.group_id = group or f"train:{i}"
    t.reward_details = {"group_index": member}
    return t


def test_sao_batches_in_finish_order_from_distinct_prompts():
    buf = ReadyBuffer(batch_size=3)
    for i in (5, 2, 9, 4):
        assert buf.admit(traj(i), current_version=0)
    batch = buf.take()
    assert [t.sample_index for t in batch] == [5, 2, 9]
    assert buf.take() is None and len(buf) == 1


def test_a_prompt_repeated_by_a_wrapped_cursor_waits_for_a_later_batch():
    # A 2-row dataset read at indices 0..3: rows p0, p1, p0, p1 (group ids differ, prompts repeat).
    buf = ReadyBuffer(batch_size=2)
    for index, row in ((0, 0), (2, 0), (1, 1), (3, 1)):
        t = traj(row)
        t.group_id = f"train:{index}"
        assert buf.admit(t, 0)
    assert [(t.prompt_id, t.group_id) for t in buf.take() or []] == [("p0", "train:0"), ("p1", "train:1")]
    assert [(t.prompt_id, t.group_id) for t in buf.take() or []] == [("p0", "train:2"), ("p1", "train:3")]
    buf.admit(traj(7), 0)
    t = traj(7)
    t.group_id = "train:9"
    buf.admit(t, 0)
    assert not buf.ready() and buf.take() is None and len(buf) == 2  # two of one prompt never make a batch
    # GRPO: groups of a batch are distinct prompts too.
    grpo = ReadyBuffer(batch_size=4, group_size=2)
    for index in (0, 2, 1):
        for m in (0, 1):
            t = traj(index % 2, group=f"train:{index}", member=m)
            assert grpo.admit(t, 0)
    assert [t.group_id for t in grpo.take() or []] == ["train:0", "train:0", "train:1", "train:1"]


def test_lag_bound_and_failures_are_dropped_and_counted():
    buf = ReadyBuffer(batch_size=1, max_policy_lag=2)
    assert not buf.admit(traj(1, version=0), current_version=3)
    assert buf.admit(traj(2, version=1), current_version=3)
    assert not buf.admit(traj(3, status="failed"), current_version=3)
    assert buf.stats.dropped_stale == 1 and buf.stats.dropped_failed["engine"] == 1
    assert buf.discard_stale(current_version=4) == 1 and len(buf) == 0


def test_zero_action_trajectories_are_dropped_counted_and_checkpointed():
    buf = ReadyBuffer(batch_size=1)
    empty = traj(1, status="truncated")  # the prompt alone filled the context: nothing generated
    empty.response_ids, empty.action_mask, empty.behavior_logprobs, empty.policy_versions = [], [], [], []
    observed_only = traj(2)
    observed_only.action_mask = [0, 0, 0]  # tokens, but none of them an action
    assert not buf.admit(empty, current_version=0) and not buf.admit(observed_only, current_version=0)
    assert buf.stats.dropped_no_actions == 2 and buf.stats.admitted == 0 and len(buf) == 0
    assert buf.admit(traj(3), current_version=0)
    restored = ReadyBuffer(batch_size=1)
    restored.load_state_dict(buf.state_dict())
    assert restored.stats.dropped_no_actions == 2
    legacy = buf.state_dict()
    del legacy["stats"]["dropped_no_actions"]  # a checkpoint written before the counter existed
    restored.load_state_dict(legacy)
    assert restored.stats.dropped_no_actions == 0


def test_observer_reports_the_drops_by_cause():
    from sao_megatron.driver.observer import buffer_metrics

    buf = ReadyBuffer(batch_size=2)
    buf.admit(traj(1), 0)
    buf.admit(traj(2, status="failed"), 0)
    empty = traj(3)
    empty.action_mask = [0, 0, 0]
    buf.admit(empty, 0)
    m = buffer_metrics(buf)
    assert m == {
        "buffer/waiting": 1.0,
        "buffer/dropped_stale": 0.0,
        "buffer/dropped_failed": 1.0,
        "buffer/dropped_failed/engine": 1.0,
        "buffer/dropped_no_actions": 1.0,
        "buffer/dropped_group": 0.0,
        "buffer/kept_stale": 0.0,
    }


def test_group_mode_waits_for_siblings_and_measures_the_wait():
    buf = ReadyBuffer(batch_size=4, group_size=2)
    buf.admit(traj(1, group="g1", member=0, finished_at=10.0), 0)
    buf.admit(traj(2, group="g2", member=0, finished_at=11.0), 0)
    buf.admit(traj(2, group="g2", member=1, finished_at=12.0), 0)
    assert buf.take() is None  # g1 incomplete
    buf.admit(traj(1, group="g1", member=1, finished_at=15.0), 0)
    batch = buf.take()
    assert sorted(t.group_id for t in batch) == ["g1", "g1", "g2", "g2"]
    assert sorted(buf.stats.group_waits_s) == [1.0, 5.0]


def test_never_hands_out_twice_and_round_trips_state():
    buf = ReadyBuffer(batch_size=1)
    buf.admit(traj(1), 0)
    first = buf.take()
    with pytest.raises(ValueError, match="already handed"):
        buf.admit(first[0], 0)
    buf.admit(traj(2), 0)
    restored = ReadyBuffer(batch_size=1)
    restored.load_state_dict(buf.state_dict())
    assert [t.sample_index for t in restored.take()] == [2]
    with pytest.raises(ValueError, match="already handed"):
        restored.admit(traj(1), 0)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="multiple of group_size"):
        ReadyBuffer(batch_size=6, group_size=4)


def test_a_dropped_grpo_member_drops_its_siblings_so_none_waits_forever():
    buf = ReadyBuffer(batch_size=4, group_size=2, max_policy_lag=1)
    assert buf.admit(traj(1, group="g1", member=0), 0)  # waits for its sibling ...
    assert not buf.admit(traj(1, group="g1", member=1, status="failed"), 0)  # ... which failed
    assert len(buf) == 0 and buf.stats.dropped_group == 1 and buf._broken == {}  # all accounted for
    assert not buf.admit(traj(2, group="g2", member=0, status="failed"), 0)  # failed first
    assert not buf.admit(traj(2, group="g2", member=1), 0)  # the later sibling is dropped on arrival
    assert buf.stats.dropped_group == 2 and buf._broken == {}
    for i, g in ((3, "g3"), (4, "g4")):
        for m in (0, 1):
            assert buf.admit(traj(i, group=g, member=m), 0)
    assert [t.group_id for t in buf.take() or []] == ["g3", "g3", "g4", "g4"]  # whole groups only
    # A member gone stale while waiting takes its sibling with it, and a late sibling is dropped too.
    buf3 = ReadyBuffer(batch_size=3, group_size=3, max_policy_lag=1)
    assert buf3.admit(traj(5, version=0, group="g5", member=0), 0)
    assert buf3.admit(traj(5, version=2, group="g5", member=1), 2)
    assert buf3.discard_stale(2) == 1 and len(buf3) == 0 and buf3.stats.dropped_group == 1
    state = buf3.state_dict()
    restored = ReadyBuffer(batch_size=3, group_size=3, max_policy_lag=1)
    restored.load_state_dict(state)
    assert not restored.admit(traj(5, version=2, group="g5", member=2), 2)
    assert restored.stats.dropped_group == 2 and restored._broken == {}


def test_selection_compares_what_finished_with_what_the_lag_bound_dropped_by_length():
    buf = ReadyBuffer(batch_size=8, max_policy_lag=1, response_budget=12)

    def sized(i, version, tokens, reward):
        t = traj(i, version=version)
        t.response_ids = list(range(tokens))
        t.action_mask = [1] * tokens
        t.behavior_logprobs = [-0.1] * tokens
        t.policy_versions = [version] * tokens
        t.reward = reward
        return t

    # version 3: short and fresh ones admitted, long and old ones dropped (quarters of 12: 0-2, 3-5, 6-8, 9-12)
    assert buf.admit(sized(1, 3, 2, 1.0), 3) and buf.admit(sized(2, 2, 4, 1.0), 3)
    assert not buf.admit(sized(3, 0, 11, 0.0), 3) and not buf.admit(sized(4, 1, 12, 0.5), 3)
    m = buf.selection.metrics()
    assert m["select/finished/n"] == 4 and m["select/finished/response_tokens"] == (2 + 4 + 11 + 12) / 4
    assert m["select/finished/reward"] == 2.5 / 4 and m["select/finished/turns"] == 1
    assert m["select/dropped_stale/n"] == 2 and m["select/dropped_stale/response_tokens"] == 11.5
    assert m["select/dropped_stale/reward"] == 0.25
    assert (m["select/drop_rate/len0"], m["select/drop_rate/len1"], m["select/drop_rate/len3"]) == (0.0, 0.0, 1.0)
    assert "select/drop_rate/len2" not in m  # nothing finished in that quarter

    buf.selection.window.clear()  # the learner's step: a new window; the length counts go on
    assert buf.discard_stale(current_version=4) == 1  # the version-2 one became too stale waiting
    m = buf.selection.metrics()
    assert m["select/finished/n"] == 0 and "select/finished/reward" not in m
    assert m["select/dropped_stale/n"] == 1 and m["select/drop_rate/len1"] == 1.0

    restored = ReadyBuffer(batch_size=8, max_policy_lag=1, response_budget=12)
    restored.load_state_dict(buf.state_dict())
    assert restored.selection.by_length == buf.selection.by_length == [[1, 0], [1, 1], [0, 0], [2, 2]]


def test_mask_keeps_a_trajectory_until_its_newest_action_token_is_past_the_bound():
    def spanning(i, oldest, newest):  # an episode whose turns were sampled by two versions
        t = traj(i)
        t.response_ids, t.action_mask = [7, 8, 9, 10], [1, 0, 1, 1]
        t.behavior_logprobs, t.policy_versions = [-0.1] * 4, [oldest, -1, newest, newest]
        return t

    drop = ReadyBuffer(batch_size=4, max_policy_lag=2)
    mask = ReadyBuffer(batch_size=4, max_policy_lag=2, over_lag="mask")
    for buf in (drop, mask):
        assert buf.admit(spanning(1, 3, 4), current_version=5)  # within the bound either way
    assert not drop.admit(spanning(2, 1, 4), current_version=5)  # oldest token 4 versions old
    assert mask.admit(spanning(2, 1, 4), current_version=5)  # newest 1 old: kept, its old turn masked
    assert (drop.stats.dropped_stale, drop.stats.kept_stale) == (1, 0)
    assert (mask.stats.dropped_stale, mask.stats.kept_stale) == (0, 1)
    assert mask.selection.metrics()["select/kept_stale/n"] == 1
    assert not mask.admit(spanning(3, 0, 2), current_version=5)  # every action token past the bound
    assert mask.discard_stale(current_version=6) == 0 and len(mask) == 2  # newest tokens 2 old
    restored = ReadyBuffer(batch_size=4, max_policy_lag=2, over_lag="mask")
    restored.load_state_dict(mask.state_dict())
    assert restored.stats.kept_stale == 1
    assert mask.discard_stale(current_version=7) == 2 and len(mask) == 0  # now 3 old: past the bound


def test_start_order_takes_the_waiting_episodes_that_started_first():
    finish, start = ReadyBuffer(batch_size=2), ReadyBuffer(batch_size=2, batch_order="start")
    for buf in (finish, start):
        for i, started in ((1, 30.0), (2, 20.0), (3, 10.0), (4, 25.0)):  # finish order 1, 2, 3, 4
            t = traj(i)
            t.started_at = started
            assert buf.admit(t, 0)
    assert [t.sample_index for t in finish.take() or []] == [1, 2]
    assert [t.sample_index for t in start.take() or []] == [3, 2]  # started at 10, then 20
    assert [t.sample_index for t in start.take() or []] == [4, 1]
