"""The OpenAI-compatible gateway on a scripted engine, driven by the official ``openai`` client.

Token bookkeeping (one segment while the agent's messages extend what the session returned, a new
one when it rewrites its history), the reward's sources, the session's end (timeout: dropped; an
agent that raises: failed), streaming, parallel native calls under Qwen3's template."""

# pyright: reportArgumentType=false, reportOptionalSubscript=false, reportOptionalMemberAccess=false
# (plain dicts as the openai client's typed message and tool params, as agents write them)
from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from sao_megatron.config import AgentLoopConfig
from sao_megatron.config.schema import GatewayConfig, OpenAIAgentConfig
from sao_megatron.envs import make_env
from sao_megatron.rollout.gateway import Gateway
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.gateway_fakes import CALCULATOR, MODEL, SAMPLE, in_session, scripted_loop, user

TOOL_THEN_ANSWER = ["<tool>2+3</tool><|end|>", "<answer>5</answer><|end|>"]


def client(gateway, session) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key, max_retries=0)


async def tool_conversation(api: openai.AsyncOpenAI) -> tuple[list[dict], str | None]:
    """Ask, run the calculator the model calls, send its result; the messages and the final answer."""
    messages: list = user()
    first = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])  # type: ignore[list-item]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "2+3"})  # type: ignore[union-attr]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])  # type: ignore[arg-type]
    assert second.choices[0].finish_reason == "stop" and second.usage is not None
    return messages, second.choices[0].message.content


def test_a_tool_conversation_is_one_segment_whose_ids_are_the_template_of_the_conversation():
    tok = load_tokenizer()
    loop = scripted_loop(TOOL_THEN_ANSWER, tok)

    async def go(gateway, session):
        messages, answer = await tool_conversation(client(gateway, session))
        return messages, answer, session

    messages, answer, session = asyncio.run(in_session(loop, go))
    assert answer == "5" and len(session.segments) == 1
    [traj] = session.trajectories("finished", "", 1.0, True, {})
    rendered = tok.apply_chat_template(
        [*user(), {"role": "assistant", "content": "<tool>2+3</tool>"}, {"role": "tool", "content": "5"},
         {"role": "assistant", "content": "<answer>5</answer>"}],
        tokenize=True, return_dict=False,
    )  # fmt: skip
    assert traj.prompt_ids + traj.response_ids == list(rendered)
    assert tok.decode(traj.response_ids[traj.turns[0].end : traj.turns[1].start]) == "<|tool|>5<|assistant|>"
    assert traj.action_mask == [1] * 6 + [0] * 3 + [1] * 4
    assert traj.behavior_logprobs == [-0.5] * 6 + [0.0] * 3 + [-0.5] * 4
    assert traj.policy_versions == [3] * 6 + [-1] * 3 + [3] * 4
    assert loop.client.inputs[1] == traj.prompt_ids + traj.response_ids[: traj.turns[1].start]  # type: ignore[attr-defined]


def test_a_history_rewrite_starts_a_second_segment_sharing_the_session_and_reward():
    loop = scripted_loop([TOOL_THEN_ANSWER[0], "<answer>5</answer><|end|>"])

    async def go(gateway, session):
        api = client(gateway, session)
        await api.chat.completions.create(model=MODEL, messages=user(), tools=[CALCULATOR])  # type: ignore[arg-type]
        compacted = user("Earlier you computed 2+3 with the calculator. What is 2+3?")
        await api.chat.completions.create(model=MODEL, messages=compacted, tools=[CALCULATOR])  # type: ignore[arg-type]
        return session

    session = asyncio.run(in_session(loop, go))
    first, second = session.trajectories("finished", "", 0.5, None, {})
    assert second.prompt_ids == loop.client.inputs[1]  # type: ignore[attr-defined]  # a fresh prompt, not an extension
    assert (first.prompt_id, second.prompt_id) == (SAMPLE.prompt_id, SAMPLE.prompt_id)
    assert first.reward_details["session"] == second.reward_details["session"] == session.id
    assert [t.reward_details["segment"] for t in (first, second)] == [0, 1]
    assert first.reward_details["session_segments"] == 2 and first.reward == second.reward == 0.5


