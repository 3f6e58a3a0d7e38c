"""A malformed request is a 400 naming its field before anything reaches the engine, records nothing,
and leaves the session to finish as one consistent segment; an engine's refusal of a request is the
agent's 400, not an engine failure. (Each case's status, code and field: tests/test_bad_inputs.py.)"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from sao_megatron.rollout.client import EngineError
from tests.rollout.gateway_fakes import CALCULATOR, MODEL, in_session, scripted_loop, user

ACTIONS = ["<tool>2+3</tool><|end|>", "<answer>5</answer><|end|>"]
CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
AFTER_THE_CALL = [*user(), {"role": "assistant", "content": None, "tool_calls": [CALL]}]
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "5"}

BAD = {  # a bad request sent after the first turn: its body's changes, the field the 400 names
    "temperature-nan": ({"temperature": float("nan")}, "temperature"),
    "top-p-infinite": ({"top_p": float("inf")}, "top_p"),
    "regex-invalid": ({"regex": "([a-z"}, "regex"),
    "tool-calls-not-a-list": ({"messages": [*user(), {"role": "assistant", "tool_calls": 5}]}, "messages[1].tool_calls"),
    "stream-options-not-an-object": ({"stream": True, "stream_options": 5}, "stream_options"),
    "include-usage-not-a-boolean": ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    "n-true": ({"n": True}, "n"),
    "max-tokens-beside-max-completion-tokens": ({"max_completion_tokens": 8, "max_tokens": 8.5}, "max_tokens"),
    "image-content": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
}  # fmt: skip


class RefusingOnce:
    """The scripted engine, whose ``refuse``-th call fails with HTTP ``status`` first."""

    def __init__(self, client, refuse: int, status: int):
        self.client, self.url, self.refuse, self.status, self.calls = client, client.url, refuse, status, 0

    @property
    def inputs(self):
        return self.client.inputs

    async def generate(self, input_ids, sampling, rid=None, timeout_s=None):
        self.calls += 1
        if self.calls == self.refuse:
            raise EngineError("/generate", "Invalid regex", self.status, url="http://engine")
        return await self.client.generate(input_ids, sampling, rid=rid, timeout_s=timeout_s)


async def post(gateway, session, body: dict) -> tuple[int, dict]:
    url = f"{gateway.url}/sessions/{session.id}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {session.key}"}
        async with http.post(url, data=json.dumps(body), headers=headers) as r:
            return r.status, json.loads(await r.text())


def two_turns_with(bad: dict, refuse: int = 0, status: int = 400):
    """Turn one; then the bad request (with the tool result); then the same request, well formed. The
    answers' statuses and errors, the session and its engine's inputs."""
    loop = scripted_loop(ACTIONS)
    if refuse:
        loop.client = RefusingOnce(loop.client, refuse, status)  # type: ignore[assignment]

    async def go(gateway, session):
        good = {"model": MODEL, "tools": [CALCULATOR]}
        first = await post(gateway, session, {**good, "messages": user()})
        assert first[0] == 200, first
        answers = [await post(gateway, session, {**good, "messages": [*AFTER_THE_CALL, RESULT], **bad})]
        answers.append(await post(gateway, session, {**good, "messages": [*AFTER_THE_CALL, RESULT]}))
        return answers, session

    answers, session = asyncio.run(in_session(loop, go))
    return answers, session, loop.client.inputs  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", BAD)
def test_a_bad_request_is_refused_before_the_engine_and_the_session_goes_on_as_one_segment(case):
    body, param = BAD[case]
    [(status, error), (retried, _)], session, inputs = two_turns_with(body)
    assert (status, error["error"]["param"]) == (400, param), error
    assert set(error["error"]) == {"message", "type", "code", "param"}
    assert retried == 200 and len(inputs) == 2 and not session.engine_error  # the bad one never reached it
    [traj] = session.trajectories("finished", "", 1.0, True, {})
    assert len(traj.turns) == 2
    for k, turn in enumerate(traj.turns):
        assert inputs[k] == traj.prompt_ids + traj.response_ids[: turn.start]


@pytest.mark.parametrize("status", [400, 422])
def test_an_engine_refusing_the_request_is_a_400_and_not_an_engine_failure(status):
    [(refused, error), (retried, _)], session, inputs = two_turns_with({}, refuse=2, status=status)
    assert (refused, error["error"]["code"]) == (400, "engine_refused_request"), error
    assert "Invalid regex" in error["error"]["message"] and not session.engine_error
    assert retried == 200 and len(session.segments) == 1 and len(session.segments[0].ep.turns) == 2
    assert inputs[0] + session.segments[0].ep.response_ids[: session.segments[0].ep.turns[1].start] == inputs[1]


def test_an_engine_failure_is_a_502_that_records_nothing():
    [(failed, error), (retried, _)], session, _ = two_turns_with({}, refuse=2, status=500)
    assert (failed, error["error"]["code"], retried) == (502, "engine_error", 200)
    assert session.engine_error and len(session.segments) == 1  # the retry continues the segment
