"""``rollout.update_policy`` without an engine: the agent loop's side (an aborted generation resubmitted
as a continuation, the stale-KV spans of ``in_place``, the prefill each sync recomputes) against a
scripted client, and the control plane's (the pause mode, no flush per bucket, one flush per sync,
a refused flush kept in place) against an in-process HTTP fake. The same paths through a real SGLang
engine: ``tests/rollout/test_engine_integration.py``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from aiohttp import web

from sao_megatron.config import AgentLoopConfig
from sao_megatron.driver.observer import episode_metrics
from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.records import Trajectory, Turn
from sao_megatron.rollout.agent_loop import MAX_EMPTY_ABORTS, AgentLoop
from sao_megatron.rollout.client import EngineClient, EngineError, Generation
from sao_megatron.tokenizer import load_tokenizer
from sao_megatron.weight_sync import BucketSpec, EngineControl
from tests.rollout.fakes import CountingTask


@dataclass(frozen=True)
class Answer:
    """One scripted ``/generate`` answer: tokens, their weight versions, finish reason, cache hits."""

    ids: list[int]
    versions: list[str]
    finish: str = "stop"
    cached: int = 0


class SyncingClient:
    """Answers call k with ``answers[k]``; token j of call k has behavior logprob ``-(k + j / 100)``."""

    def __init__(self, answers: list[Answer], cache_version: int | None = None):
        self.answers = answers
        self.url = "scripted"
        self.cache_version = cache_version
        self.inputs: list[list[int]] = []
        self.sampling: list = []

    async def generate(self, input_ids, sampling, rid=None, timeout_s=None) -> Generation:
        k = len(self.inputs)
        self.inputs.append(list(input_ids))
        self.sampling.append(sampling)
        a = self.answers[k]
        assert len(a.ids) <= sampling.max_new_tokens
        return Generation(
            output_ids=list(a.ids),
            behavior_logprobs=[-(k + j / 100) for j in range(len(a.ids))],
            weight_versions=list(a.versions),
            finish_reason=a.finish,
            prompt_tokens=len(input_ids),
            latency_s=0.0,
            cached_tokens=a.cached,
        )


class TurnsEnv(Env):
    """Ends after ``turns`` actions; every other action gets the observation ``ok``."""

    task_class = CountingTask

    def __init__(self, turns: int = 1):
        self.turns, self.done = turns, 0

    def reset(self, sample: Sample) -> str:
        return sample.question

    def step(self, action: str) -> StepResult:
        self.done += 1
        return StepResult(None if self.done == self.turns else "ok", self.done == self.turns)

    def reward(self) -> RewardResult:
        return RewardResult(1.0, True)


CFG = AgentLoopConfig(max_turns=8, max_new_tokens=16, max_response_tokens=1024, max_context_tokens=4096)


def _run(answers: list[Answer], policy: str, turns: int = 1, cache_version: int | None = None):
    client = SyncingClient(answers, cache_version)
    loop = AgentLoop(client, load_tokenizer(), CFG, update_policy=policy)  # type: ignore[arg-type]
    traj = asyncio.run(loop.run(TurnsEnv(turns), Sample("p", "q", "a")))
    return traj, client


def test_an_abort_is_resubmitted_as_a_continuation_under_the_abort_policy():
    """The sync aborts the generation after two tokens, then (the resubmission still queued at the
    next sync) again before any token; the third call finishes the action. One action, one episode:
    the aborted tokens keep their logprobs and versions, each continuation is prompt + the action so
    far with the rest of the budget, and both resubmitted contexts count as recomputed prefill."""
    answers = [
        Answer([40, 41], ["3", "3"], "abort"),
        Answer([], [], "abort"),
        Answer([42, 43, 44], ["5", "5", "5"], "stop"),
    ]
    traj, client = _run(answers, "abort")
    prompt = client.inputs[0]
    assert traj.status == "finished" and traj.response_ids == [40, 41, 42, 43, 44]
    assert traj.turns == [Turn(0, 5)] and traj.action_mask == [1] * 5
    assert traj.behavior_logprobs == [-0.0, -0.01, -2.0, -2.01, -2.02]
    assert traj.policy_versions == [3, 3, 5, 5, 5]
    assert client.inputs[1] == client.inputs[2] == prompt + [40, 41]
    assert [s.max_new_tokens for s in client.sampling] == [16, 14, 14]
    assert traj.stats.resubmitted == 2
    assert traj.stats.prefill_recomputed == 2 * (len(prompt) + 2)
    assert traj.stale_kv == []


def test_a_continuation_keeps_the_exact_action_length_of_a_synthetic_workload():
    """``meta["action_tokens"]`` asks for exactly n tokens (min = max): a continuation asks for the rest."""
    client = SyncingClient([Answer([40] * 3, ["0"] * 3, "abort"), Answer([41] * 7, ["1"] * 7, "length")])
    loop = AgentLoop(client, load_tokenizer(), CFG, update_policy="abort")  # type: ignore[arg-type]
    traj = asyncio.run(loop.run(TurnsEnv(1), Sample("p", "q", "a", meta={"action_tokens": [10]})))
    assert [(s.max_new_tokens, s.min_new_tokens) for s in client.sampling] == [(10, 10), (7, 7)]
    assert traj.num_action_tokens == 10 and traj.policy_versions == [0] * 3 + [1] * 7


@pytest.mark.parametrize("policy", ["retract", "in_place"])
def test_an_abort_is_an_engine_failure_under_the_other_policies(policy):
    """Only the abort policy's syncs abort generations; otherwise an abort is the engine's fault
    (rerouted where a reroute is given; here none: the episode fails)."""
    traj, client = _run([Answer([40, 41], ["3", "3"], "abort")], policy)
    assert traj.status == "failed" and traj.status_reason == "generation aborted by the engine"
    assert len(client.inputs) == 1


def test_aborts_without_a_token_in_a_row_end_the_action():
    """Each sync aborts a request at most once: ``MAX_EMPTY_ABORTS`` empty aborts in a row are not syncs."""
    traj, client = _run([Answer([], [], "abort")] * MAX_EMPTY_ABORTS, "abort")
    assert traj.status == "failed" and traj.status_reason == "generation aborted by the engine"
    assert len(client.inputs) == MAX_EMPTY_ABORTS


def test_retract_counts_the_context_each_sync_retracted():
    """A version change inside a generation is a sync that retracted the request: its context then
    (prompt + tokens so far) is prefilled again; two syncs in one generation count twice."""
    traj, client = _run([Answer([40, 41, 42, 43, 44], ["3", "3", "4", "4", "6"])], "retract")
    prompt = len(client.inputs[0])
    assert traj.stats.prefill_recomputed == (prompt + 2) + (prompt + 4)
    assert traj.stale_kv == [] and traj.stats.resubmitted == 0


def test_in_place_records_the_tokens_sampled_on_stale_kv():
    """Turn 1: a sync kept the request's KV after two tokens: tokens 2.. are stale, nothing is
    recomputed. Turn 2 hits the prefix cache (``cached``) at version 4 while the engine's cache may
    hold version 3's KV (``cache_version`` 3): the whole action is stale. Turn 3 at version 4 without
    a cache hit: its whole context was computed under version 4, not stale."""
    answers = [
        Answer([40, 41, 42, 43], ["3", "3", "4", "4"], "stop"),
        Answer([44, 45], ["4", "4"], "stop", cached=8),
        Answer([46], ["4"], "stop"),
    ]
    traj, _ = _run(answers, "in_place", turns=3, cache_version=3)
    first, second, third = traj.turns
    assert traj.stale_kv == [Turn(first.start + 2, first.end), Turn(second.start, second.end)]
    assert traj.num_stale_kv_tokens == 4 and traj.stats.prefill_recomputed == 0
    assert third.end - third.start == 1
    again = Trajectory.from_dict(traj.to_dict())  # the record survives a checkpoint's round trip
    assert again.stale_kv == traj.stale_kv


def test_a_cache_hit_is_not_stale_before_any_sync_flushed_the_cache():
    """``cache_version`` None: no sync has flushed the engine's cache (none yet), so a hit cannot be
    on an older version's KV."""
    traj, _ = _run([Answer([40, 41], ["4", "4"], "stop", cached=8)], "in_place", cache_version=None)
    assert traj.stale_kv == []


