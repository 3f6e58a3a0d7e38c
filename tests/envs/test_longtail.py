"""The longtail benchmark workload: seeded heavy-tailed episode shapes, exact action lengths."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from sao_megatron.config import AgentLoopConfig
from sao_megatron.envs.longtail import OBSERVATION, LongTailEnv, LongTailTask
from sao_megatron.envs.registry import make_env, make_task
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.fakes import ScriptedClient


def test_shapes_are_seeded_clipped_and_heavy_tailed():
    task = LongTailTask(
        turns_median=3,
        turns_sigma=1.0,
        max_turns=12,
        tokens_median=24,
        tokens_sigma=1.0,
        max_tokens=128,
        tool_latency_s=0.3,
        tool_sigma=1.0,
        max_tool_latency_s=5.0,
        seed=7,
    )
    shapes = [task.get("train", i).meta for i in range(2000)]
    assert (
        shapes[5]
        == LongTailTask(
            turns_median=3,
            turns_sigma=1.0,
            max_turns=12,
            tokens_median=24,
            tokens_sigma=1.0,
            max_tokens=128,
            tool_latency_s=0.3,
            tool_sigma=1.0,
            max_tool_latency_s=5.0,
            seed=7,
        )
        .get("train", 5)
        .meta
    )
    assert task.get("heldout", 5).prompt_id != task.get("train", 5).prompt_id
    turns = [len(s["action_tokens"]) for s in shapes]
    tokens = [n for s in shapes for n in s["action_tokens"]]
    latency = [x for s in shapes for x in s["tool_latency_s"]]
    assert all(len(s["tool_latency_s"]) == len(s["action_tokens"]) - 1 for s in shapes)
    assert 1 <= min(turns) and max(turns) == 12  # clipped, and the tail reaches the clip
    assert statistics.median(turns) == 3
    assert 1 <= min(tokens) and max(tokens) == 128 and 20 <= statistics.median(tokens) <= 28
    assert max(latency) == 5.0 and 0.25 <= statistics.median(latency) <= 0.35
    assert statistics.mean(tokens) > 1.4 * statistics.median(tokens)  # lognormal: mean well above median

    flat = LongTailTask(turns_median=3, tokens_median=24, tool_latency_s=0.3)  # sigma 0: identical episodes
    assert {
        (str(m["action_tokens"]), str(m["tool_latency_s"])) for m in (flat.get("train", i).meta for i in range(50))
    } == {(str([24] * 3), str([0.3] * 2))}

    # GRPO members: each its own draw, member 0 the sample itself, deterministic
    sample = task.get("train", 9)
    members = [task.member(sample, g).meta["action_tokens"] for g in range(1, 4)]
    assert task.member(sample, 2).meta == LongTailTask(**vars(task)).member(sample, 2).meta
    assert sample.meta["action_tokens"] not in members and len({str(m) for m in members}) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"turns_median": 0.5},
        {"turns_median": 9, "max_turns": 8},
        {"tokens_median": 300},
        {"tool_sigma": -1},
        {"tool_latency_s": 40},
    ],
)
def test_bad_shapes_are_refused(kwargs):
    with pytest.raises(ValueError, match="longtail"):
        LongTailTask(**kwargs)


def test_env_runs_its_turns_awaits_the_tool_and_flips_a_seeded_coin():
    task = make_task("longtail", turns_median=3, tool_latency_s=0.05)
    sample = task.get("train", 0)
    env = make_env("longtail", seed=1)
    assert isinstance(env, LongTailEnv) and env.reset(sample) == sample.question

    async def episode() -> list:
        t0 = time.perf_counter()
        steps = [await env.astep("a"), await env.astep("b"), await env.astep("c")]
        return [steps, time.perf_counter() - t0]

    steps, seconds = asyncio.run(episode())
    assert [s.done for s in steps] == [False, False, True] and steps[0].observation == OBSERVATION
    assert seconds >= 0.1  # two tool calls of 0.05 s
    rewards = set()
    for i in range(40):
        e = make_env("longtail", seed=1)
        e.reset(task.get("train", i))
        e.step("x"), e.step("y"), e.step("z")
        rewards.add(e.reward().reward)
    assert rewards == {0.0, 1.0}


def test_the_agent_loop_generates_each_turns_exact_length_with_stop_tokens_masked():
    tokenizer = load_tokenizer()
    sample = LongTailTask(
        turns_median=3, turns_sigma=1.0, tokens_median=5, tokens_sigma=1.0, max_tokens=40, seed=3
    ).get("train", 11)
    lengths = sample.meta["action_tokens"]
    client = ScriptedClient([[40 + k] * 64 for k in range(len(lengths))])
    cfg = AgentLoopConfig(max_turns=12, max_new_tokens=64, max_response_tokens=1024, max_context_tokens=2048)
    traj = asyncio.run(AgentLoop(client, tokenizer, cfg).run(make_env("longtail"), sample))  # type: ignore[arg-type]
    assert traj.status == "finished", traj.status_reason
    assert [t.end - t.start for t in traj.turns] == lengths
    assert [s.max_new_tokens for s in client.sampling] == lengths
    assert all(s.min_new_tokens == s.max_new_tokens and s.stop_token_ids and not s.ignore_eos for s in client.sampling)
