"""Routing replay's capture in the agent loop, against a scripted engine that answers routes the way
SGLang does (``meta_info.routed_experts``: base64 int32 ``[positions, hidden layers, top-k]`` for
positions ``[routed_experts_start_len, prompt + output - 1)``): which positions each request asks for,
the trajectory's rows, what is recorded as missing, and what the weight-sync policies do to the routes
(an aborted piece's rows dropped, ``routes_recomputed``). The client's side of the request (the payload
fields, ``Generation.routes``) against an in-process HTTP fake. A real engine:
``tests/rollout/test_engine_integration.py``."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
from aiohttp import web

from sao_megatron.config import AgentLoopConfig
from sao_megatron.driver.observer import episode_metrics
from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.records import Trajectory, Turn
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import EngineClient, EngineError, Generation, SamplingParams
from sao_megatron.routing import RouteShape
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.fakes import CountingTask, ScriptedClient

SHAPE = RouteShape(hidden_layers=3, moe_layers=(1, 2), topk=2, num_experts=256)
"""Layer 0 dense: the engine's rows hold it, the trajectory's do not."""

RouteReply = Literal["rows", "none", "short", "bad", "repeat"]


@dataclass(frozen=True)
class Answer:
    """One scripted ``/generate`` answer: tokens, their versions, finish reason, and what comes back as
    routes: the rows SGLang would send, none, one row short, an expert id outside the model in the last
    row, or an expert named twice in the first two rows."""

    ids: list[int]
    versions: list[str] | None = None  # default: "0" for every token
    finish: str = "stop"
    routes: RouteReply = "rows"


def engine_rows(call: int, start: int, end: int) -> np.ndarray:
    """``[end - start, hidden layers, top-k]`` int32: the experts call ``call`` chose at positions
    ``[start, end)``; distinct per position, layer, slot and call, so rows from the wrong request or
    offset show. Dense layer 0 holds -1 (not an expert: decoding must drop it)."""
    p, layer, slot = np.meshgrid(np.arange(start, end), np.arange(3), np.arange(2), indexing="ij")
    rows = (p * 6 + layer * 2 + slot + call * 101) % SHAPE.num_experts
    rows[:, 0] = -1
    return rows.astype(np.int32)


def kept(call: int, start: int, end: int) -> np.ndarray:
    """What the trajectory holds for ``engine_rows(call, start, end)``: the MoE layers, uint8."""
    return engine_rows(call, start, end)[:, list(SHAPE.moe_layers)].astype(np.uint8)


class RoutingEngine:
    """Answers call k with ``answers[k]``; asked for routes (``routes_from``), sends those of positions
    ``[routes_from, len(input_ids) + len(output) - 1)`` (the last sampled token is never run through
    the model), whatever the finish reason."""

    def __init__(self, answers: list[Answer]):
        self.answers = answers
        self.url = "scripted"
        self.cache_version = None
        self.inputs: list[list[int]] = []
        self.routes_from: list[int | None] = []

    async def generate(self, input_ids, sampling, rid=None, timeout_s=None, routes_from=None) -> Generation:
        k = len(self.inputs)
        self.inputs.append(list(input_ids))
        self.routes_from.append(routes_from)
        a = self.answers[k]
        assert len(a.ids) <= sampling.max_new_tokens
        routes = None
        if routes_from is not None and a.routes != "none":
            rows = engine_rows(k, routes_from, len(input_ids) + len(a.ids) - 1)
            if a.routes == "short":
                rows = rows[1:]
            if a.routes == "bad":
                rows[-1, 2, 1] = SHAPE.num_experts
            if a.routes == "repeat":
                rows[:2, 1, 1] = rows[:2, 1, 0]
            routes = base64.b64encode(rows.tobytes()).decode("ascii")
        return Generation(
            output_ids=list(a.ids),
            behavior_logprobs=[-0.5] * len(a.ids),
            weight_versions=list(a.versions or ["0"] * len(a.ids)),
            finish_reason=a.finish,
            prompt_tokens=len(input_ids),
            latency_s=0.0,
            routes=routes,
        )


class Ticker(Env):
    """Answers every action with one digit (the turn number); done after ``turns`` actions (0: never)."""

    task_class = CountingTask

    def __init__(self, turns: int = 0):
        self.turns, self.done = turns, 0

    def reset(self, sample: Sample) -> str:
        return sample.question

    def step(self, action: str) -> StepResult:
        self.done += 1
        return StepResult(str(self.done % 10), self.done == self.turns)

    def reward(self) -> RewardResult:
        return RewardResult(1.0, True)


CFG = AgentLoopConfig(max_turns=8, max_new_tokens=16, max_response_tokens=1024, max_context_tokens=4096)


def run(
    answers: list[Answer], turns: int, policy: str = "retract", capture: bool = True, cfg: AgentLoopConfig = CFG
) -> tuple[Trajectory, RoutingEngine]:
    engine = RoutingEngine(answers)
    loop = AgentLoop(engine, load_tokenizer(), cfg, update_policy=policy, routes=SHAPE if capture else None)  # type: ignore[arg-type]
    traj = asyncio.run(loop.run(Ticker(turns), Sample("p", "Count.", "")))
    assert traj.status != "failed", traj.status_reason
    assert len(engine.inputs) == len(answers)
    return traj, engine


def covered(engine: RoutingEngine, k: int) -> int:
    """The position call ``k``'s routes end at (exclusive): its context plus its tokens, less one."""
    return len(engine.inputs[k]) + len(engine.answers[k].ids) - 1


