"""writing_shift: the schedule, the deterministic judge, and pluggable judges."""

from __future__ import annotations

import pytest

from sao_megatron.envs import make_env
from sao_megatron.envs.writing_shift import (
    STYLES,
    HeuristicJudge,
    StyleSchedule,
    WritingShiftEnv,
    WritingTask,
    example_response,
)


def test_schedule_switches_three_times() -> None:
    sched = StyleSchedule()
    assert [sched.style_at(p) for p in (0, 99, 100, 199, 200, 300, 10**6)] == [
        "concise",
        "concise",
        "verbose",
        "verbose",
        "formal",
        "casual",
        "casual",
    ]
    with pytest.raises(ValueError):
        StyleSchedule(boundaries=(10,), styles=("concise",))
    with pytest.raises(ValueError):
        StyleSchedule(boundaries=(20, 10), styles=("concise", "formal", "casual"))
    with pytest.raises(ValueError):
        StyleSchedule(boundaries=(10,), styles=("concise", "sarcastic"))


def test_each_example_scores_best_under_its_own_style() -> None:
    task, judge = WritingTask(), HeuristicJudge()
    for i in range(40):
        sample = task.get("train", i)
        for style in STYLES:
            own = judge.score(sample.question, example_response(sample, style), style)
            others = [judge.score(sample.question, example_response(sample, s), style) for s in STYLES if s != style]
            assert own >= 0.8 and own > max(others), (style, own, others)


def test_same_response_is_rewarded_differently_after_a_switch() -> None:
    sample = WritingTask().get("train", 3)
    response = example_response(sample, "concise")
    rewards = []
    for progress in (0, 150):
        env = make_env("writing_shift", progress=progress)
        assert env.reset(sample) == sample.question
        step = env.step(response + "<|end|>")
        assert step.done and step.observation is None
        result = env.reward()
        assert result.correct is None and 0.0 <= result.reward <= 1.0
        rewards.append(result.reward)
    assert rewards[0] == 1.0 and rewards[1] < 0.5


def test_judge_is_deterministic_and_penalises_off_topic() -> None:
    judge, sample = HeuristicJudge(), WritingTask().get("train", 0)
    text = example_response(sample, "formal")
    assert judge.score(sample.question, text, "formal") == judge.score(sample.question, text, "formal")
    off_topic = "Dear colleague, please note the arrangements are complete. Sincerely, the team."
    assert judge.score(sample.question, off_topic, "formal") < judge.score(sample.question, text, "formal")
    assert judge.score(sample.question, "ok", "concise") == 0.0


def test_custom_judge_plugs_in() -> None:
    class LengthJudge:
        def score(self, prompt: str, response: str, style: str) -> float:
            return len(response) / 100

    env = WritingShiftEnv(judge=LengthJudge())
    env.reset(WritingTask().get("train", 0))
    env.step("x" * 50)
    assert env.reward().reward == 0.5


def test_splits_disjoint_and_demonstration_follows_the_schedule() -> None:
    task = WritingTask()
    train = {task.get("train", i).question for i in range(500)}
    heldout = {task.get("heldout", i).question for i in range(200)}
    assert not train & heldout
    sample = task.get("heldout", 0)
    env = WritingShiftEnv(progress=250)
    ((role, text),) = env.demonstration(sample)
    env.reset(sample)
    env.step(text)
    assert role == "assistant" and env.style == "formal" and env.reward().reward >= 0.8


def test_the_style_shifts_with_the_prompt_index_during_a_run() -> None:
    task = WritingTask()
    env = WritingShiftEnv(boundaries=[10, 20, 30], shift_by_prompt_index=True)
    styles = []
    for index in (0, 9, 10, 25, 31):
        env.reset(task.get("train", index))
        styles.append(env.style)
    assert styles == ["concise", "concise", "verbose", "formal", "casual"]
    env.reset(task.get("heldout", 25))  # held-out episodes (and demonstrations) keep `progress`
    assert env.style == "concise" and env.demonstration(task.get("train", 25))[0][1].count(" ") < 12
    plain = WritingShiftEnv(boundaries=[10, 20, 30])
    plain.reset(task.get("train", 25))
    assert plain.style == "concise"  # without shift_by_prompt_index the style is progress's
