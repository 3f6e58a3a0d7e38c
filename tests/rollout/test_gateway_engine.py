"""The gateway on the real CPU engine with the real Qwen3 chat template, driven by the official
``openai`` client: a three-turn tool conversation (one call, two parallel calls streamed, an answer),
and user follow-ups after tool calls (one call, then two parallel calls), each one segment.

The tiny random Qwen3-MoE would almost never write a well-formed call, so each request carries
SGLang's ``regex`` (``extra_body``, the engine's structured decoding): every token is still the
model's, sampled from its distribution restricted to the grammar, so the structure is fixed while
the expressions are the model's. Decoding is greedy, so the run is deterministic."""

# pyright: reportArgumentType=false, reportOptionalSubscript=false, reportOptionalMemberAccess=false
from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from sao_megatron.config import AgentLoopConfig
from sao_megatron.config.schema import GatewayConfig, OpenAIAgentConfig
from sao_megatron.envs.base import Sample
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import EngineClient
from sao_megatron.rollout.engine import EngineProcess, EngineSpec
from sao_megatron.rollout.gateway import Gateway
from sao_megatron.spawn import free_port
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.gateway_fakes import CALCULATOR
from tests.test_from_hf import make_tiny_qwen3

pytestmark = pytest.mark.timeout(600)

THINK = r"<think>\n[a-z]{1,6}\n</think>\n\n"
CALL = r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": "[1-9][+*][1-9]"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory, qwen3_tokenizer_dir):
    model = make_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "model", qwen3_tokenizer_dir)
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    spec = EngineSpec(
        model_path=str(model), port=free_port(), dtype="float32", max_total_tokens=8192, log_path=str(log)
    )
    with EngineProcess(spec) as proc:
        yield proc, model


class Recording:
    """The engine's client, every prompt it was sent recorded."""

    def __init__(self, client: EngineClient):
        self.client, self.url, self.inputs = client, client.url, []

    async def generate(self, input_ids, sampling, rid=None, timeout_s=None):
        self.inputs.append(list(input_ids))
        return await self.client.generate(input_ids, sampling, rid=rid, timeout_s=timeout_s)


def test_a_three_turn_tool_conversation_through_the_openai_client(qwen3_engine):
    engine, model = qwen3_engine
    tok = load_tokenizer(model)
    calculate = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}

    def result(call) -> str:
        expr = json.loads(call.function.arguments)["expression"]
        return str(calculate[expr[1]](int(expr[0]), int(expr[2])))

    async def go():
        async with EngineClient(engine.url) as client:
            recording = Recording(client)
            loop = AgentLoop(recording, tok, AgentLoopConfig(max_new_tokens=96, max_context_tokens=2048))  # type: ignore[arg-type]
            gateway = Gateway(GatewayConfig(), OpenAIAgentConfig())
            await gateway.start()
            session = gateway.open(loop, Sample("q", "2+3 and then two more?", ""))
            api = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
            ask: dict[str, Any] = dict(model="sao-policy", tools=[CALCULATOR], temperature=0.0)
            try:
                messages: list = [{"role": "user", "content": "2+3 and then two more?"}]
                first = await api.chat.completions.create(messages=messages, extra_body={"regex": THINK + CALL}, **ask)
                assert first.choices[0].finish_reason == "tool_calls" and len(first.choices[0].message.tool_calls) == 1
                messages.append(first.choices[0].message.model_dump(exclude_none=True))
                messages += [
                    {"role": "tool", "tool_call_id": c.id, "content": result(c)}
                    for c in first.choices[0].message.tool_calls
                ]
                stream = await api.chat.completions.create(
                    messages=messages, stream=True, extra_body={"regex": THINK + CALL + "\n" + CALL}, **ask
                )
                chunks = [c async for c in stream]
                calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
                reasoning = "".join(
                    c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices
                )
                assert len(calls) == 2 and chunks[-1].choices[0].finish_reason == "tool_calls"  # parallel, streamed
                messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning,
                                 "tool_calls": [{"id": c.id, "type": "function", "function": c.function.model_dump()} for c in calls]})  # fmt: skip
                messages += [{"role": "tool", "tool_call_id": c.id, "content": result(c)} for c in calls]
                third = await api.chat.completions.create(
                    messages=messages, extra_body={"regex": THINK + "[0-9]{1,3}"}, **ask
                )
                assert third.choices[0].finish_reason == "stop" and third.choices[0].message.content.isdigit()
                messages.append(third.choices[0].message.model_dump(exclude_none=True))
            finally:
                await gateway.close()
            return messages, session, recording.inputs

    messages, session, inputs = asyncio.run(go())
    [traj] = session.trajectories("finished", "", 1.0, None, {})
    assert len(traj.turns) == 3 and all(lp <= 0.0 for lp in traj.behavior_logprobs)
    assert all(v == 0 for v, m in zip(traj.policy_versions, traj.action_mask, strict=True) if m)
    for k, turn in enumerate(traj.turns):  # token-in/token-out: each request extends the recorded ids
        assert inputs[k] == traj.prompt_ids + traj.response_ids[: turn.start]
    whole = tok.apply_chat_template(
        [{"content": "", **m} for m in messages], tools=[CALCULATOR], tokenize=True, return_dict=False
    )
    # The template closes the last turn with "<|im_end|>\n"; the engine stops at <|im_end|>. The recorded
    # ids are the template's everywhere, the actions being spelled as the engine generated them: under a
    # grammar the random model may write "<think>" as "<th" + "ink>", which the tokenizer never would, so
    # each action is compared through the tokenizer's own spelling of its text (the observations and the
    # prompt are compared id for id).
    canonical, at = list(traj.prompt_ids), 0
    for turn in traj.turns:
        canonical += traj.response_ids[at : turn.start]
        action = traj.response_ids[turn.start : turn.end]
        canonical += tok.encode(tok.decode(action[:-1]), add_special_tokens=False) + action[-1:]  # up to <|im_end|>
        at = turn.end
    assert canonical + tok.encode("\n") == list(whole)
    assert tok.decode(traj.prompt_ids + traj.response_ids) + "\n" == tok.decode(whole)


