"""A real SGLang server on CPU serves the tiny model; client and agent loop run against it.

One engine for the module (start-up is ~20-40 s on this machine); loopback only. It is started on
a port that a squatter holds, so its start also shows the restart on a fresh port (one engine start
for that and every other test here).

Order matters: the tests run in file order against the one engine. The agent-loop tests expect
the initial weights ("default" -> version 0); every test that loads other weights restores
checkpoint 0 from disk before it returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sao_megatron.config import ConfigError, load_config
from sao_megatron.driver.observer import episode_metrics
from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.envs.registry import make_env
from sao_megatron.envs.safe_eval import calculator
from sao_megatron.envs.tool_parse import Parallel, ToolCall, parse_action
from sao_megatron.records import OBSERVATION_VERSION, Turn
from sao_megatron.rollout.agent_loop import AgentLoop, AgentLoopConfig
from sao_megatron.rollout.client import (
    API_KEY_ENV,
    EngineClient,
    EngineError,
    SamplingParams,
    require_route_capture,
)
from sao_megatron.rollout.engine import EngineProcess, EngineSpec, RouterProcess, RouterSpec
from sao_megatron.routing import RouteShape
from sao_megatron.spawn import free_port
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.engine_fixtures import make_tiny_hf, squatter
from tests.rollout.fakes import CountingTask

pytestmark = pytest.mark.timeout(600)

ENGINE_TOL = 1e-4
"""Max |logprob| difference of the float32 engine against ``transformers`` float32 on the same weights, and
between two requests of one engine. Model-level, not one sum of n terms (tests/tolerance.py): SGLang's own
kernels (torch_native attention, fused norms and rotary, its logits processor; another batch composition)
against transformers' eager forward. docs/rollout.md: ~1e-6 measured (docs/RESULTS.md: <= 2.9e-6 on the
real vocabulary), so 1e-4 is a wide margin; a wrong weight version moves logprobs by far more."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return make_tiny_hf(root / "v0", seed=0), make_tiny_hf(root / "v1", seed=1)


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    """A port bound by a plain HTTP server (its ``/health`` answers 404) for the module's lifetime."""
    with squatter(http.server.SimpleHTTPRequestHandler) as port:
        yield port


@pytest.fixture(scope="module")
def api_key() -> Iterator[str]:
    """The run's engine key, as the driver sets it (every EngineClient here, and every rank a test
    spawns, sends it by default)."""
    key = secrets.token_hex(32)
    before = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = key
    try:
        yield key
    finally:
        if before is None:
            os.environ.pop(API_KEY_ENV, None)
        else:
            os.environ[API_KEY_ENV] = before


@pytest.fixture(scope="module")
def engine(checkpoints, taken_port, api_key, tmp_path_factory):
    """The module's engine, asked for the squatter's port, taking the run's API key."""
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    spec = EngineSpec(
        model_path=str(checkpoints[0]),
        port=taken_port,
        dtype="float32",
        max_total_tokens=16384,
        log_path=str(log),
        api_key=api_key,
        return_routed_experts=True,  # rollout.routing_replay (asked for by the routing tests only)
    )
    # strict_nccl registered in the engine's processes (its shim), so the sync tests can form their
    # groups on it as well as on gloo; nothing else changes for a gloo group
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SAO_STRICT_NCCL", "1")
        with EngineProcess(spec) as proc:
            yield proc


def test_an_engine_whose_port_was_taken_restarts_on_a_fresh_one(engine, taken_port):
    """The engine notices the clash, restarts on a fresh port, and the health check never mistakes
    the squatter for it (the squatter answers 404; every later test here talks to this engine)."""
    assert engine.port != taken_port and engine.spec.port == engine.port
    assert engine.healthy()


def run(coro):
    return asyncio.run(coro)


