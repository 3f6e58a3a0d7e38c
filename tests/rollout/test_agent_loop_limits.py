"""The agent loop's long-horizon accounting: why an episode ended (every cause), observation
budgets per call and per episode, the context and response limits (a trajectory never exceeds
them), parallel-call counts and ``max_calls_per_turn`` (also through an env worker), and the
step metrics computed from them. Scripted engine (tests/rollout/fakes.ScriptedClient), tiny
tokenizer; no engine, no Ray."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from sao_megatron.config import AgentLoopConfig
from sao_megatron.driver.observer import END_CAUSES, episode_metrics
from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.envs.format import ChatFormat
from sao_megatron.records import EpisodeStats, Trajectory, Turn
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.env_workers import EnvWorker, RemoteEnv
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.fakes import CountingTask, ScriptedClient

ECHO = "tests.rollout.test_agent_loop_limits:EchoEnv"


class EchoEnv(Env):
    """Answers each action with ``outputs[turn]`` (a string, or a tuple: parallel calls; the last
    entry repeats), ``refused`` calls per step; ends on an action holding ``<answer>``, or with
    ``info["truncated"]`` after ``env_max_turns`` actions (0: never)."""

    task_class = CountingTask

    def __init__(self, outputs=("ok",), refused: int = 0, env_max_turns: int = 0):
        self.outputs = list(outputs)
        self.refused = refused
        self.env_max_turns = env_max_turns
        self.turns = 0

    def reset(self, sample: Sample) -> str:
        self.turns = 0
        return sample.question

    def step(self, action: str) -> StepResult:
        self.turns += 1
        if "<answer>" in action:
            return StepResult(None, True)
        if self.turns == self.env_max_turns:
            return StepResult(None, True, {"truncated": True})
        out = self.outputs[min(self.turns, len(self.outputs)) - 1]
        # min(): the count depends on the limit the loop set, so a test sees that it arrived
        return StepResult(out, False, refused_calls=min(self.refused, self.max_calls_per_turn))

    def reward(self) -> RewardResult:
        return RewardResult(0.0, None, {"max_calls_per_turn": self.max_calls_per_turn})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def run(tok, env, actions, finish_reasons=None, **cfg):
    loop_cfg = AgentLoopConfig(
        **{"max_turns": 50, "max_new_tokens": 16, "max_response_tokens": 4096, "max_context_tokens": 8192, **cfg}
    )
    client = ScriptedClient(actions, finish_reasons)
    traj = asyncio.run(AgentLoop(client, tok, loop_cfg).run(env, Sample("p", "q", "a")))  # type: ignore[arg-type]
    return traj, client


def obs_ids(tok, outputs):
    """The tiny template's observation for ``outputs`` (consecutive <|tool|>..<|assistant|>)."""
    outputs = (outputs,) if isinstance(outputs, str) else outputs
    return ids(tok, "".join(f"<|tool|>{o}<|assistant|>" for o in outputs))


def test_the_loop_ends_for_each_cause(tok):
    act, answer = ids(tok, "x<|end|>"), ids(tok, "<answer>1</answer><|end|>")
    done, _ = run(tok, EchoEnv(), [act, act, answer])
    assert (done.status, done.stats.end, done.num_turns) == ("finished", "done", 3)
    env_limit, _ = run(tok, EchoEnv(env_max_turns=2), [act, act])
    assert (env_limit.status, env_limit.stats.end, env_limit.num_turns) == ("finished", "env_max_turns", 2)
    turns, _ = run(tok, EchoEnv(), [act] * 4, max_turns=4)
    assert (turns.status, turns.stats.end, turns.status_reason) == (
        "truncated",
        "max_turns",
        "max_turns=4 reached without an answer",
    )
    cut, _ = run(tok, EchoEnv(), [act, ids(tok, "xxxx")], finish_reasons=["stop", "length"], max_turns=2)
    assert (cut.stats.end, cut.status_reason) == ("max_turns", "action cut at max_new_tokens")
    failed, _ = run(tok, EchoEnv(), [act, []])
    assert (failed.status, failed.stats.end, failed.status_reason) == ("failed", "failed", "engine returned no tokens")


def test_a_trajectory_never_exceeds_the_context_or_response_limit(tok):
    """An observation that does not fit is left out and the episode ends there (cause context /
    response); one that fits exactly stays, and the next turn finds no room (the same cause)."""
    act = ids(tok, "x<|end|>")
    prompt = len(ChatFormat(tok).prompt_ids("q"))
    small, big = "ok", "0123456789" * 8
    obs_small, obs_big = len(obs_ids(tok, small)), len(obs_ids(tok, big))
    limit = prompt + 2 * len(act) + obs_small + obs_big - 1  # the big observation misses by one token
    traj, _ = run(tok, EchoEnv([small, big]), [act] * 3, max_context_tokens=limit)
    assert (traj.status, traj.stats.end, traj.num_turns) == ("truncated", "context", 2)
    assert (
        traj.status_reason == f"token budget exhausted: a {obs_big}-token observation does not fit max_context_tokens"
    )
    assert traj.num_context_tokens == prompt + 2 * len(act) + obs_small < limit
    assert traj.num_observation_tokens == obs_small
    exact, _ = run(tok, EchoEnv([small, big]), [act] * 3, max_context_tokens=limit + 1)
    assert (exact.stats.end, exact.status_reason, exact.num_context_tokens) == (
        "context",
        "token budget exhausted",
        limit + 1,
    )
    response, _ = run(tok, EchoEnv([small, big]), [act] * 3, max_response_tokens=2 * len(act) + obs_small + 3)
    assert (response.stats.end, len(response.response_ids)) == ("response", 2 * len(act) + obs_small)


