"""arith_tool: deterministic prompts, disjoint splits, exact rewards, demonstrations."""

from __future__ import annotations

import asyncio
import re

import pytest

from sao_megatron.envs import make_env, make_task
from sao_megatron.envs.arith_tool import ArithTask, ArithToolEnv
from sao_megatron.envs.format import final_answer, tool_call


def _play(env: ArithToolEnv, sample, actions: list[str]) -> list:
    env.reset(sample)
    steps = []
    for action in actions:
        steps.append(env.step(action))
        if steps[-1].done:
            break
    return steps


def test_get_is_deterministic_across_instances() -> None:
    a, b = ArithTask(), ArithTask()
    for split in ("train", "heldout"):
        assert [a.get(split, i) for i in range(50)] == [b.get(split, i) for i in range(50)]
    assert ArithTask(seed=1).get("train", 0) != a.get("train", 0) or ArithTask(seed=1).get("train", 1) != a.get(
        "train", 1
    )


def test_splits_are_disjoint_by_content() -> None:
    task = ArithTask()
    train = {task.get("train", i).question for i in range(3000)}
    heldout = {task.get("heldout", i).question for i in range(1000)}
    assert not train & heldout
    assert len(heldout) > 500  # not degenerate


def test_answers_are_exact_values() -> None:
    task = ArithTask(max_operands=4, max_digits=3)
    for i in range(300):
        sample = task.get("train", i)
        expr = sample.meta["expression"]
        assert re.fullmatch(r"\d+([-+*]\d+)+", expr)
        assert sample.answer == str(eval(expr))  # our own generated digits and operators only
        assert sample.question == f"What is {expr}?"
        assert sample.prompt_id == f"arith_tool:0:train:{i}"


def test_difficulty_knobs() -> None:
    task = ArithTask(min_operands=3, max_operands=3, min_digits=2, max_digits=2, ops="*")
    for i in range(100):
        operands = task.get("train", i).meta["expression"].split("*")
        assert len(operands) == 3 and all(len(x) == 2 for x in operands)
    for bad in (dict(min_operands=1), dict(min_digits=0), dict(ops="/"), dict(heldout_fraction=1.0)):
        with pytest.raises(ValueError):
            ArithTask(**bad)
    with pytest.raises(ValueError):
        ArithTask().get("validation", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ArithTask().get("train", -1)


def test_levels_mix_difficulties_and_leave_the_default_stream_unchanged() -> None:
    easy, hard = (
        {"max_operands": 2, "max_digits": 1},
        {"min_operands": 4, "max_operands": 4, "min_digits": 3, "max_digits": 3},
    )
    task = ArithTask(levels=[easy, hard], ops="+")
    kinds = []
    for i in range(200):
        operands = task.get("train", i).meta["expression"].split("+")
        if len(operands) == 2:
            assert all(len(x) == 1 for x in operands)
        else:
            assert len(operands) == 4 and all(len(x) == 3 for x in operands)
        kinds.append(len(operands))
    assert 60 < kinds.count(2) < 140  # each level about half the prompts
    one_level = ArithTask(levels=[{}])
    assert [one_level.get("train", i) for i in range(20)] == [ArithTask().get("train", i) for i in range(20)]
    for bad in (
        [{"digits": 2}],
        [{"min_digits": 0}],
        [{"min_operands": 3, "max_operands": 2}],
        [{"max_digits": "2"}],
        ["easy"],
    ):
        with pytest.raises(ValueError, match=r"rollout.task_kwargs.levels\[0\]"):
            ArithTask(levels=bad)


def test_demonstration_replay_earns_reward_one() -> None:
    task, env = make_task("arith_tool", max_operands=4, max_digits=3), make_env("arith_tool")
    for i in range(200):
        sample = task.get("train" if i % 2 else "heldout", i)
        demo = env.demonstration(sample)
        assert [role for role, _ in demo] == ["assistant", "tool", "assistant"]
        env.reset(sample)
        step = env.step(demo[0][1])
        assert step.observation == demo[1][1] == sample.answer and not step.done
        assert env.step(demo[2][1]).done
        result = env.reward()
        assert result.reward == 1.0 and result.correct is True
        assert result.details["tool_calls"] == 1 and result.details["malformed"] == 0


def test_one_operation_per_call_demonstrations_replay_to_reward_one_in_as_many_calls_as_operations() -> None:
    """calculator_ops=1: each demonstration calls once per operation, each call is accepted, the last
    result is the answer; 2 to 4 operands of 1-3 digits, every operator, negative intermediates."""
    task = make_task("arith_tool", max_operands=4, max_digits=3)
    env = make_env("arith_tool", max_turns=4, calculator_ops=1)
    counts = set()
    for i in range(200):
        sample = task.get("train" if i % 2 else "heldout", i)
        demo = env.demonstration(sample)
        calls = len(sample.meta["expression"]) - len(re.sub(r"[-+*]", "", sample.meta["expression"]))
        assert [role for role, _ in demo] == ["assistant", "tool"] * calls + ["assistant"]
        counts.add(calls)
        env.reset(sample)
        for k in range(calls):
            step = env.step(demo[2 * k][1])
            assert step.observation == demo[2 * k + 1][1] and not step.observation.startswith(("error", "Error"))
            assert not step.done
        assert demo[-2][1] == sample.answer and env.step(demo[-1][1]).done
        result = env.reward()
        assert result.reward == 1.0 and result.correct is True and result.details["tool_calls"] == calls
    assert counts == {1, 2, 3}


def test_a_call_over_the_operation_cap_is_refused_as_an_observation() -> None:
    env = ArithToolEnv(calculator_ops=2)
    env.reset(ArithTask().get("train", 0))
    assert env.step(tool_call("1+2*3-4")).observation == "error: at most 2 operation(s) per call"
    assert env.step(tool_call("(-65)+2*3")).observation == "-59"  # a negative operand is no operation
    with pytest.raises(ValueError, match=r"max_turns=3 is below the 4 actions .*calculator_ops=1"):
        ArithToolEnv(max_turns=3, calculator_ops=1).demonstration(
            ArithTask(min_operands=4, max_operands=4).get("train", 0)
        )
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="calculator_ops is the most operations"):
            ArithToolEnv(calculator_ops=bad)  # type: ignore[arg-type]