def test_a_request_without_the_runs_key_is_refused(engine):
    """Nobody else on the network drives the engine: no key or a wrong one gets 401 on generation,
    weight updates and cache control alike; health (probes) stays open."""

    async def go():
        refused = {}
        for label, key in (("none", ""), ("wrong", "0" * 64)):
            async with EngineClient(engine.url, api_key=key) as client:
                for call in ("generate", "flush", "model_info"):
                    try:
                        if call == "generate":
                            await client.generate([2, 40, 3], SamplingParams(max_new_tokens=2))
                        elif call == "flush":
                            await client._call("POST", "/flush_cache")
                        else:
                            await client._call("GET", "/get_model_info")
                    except EngineError as err:
                        refused[(label, call)] = err.status
        async with EngineClient(engine.url) as client:  # the run's key
            await client._call("GET", "/get_model_info")
        return refused

    refused = run(go())
    assert refused == {(k, c): 401 for k in ("none", "wrong") for c in ("generate", "flush", "model_info")}
    assert engine.healthy()


def test_the_key_is_on_no_command_line_and_in_no_log(engine, api_key):
    """Every user of the node sees command lines (``ps``), and the engine's log goes where the run's
    logs go: the key reaches SGLang on stdin, and SGLang's log of its arguments shows it redacted
    (the test above shows the engine took it)."""
    import psutil

    from sao_megatron.rollout.engine_main import REDACTED

    assert engine.proc is not None
    session = [engine.proc.pid, *(p.pid for p in psutil.Process(engine.proc.pid).children(recursive=True))]
    assert len(session) >= 3, session  # the session's leader, SGLang's server, its scheduler
    for pid in session:
        assert api_key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"), pid
    log = engine.log_path.read_text(errors="replace")
    assert f"'api_key': '{REDACTED}'" in log and api_key not in log


def test_generate_returns_logprobs_and_versions(engine):
    async def go():
        async with EngineClient(engine.url) as client:
            return await client.generate([2, 40, 41, 3], SamplingParams(max_new_tokens=12, seed=7))

    gen = run(go())
    assert 1 <= len(gen.output_ids) <= 12
    assert len(gen.behavior_logprobs) == len(gen.output_ids) == len(gen.weight_versions)
    assert all(lp <= 0.0 for lp in gen.behavior_logprobs)
    assert gen.finish_reason in ("stop", "length")


@pytest.mark.parametrize("env_name", ["arith_tool", "math_python"])
def test_agent_loop_multi_turn_episode(engine, env_name):
    tokenizer = load_tokenizer()
    cfg = AgentLoopConfig(max_turns=3, max_new_tokens=16, max_response_tokens=400)

    async def go():
        async with EngineClient(engine.url) as client:
            loop = AgentLoop(client, tokenizer, cfg)
            env = make_env(env_name)
            sample = env.task_class().get("train", 3)
            return await loop.run(env, sample, index=3)

    traj = run(go())
    assert traj.status in ("finished", "truncated"), traj.status_reason
    assert traj.turns and traj.sample_index == 3
    for turn in traj.turns:  # action spans: mask 1, a behavior logprob, a real version
        assert all(traj.action_mask[i] == 1 for i in range(turn.start, turn.end))
        assert all(traj.behavior_logprobs[i] <= 0.0 for i in range(turn.start, turn.end))
        assert all(traj.policy_versions[i] == 0 for i in range(turn.start, turn.end))
    in_turn = {i for t in traj.turns for i in range(t.start, t.end)}
    observation = [i for i in range(len(traj.response_ids)) if i not in in_turn]
    assert all(traj.action_mask[i] == 0 and traj.policy_versions[i] == OBSERVATION_VERSION for i in observation)
    if len(traj.turns) > 1:
        assert observation, "a multi-turn episode has observation tokens between actions"
        text = tokenizer.decode([traj.response_ids[i] for i in observation])
        assert text.startswith("<|tool|>") and text.endswith("<|assistant|>")


class Recording:
    """The module's client, every request recorded (and constrained to ``regex`` when given)."""

    def __init__(self, client: EngineClient, regex: str = ""):
        self.client, self.regex, self.url = client, regex, client.url
        self.inputs: list[list[int]] = []
        self.starts: list[int | None] = []

    async def generate(self, input_ids, sampling, rid=None, timeout_s=None, routes_from=None):
        self.inputs.append(list(input_ids))
        self.starts.append(routes_from)
        if self.regex:
            sampling = dataclasses.replace(sampling, regex=self.regex)  # SGLang's regex: structured decoding
        return await self.client.generate(input_ids, sampling, rid=rid, timeout_s=timeout_s, routes_from=routes_from)