def test_each_request_asks_for_the_positions_new_to_it():
    """Three turns, two observations: request k asks from where request k-1's rows ended (0 first, then
    prompt + first action - 1: the first action's last token, then its observation, are new), and the
    trajectory's routes are the requests' rows end to end, the last position (never run) missing."""
    traj, engine = run([Answer([40, 41]), Answer([42, 43, 44]), Answer([45])], turns=3)
    prompt = len(traj.prompt_ids)
    assert engine.routes_from == [0, prompt + 2 - 1, covered(engine, 1)]
    assert engine.routes_from[2] == prompt + traj.turns[1].end - 1
    n = traj.num_context_tokens
    assert covered(engine, 2) == n - 1
    b, c = covered(engine, 0), covered(engine, 1)
    expected = np.concatenate([kept(0, 0, b), kept(1, b, c), kept(2, c, n - 1)])
    assert traj.routes is not None and traj.routes.dtype == np.uint8 and traj.routes.shape == (n, 2, 2)
    np.testing.assert_array_equal(traj.routes[: n - 1], expected)
    assert not traj.routes[n - 1].any()
    assert traj.routes_missing == [Turn(n - 1, n)] and traj.num_routed_positions == n - 1
    assert traj.stats.routes_recomputed == 0


def test_a_trailing_observation_is_missing():
    """An episode ended by max_turns after an observation: the last action's last token and the
    observation after it were never run through the engine."""
    cfg = AgentLoopConfig(max_turns=2, max_new_tokens=16, max_response_tokens=1024, max_context_tokens=4096)
    traj, engine = run([Answer([40, 41]), Answer([42])], turns=0, cfg=cfg)
    n, last = traj.num_context_tokens, covered(engine, 1)
    observation = len(traj.response_ids) - traj.turns[1].end
    assert traj.stats.end == "max_turns" and observation > 0
    assert traj.routes_missing == [Turn(last, n)] and n - last == 1 + observation
    assert traj.routes is not None
    b = covered(engine, 0)
    np.testing.assert_array_equal(traj.routes[:last], np.concatenate([kept(0, 0, b), kept(1, b, last)]))
    assert not traj.routes[last:].any()


@pytest.mark.parametrize("reply", ["none", "short"])
def test_a_request_without_usable_routes_is_a_missing_span(reply: RouteReply):
    """No routes or a wrong row count: that request's positions are zeros recorded as missing; the next
    request still asks from where the last rows ended and its rows come through."""
    traj, engine = run([Answer([40, 41]), Answer([42, 43, 44], routes=reply), Answer([45])], turns=3)
    a, b, n = engine.routes_from[1], engine.routes_from[2], traj.num_context_tokens
    assert a is not None and b is not None and a < b
    assert traj.routes_missing == [Turn(a, b), Turn(n - 1, n)]
    assert traj.num_routed_positions == n - 1 - (b - a)
    assert traj.routes is not None
    np.testing.assert_array_equal(traj.routes[:a], kept(0, 0, a))
    assert not traj.routes[a:b].any()
    np.testing.assert_array_equal(traj.routes[b : n - 1], kept(2, b, n - 1))