def test_an_answer_sent_back_without_its_reasoning_still_extends_the_segment():
    """Qwen3-style reasoning comes back as ``reasoning_content``; an agent that drops it (as most do)
    sends the same turn, so the session's generated ids are kept and the sequence grows."""
    loop = scripted_loop(["<think>add</think><tool>2+3</tool><|end|>", "<answer>5</answer><|end|>"])

    async def go(gateway, session):
        api = client(gateway, session)
        first = await api.chat.completions.create(model=MODEL, messages=user(), tools=[CALCULATOR])  # type: ignore[arg-type]
        message = first.choices[0].message
        assert message.content is None and message.model_extra["reasoning_content"] == "add"  # type: ignore[index]
        call = message.tool_calls[0]  # type: ignore[index]
        sent = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
        messages = [*user(), sent, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])  # type: ignore[arg-type]
        return session

    session = asyncio.run(in_session(loop, go))
    assert len(session.segments) == 1 and session.segments[0].ep.turns[1].start > session.segments[0].ep.turns[0].end


def test_streaming_gives_the_same_message_in_chunks():
    loop = scripted_loop(TOOL_THEN_ANSWER)

    async def go(gateway, session):
        stream = await client(gateway, session).chat.completions.create(
            model=MODEL,
            messages=user(),
            tools=[CALCULATOR],
            stream=True,
            stream_options={"include_usage": True},  # type: ignore[arg-type]
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(in_session(loop, go))
    calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "2+3"})
    ]  # type: ignore[union-attr, arg-type]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


async def _arith_agent(task: str, base_url: str, api_key: str) -> None:
    api = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await tool_conversation(api)


async def _posting_agent(task: str, base_url: str, api_key: str) -> None:
    import aiohttp

    await _arith_agent(task, base_url, api_key)
    async with aiohttp.ClientSession() as http:
        url = base_url.removesuffix("/v1") + "/reward"
        async with http.post(
            url, json={"reward": 0.25, "details": {"judge": "x"}}, headers={"Authorization": f"Bearer {api_key}"}
        ) as r:
            assert r.status == 200


async def _returning_agent(task: str, base_url: str, api_key: str) -> float:
    await _posting_agent(task, base_url, api_key)
    return 0.75


async def _sleeping_agent(task: str, base_url: str, api_key: str) -> None:
    await asyncio.sleep(30)


def _raising_agent(task: str, base_url: str, api_key: str) -> None:
    raise ValueError(f"the agent broke on {task!r}")


def episode(agent: str | OpenAIAgentConfig, actions=TOOL_THEN_ANSWER, timeout_s: float = 60.0, cfg=None):
    """One ``openai_agent`` episode through the agent loop (``agent``: a function of this module, or the
    agent's config); its trajectories, the gateway and the scripted loop."""
    if isinstance(agent, str):
        agent = OpenAIAgentConfig(entry_point=f"{__name__}:{agent}")
    gateway = Gateway(GatewayConfig(session_timeout_s=timeout_s), agent)
    loop = scripted_loop(actions, cfg=cfg)
    loop.gateway = gateway

    async def go():
        try:
            return await loop.run_segments(make_env("openai_agent"), SAMPLE)
        finally:
            await gateway.close()

    return asyncio.run(go()), gateway, loop


@pytest.mark.parametrize(
    ("entry", "reward", "correct", "details"),
    [
        ("_arith_agent", 1.0, True, "answer"),
        ("_posting_agent", 0.25, None, "judge"),
        ("_returning_agent", 0.75, None, None),
    ],
)
def test_the_reward_comes_from_the_agent_else_the_session_else_the_task(entry, reward, correct, details):
    [traj], gateway, _ = episode(entry)
    assert (traj.status, traj.reward, traj.correct) == ("finished", reward, correct), traj.status_reason
    assert details is None or details in traj.reward_details
    assert gateway.counts.finished == 1 and gateway.counts.segments == 1 and not gateway.sessions


def test_a_session_past_its_timeout_is_dropped_and_counted():
    [traj], gateway, _ = episode("_sleeping_agent", timeout_s=0.2)
    assert traj.status == "failed" and traj.status_reason.startswith("gateway: session timed out after 0.2s")
    assert (gateway.counts.dropped, gateway.counts.finished, gateway.metrics()["gateway/sessions_dropped"]) == (
        1,
        0,
        1.0,
    )


def test_an_agent_that_raises_is_a_failed_episode():
    [traj], gateway, _ = episode("_raising_agent")
    assert traj.status == "failed" and traj.status_reason == "agent: ValueError: the agent broke on 'What is 2+3?'"
    assert gateway.counts.failed == 1 and not traj.response_ids