TWO_CALLS = r"<tool>[1-9][+*][1-9]</tool><tool>[1-9][+*][1-9]</tool>"


def test_a_model_constrained_to_two_calls_gets_both_executed(engine):
    """Parallel calls through the real engine. The tiny random model would almost never write two
    well-formed calls, so every action is constrained by the engine's own structured decoding
    (SGLang ``regex``, :data:`TWO_CALLS`): each token is still sampled by the model from its
    distribution restricted to the grammar (nothing is inserted into an action; the trajectory
    keeps the engine's ids and logprobs), so the two-call structure is deterministic while the
    digits and operators are the model's. The environment parses both calls of each action, runs
    both, and the next prompt holds both results as consecutive observations."""
    tokenizer = load_tokenizer()
    cfg = AgentLoopConfig(max_turns=2, max_new_tokens=32, max_response_tokens=400)

    async def go():
        async with EngineClient(engine.url) as client:
            recording = Recording(client, TWO_CALLS)
            env = make_env("arith_tool", max_turns=3)
            traj = await AgentLoop(recording, tokenizer, cfg).run(env, env.task_class().get("train", 0))  # type: ignore[arg-type]
            return traj, recording.inputs

    traj, inputs = run(go())
    assert (traj.status, traj.stats.end, traj.num_turns) == ("truncated", "max_turns", 2), traj.status_reason
    for k, turn in enumerate(traj.turns):
        action = tokenizer.decode(traj.response_ids[turn.start : turn.end])
        parsed = parse_action(action)
        assert isinstance(parsed, Parallel) and len(parsed.calls) == 2 and action.endswith("<|end|>"), action
        outputs = [calculator(c.code) for c in parsed.calls if isinstance(c, ToolCall)]
        assert len(outputs) == 2
        following = traj.turns[k + 1].start if k + 1 < len(traj.turns) else len(traj.response_ids)
        observation = tokenizer.decode(traj.response_ids[turn.end : following])
        assert observation == "".join(f"<|tool|>{o}<|assistant|>" for o in outputs)
        assert inputs[k] == traj.prompt_ids + traj.response_ids[: turn.start]
    assert traj.reward_details["tool_calls"] == 4 and traj.reward_details["malformed"] == 0
    assert (traj.stats.tool_outputs, traj.stats.parallel_turns, traj.stats.refused_calls) == (4, 2, 0)
    assert all(lp <= 0.0 for lp in traj.behavior_logprobs[: traj.turns[0].end])


class Ticker(Env):
    """A scripted tool: every action is answered by one digit (the turn number mod 10); never done."""

    task_class = CountingTask

    def reset(self, sample: Sample) -> str:
        self.turns = 0
        return sample.question

    def step(self, action: str) -> StepResult:
        self.turns += 1
        return StepResult(str(self.turns % 10), False)

    def reward(self) -> RewardResult:
        return RewardResult(0.0, None, {"turns": self.turns})


def test_a_150_turn_episode_through_the_engine(engine):
    """Long horizon: 150 turns against the real engine (one-token actions, one-digit observations). Token-in/token-out holds at every turn, the context accounting adds up, and the
    episode ends at rollout.loop.max_turns (cause ``max_turns``, turn 150)."""
    tokenizer = load_tokenizer()
    cfg = AgentLoopConfig(max_turns=150, max_new_tokens=1, max_response_tokens=1000, max_context_tokens=1024)

    async def go():
        async with EngineClient(engine.url) as client:
            recording = Recording(client)
            traj = await AgentLoop(recording, tokenizer, cfg).run(Ticker(), Sample("long", "Count.", ""))  # type: ignore[arg-type]
            return traj, recording.inputs

    traj, inputs = run(go())
    assert (traj.status, traj.stats.end, traj.num_turns) == ("truncated", "max_turns", 150), traj.status_reason
    assert len(inputs) == 150 and traj.reward_details == {"turns": 150}
    for k, turn in enumerate(traj.turns):
        assert inputs[k] == traj.prompt_ids + traj.response_ids[: turn.start]
        assert turn.end - turn.start == 1
    for k in range(149):
        obs = tokenizer.decode(traj.response_ids[traj.turns[k].end : traj.turns[k + 1].start])
        assert obs == f"<|tool|>{(k + 1) % 10}<|assistant|>"
    assert traj.num_prompt_tokens + traj.num_action_tokens + traj.num_observation_tokens == traj.num_context_tokens
    observed = 149 if traj.status_reason == "action cut at max_new_tokens" else 150  # the last action cut: no output
    assert traj.num_observation_tokens == observed * 3 and traj.stats.tool_outputs == observed
    metrics = episode_metrics([traj])
    assert metrics["rollout/end/max_turns"] == 1.0 and metrics["rollout/end_turn/max_turns"] == 150.0
    assert metrics["rollout/context_tokens"] == traj.num_context_tokens <= 1024


