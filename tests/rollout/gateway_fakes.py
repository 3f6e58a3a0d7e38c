"""A gateway whose sessions run on a scripted engine (tests.rollout.fakes.ScriptedClient), and the
bad requests of the bad-input table (tests/test_bad_inputs.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from sao_megatron.config import AgentLoopConfig
from sao_megatron.config.schema import GatewayConfig, OpenAIAgentConfig
from sao_megatron.envs.base import Sample
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.gateway import Gateway
from sao_megatron.rollout.gateway_session import GatewaySession
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.fakes import ScriptedClient

MODEL = "sao-policy"
SAMPLE = Sample(prompt_id="p0", question="What is 2+3?", answer="5")
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def scripted_loop(actions: list[str], tokenizer=None, cfg: AgentLoopConfig | None = None) -> AgentLoop:
    """An agent loop whose engine answers request k with the ids of ``actions[k]``."""
    tok = tokenizer or load_tokenizer()
    client = ScriptedClient([tok.encode(a, add_special_tokens=False) for a in actions])
    return AgentLoop(client, tok, cfg or AgentLoopConfig(), engine_name="scripted")  # type: ignore[arg-type]


async def in_session(
    loop: AgentLoop, fn: Callable[[Gateway, GatewaySession], Awaitable[Any]], cfg: GatewayConfig | None = None
) -> Any:
    """``fn(gateway, session)`` with a started gateway and one open session on ``loop``."""
    gateway = Gateway(cfg or GatewayConfig(), OpenAIAgentConfig())
    await gateway.start()
    try:
        return await fn(gateway, gateway.open(loop, SAMPLE))
    finally:
        await gateway.close()


def user(text: str = "What is 2+3?") -> list[dict]:
    return [{"role": "user", "content": text}]


def bad_request(
    body: dict, path: str = "chat", key: str | None = "session", cfg: AgentLoopConfig | None = None
) -> Callable[[], object]:
    """A call that sends ``body`` to a fresh session and raises ``ValueError("STATUS CODE PARAM:
    MESSAGE")`` from the OpenAI error JSON it gets back (asserting its shape and a 4xx status).

    ``path``: ``chat`` (the session's completions), ``unknown`` (a session that does not exist),
    ``closed`` (after the session's reward), ``header`` (/v1/chat/completions without a session
    header); ``key``: ``session`` (its key), None (no Authorization header) or a wrong key."""

    async def go() -> None:
        loop = scripted_loop(["<answer>5</answer><|end|>"], cfg=cfg)

        async def send(gateway: Gateway, session: GatewaySession) -> None:
            headers = {} if key is None else {"Authorization": f"Bearer {session.key if key == 'session' else key}"}
            url = f"{gateway.url}/sessions/{session.id}/v1/chat/completions"
            async with aiohttp.ClientSession() as http:
                if path == "unknown":
                    url = f"{gateway.url}/sessions/nosuchsession/v1/chat/completions"
                elif path == "header":
                    url = f"{gateway.url}/v1/chat/completions"
                elif path == "closed":
                    async with http.post(
                        f"{gateway.url}/sessions/{session.id}/reward", json={"reward": 1.0}, headers=headers
                    ) as r:
                        assert r.status == 200, await r.text()
                async with http.post(url, data=json.dumps(body), headers=headers) as r:
                    status, answer = r.status, await r.json()
            assert 400 <= status < 500, (status, answer)
            error = answer["error"]
            assert set(error) == {"message", "type", "code", "param"}, answer
            raise ValueError(f"{status} {error['code']} {error['param']}: {error['message']}")

        await in_session(loop, send)

    return lambda: asyncio.run(go())