def test_the_episode_observation_budget_ends_the_episode_before_it_is_passed(tok):
    act = ids(tok, "x<|end|>")
    per_turn = len(obs_ids(tok, "abc"))
    traj, _ = run(tok, EchoEnv(["abc"]), [act] * 20, max_observation_tokens_per_episode=5 * per_turn + per_turn - 1)
    assert (traj.status, traj.stats.end, traj.num_turns) == ("truncated", "observation_budget", 6)
    assert traj.num_observation_tokens == 5 * per_turn
    assert traj.status_reason == (
        f"observation budget: {5 * per_turn} + {per_turn} tokens would pass "
        f"max_observation_tokens_per_episode={6 * per_turn - 1}"
    )


def test_outputs_are_clipped_per_call_to_the_token_limit(tok):
    act = ids(tok, "x<|end|>")
    long = "abcdefghij" * 6
    n = len(ids(tok, long))
    actions = [act, act, ids(tok, "<answer>1</answer><|end|>")]
    traj, _ = run(tok, EchoEnv([(long, "short"), "ok"]), actions, max_output_tokens_per_call=10)
    clipped = tok.decode(ids(tok, long)[:10]) + f"...[{n - 10} tokens clipped]"
    first = traj.response_ids[traj.turns[0].end : traj.turns[1].start]
    assert first == obs_ids(tok, (clipped, "short"))
    assert (traj.stats.clipped_outputs, traj.stats.clipped_tokens) == (1, n - 10)
    assert (traj.stats.tool_outputs, traj.stats.parallel_turns) == (3, 1)


def test_refused_calls_are_counted_and_the_limit_reaches_an_env_worker(tok):
    """``max_calls_per_turn`` goes to the environment before its reset, also when it lives on an
    env worker (the RemoteEnv sends it with the reset; the worker here is in-process, no Ray)."""
    act = ids(tok, "x<|end|>")
    local, _ = run(tok, EchoEnv(refused=5), [act] * 3, max_turns=3, max_calls_per_turn=2)
    assert local.stats.refused_calls == 3 * 2 and local.reward_details == {"max_calls_per_turn": 2}

    async def remote():
        worker = EnvWorker(max_episodes=1)

        async def call(method, *args):
            return await getattr(worker, method)(*args)

        env = await RemoteEnv.open(call, ECHO, {"refused": 5}, "tags")
        cfg = AgentLoopConfig(max_turns=3, max_new_tokens=16, max_calls_per_turn=4)
        return await AgentLoop(ScriptedClient([act] * 3), tok, cfg).run(env, Sample("p", "q", "a"))  # type: ignore[arg-type]

    traj = asyncio.run(remote())
    assert traj.stats.refused_calls == 3 * 4 and traj.reward_details["max_calls_per_turn"] == 4


def trajectory(end, turns, prompt=3, response=(1, 1, 0, 0), stats=None):
    mask = list(response)
    return Trajectory(
        prompt_id="p",
        prompt_ids=[2] * prompt,
        response_ids=[7] * len(mask),
        action_mask=mask,
        behavior_logprobs=[0.0] * len(mask),
        policy_versions=[0] * len(mask),
        turns=[Turn(0, 1)] * turns,
        reward=0.0,
        status="finished" if end in ("done", "env_max_turns") else "truncated",
        stats=dataclasses.replace(stats or EpisodeStats(), end=end),
    )


def test_episode_metrics_by_cause_and_turn():
    batch = [
        trajectory("done", 2, stats=EpisodeStats(tool_outputs=3, parallel_turns=1, refused_calls=2)),
        trajectory("max_turns", 4, prompt=5, response=(1, 0, 0, 0, 0, 0)),
        trajectory("context", 6, stats=EpisodeStats(clipped_outputs=3)),
        trajectory("context", 9),
    ]
    m = episode_metrics(batch)
    assert m["rollout/prompt_tokens"] == (3 + 5 + 3 + 3) / 4
    assert m["rollout/observation_tokens"] == (2 + 5 + 2 + 2) / 4
    assert m["rollout/context_tokens"] == (7 + 11 + 7 + 7) / 4 and m["rollout/context_tokens_max"] == 11
    assert m["rollout/tool_outputs_per_turn"] == 3 / 21 and m["rollout/parallel_turns"] == 1 / 21
    assert m["rollout/refused_calls"] == 2 / 4 and m["rollout/clipped_outputs"] == 3 / 4
    assert {c: m[f"rollout/end/{c}"] for c in END_CAUSES} == {
        "done": 0.25,
        "env_max_turns": 0.0,
        "max_turns": 0.25,
        "context": 0.5,
        "response": 0.0,
        "observation_budget": 0.0,
    }
    assert {k: v for k, v in m.items() if k.startswith("rollout/end_turn/")} == {
        "rollout/end_turn/done": 2.0,
        "rollout/end_turn/max_turns": 4.0,
        "rollout/end_turn/context": 7.5,
    }


def test_stats_survive_the_dict_round_trip(tok):
    traj, _ = run(tok, EchoEnv([("a", "b")]), [ids(tok, "x<|end|>")] * 2, max_turns=2)
    again = Trajectory.from_dict(traj.to_dict())
    assert again == traj and again.stats == EpisodeStats(end="max_turns", tool_outputs=4, parallel_turns=2)