class ThreeTurns(Ticker):
    """The Ticker, done after its third action: prompt, three actions, two observations."""

    def step(self, action: str) -> StepResult:
        self.turns += 1
        return StepResult(str(self.turns), self.turns >= 3)


def test_routes_of_a_multi_turn_episode_equal_a_prefill_of_its_ids(engine):
    """rollout.routing_replay: each turn asks for the routes of the positions new to it; the episode's routes
    (one row per position, the last never run: missing) equal those of one prefill of the whole sequence,
    computed afresh (cache flushed) and from the prefix cache (the routes of the KV it reuses)."""
    tokenizer = load_tokenizer()
    shape = RouteShape.of(load_config().model)
    cfg = AgentLoopConfig(max_turns=5, max_new_tokens=4, max_response_tokens=400)
    once = SamplingParams(max_new_tokens=1, temperature=0.0)

    async def go():
        async with EngineClient(engine.url) as client:
            recording = Recording(client)
            loop = AgentLoop(recording, tokenizer, cfg, routes=shape)  # type: ignore[arg-type]
            traj = await loop.run(ThreeTurns(), Sample("routes", "Count.", ""))
            ids = traj.prompt_ids + traj.response_ids
            await require_route_capture([client], "on")  # this engine has the flag: no error
            await client.flush_cache()
            fresh = await client.generate(ids, once, routes_from=0)
            cached = await client.generate(ids, once, routes_from=0)
            return traj, recording.starts, fresh, cached

    traj, starts, fresh, cached = run(go())
    n = traj.num_context_tokens
    assert (traj.status, traj.num_turns, traj.num_observation_tokens > 0) == ("finished", 3, True), traj.status_reason
    # each turn asks from the last position the previous one ran: its action's last token, never run until now
    assert starts == [0] + [traj.num_prompt_tokens + t.end - 1 for t in traj.turns[:-1]]
    assert traj.routes is not None and traj.routes.shape == (n, len(shape.moe_layers), shape.topk)
    assert traj.routes.dtype == np.uint8 and traj.routes_missing == [Turn(n - 1, n)]
    assert fresh.cached_tokens == 0 and cached.cached_tokens > 0
    for prefill in (fresh, cached):
        assert prefill.routes is not None
        rows, bad = shape.decode(prefill.routes)
        assert rows.shape[0] == n and not bad.any()  # positions [0, n + 1 - 1), each naming k distinct experts
        np.testing.assert_array_equal(np.sort(traj.routes[: n - 1], -1), np.sort(rows[: n - 1], -1))


def test_routing_replay_refuses_an_engine_without_route_capture():
    class NoCapture:  # /server_info of an engine started without --enable-return-routed-experts
        url = "http://127.0.0.1:1"

        async def server_info(self):
            return {"enable_return_routed_experts": False}

    with pytest.raises(
        ConfigError, match=r"^rollout\.routing_replay=on: the engine at http://127\.0\.0\.1:1 does not "
    ):
        run(require_route_capture([NoCapture()], "on"))  # type: ignore[list-item]