@pytest.mark.parametrize("reply", ["bad", "repeat"])
def test_a_row_naming_an_expert_twice_or_outside_the_model_is_a_counted_missing_span(reply: RouteReply):
    """The replay cannot use such a row (Megatron's dispatcher fails on it inside the step): only its
    positions are recorded as missing (zeros, the routers route them) and counted per episode and in
    the batch's ``rollout/routes_invalid``; the request's other rows come through."""
    traj, engine = run([Answer([40, 41]), Answer([42, 43, 44], routes=reply), Answer([45])], turns=3)
    a, b, n = engine.routes_from[1], engine.routes_from[2], traj.num_context_tokens
    assert a is not None and b is not None and traj.routes is not None
    lo, hi = (b - 1, b) if reply == "bad" else (a, a + 2)  # the rows RoutingEngine spoils
    assert traj.routes_missing == [Turn(lo, hi), Turn(n - 1, n)]
    assert traj.stats.routes_invalid == hi - lo and traj.num_routed_positions == n - 1 - (hi - lo)
    expected = np.concatenate([kept(0, 0, a), kept(1, a, b), kept(2, b, n - 1)])
    expected[lo:hi] = 0
    np.testing.assert_array_equal(traj.routes[: n - 1], expected)
    assert episode_metrics([traj, traj])["rollout/routes_invalid"] == 2 * (hi - lo)


def test_an_aborted_piece_gives_way_to_its_continuation():
    """Under ``abort``, turn 2 is aborted after one token, then again before any: each continuation
    asks from the same start, the last one's rows cover the aborted token's positions (the aborted
    requests' rows are dropped), and the one token sampled before the abort is counted."""
    answers = [
        Answer([40, 41]),
        Answer([42], finish="abort"),
        Answer([], finish="abort"),
        Answer([43, 44]),
        Answer([45]),
    ]
    traj, engine = run(answers, turns=3, policy="abort")
    start = covered(engine, 0)
    assert engine.routes_from == [0, start, start, start, covered(engine, 3)]
    assert engine.inputs[2] == engine.inputs[3] == engine.inputs[1] + [42]
    assert traj.response_ids[traj.turns[1].start : traj.turns[1].end] == [42, 43, 44]
    n = traj.num_context_tokens
    assert traj.routes is not None and traj.routes_missing == [Turn(n - 1, n)]
    expected = np.concatenate(
        [kept(0, 0, start), kept(3, start, covered(engine, 3)), kept(4, covered(engine, 3), n - 1)]
    )
    np.testing.assert_array_equal(traj.routes[: n - 1], expected)
    assert traj.stats.routes_recomputed == 1 and traj.stats.resubmitted == 2


def test_an_abort_of_the_first_request_replaces_the_prompts_routes():
    traj, engine = run([Answer([40, 41], ["3", "3"], "abort"), Answer([42], ["4"])], turns=1, policy="abort")
    n = traj.num_context_tokens
    assert engine.routes_from == [0, 0]
    assert traj.routes is not None
    np.testing.assert_array_equal(traj.routes[: n - 1], kept(1, 0, n - 1))
    assert traj.stats.routes_recomputed == 2


def test_an_abort_as_the_budget_runs_out_leaves_its_positions_to_the_next_request():
    """The action is complete when aborted (no continuation): its rows are not taken, the next turn asks
    from where the previous rows ended and covers them."""
    cfg = AgentLoopConfig(max_turns=8, max_new_tokens=2, max_response_tokens=1024, max_context_tokens=4096)
    traj, engine = run([Answer([40, 41], finish="abort"), Answer([42])], turns=2, policy="abort", cfg=cfg)
    n = traj.num_context_tokens
    assert engine.routes_from == [0, 0]
    assert traj.routes is not None and traj.routes_missing == [Turn(n - 1, n)]
    np.testing.assert_array_equal(traj.routes[: n - 1], kept(1, 0, n - 1))