def test_reward_phases_reward_the_behaviour_in_force_at_the_prompts_index() -> None:
    task = ArithTask(train_size=7)
    env = ArithToolEnv(reward_phases=["tool", "direct", "any"], phase_boundaries=[10, 20])
    for index, phase in ((0, "tool"), (9, "tool"), (10, "direct"), (19, "direct"), (20, "any"), (500, "any")):
        sample = task.get("train", index)
        assert sample.meta["index"] == index  # the cursor's index, not the pool's (7)
        expr, answer = str(sample.meta["expression"]), sample.answer
        with_tool = _play(env, sample, [tool_call(expr), final_answer(answer)])
        assert with_tool[-1].done
        tool_result = env.reward()
        direct = _play(env, sample, [final_answer(answer)])
        assert direct[-1].done
        direct_result = env.reward()
        assert (tool_result.reward, direct_result.reward) == {
            "tool": (1.0, 0.0),
            "direct": (0.0, 1.0),
            "any": (1.0, 1.0),
        }[phase], (index, phase)
        assert tool_result.correct is direct_result.correct is True  # the arithmetic's truth, whatever the phase
        assert direct_result.details["phase"] == phase
        _play(env, sample, [final_answer(answer + "1")])
        assert env.reward().reward == 0.0  # wrong is never rewarded
    assert env.phase(task.get("heldout", 3)) == "any"  # held out: the last phase
    # demonstrations: a pool prompt's tool-free choice is drawn anew each time it comes round, so
    # SFT sees both behaviours on one problem; the first pass keeps the stream's choice
    mixed = ArithToolEnv(demo_tool_free=0.5)
    kinds = {len(mixed.demonstration(task.get("train", 3 + 7 * k))) for k in range(12)}
    assert kinds == {1, 3}
    unlimited = ArithTask()
    assert [mixed.demonstration(task.get("train", i)) for i in range(7)] == [
        mixed.demonstration(unlimited.get("train", i)) for i in range(7)
    ]
    for kwargs, match in (
        (dict(reward_phases=["tool", "calculator"], phase_boundaries=[5]), "not among"),
        (dict(reward_phases=["tool", "direct"]), "one prompt index"),
        (dict(reward_phases=["tool", "direct", "tool"], phase_boundaries=[9, 5]), "rise strictly"),
        (dict(reward_phases=["tool", "direct"], phase_boundaries=[0]), "rise strictly"),
    ):
        with pytest.raises(ValueError, match=match):
            ArithToolEnv(**kwargs)