def test_user_follow_ups_after_tool_calls_through_the_openai_client(qwen3_engine):
    """Ask, one call, its result, an answer, a follow-up; two parallel calls, their results, an answer, a
    second follow-up; an answer. Qwen3's template re-renders each answered turn without its ``<think>``
    block once a follow-up comes: still one segment whose ids are what the engine saw."""
    engine, model = qwen3_engine
    tok = load_tokenizer(model)

    async def go():
        async with EngineClient(engine.url) as client:
            recording = Recording(client)
            loop = AgentLoop(recording, tok, AgentLoopConfig(max_new_tokens=96, max_context_tokens=4096))  # type: ignore[arg-type]
            gateway = Gateway(GatewayConfig(), OpenAIAgentConfig())
            await gateway.start()
            session = gateway.open(loop, Sample("q", "2+3?", ""))
            api = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
            ask: dict[str, Any] = dict(model="sao-policy", tools=[CALCULATOR], temperature=0.0)
            messages: list = [{"role": "user", "content": "2+3?"}]
            seen = []  # the messages of each request

            async def turn(regex: str):
                seen.append(list(messages))
                reply = await api.chat.completions.create(messages=messages, extra_body={"regex": regex}, **ask)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                return reply.choices[0].message.tool_calls or []

            try:
                for calls_regex, follow_up in ((CALL, "And tomorrow?"), (CALL + "\n" + CALL, "Thanks, and 4*5?")):
                    calls = await turn(THINK + calls_regex)
                    messages.extend({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in calls)
                    await turn(THINK + "[0-9]{1,3}")
                    messages.append({"role": "user", "content": follow_up})
                await turn(THINK + "[a-z]{1,8}")
            finally:
                await gateway.close()
            return seen, session, recording.inputs

    seen, session, inputs = asyncio.run(go())
    assert len(session.segments) == 1 and len(inputs) == 5
    [traj] = session.trajectories("finished", "", 1.0, None, {})
    assert len(traj.turns) == 5 and [m["role"] for m in seen[3][-3:]] == ["assistant", "tool", "tool"]
    assert len(seen[1][-2]["tool_calls"]) == 1 and len(seen[3][-3]["tool_calls"]) == 2  # one call, two parallel
    for k, turn in enumerate(traj.turns):  # each request extends the recorded ids; these are what the engine saw
        assert inputs[k] == traj.prompt_ids + traj.response_ids[: turn.start]
    for k in range(1, 5):  # observation k: the template's rendering of request k's new messages
        ids = traj.response_ids[traj.turns[k - 1].end : traj.turns[k].start]
        rendering = tok.apply_chat_template(
            [{"content": "", **m} for m in seen[k]], tools=[CALCULATOR], tokenize=False, add_generation_prompt=True
        )
        assert rendering.endswith(tok.decode(ids)) and ids == tok.encode(tok.decode(ids), add_special_tokens=False)
        if seen[k][-1]["role"] == "user":
            follow_up = seen[k][-1]["content"]
            assert tok.decode(ids) == f"\n<|im_start|>user\n{follow_up}<|im_end|>\n<|im_start|>assistant\n"
