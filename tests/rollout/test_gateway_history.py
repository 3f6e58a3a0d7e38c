"""What a gateway session makes of the history an agent sends back, under the real Qwen3 template on a
scripted engine: a user follow-up after tool calls extends the session (Qwen3 re-renders the earlier
turns without their ``<think>`` blocks, which the recorded ids keep), re-spelt messages extend it, a
real rewrite opens a segment; roles the template cannot render are mapped or refused."""

# pyright: reportArgumentType=false, reportOptionalSubscript=false, reportOptionalMemberAccess=false
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from sao_megatron.rollout.gateway_session import GatewaySession
from tests.rollout.gateway_fakes import CALCULATOR, MODEL, in_session, scripted_loop, user


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


def calls_text(*expressions: str) -> str:
    return "\n".join(
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}\n</tool_call>'
        for e in expressions
    )


def render(tok, messages: list[dict], generation_prompt: bool = True) -> str:
    return tok.apply_chat_template(
        [{"content": "", **m} for m in messages],
        tools=[CALCULATOR],
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )


def check_one_segment(session: GatewaySession, inputs: list[list[int]]) -> None:
    """One segment whose every engine input is its prompt and response up to that action."""
    [traj] = session.trajectories("finished", "", 1.0, True, {})
    assert len(session.segments) == 1 and len(traj.turns) == len(inputs)
    for k, turn in enumerate(traj.turns):
        assert inputs[k] == traj.prompt_ids + traj.response_ids[: turn.start]


async def follow_up(api: openai.AsyncOpenAI, expressions: tuple[str, ...], results: tuple[str, ...]) -> list[dict]:
    """Ask, send the calls' results, get the answer, ask a follow-up: the messages as sent, answers included."""
    messages: list = user("What is it?")
    first = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
    calls = first.choices[0].message.tool_calls or []
    assert [json.loads(c.function.arguments)["expression"] for c in calls] == list(expressions)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results, strict=True)]
    answer = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
    messages += [answer.choices[0].message.model_dump(exclude_none=True), *user("And tomorrow?")]
    last = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
    assert last.choices[0].message.content == "Same."
    return messages


@pytest.mark.parametrize("expressions", [("2+3",), ("2+3", "4*5")], ids=["one-call", "two-parallel-calls"])
def test_a_user_follow_up_after_tool_calls_extends_the_session(qwen3, expressions):
    results = tuple(str(eval(e)) for e in expressions)
    texts = [
        f"<think>\nCalculate.\n</think>\n\n{calls_text(*expressions)}",
        f"<think>\nAdd up.\n</think>\n\n{' and '.join(results)}",
        "<think>\nThe same.\n</think>\n\nSame.",
    ]
    loop = scripted_loop([t + "<|im_end|>" for t in texts], qwen3)

    async def go(gateway, session):
        api = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
        return await follow_up(api, expressions, results), session

    messages, session = asyncio.run(in_session(loop, go))
    check_one_segment(session, loop.client.inputs)
    [traj] = session.trajectories("finished", "", 1.0, True, {})
    observation = qwen3.decode(traj.response_ids[traj.turns[1].end : traj.turns[2].start])
    assert observation == "\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n"
    assert render(qwen3, messages).endswith(observation)  # the template's rendering of the new message
    # The earlier turns keep the reasoning the engine saw, which the template now drops from them.
    assert "Calculate." in qwen3.decode(traj.response_ids) and "Calculate." not in render(qwen3, messages)


def test_answers_sent_back_re_spelt_extend_the_session(qwen3):
    """Whitespace around the content, arguments re-serialised with other spacing, keys in another order,
    no reasoning: the same turns."""
    texts = [f"<think>\nCalculate.\n</think>\n\n{calls_text('2+3')}", "<think>\nDone.\n</think>\n\nIt is 5.", "Yes."]
    loop = scripted_loop([t + "<|im_end|>" for t in texts], qwen3)

    async def go(gateway, session):
        api = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
        first = await api.chat.completions.create(model=MODEL, messages=user(), tools=[CALCULATOR])
        call = first.choices[0].message.tool_calls[0]
        sent = {
            "tool_calls": [
                {"function": {"arguments": '{ "expression" :"2+3" }', "name": "calculator"}, "type": "function", "id": call.id}
            ],
            "content": "  ",
            "role": "assistant",
        }  # fmt: skip
        messages = [*user(), sent, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        messages += [{"role": "assistant", "content": "\n" + second.choices[0].message.content + "  "}, *user("Sure?")]
        await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        return session

    session = asyncio.run(in_session(loop, go))
    check_one_segment(session, loop.client.inputs)


@pytest.mark.parametrize("rewrite", ["edited", "removed"])
def test_a_message_edited_or_removed_opens_a_segment(qwen3, rewrite):
    texts = [f"<think>\nx\n</think>\n\n{calls_text('2+3')}", "<think>\ny\n</think>\n\n5", "<think>\nz\n</think>\n\nok"]
    loop = scripted_loop([t + "<|im_end|>" for t in texts], qwen3)

    async def go(gateway, session):
        api = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
        first = await api.chat.completions.create(model=MODEL, messages=user(), tools=[CALCULATOR])
        call = first.choices[0].message.tool_calls[0]
        messages = [*user(), first.choices[0].message.model_dump(exclude_none=True)]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        second = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        messages += [second.choices[0].message.model_dump(exclude_none=True), *user("Thanks")]
        if rewrite == "edited":
            messages[2] = {**messages[2], "content": "6"}
        else:
            del messages[1:3]
        await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        return messages, session

    messages, session = asyncio.run(in_session(loop, go))
    assert len(session.segments) == 2
    second = session.trajectories("finished", "", 1.0, True, {})[1]
    assert second.prompt_ids == qwen3.encode(render(qwen3, messages), add_special_tokens=False)


def test_a_developer_message_is_rendered_as_the_system_message_under_qwen3(qwen3):
    """Qwen3's template renders no ``developer`` role (it would drop the message silently)."""
    loop = scripted_loop(["Hi.<|im_end|>"], qwen3)
    messages = [{"role": "developer", "content": "Answer in French."}, *user()]

    async def go(gateway, session):
        api = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)
        await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])

    asyncio.run(in_session(loop, go))
    system = [{"role": "system", "content": "Answer in French."}, *user()]
    assert "Answer in French." not in render(qwen3, messages)  # what the template alone makes of it
    assert loop.client.inputs[0] == qwen3.encode(render(qwen3, system), add_special_tokens=False)