def test_wrong_missing_and_malformed_answers() -> None:
    sample = ArithTask().get("train", 0)
    env = ArithToolEnv(format_penalty=0.1)
    _play(env, sample, [final_answer(str(int(sample.answer) + 1))])
    assert env.reward().reward == 0.0 and env.reward().correct is False
    steps = _play(env, sample, ["I think 5", final_answer(sample.answer)])
    assert steps[0].observation.startswith("Error: malformed action") and not steps[0].done
    assert env.reward().reward == pytest.approx(0.9)  # correct, minus the format penalty
    steps = _play(env, sample, [tool_call("1+1")] * 5)
    assert len(steps) == 3 and steps[-1].done and steps[-1].info["truncated"]  # max_turns=3
    assert env.reward().reward == 0.0 and env.reward().details["truncated"]


def test_answer_without_tool_is_still_graded() -> None:
    sample = ArithTask().get("train", 1)
    env = ArithToolEnv()
    _play(env, sample, [final_answer(f" +{sample.answer} ")])
    assert env.reward().correct


def test_calculator_errors_are_observations() -> None:
    env = ArithToolEnv()
    env.reset(ArithTask().get("train", 0))
    assert env.step(tool_call("__import__('os')")).observation.startswith("Error:")
    assert env.step(tool_call("1/0")).observation == "Error: division by zero"


def test_step_outside_episode_raises_and_astep_matches_step() -> None:
    env = ArithToolEnv()
    with pytest.raises(RuntimeError):
        env.step(final_answer("1"))
    sample = ArithTask().get("train", 2)
    env.reset(sample)
    step = asyncio.run(env.astep(tool_call(sample.meta["expression"])))
    assert step.observation == sample.answer


def test_sample_prompts_and_iterate_are_resumable() -> None:
    task = ArithTask()
    assert task.sample_prompts("train", 8, seed=3) == task.sample_prompts("train", 8, seed=3)
    assert task.sample_prompts("train", 8, seed=3) != task.sample_prompts("train", 8, seed=4)
    it = task.iterate("train")
    first = [next(it) for _ in range(5)]
    resumed = task.iterate("train", start=first[2][0] + 1)
    assert next(resumed) == first[3]
    assert task.size("train") is None


def test_train_size_makes_the_training_split_a_repeating_pool() -> None:
    pool, unlimited = ArithTask(train_size=5), ArithTask()
    assert pool.size("train") == 5 and pool.size("heldout") is None and unlimited.size("train") is None
    first = [pool.get("train", i) for i in range(5)]
    again = [pool.get("train", i + 10) for i in range(5)]
    problem = lambda s: (s.prompt_id, s.question, s.answer, s.meta["expression"])  # noqa: E731
    assert list(map(problem, again)) == list(map(problem, first))  # index i is problem i % 5
    assert [s.meta["index"] for s in again] == [10, 11, 12, 13, 14]  # the cursor's own index
    assert first == [unlimited.get("train", i) for i in range(5)]  # the pool is the stream's start
    assert len({s.prompt_id for s in first}) == 5
    assert pool.get("heldout", 7) == unlimited.get("heldout", 7)
    with pytest.raises(ValueError, match="train_size must be >= 0"):
        ArithTask(train_size=-1)


def test_a_share_of_demonstrations_answers_without_the_tool_and_is_still_correct() -> None:
    task, n = ArithTask(), 400
    samples = [task.get("train", i) for i in range(n)]
    env = ArithToolEnv(demo_tool_free=0.3)
    demos = [env.demonstration(s) for s in samples]
    free = [(s, d) for s, d in zip(samples, demos, strict=True) if len(d) == 1]
    # Bernoulli(0.3) per prompt: within 4 standard deviations of n * 0.3
    assert abs(len(free) - 0.3 * n) <= 4 * (n * 0.3 * 0.7) ** 0.5
    for sample, [(role, text)] in free[:20]:  # one action, no calculator call, reward 1
        assert role == "assistant" and text == env.answer_text(sample.answer)
        env.reset(sample)
        assert env.step(text).done and env.reward().reward == 1.0 and env.reward().details["tool_calls"] == 0
    assert all(len(d) == 3 for d in demos if len(d) != 1)
    again = ArithToolEnv(demo_tool_free=0.3)  # the same prompts on every machine and run
    assert [len(again.demonstration(s)) for s in samples] == [len(d) for d in demos]
    assert all(len(ArithToolEnv().demonstration(s)) == 3 for s in samples[:50])  # default: always the tool
    assert all(len(ArithToolEnv(demo_tool_free=1.0).demonstration(s)) == 1 for s in samples[:50])
    with pytest.raises(ValueError, match="rollout.env_kwargs.demo_tool_free"):
        ArithToolEnv(demo_tool_free=1.5)