def test_weight_update_mid_generation_gives_two_versions(engine, checkpoints):
    """A generation that spans a pause/update/continue carries both versions (timing-dependent,
    so up to three attempts: on a quiet machine a generation may finish before the pause)."""

    async def attempt(client, label: str):
        sampling = SamplingParams(max_new_tokens=800, seed=1, ignore_eos=True)
        task = asyncio.create_task(client.generate([2, 50, 51, 3], sampling))
        await asyncio.sleep(0.4)
        await client.pause("retract")
        await client.update_weights_from_disk(str(checkpoints[1]), label)
        await client.resume()
        gen = await task
        await client.update_weights_from_disk(str(checkpoints[0]), label + "-restored")
        return gen

    async def go():
        async with EngineClient(engine.url) as client:
            tries = []
            for i in range(3):
                gen = await attempt(client, f"mid{i}")
                tries.append(gen)
                if len(set(gen.weight_versions)) == 2:
                    break
            return tries

    tries = run(go())
    gen = tries[-1]
    assert len(set(gen.weight_versions)) == 2, [sorted(set(t.weight_versions)) for t in tries]
    assert gen.weight_versions[-1] == f"mid{len(tries) - 1}" and gen.weight_versions[0] != gen.weight_versions[-1]


def test_engine_errors_become_failed_episodes():
    tokenizer = load_tokenizer()

    async def go():
        async with EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=5) as client:
            with pytest.raises(EngineError, match="/generate"):
                await client.generate([1, 2], SamplingParams(max_new_tokens=2))
            loop = AgentLoop(client, tokenizer, AgentLoopConfig())
            env = make_env("arith_tool")
            return await loop.run(env, env.task_class().get("train", 0))

    traj = run(go())
    assert traj.status == "failed" and traj.status_reason.startswith("engine:")
    assert traj.response_ids == [] and traj.reward == 0.0