def test_a_command_agent_gets_the_task_on_stdin_and_the_session_in_its_environment(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import os, sys, openai\n"
        "task = sys.stdin.read()\n"
        "api = openai.OpenAI(base_url=os.environ['OPENAI_BASE_URL'], api_key=os.environ['OPENAI_API_KEY'])\n"
        "r = api.chat.completions.create(model='sao-policy', messages=[{'role': 'user', 'content': task}])\n"
        "sys.exit(0 if r.choices[0].message.content == '5' else 3)\n"
    )
    tmp_path.chmod(0o755)  # the sandbox (rollout.agent.sandbox=auto) runs it as an unprivileged uid
    import sys

    [traj], _, loop = episode(OpenAIAgentConfig(command=[sys.executable, str(script)]), ["<answer>5</answer><|end|>"])
    assert (traj.status, traj.reward, traj.correct) == ("finished", 1.0, True), traj.status_reason
    assert loop.client.inputs[0] == load_tokenizer().apply_chat_template(user(), tokenize=True, return_dict=False)  # type: ignore[attr-defined]


@pytest.mark.parametrize("exit_code", [0, 4])
def test_an_unsandboxed_command_agent_ends_with_its_exit_though_a_child_holds_its_stderr(tmp_path, exit_code):
    """rollout.agent.sandbox=off: a child the agent left in its process group, holding its stderr, neither
    keeps the episode open (to the session's timeout, as waiting for the pipe did) nor outlives it."""
    import os
    import sys
    import time
    import uuid

    marker = f"sao-agent-test-{uuid.uuid4().hex}"
    script = tmp_path / "agent.py"
    script.write_text(
        "import os, subprocess, sys, openai\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}])\n"
        "task = sys.stdin.read()\n"
        "api = openai.OpenAI(base_url=os.environ['OPENAI_BASE_URL'], api_key=os.environ['OPENAI_API_KEY'])\n"
        "r = api.chat.completions.create(model='sao-policy', messages=[{'role': 'user', 'content': task}])\n"
        f"sys.stderr.write('the agent says goodbye\\n'); sys.exit({exit_code})\n"
    )
    cfg = OpenAIAgentConfig(command=[sys.executable, str(script)], sandbox="off")

    def children() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(int(pid))
            except OSError:
                pass
        return found

    started = time.monotonic()
    try:
        [traj], gateway, _ = episode(cfg, ["<answer>5</answer><|end|>"], timeout_s=120.0)
        took = time.monotonic() - started
        if exit_code == 0:
            assert (traj.status, traj.reward) == ("finished", 1.0), traj.status_reason
        else:
            assert traj.status == "failed" and traj.status_reason.startswith(
                f"agent: {sys.executable} exited with code 4"
            )
            assert traj.status_reason.endswith("the agent says goodbye")
        assert took < 60.0 and not gateway.counts.dropped  # not held open to the session's timeout
        assert children() == []
    finally:
        for pid in children():  # only when the test failed: what it started, by pid
            os.kill(pid, 9)


def test_a_gateway_on_every_interface_gives_agents_the_node_s_address():
    """``rollout.gateway.host=0.0.0.0`` (env workers on other nodes): the URL names an address they can use."""

    async def go(gateway, session):
        models = await client(gateway, session).models.list()
        return gateway.url, models.data[0].id

    url, model = asyncio.run(in_session(scripted_loop([]), go, GatewayConfig(host="0.0.0.0")))
    assert model == MODEL and not url.startswith("http://0.0.0.0:")


