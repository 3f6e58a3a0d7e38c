"""``Session.evaluate``: greedy pass@1 and mean accuracy over k samples, on a scripted agent loop."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import cast

import pytest

from sao_megatron.config import load_config
from sao_megatron.driver import session as session_module
from sao_megatron.driver.session import Session
from sao_megatron.envs import make_task
from sao_megatron.rollout.client import EngineClient
from sao_megatron.rollout.manager import EngineStates


@dataclass
class Result:
    correct: bool
    reward: float
    status: str = "finished"
    num_turns: int = 2


class ScriptedEvalLoop:
    """Greedy (temperature 0): prompt i is right iff i is even. Sampled: the j-th sample of prompt i
    is right iff j < i % 4 (so prompt i's mean accuracy over k=4 samples is (i % 4) / 4)."""

    calls: list[tuple[float, int, str]] = []
    seen: Counter = Counter()
    max_turns: set[int] = set()

    def __init__(self, client, tokenizer, loop_cfg, engine_name="", update_policy="retract", gateway=None) -> None:
        self.temperature = loop_cfg.temperature
        ScriptedEvalLoop.max_turns.add(loop_cfg.max_turns)

    async def run(self, env, sample, split="train", index=-1, submitted_at=None) -> Result:
        await asyncio.sleep(0)
        ScriptedEvalLoop.calls.append((self.temperature, index, split))
        if self.temperature == 0.0:
            return Result(index % 2 == 0, float(index % 2 == 0))
        j = ScriptedEvalLoop.seen[index]
        ScriptedEvalLoop.seen[index] += 1
        if index == 5 and j == 0:
            return Result(False, 0.0, status="failed")
        return Result(j < index % 4, float(j < index % 4))


def make_session(overrides: list[str]) -> Session:
    cfg = load_config(None, ["rollout.env=math_python", *overrides])
    session = object.__new__(Session)  # no Ray, engines or tokenizer: evaluate needs none of them
    session.cfg, session.tokenizer = cfg, None
    session.task = make_task(cfg.rollout.env, dataset=cfg.data, **cfg.rollout.task_kwargs)
    session.clients = [cast(EngineClient, object()), cast(EngineClient, object())]
    session.engine_states = EngineStates(2)  # both up
    return session


@pytest.fixture(autouse=True)
def scripted(monkeypatch):
    ScriptedEvalLoop.calls, ScriptedEvalLoop.seen, ScriptedEvalLoop.max_turns = [], Counter(), set()
    monkeypatch.setattr(session_module, "AgentLoop", ScriptedEvalLoop)


def test_greedy_pass1_and_mean_accuracy_over_k_samples() -> None:
    session = make_session(["train.eval_prompts=8", "train.eval_samples=4", "train.eval_sample_temperature=0.7"])
    metrics = asyncio.run(session.evaluate())
    assert metrics["eval/accuracy"] == 0.5 and metrics["eval/reward"] == 0.5
    # prompts 0..7: i % 4 correct samples of 4, except prompt 5 whose first (correct) sample failed
    assert metrics["eval/mean_accuracy@4"] == pytest.approx((2 * (0 + 1 + 2 + 3) - 1) / 32)
    assert metrics["eval/pass@4"] == 5 / 8  # i % 4 > 0, but prompt 5 lost its one correct sample
    assert metrics["eval/accuracy_se"] == pytest.approx((0.5 * 0.5 / 8) ** 0.5)  # binomial over 8 prompts
    means = [(i % 4 - (i == 5)) / 4 for i in range(8)]
    assert metrics["eval/mean_accuracy@4_se"] == pytest.approx(statistics.stdev(means) / 8**0.5)
    assert metrics["eval/sampled_failed"] == 1.0 and metrics["eval/failed"] == 0.0
    temps = Counter(t for t, _, _ in ScriptedEvalLoop.calls)
    assert temps == {0.0: 8, 0.7: 32}
    assert {split for _, _, split in ScriptedEvalLoop.calls} == {"heldout"}
    assert sorted(i for t, i, _ in ScriptedEvalLoop.calls if t == 0.0) == list(range(8))


@pytest.mark.parametrize(("overrides", "expected"), [([], 5), (["train.eval_max_turns=7"], 7)])
def test_evaluation_episodes_take_the_loops_turn_limit_unless_eval_max_turns_is_set(overrides, expected) -> None:
    session = make_session(["train.eval_prompts=4", "train.eval_samples=2", "rollout.loop.max_turns=5", *overrides])
    asyncio.run(session.evaluate())
    assert ScriptedEvalLoop.max_turns == {expected}  # the greedy and the sampled episodes alike


def test_without_samples_only_pass1_and_prompts_capped_at_the_heldout_size() -> None:
    session = make_session(["train.eval_prompts=1000"])
    size = session.task.size("heldout")
    metrics = asyncio.run(session.evaluate())
    assert set(metrics) == {"eval/accuracy", "eval/accuracy_se", "eval/reward", "eval/failed", "eval/turns"}
    assert len(ScriptedEvalLoop.calls) == size == 11  # every held-out problem once, none repeated
    assert asyncio.run(make_session(["train.eval_prompts=0"]).evaluate()) == {}


def test_report_and_plots_show_the_sampled_figures(tmp_path) -> None:
    import json

    from sao_megatron.report import summary, write_report

    records = [
        {
            "stage": "eval",
            "step": 0,
            "time": 0.0,
            "eval/accuracy": 0.5,
            "eval/mean_accuracy@16": 0.25,
            "eval/pass@16": 0.75,
        },
        {"stage": "rl", "step": 1, "time": 1.0, "rollout/reward": 0.5},
        {
            "stage": "rl",
            "step": 2,
            "time": 2.0,
            "eval/accuracy": 0.625,
            "eval/mean_accuracy@16": 0.375,
            "eval/pass@16": 0.875,
        },
    ]
    text = summary(records)
    assert "held-out accuracy: 0.500 (start of RL, step 0) -> 0.625 (step 2)" in text
    assert "held-out mean accuracy over 16 samples: 0.250 (step 0) -> 0.375 (step 2)" in text
    assert "held-out pass@16: 0.750 (step 0) -> 0.875 (step 2)" in text
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(tmp_path)
    assert any(p.name.endswith("_held-out.png") for p in (tmp_path / "report").iterdir())
