"""The OpenAI-compatible gateway: a user's agent drives the engines, every session is recorded.

An agent written against the OpenAI chat-completions API trains unchanged: its ``base_url`` is its
session's URL, its ``api_key`` the session's key (:func:`Gateway.run_episode` hands both to it)::

    GET  /v1/models                                   (also under /sessions/{id}/v1/models)
    POST /sessions/{id}/v1/chat/completions           (or /v1/chat/completions + header X-SAO-Session)
         messages (system, user, assistant with tool_calls, tool), tools, tool_choice, temperature,
         top_p, max_tokens / max_completion_tokens, stop, n=1, seed, stream (SSE, stream_options),
         regex (SGLang's extension: constrained decoding)
         -> choices[0].message {content, reasoning_content, tool_calls}, finish_reason, usage
    POST /sessions/{id}/reward   {"reward": float, "details": {...}}   closes the session

Requests are rendered with the checkpoint's chat template and sent token-in/token-out to the engine
the session is pinned to (the episode's :class:`~sao_megatron.rollout.agent_loop.AgentLoop`: its
client, the run's API key, its update policy and route capture); tool calls come back parsed from the
model's native format (:mod:`sao_megatron.envs.tool_parse`, parallel calls included). The token
bookkeeping (observations, segments) is :mod:`sao_megatron.rollout.gateway_session`'s.

A streamed answer is generated whole, then sent as chunks: the engine call is token-in/token-out.
``tool_choice`` ``required`` or a named function is accepted but not enforced (the model samples
freely: training needs its own distribution's logprobs). Bad requests get the OpenAI error JSON
``{"error": {"message", "type", "code", "param"}}`` with a 4xx naming the field, every field checked
before anything reaches the engine (:mod:`sao_megatron.rollout.gateway_request`; docs/rollout.md); an
engine's own refusal of a request (HTTP 400, 413, 422) is passed on as a 400, not an engine failure.

The gateway runs on the rollout process's asyncio loop, one per run, listening on
``rollout.gateway.host:port`` (loopback, a free port by default) and, for sandboxed command agents,
on a Unix socket (:attr:`Gateway.unix_socket`, :mod:`sao_megatron.envs.agent_sandbox`); it starts with
its first session. The agent runs where the episode's Env is (``env.arun_agent``: here, or on an env
worker, which relays its sandboxes' connections to the TCP address).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from sao_megatron.config.agent import GatewayConfig, OpenAIAgentConfig
from sao_megatron.envs.agent_sandbox import GatewayEndpoint
from sao_megatron.envs.base import Env, Sample
from sao_megatron.envs.format import ChatTemplateError
from sao_megatron.envs.openai_agent import AgentError
from sao_megatron.records import Trajectory
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import EngineError
from sao_megatron.rollout.gateway_request import RequestError, parse_request
from sao_megatron.rollout.gateway_session import GatewaySession

log = logging.getLogger(__name__)

SESSION_HEADER = "X-SAO-Session"
MAX_SYNC_AGENTS = 512
"""Sync agent functions running at once, at most (threads; ``rollout.max_concurrent`` bounds the episodes)."""
MAX_CLOSED_IDS = 65536
ENGINE_REQUEST_ERRORS = (400, 413, 422)
"""Engine statuses that refuse the request itself (a regex its grammar backend cannot compile, a prompt
too long): passed on to the agent as 400, not an engine failure."""


@dataclass
class GatewayCounts:
    """Sessions since the run started (``gateway/*`` metrics)."""

    admitted: int = 0
    finished: int = 0
    dropped: int = 0
    """Timed out (``rollout.gateway.session_timeout_s``)."""
    failed: int = 0
    """The agent raised, exited non-zero, or the engine failed."""
    segments: int = 0
    requests: int = 0


def _node_address() -> str:
    """This node's address as other nodes reach it (a wildcard ``rollout.gateway.host``'s URL): the source
    address of its route out (a UDP connect sends nothing), else its host name's."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class Gateway:
    """The HTTP server and its open sessions."""

    def __init__(self, cfg: GatewayConfig, agent: OpenAIAgentConfig | None = None):
        self.cfg = cfg
        self.agent = agent or OpenAIAgentConfig()
        self.sessions: dict[str, GatewaySession] = {}
        self.closed_ids: OrderedDict[str, None] = OrderedDict()
        """The last ``MAX_CLOSED_IDS`` sessions ended (a late request to one is told it is closed, not unknown)."""
        self.counts = GatewayCounts()
        self._runner: web.AppRunner | None = None
        self._threads = ThreadPoolExecutor(max_workers=MAX_SYNC_AGENTS, thread_name_prefix="sao-agent")
        """Where sync agent functions run (asyncio's default pool would run only ``cpus + 4`` at once)."""
        self._start_lock = asyncio.Lock()
        self.url = ""
        self.unix_socket = ""
        """Also listened on when sandboxed command agents run here (their relays connect to it)."""

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> str:
        """Listen (once); the gateway's URL."""
        async with self._start_lock:
            if self._runner is None:
                app = web.Application(client_max_size=64 * 1024 * 1024)
                app.add_routes(
                    [
                        web.get("/v1/models", self._models),
                        web.get("/sessions/{sid}/v1/models", self._models),
                        web.post("/v1/chat/completions", self._chat),
                        web.post("/sessions/{sid}/v1/chat/completions", self._chat),
                        web.post("/sessions/{sid}/reward", self._reward),
                    ]
                )
                runner = web.AppRunner(app, access_log=None)
                await runner.setup()
                site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
                await site.start()
                port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # port 0: the one bound
                host = _node_address() if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host
                self._runner, self.url = runner, f"http://{host}:{port}"
                if self.agent.command and self.agent.sandbox != "off":
                    await self._listen_unix(runner)
                log.info("gateway listening on %s %s", self.url, self.unix_socket)
        return self.url

    async def _listen_unix(self, runner: web.AppRunner) -> None:
        """A Unix socket in a directory of its own (bound into each agent's sandbox), any uid may connect:
        the sandboxes run as unprivileged uids, and every session still needs its key."""
        directory = tempfile.mkdtemp(prefix="sao_gw_")
        os.chmod(directory, 0o755)
        path = os.path.join(directory, "gateway.sock")
        await web.UnixSite(runner, path).start()
        os.chmod(path, 0o666)
        self.unix_socket = path

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.unix_socket:
            shutil.rmtree(os.path.dirname(self.unix_socket), ignore_errors=True)
            self.unix_socket = ""

    def open(self, loop: AgentLoop, sample: Sample) -> GatewaySession:
        """A new session for one episode on ``loop``'s engine."""
        session = GatewaySession(secrets.token_hex(8), loop, sample)
        self.sessions[session.id] = session
        self.counts.admitted += 1
        return session

    def base_url(self, session: GatewaySession) -> str:
        return f"{self.url}/sessions/{session.id}/v1"

    def finish(self, session: GatewaySession) -> None:
        session.closed = True
        self.sessions.pop(session.id, None)
        self.closed_ids[session.id] = None
        if len(self.closed_ids) > MAX_CLOSED_IDS:
            self.closed_ids.popitem(last=False)

    def metrics(self) -> dict[str, float]:
        """``gateway/sessions_{admitted,finished,dropped,failed}``, ``gateway/segments_per_session``
        (mean over finished sessions) and ``gateway/requests``, since the run started."""
        c = self.counts
        return {
            "gateway/sessions_admitted": float(c.admitted),
            "gateway/sessions_finished": float(c.finished),
            "gateway/sessions_dropped": float(c.dropped),
            "gateway/sessions_failed": float(c.failed),
            "gateway/segments_per_session": c.segments / max(1, c.finished),
            "gateway/requests": float(c.requests),
        }

    # -- one episode ----------------------------------------------------------------------------
    async def run_episode(
        self,
        loop: AgentLoop,
        env: Env,
        sample: Sample,
        split: str = "train",
        index: int | None = None,
        submitted_at: float | None = None,
    ) -> list[Trajectory]:
        """Run the agent on ``sample`` through a new session; one trajectory per segment, or one failed
        trajectory (the agent raised or exited non-zero, the session timed out: dropped, the engine failed)."""
        await self.start()
        started = time.time()
        session = self.open(loop, sample)
        status, reason = "finished", ""
        reward, correct, details = 0.0, None, {}
        timeout = self.cfg.session_timeout_s
        try:
            task = await env.areset(sample)
            try:
                path = f"/sessions/{session.id}/v1"
                endpoint = GatewayEndpoint(self.base_url(session), session.key, path, self.unix_socket)
                agent = env.arun_agent(self.agent, task, endpoint, timeout, self._threads)  # type: ignore[attr-defined]
                returned = await asyncio.wait_for(agent, timeout)
            except TimeoutError:
                self.counts.dropped += 1
                status, reason = (
                    "failed",
                    f"gateway: session timed out after {timeout}s (rollout.gateway.session_timeout_s)",
                )
            else:
                if returned is not None:
                    reward = float(returned)
                elif session.reward is not None:
                    reward, details = session.reward, dict(session.reward_details)
                else:
                    result = await env.agrade(session.final_answer)  # type: ignore[attr-defined]
                    reward, correct, details = result.reward, result.correct, dict(result.details)
                if not math.isfinite(reward):
                    status, reason = "failed", f"reward: non-finite reward {reward}"
                elif session.truncated:
                    status, reason = "truncated", session.truncated
        except AgentError as err:
            if session.truncated:  # the agent gave up on a refused request: cut at the budget, as the agent loop's
                status, reason, correct, details = "truncated", session.truncated, False, {"agent_error": str(err)}
            else:
                status, reason = "failed", f"agent: {err}"
        except Exception as err:  # the env's reset or reward function: a failed episode, never a failed run
            status, reason = "failed", f"environment: {type(err).__name__}: {err}"
        finally:
            self.finish(session)
            try:
                await env.aclose()
            except Exception as err:
                log.warning("closing the environment of %s failed: %s", sample.prompt_id, err)
        if session.engine_error and status == "failed" and not reason.startswith("gateway:"):
            reason = f"engine: {session.engine_error}"  # the manager retries these on another engine
        common: dict[str, Any] = dict(
            split=split, sample_index=index, submitted_at=submitted_at or started, started_at=started
        )
        trajs = session.trajectories(status, reason, reward, correct, details, finished_at=time.time(), **common)
        if status == "failed" or not trajs:
            self.counts.failed += status == "failed" and not reason.startswith("gateway:")
            reason = reason or "agent: the session generated nothing"
            empty = Trajectory(
                sample.prompt_id, [], [], [], [], [], [], 0.0, "failed", reason, finished_at=time.time(), **common
            )
            empty.engine = loop.engine_name
            return [empty]
        self.counts.finished += 1
        self.counts.segments += len(trajs)
        return trajs

    # -- HTTP -------------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.cfg.served_model_name, "object": "model", "created": 0, "owned_by": "sao"}
        return web.json_response({"object": "list", "data": [model]})

    def _session(self, request: web.Request) -> GatewaySession:
        sid = request.match_info.get("sid") or request.headers.get(SESSION_HEADER)
        if not sid:
            raise RequestError(
                400,
                f"no session: use /sessions/{{id}}/v1 as base_url or send {SESSION_HEADER}",
                "missing_session",
                SESSION_HEADER,
            )
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:].strip():
            raise RequestError(
                401,
                "no API key: send the session's key as 'Authorization: Bearer <key>'",
                "missing_api_key",
                "Authorization",
                "authentication_error",
            )
        session = self.sessions.get(sid)
        if session is None:
            if sid in self.closed_ids:
                raise RequestError(409, f"session {sid!r} is closed (rewarded or ended)", "session_closed", "session")
            raise RequestError(404, f"unknown session {sid!r}", "session_not_found", "session")
        if not secrets.compare_digest(auth[7:].strip(), session.key):
            raise RequestError(
                401, f"the API key is not session {sid!r}'s", "invalid_api_key", "Authorization", "authentication_error"
            )
        if session.closed:
            raise RequestError(409, f"session {sid!r} is closed (rewarded or ended)", "session_closed", "session")
        return session

    async def _json(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except ValueError as err:
            raise RequestError(400, f"the body is not JSON: {err}", "invalid_json") from err
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object", "invalid_json")
        return body

    async def _reward(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
            body = await self._json(request)
            value = body.get("reward")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RequestError(400, f"reward must be a finite number, got {value!r}", "invalid_value", "reward")
            details = body.get("details") or {}
            if not isinstance(details, dict):
                raise RequestError(400, "details must be a JSON object", "invalid_type", "details")
        except RequestError as err:
            return web.json_response(err.to_json(), status=err.status)
        session.reward, session.reward_details = float(value), details
        session.closed = True
        return web.json_response({"session": session.id, "reward": session.reward})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session: GatewaySession | None = None
        try:
            session = self._session(request)
            chat = parse_request(await self._json(request), self.cfg.served_model_name)
            self.counts.requests += 1
            async with session.lock:
                reply = await session.complete(chat)
        except RequestError as err:
            return web.json_response(err.to_json(), status=err.status)
        except ChatTemplateError as err:
            failure = RequestError(
                400, f"the chat template cannot continue these messages: {err}", "template_error", "messages"
            )
            return web.json_response(failure.to_json(), status=400)
        except EngineError as err:
            if err.status in ENGINE_REQUEST_ERRORS:  # about the request: the agent's to fix, the engine is fine
                failure = RequestError(400, f"the engine refused the request: {err}", "engine_refused_request")
                return web.json_response(failure.to_json(), status=400)
            if session is not None:
                session.engine_error = str(err)
            failure = RequestError(502, f"the engine failed: {err}", "engine_error", kind="server_error")
            return web.json_response(failure.to_json(), status=502)
        except Exception as err:  # a bug here: the agent still gets the OpenAI error shape
            log.exception("gateway: a chat completion failed")
            failure = RequestError(500, f"{type(err).__name__}: {err}", "internal_error", kind="server_error")
            return web.json_response(failure.to_json(), status=500)
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        usage = {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        }
        head = {"id": completion_id, "created": created, "model": self.cfg.served_model_name}
        if not chat.stream:
            choice = {"index": 0, "message": reply.message(), "finish_reason": reply.finish_reason, "logprobs": None}
            return web.json_response({**head, "object": "chat.completion", "choices": [choice], "usage": usage})
        return await _stream(request, head, reply, usage if chat.include_usage else None)


async def _stream(request: web.Request, head: dict, reply, usage: dict | None) -> web.StreamResponse:
    """The reply as server-sent ``chat.completion.chunk`` events: role, reasoning, content, each
    tool call, the finish reason, the usage when asked, then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(delta: dict, finish: str | None = None, extra: dict | None = None) -> None:
        chunk = {
            **head,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        await response.write(f"data: {json.dumps({**chunk, **(extra or {})})}\n\n".encode())

    await send({"role": "assistant", "content": ""})
    if reply.reasoning is not None:
        await send({"reasoning_content": reply.reasoning})
    if reply.content:
        await send({"content": reply.content})
    for k, call in enumerate(reply.tool_calls):
        await send({"tool_calls": [{"index": k, **call}]})
    await send({}, reply.finish_reason)
    if usage is not None:
        await response.write(
            f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n".encode()
        )
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