def test_parallel_native_calls_under_the_qwen3_template(qwen3_tokenizer_dir):
    """Two calls in one action come back as two ``tool_calls``; their results are one observation; the
    session's ids equal the template's rendering of the whole conversation (generated in its own form,
    reasoning sent back as ``reasoning_content``; the engine stops at ``<|im_end|>``, before its newline)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    calls_text = "\n".join(
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}\n</tool_call>'
        for e in ("2+3", "4*5")
    )
    texts = [f"<think>\nTwo sums.\n</think>\n\n{calls_text}", "<think>\nDone.\n</think>\n\n5 and 20"]
    loop = scripted_loop([t + "<|im_end|>" for t in texts], tok)

    async def go(gateway, session):
        api = client(gateway, session)
        first = await api.chat.completions.create(model=MODEL, messages=user("2+3 and 4*5?"), tools=[CALCULATOR])  # type: ignore[arg-type]
        calls = first.choices[0].message.tool_calls or []
        assert [json.loads(c.function.arguments)["expression"] for c in calls] == ["2+3", "4*5"]  # type: ignore[union-attr]
        messages = [*user("2+3 and 4*5?"), first.choices[0].message.model_dump(exclude_none=True)]
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, ("5", "20"), strict=True)
        ]
        second = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])  # type: ignore[arg-type]
        return [*messages, second.choices[0].message.model_dump(exclude_none=True)], session

    messages, session = asyncio.run(in_session(loop, go))
    assert messages[-1]["content"] == "5 and 20" and len(session.segments) == 1
    [traj] = session.trajectories("finished", "", 1.0, True, {})
    whole = tok.apply_chat_template(
        [{"content": "", **m} for m in messages], tools=[CALCULATOR], tokenize=True, return_dict=False
    )
    assert traj.prompt_ids + traj.response_ids + tok.encode("\n") == list(whole)


async def _rewriting_agent(task: str, base_url: str, api_key: str) -> float:
    api = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await api.chat.completions.create(model=MODEL, messages=user(task), tools=[CALCULATOR])
    await api.chat.completions.create(model=MODEL, messages=user("Compacted: " + task), tools=[CALCULATOR])
    return 1.0


def test_the_manager_hands_on_every_segment_of_a_session():
    from sao_megatron.buffer import ReadyBuffer
    from sao_megatron.envs.openai_agent import AgentTask
    from sao_megatron.rollout.manager import RolloutManager

    gateway = Gateway(GatewayConfig(), OpenAIAgentConfig(entry_point=f"{__name__}:_rewriting_agent"))
    loop = scripted_loop([TOOL_THEN_ANSWER[0], TOOL_THEN_ANSWER[1]])
    loop.gateway = gateway
    got = []

    async def go():
        manager = RolloutManager([loop], AgentTask(), "openai_agent", got.append, max_concurrent=1)
        try:
            await manager.run(asyncio.Event(), max_prompts=1)
            await manager.drain()
        finally:
            await gateway.close()
        return manager

    manager = asyncio.run(go())
    assert [t.reward_details["segment"] for t in got] == [0, 1] and manager.stats.finished == 2
    assert [t.group_id for t in got] == ["train:0", "train:0/segment1"] and all(t.reward == 1.0 for t in got)
    buffer = ReadyBuffer(batch_size=1, max_policy_lag=None)
    assert all(buffer.admit(t, 0) for t in got)
    assert buffer.take() == [got[0]] and buffer.take() == [got[1]]  # one prompt per batch: the segments in turn
    assert manager.gateway is gateway and gateway.metrics()["gateway/segments_per_session"] == 2.0


def test_an_agent_stopped_by_the_context_budget_is_a_truncated_episode():
    """Its second request does not fit ``max_context_tokens``: 400 to the agent, which raises; the
    episode ends truncated with the action it generated (the observation after it is cut)."""
    prompt = len(load_tokenizer().apply_chat_template(user(), tokenize=True, return_dict=False))
    [traj], gateway, _ = episode("_arith_agent", cfg=AgentLoopConfig(max_context_tokens=prompt + 6 + 3))
    assert (traj.status, traj.stats.end, traj.reward, traj.correct) == ("truncated", "context", 0.0, False)
    assert traj.status_reason.startswith("token budget exhausted: the conversation is") and traj.action_mask == [1] * 6
    assert "BadRequestError" in traj.reward_details["agent_error"] and gateway.counts.failed == 0


def test_the_example_agent_solves_a_task_through_the_gateway():
    """examples/arith_agent.py (only the openai client): lists the model, calls the calculator the model
    asks for, sends its result, stops at the answer; the task's grader rewards it."""
    [traj], _, _ = episode(OpenAIAgentConfig(entry_point="examples/arith_agent.py:run"))
    assert (traj.status, traj.reward, traj.correct, traj.num_turns) == ("finished", 1.0, True, 2), traj.status_reason
    assert (
        load_tokenizer().decode(traj.response_ids[traj.turns[0].end : traj.turns[1].start]) == "<|tool|>5<|assistant|>"
    )


ALL_AT_ONCE = threading.Barrier(40)


def _waiting_agent(task: str, base_url: str, api_key: str) -> float:
    ALL_AT_ONCE.wait(timeout=20)  # passes only when 40 sync agents run at the same time
    return 1.0


def test_sync_agents_run_concurrently_beyond_the_default_thread_pool():
    """40 sync agents at once (asyncio's default pool runs at most 32): each waits for all the others."""
    gateway = Gateway(GatewayConfig(), OpenAIAgentConfig(entry_point=f"{__name__}:_waiting_agent"))
    loop = scripted_loop([])
    loop.gateway = gateway

    async def go():
        try:
            return await asyncio.gather(*(loop.run_segments(make_env("openai_agent"), SAMPLE) for _ in range(40)))
        finally:
            await gateway.close()

    reasons = {traj.status_reason for [traj] in asyncio.run(go())}
    assert reasons == {"agent: the session generated nothing"}  # not a BrokenBarrierError