def _hf_logprobs(model_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("backend", ["gloo", "strict_nccl"])
def test_distributed_weight_sync_serves_new_weights(engine, checkpoints, backend):
    """``strict_nccl``: the trainer side and the engine's side of the group under the NCCL contract
    (ops that only enqueue, the watchdog, no split from a world), the engine's through its shim."""
    import torch
    from safetensors.torch import load_file

    from sao_megatron.parallel import resolve_backend
    from sao_megatron.weight_sync import WeightSync

    resolve_backend(backend)

    new = load_file(str(checkpoints[1] / "model.safetensors"))
    names = sorted(new)
    buckets = [[(n, new[n]) for n in names[i : i + 16]] for i in range(0, len(names), 16)]
    ids = [2, 60, 61, 62, 63, 64, 3, 70, 71, 72]

    async def go():
        sync = WeightSync([engine.url], backend=backend, group_name=f"sync_{backend}")  # master_port 0: at connect()
        await sync.connect()
        report = await sync.update(buckets, version=7)
        async with EngineClient(engine.url) as client:
            scored = await client.score(ids, start=1)
            gen = await client.generate([2, 40, 3], SamplingParams(max_new_tokens=3))
            await client.update_weights_from_disk(str(checkpoints[0]), "8")
        await sync.close()
        return report, scored, gen

    report, scored, gen = run(go())
    assert report.tensors == len(names) and report.bytes > 0
    assert set(gen.weight_versions) == {"7"}
    expected = _hf_logprobs(checkpoints[1], ids)
    assert (torch.tensor(scored) - expected).abs().max().item() <= ENGINE_TOL


def test_a_weight_sync_group_is_re_formed_under_a_new_name(engine, checkpoints):
    """What the trainer does when the engines change (a restart): the old group is destroyed on the
    engine still running, a new one formed under a new name serves the next update."""
    from safetensors.torch import load_file

    from sao_megatron.weight_sync import WeightSync

    new = load_file(str(checkpoints[1] / "model.safetensors"))
    buckets = [sorted(new.items())]

    async def go():
        first = WeightSync([engine.url], backend="gloo", group_name="reform_1")  # a name new to both sides
        await first.connect()
        await first.update(buckets, version=3)
        await first.close()
        second = WeightSync([engine.url], backend="gloo", group_name="reform_2")
        await second.connect()
        await second.update(buckets, version=4)
        async with EngineClient(engine.url) as client:
            label = await client.weight_version()
            gen = await client.generate([2, 40, 3], SamplingParams(max_new_tokens=3))
            with pytest.raises(EngineError):  # the old group is gone on the engine
                await client.destroy_weights_update_group("reform_1")
            await client.update_weights_from_disk(str(checkpoints[0]), "8")
        await second.close()
        return label, gen

    label, gen = run(go())
    assert label == "4" and set(gen.weight_versions) == {"4"}


def test_tensor_weight_update_serves_new_weights(engine, checkpoints):
    import torch
    from safetensors.torch import load_file

    new = load_file(str(checkpoints[1] / "model.safetensors"))
    ids = [2, 60, 61, 62, 63, 64, 3, 70, 71, 72]

    async def go():
        async with EngineClient(engine.url) as client:
            with pytest.raises(EngineError) as outside:  # refused outside begin/end
                await client.update_weights_from_tensor(sorted(new.items())[:1], "bad")
            async with client.weight_update_session():
                names = sorted(new)
                for i in range(0, len(names), 24):  # two buckets in one session
                    await client.update_weights_from_tensor([(n, new[n]) for n in names[i : i + 24]], "9")
            scored_v1 = await client.score(ids, start=1)
            gen = await client.generate([2, 40, 3], SamplingParams(max_new_tokens=3))
            await client.update_weights_from_disk(str(checkpoints[0]), "10")
            scored_v0 = await client.score(ids, start=1)
            assert await client.health()
        return outside.value, scored_v1, gen, scored_v0

    outside, scored_v1, gen, scored_v0 = run(go())
    assert outside.status == 400 and "begin_weight_update" in str(outside)
    assert set(gen.weight_versions) == {"9"}
    assert (torch.tensor(scored_v1) - _hf_logprobs(checkpoints[1], ids)).abs().max().item() <= ENGINE_TOL
    assert (torch.tensor(scored_v0) - _hf_logprobs(checkpoints[0], ids)).abs().max().item() <= ENGINE_TOL


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return b""


def test_router_proxies_generate(engine, tmp_path):
    spec = RouterSpec(
        worker_urls=[engine.url], port=free_port(), log_path=str(tmp_path / "router.log"), api_key=engine.spec.api_key
    )
    prompt, greedy = [2, 40, 41, 42, 3], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

    async def go(router_url):
        async with EngineClient(router_url) as via_router, EngineClient(engine.url) as direct:
            routed = await via_router.generate(prompt, greedy)
            own = await direct.generate(prompt, greedy)
            await via_router.flush_cache()  # proxied to every worker
            with pytest.raises(EngineError) as refused:  # control calls: engines only
                await via_router.pause("retract")
            return routed, own, refused.value

    with RouterProcess(spec) as router:
        assert router.url != engine.url
        key = engine.spec.api_key.encode()
        assert key and not [p for p in Path("/proc").glob("[0-9]*") if key in _cmdline(p)]  # on stdin only
        try:
            routed, own, refused = run(go(router.url))
        except Exception as err:  # a failure here shows both servers' last lines
            raise AssertionError(
                f"{err!r}\nrouter log {router.log_path}:\n{router.log_tail(60)}\n"
                f"engine log {engine.log_path}:\n{engine.log_tail(60)}"
            ) from err
    assert router.proc is not None and router.proc.poll() is not None  # stopped with its process group
    assert key not in Path(router.log_path).read_bytes()
    assert routed.output_ids == own.output_ids and len(routed.output_ids) == 8
    assert max(abs(a - b) for a, b in zip(routed.behavior_logprobs, own.behavior_logprobs, strict=True)) <= ENGINE_TOL
    assert (
        routed.weight_versions == own.weight_versions and routed.finish_reason == "length" and routed.prompt_tokens == 5
    )
    assert refused.status == 404


class _TwoTurns(Env):
    """Two actions with the observation ``ok`` between them (the model's text is ignored)."""

    task_class = CountingTask

    def __init__(self):
        self.turns = 0

    def reset(self, sample: Sample) -> str:
        return sample.question

    def step(self, action: str) -> StepResult:
        self.turns += 1
        return StepResult(None if self.turns == 2 else "ok", self.turns == 2)

    def reward(self) -> RewardResult:
        return RewardResult(0.0, None)


def _flushes(engine) -> int:
    """Cache flushes the engine has logged so far."""
    with open(engine.spec.log_path, errors="replace") as f:
        return f.read().count("Cache flushed successfully")


def _synced_mid_flight(trajs, policy: str) -> bool:
    """The sync met a generation in flight: resubmitted (abort) or an action with both versions."""
    if policy == "abort":
        return any(t.stats.resubmitted for t in trajs)
    return any(len(set(t.policy_versions[turn.start : turn.end])) == 2 for t in trajs for turn in t.turns)


@pytest.mark.parametrize("policy", ["retract", "in_place", "abort"])
def test_a_sync_with_episodes_in_flight_under_each_update_policy(engine, checkpoints, policy):
    """Eight two-turn episodes run while a four-bucket sync replaces checkpoint 0 (version ``old``)
    by checkpoint 1 (``new``) under ``rollout.update_policy``. Every episode comes back once,
    finished, with both actions (none lost or run twice); the engine logged one cache flush for the
    sync under retract and abort, none in place (the batch held requests: the cache was kept).
    Every action token not recorded as stale-KV has the behavior logprob the engine gives it when it
    scores the whole sequence afresh under the weights of its version (abort: the continuation's
    tokens are new, the aborted ones keep their old logprobs and version); in place some stale
    token's logprob differs from the fresh one (the record marks real staleness). Timing-dependent
    (the sync must meet a generation in flight): up to three attempts."""
    from safetensors.torch import load_file

    from sao_megatron.weight_sync import WeightSync

    new_weights = load_file(str(checkpoints[1] / "model.safetensors"))
    names = sorted(new_weights)
    size = -(-len(names) // 4)
    buckets = [[(n, new_weights[n]) for n in names[i : i + size]] for i in range(0, len(names), size)]
    cfg = AgentLoopConfig(max_turns=2, max_new_tokens=160, max_response_tokens=512, max_context_tokens=1024)
    tokenizer = load_tokenizer()

    async def attempt(client, sync, k: int):
        old, new = 30 + 2 * k, 31 + 2 * k
        await client.update_weights_from_disk(str(checkpoints[0]), str(old))  # flushes: the cache holds `old` only
        client.cache_version = old
        loop = AgentLoop(client, tokenizer, cfg, update_policy=policy)
        samples = [Sample(f"p{i}", f"question {i}", "") for i in range(8)]
        episodes = [asyncio.create_task(loop.run(_TwoTurns(), s)) for s in samples]
        await asyncio.sleep(0.5)
        before = _flushes(engine)
        report = await sync.update(buckets, version=new)
        flushed = _flushes(engine) - before
        trajs = await asyncio.gather(*episodes)
        return trajs, report, flushed, old, new

    async def go():
        sync = WeightSync([engine.url], backend="gloo", group_name=f"policy_{policy}", policy=policy)
        await sync.connect()
        try:
            async with EngineClient(engine.url) as client:
                trajs, report, flushed, old, new = await attempt(client, sync, 0)
                for k in (1, 2):
                    if _synced_mid_flight(trajs, policy):
                        break
                    trajs, report, flushed, old, new = await attempt(client, sync, k)
                await client.flush_cache()  # idle: the scores below are computed afresh
                scored = {new: [await client.score(t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in trajs]}
                await client.update_weights_from_disk(str(checkpoints[0]), "restored")
                scored[old] = [await client.score(t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in trajs]
        finally:
            await sync.close()
        return trajs, report, flushed, old, new, scored

    trajs, report, flushed, old, new, scored = asyncio.run(go())
    assert _synced_mid_flight(trajs, policy), "no generation was in flight at the sync in three attempts"
    assert sorted(t.prompt_id for t in trajs) == [f"p{i}" for i in range(8)]
    assert all(t.status == "finished" and t.num_turns == 2 for t in trajs), [t.status_reason for t in trajs]
    assert (flushed, report.caches_kept) == ((0, 1) if policy == "in_place" else (1, 0))
    stale_differs = False
    for i, t in enumerate(trajs):
        stale = {j for span in t.stale_kv for j in range(span.start, span.end)}
        assert set(t.action_versions) <= {old, new}
        assert not stale or policy == "in_place"
        for j, (m, v) in enumerate(zip(t.action_mask, t.policy_versions, strict=True)):
            if not m:
                continue
            gap = abs(t.behavior_logprobs[j] - scored[v][i][j])
            if j in stale:
                stale_differs |= gap > ENGINE_TOL
            else:
                assert gap <= ENGINE_TOL, (policy, t.prompt_id, j, v, gap)
    assert stale_differs or policy != "in_place"
    recomputed = sum(t.stats.prefill_recomputed for t in trajs)
    assert (recomputed == 0) if policy == "in_place" else (recomputed > 0)