def test_retract_counts_the_tokens_before_the_last_version_change():
    """A version change inside a generation is a sync that retracted the request and recomputed its
    context: the tokens sampled before the last change replay routes computed after them. Turn 1: two
    changes, the last before token 4; turn 2: one, before token 1. The rows are the request's own."""
    answers = [Answer([40, 41, 42, 43, 44], ["3", "3", "4", "4", "6"]), Answer([45, 46], ["6", "7"])]
    traj, engine = run(answers, turns=2, policy="retract")
    assert traj.stats.routes_recomputed == 4 + 1
    n = traj.num_context_tokens
    assert traj.routes is not None and traj.routes_missing == [Turn(n - 1, n)]
    b = engine.routes_from[1]
    assert b is not None
    np.testing.assert_array_equal(traj.routes[: n - 1], np.concatenate([kept(0, 0, b), kept(1, b, n - 1)]))


def test_in_place_recomputes_no_routes():
    """In place the request keeps its KV across the sync: nothing computed again, nothing counted."""
    answers = [Answer([40, 41, 42, 43, 44], ["3", "3", "4", "4", "6"]), Answer([45, 46], ["6", "7"])]
    traj, _ = run(answers, turns=2, policy="in_place")
    assert traj.stats.routes_recomputed == 0
    assert traj.stale_kv  # the version changes were seen
    assert traj.routes is not None and traj.num_routed_positions == traj.num_context_tokens - 1


def test_without_capture_no_routes_are_asked_or_kept():
    traj, engine = run([Answer([40, 41]), Answer([42])], turns=2, capture=False)
    assert engine.routes_from == [None, None]
    assert traj.routes is None and traj.routes_missing == [] and traj.num_routed_positions == 0


def test_without_capture_a_client_that_predates_it_still_fits():
    """Capture off, the loop calls ``generate`` without ``routes_from``: a client (or fake) whose
    ``generate`` has no such argument runs the episode (it failed with a TypeError when always passed)."""
    client = ScriptedClient([[40, 41], [42]])
    traj = asyncio.run(AgentLoop(client, load_tokenizer(), CFG).run(Ticker(2), Sample("p", "q", "")))  # type: ignore[arg-type]
    assert traj.status == "finished" and len(client.inputs) == 2 and traj.routes is None


def test_a_failed_first_generation_has_no_routes():
    """The engine failed the first request: nothing came back, so the trajectory has no routes at all
    (not one missing span over its prompt)."""

    class Down(RoutingEngine):
        async def generate(self, input_ids, sampling, rid=None, timeout_s=None, routes_from=None) -> Generation:
            raise EngineError("/generate", "connection refused")

    loop = AgentLoop(Down([]), load_tokenizer(), CFG, routes=SHAPE)  # type: ignore[arg-type]
    traj = asyncio.run(loop.run(Ticker(1), Sample("p", "q", "")))
    assert traj.status == "failed" and traj.status_reason.startswith("engine:")
    assert traj.routes is None and traj.routes_missing == []


# ---- the client's request and answer -----------------------------------------------------------


async def _generate_twice() -> tuple[list[dict], list[Generation]]:
    """Two ``/generate`` calls through a real EngineClient to an in-process fake: with and without routes."""
    seen: list[dict] = []
    routes = base64.b64encode(engine_rows(0, 3, 5).tobytes()).decode("ascii")

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        meta = {"output_token_logprobs": [[-0.25, 9, None]], "finish_reason": {"type": "stop"}, "weight_version": "2"}
        if body.get("return_routed_experts"):
            meta["routed_experts"] = routes
        return web.json_response({"meta_info": meta})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with EngineClient(f"http://127.0.0.1:{runner.addresses[0][1]}") as client:
            sampling = SamplingParams(max_new_tokens=1)
            gens = [
                await client.generate([1, 2, 3, 4, 5], sampling, routes_from=3),
                await client.generate([1, 2], sampling),
            ]
        return seen, gens
    finally:
        await runner.cleanup()


def test_the_client_asks_for_routes_only_when_told_and_passes_them_on():
    seen, (routed, plain) = asyncio.run(_generate_twice())
    assert seen[0]["return_routed_experts"] is True and seen[0]["routed_experts_start_len"] == 3
    assert "return_routed_experts" not in seen[1] and "routed_experts_start_len" not in seen[1]
    assert routed.routes is not None and plain.routes is None
    np.testing.assert_array_equal(SHAPE.decode(routed.routes)[0], kept(0, 3, 5))