def test_the_batch_metrics_of_the_syncs():
    aborted, _ = _run([Answer([40, 41], ["3", "3"], "abort"), Answer([42], ["4"], "stop")], "abort")
    stale, _ = _run([Answer([40, 41, 42, 43], ["3", "3", "4", "4"], "stop")], "in_place")
    m = episode_metrics([aborted, stale])
    assert m["rollout/resubmitted"] == 1.0
    assert m["rollout/prefill_recomputed"] == float(aborted.stats.prefill_recomputed) > 0
    assert m["rollout/stale_kv_tokens"] == 2 / 7


class ControlFake:
    """The control endpoints of one engine in process: logs every call; ``/flush_cache`` answers 400
    (SGLang's refusal while requests run; a router answers 206, ``partial_success``) for the first
    ``busy`` calls."""

    def __init__(self, busy: int = 0, refusal: int = 400):
        self.busy, self.refusal = busy, refusal
        self.log: list[tuple] = []
        self.flushes = 0

    async def control(self, request: web.Request) -> web.Response:
        endpoint = "/" + request.match_info["control"]
        body = await request.json() if request.can_read_body else {}
        if endpoint == "/flush_cache":
            self.flushes += 1
            self.log.append((endpoint,))
            if self.flushes <= self.busy:
                return web.Response(status=self.refusal, text="Cache not flushed: requests are running")
            return web.Response(text="Cache flushed.\n")
        detail = body.get("mode") if endpoint == "/pause_generation" else body.get("flush_cache")
        self.log.append((endpoint, detail) if detail is not None else (endpoint,))
        return web.json_response({"success": True, "message": ""})


