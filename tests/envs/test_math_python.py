"""math_python: the bundled dataset is self-consistent and the env runs code in the sandbox."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from sao_megatron.envs.answer_check import answers_match
from sao_megatron.envs.format import final_answer, tool_call
from sao_megatron.envs.math_python import DATA_PATH, MathPythonEnv, MathPythonTask
from sao_megatron.envs.sandbox import SandboxLimits, arun_python

FAST = SandboxLimits(wall_s=5.0, cpu_s=5, memory_bytes=256 << 20)


def test_dataset_fields_and_splits() -> None:
    rows = [json.loads(line) for line in DATA_PATH.read_text().splitlines() if line.strip()]
    assert 40 <= len(rows) <= 100
    assert len({r["id"] for r in rows}) == len(rows)
    task = MathPythonTask()
    train = {task.get("train", i).question for i in range(task.size("train"))}
    heldout = {task.get("heldout", i).question for i in range(task.size("heldout"))}
    assert train and heldout and not train & heldout
    assert len(train) + len(heldout) == len(rows)
    assert task.get("train", task.size("train")) == task.get("train", 0)  # wraps around


def test_every_reference_solution_prints_its_answer() -> None:
    rows = [json.loads(line) for line in DATA_PATH.read_text().splitlines() if line.strip()]

    async def run_all() -> list:
        sem = asyncio.Semaphore(8)

        async def one(code: str):
            async with sem:
                return await arun_python(code, FAST)

        return await asyncio.gather(*(one(r["solution"]) for r in rows))

    for row, result in zip(rows, asyncio.run(run_all()), strict=True):
        assert result.status == "ok", (row["id"], result)
        assert answers_match(result.stdout.strip(), row["answer"]), (row["id"], result.stdout, row["answer"])


def test_demonstration_replay_earns_reward_one() -> None:
    task, env = MathPythonTask(), MathPythonEnv(limits=FAST)
    for index in range(3):
        sample = task.get("heldout", index)
        demo = env.demonstration(sample)
        env.reset(sample)
        step = env.step(demo[0][1])
        assert not step.done and step.observation == demo[1][1]
        assert env.step(demo[2][1]).done
        assert env.reward().reward == 1.0


def test_tool_errors_and_wrong_answers() -> None:
    sample = MathPythonTask().get("train", 0)
    env = MathPythonEnv(limits=replace(FAST, wall_s=1.0))
    env.reset(sample)
    assert env.step(tool_call("1/0")).observation == "Error: ZeroDivisionError: division by zero"
    assert env.step(tool_call("while True: pass")).observation == "Error: timeout after 1s"
    assert env.step(final_answer("-12345")).done
    assert env.reward().reward == 0.0 and env.reward().correct is False


def test_astep_uses_the_async_sandbox() -> None:
    sample = MathPythonTask().get("train", 1)
    env = MathPythonEnv(limits=FAST)
    env.reset(sample)
    step = asyncio.run(env.astep(tool_call(sample.meta["solution"])))
    assert answers_match(step.observation, sample.answer)


def test_custom_dataset_path(tmp_path) -> None:
    path = tmp_path / "mini.jsonl"
    rows = [
        {"id": "a", "question": "1+1?", "answer": "2", "split": "train"},
        {"id": "b", "question": "2+2?", "answer": "4", "split": "heldout"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = MathPythonTask(path)
    assert task.get("heldout", 0).answer == "4" and task.get("train", 0).prompt_id == "math_python:a"
    path.write_text(json.dumps(rows[0]))
    with pytest.raises(ValueError, match="split 'heldout' is empty"):
        MathPythonTask(path)