async def _serve(fake: ControlFake) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/{control}", fake.control)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _sync(fake: ControlFake, policy: str) -> EngineControl:
    runner, url = await _serve(fake)
    try:
        async with EngineControl([url], policy) as control:
            for k in range(3):  # three buckets
                await control.load("g", BucketSpec([f"w{k}"], ["float32"], [[1]]), 7)
        return control
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("policy", ["retract", "in_place", "abort"])
def test_a_sync_pauses_in_the_policys_mode_and_flushes_once(policy):
    fake = ControlFake()
    control = asyncio.run(_sync(fake, policy))
    update = ("/update_weights_from_distributed", False)  # no bucket flushes the cache
    assert fake.log == [
        ("/pause_generation", policy),
        ("/begin_weight_update",),
        update,
        update,
        update,
        ("/end_weight_update",),
        ("/flush_cache",),
        ("/continue_generation",),
    ]
    assert control.caches_kept == 0


def test_in_place_keeps_a_cache_the_engine_refuses_to_flush():
    """In place, the requests stay in the batch and the engine refuses the flush: the sync keeps the
    cache (counted), it does not fail or wait."""
    fake = ControlFake(busy=1)
    control = asyncio.run(_sync(fake, "in_place"))
    assert control.caches_kept == 1 and fake.flushes == 1
    assert fake.log[-1] == ("/continue_generation",)


def test_retract_retries_a_refused_flush(monkeypatch):
    """Retracted requests are out of the batch, but one the engine just answered may still sit in it
    for a moment: the flush is asked again (within ``FLUSH_RETRY_S``) until it succeeds."""
    monkeypatch.setattr(EngineClient, "FLUSH_RETRY_S", 5.0)
    fake = ControlFake(busy=2)
    control = asyncio.run(_sync(fake, "retract"))
    assert fake.flushes == 3 and control.caches_kept == 0


@pytest.mark.parametrize("refusal", [400, 206])
def test_a_refused_flush_is_retried_from_an_engine_and_through_a_router(monkeypatch, refusal):
    """A router answers 206 when a worker refused the flush (its own health checks are one-token
    generations): retried like the engine's 400; a refusal that lasts past ``FLUSH_RETRY_S`` raises."""
    monkeypatch.setattr(EngineClient, "FLUSH_RETRY_S", 5.0)

    async def flush(busy: int, retry_s: float | None) -> int:
        fake = ControlFake(busy=busy, refusal=refusal)
        runner, url = await _serve(fake)
        try:
            async with EngineClient(url) as client:
                await client.flush_cache(retry_s)
        finally:
            await runner.cleanup()
        return fake.flushes

    assert asyncio.run(flush(2, None)) == 3
    with pytest.raises(EngineError) as refused:
        asyncio.run(flush(2, 0))
    assert refused.value.status == refusal


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="update policy 'keep': use one of retract, in_place, abort"):
        EngineControl(["http://127.0.0.1:1"], "keep")
