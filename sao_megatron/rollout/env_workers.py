"""Environments off the driver: the worker side (:class:`EnvWorker`) and the driver's proxy (:class:`RemoteEnv`).

With ``rollout.env_workers`` > 0 the driver holds no environment: each episode's Env lives in one
:class:`EnvWorker` (a Ray actor of :class:`sao_megatron.driver.env_pool.EnvWorkerPool`, on the
``rollout.env_node_group`` nodes), and the agent loop drives a :class:`RemoteEnv` that forwards::

    driver (agent loop)                       env worker (one process, many episodes)
    env = await RemoteEnv.open(call, ...)  -> open: wait for one of ``env_worker_episodes`` slots,
                                              make_env, use_tool_format; tools, system prompt
    env.limit_calls_per_turn(n)               (kept; sent with the reset)
    await env.areset(sample)               -> reset:  env.limit_calls_per_turn(n), env.areset(sample)
    await env.astep(action)                -> step:   env.astep(action)
    await env.areward()                    -> reward: env.areward()   (+ details["env_calls"])
    await env.aclose()                     -> close:  env.aclose(), frees the slot

Every worker method answers ``(value, (pid, host))``; the proxy lists each call as
``[method, pid, host]`` in the reward's ``details["env_calls"]``. This module knows nothing of Ray
(tests/test_layering.py): a worker is reached through a :data:`WorkerCall`, which the pool
implements; it raises :class:`EnvWorkerError` when the worker is gone, and the agent loop turns
that into a failed episode (``environment: env worker ...``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sao_megatron.config.agent import OpenAIAgentConfig
from sao_megatron.envs.agent_sandbox import GatewayEndpoint, GatewayRelay
from sao_megatron.envs.base import Env, RewardResult, Sample, StepResult
from sao_megatron.envs.format import ToolFormat
from sao_megatron.envs.openai_agent import AgentError
from sao_megatron.envs.registry import make_env, resolve_env

Where = tuple[int, str]
"""Where a call ran: ``(os.getpid(), socket.gethostname())`` of the worker."""

WorkerCall = Callable[..., Awaitable[Any]]
"""``await call(method, *args)`` runs ``EnvWorker.<method>(*args)`` in one worker and returns its
answer; raises :class:`EnvWorkerError` when the worker died, and the environment's own exception
when the environment raised."""

EnvFactory = Callable[[], Awaitable[Env]]
"""A fresh Env for one episode (in this process, or a :class:`RemoteEnv` on a worker)."""


class EnvWorkerError(RuntimeError):
    """The worker holding an episode's environment died or cannot be reached; the message starts
    with ``env worker``."""


def environment_failure(err: BaseException) -> str:
    """A failed episode's ``status_reason`` for an exception its environment (or worker) raised."""
    if isinstance(err, EnvWorkerError):
        return f"environment: {err}"
    return f"environment: {type(err).__name__}: {err}"


def local_env_factory(env_name: str, env_kwargs: Mapping[str, Any] | None = None) -> EnvFactory:
    """Environments built in this process (``rollout.env_workers=0``)."""
    kwargs = dict(env_kwargs or {})

    async def make() -> Env:
        return make_env(env_name, **kwargs)

    return make


class EnvWorker:
    """The live environments of the episodes placed on one worker process, by episode id.

    At most ``max_episodes`` are open at once: :meth:`open` waits for a free slot, :meth:`close`
    frees it. Every method answers where it ran. Plain asyncio (no Ray): the pool runs it as an
    async Ray actor, so the episodes' awaits interleave on the worker's event loop."""

    def __init__(self, max_episodes: int = 16) -> None:
        if max_episodes < 1:
            raise ValueError(f"an env worker needs max_episodes >= 1, got {max_episodes}")
        self.max_episodes = max_episodes
        self.where: Where = (os.getpid(), socket.gethostname())
        self._slots = asyncio.Semaphore(max_episodes)
        self._envs: dict[str, Env] = {}
        self._opened = 0
        self.max_open = 0
        self.calls: Counter[str] = Counter()
        self.running = 0
        """Environment calls (reset, step, reward) in progress now."""

    async def info(self) -> dict[str, Any]:
        """pid, host, episodes open now and at most so far, calls per method, calls in progress."""
        pid, host = self.where
        return {
            "pid": pid,
            "host": host,
            "open": len(self._envs),
            "max_open": self.max_open,
            "max_episodes": self.max_episodes,
            "calls": dict(self.calls),
            "running": self.running,
        }

    async def open(
        self, env_name: str, env_kwargs: Mapping[str, Any], tool_format: ToolFormat
    ) -> tuple[str, list[dict], str | None, Where]:
        """Build one episode's Env once a slot is free: ``(episode_id, tools, system_prompt, where)``."""
        await self._slots.acquire()
        env: Env | None = None
        try:
            env = make_env(env_name, **env_kwargs)
            env.use_tool_format(tool_format)
            tools, system = list(env.tools), env.system_prompt
        except BaseException:
            if env is not None:
                with contextlib.suppress(Exception):
                    env.close()
            self._slots.release()
            raise
        self._opened += 1
        episode_id = f"{self.where[0]}:{self._opened}"
        self._envs[episode_id] = env
        self.max_open = max(self.max_open, len(self._envs))
        self.calls["open"] += 1
        return episode_id, tools, system, self.where

    def _env(self, episode_id: str, method: str) -> Env:
        self.calls[method] += 1
        env = self._envs.get(episode_id)
        if env is None:
            pid, host = self.where
            raise RuntimeError(f"env worker pid {pid} on {host} has no open episode {episode_id!r} (closed already)")
        return env

    async def _running[T](self, call: Awaitable[T]) -> tuple[T, Where]:
        self.running += 1
        try:
            return await call, self.where
        finally:
            self.running -= 1

    async def reset(self, episode_id: str, sample: Sample, max_calls_per_turn: int = 1) -> tuple[str, Where]:
        env = self._env(episode_id, "reset")
        env.limit_calls_per_turn(max_calls_per_turn)
        return await self._running(env.areset(sample))

    async def step(self, episode_id: str, action: str) -> tuple[StepResult, Where]:
        return await self._running(self._env(episode_id, "step").astep(action))

    async def reward(self, episode_id: str) -> tuple[RewardResult, Where]:
        return await self._running(self._env(episode_id, "reward").areward())

    async def run_agent(
        self, episode_id: str, cfg: OpenAIAgentConfig, task: str, endpoint: GatewayEndpoint, timeout_s: float
    ) -> tuple[float | None, Where]:
        """Run the user's agent of an episode driven through the gateway (``rollout.env=openai_agent``) on
        this worker: a sandboxed command reaches the gateway through a :class:`GatewayRelay` of the episode's own."""
        env = self._env(episode_id, "run_agent")
        relay = GatewayRelay(endpoint.base_url)  # the episode's own: its failures are this agent's
        here = dataclasses.replace(endpoint, unix_socket=await relay.start())
        try:
            return await self._running(env.arun_agent(cfg, task, here, timeout_s))  # type: ignore[attr-defined]
        except AgentError as err:
            if not relay.failures:
                raise
            gateway = endpoint.base_url.split("/sessions/")[0]
            cause = f"env worker on {self.where[1]} could not reach the gateway at {gateway} ({relay.failures[0]})"
            raise AgentError(f"{err}; {cause}") from err
        finally:
            relay.close()

    async def grade(self, episode_id: str, answer: str | None) -> tuple[RewardResult, Where]:
        """The episode's task reward for the agent's final ``answer`` (``rollout.env=openai_agent``)."""
        return await self._running(self._env(episode_id, "grade").agrade(answer))  # type: ignore[attr-defined]

    async def close(self, episode_id: str) -> tuple[None, Where]:
        """Close the episode's Env and free its slot; closing twice is a no-op."""
        env = self._envs.pop(episode_id, None)
        if env is not None:
            self.calls["close"] += 1
            try:
                await env.aclose()
            finally:
                self._slots.release()
        return None, self.where


_SYNC = "RemoteEnv.{method}: a remote environment runs through its async methods; use `await env.a{method}()`"


class RemoteEnv(Env):
    """The driver's handle on one episode's Env in an :class:`EnvWorker` (see the module docstring).

    Built by :meth:`open`; tools and system prompt are those the worker's Env reported then.
    The sync ``reset``/``step``/``reward``/``close`` raise: use the async forms."""

    def __init__(
        self,
        call: WorkerCall,
        episode_id: str,
        tools: list[dict],
        system_prompt: str | None,
        tool_format: ToolFormat,
        where: Where,
        on_close: Callable[[], None] | None = None,
    ):
        self._call = call
        self.episode_id = episode_id
        self._tools, self._system = tools, system_prompt
        self.tool_format = tool_format
        self.calls: list[list[Any]] = [["open", *where]]
        """``[method, pid, host]`` of every call to the worker so far."""
        self._on_close = on_close
        self._closed = False
        self.external_agent = False
        """Whether a user's agent drives the episode through the gateway (the worker's Env class says)."""

    @classmethod
    async def open(
        cls,
        call: WorkerCall,
        env_name: str,
        env_kwargs: Mapping[str, Any],
        tool_format: ToolFormat,
        on_close: Callable[[], None] | None = None,
    ) -> RemoteEnv:
        """Open an episode on the worker behind ``call`` (waits while the worker's slots are taken).

        Cancelled while waiting, the episode the worker opens anyway is closed when it arrives."""
        opening = asyncio.ensure_future(call("open", env_name, dict(env_kwargs), tool_format))
        try:
            episode_id, tools, system, where = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(lambda done: _close_orphan(call, done))
            raise
        env = cls(call, episode_id, tools, system, tool_format, tuple(where), on_close)
        env.external_agent = bool(getattr(resolve_env(env_name), "external_agent", False))
        return env

    async def _remote(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"RemoteEnv.{method}: episode {self.episode_id} is closed")
        value, (pid, host) = await self._call(method, self.episode_id, *args)
        self.calls.append([method, pid, host])
        return value

    async def areset(self, sample: Sample) -> str:
        return await self._remote("reset", sample, self.max_calls_per_turn)

    async def astep(self, action: str) -> StepResult:
        return await self._remote("step", action)

    async def areward(self) -> RewardResult:
        result: RewardResult = await self._remote("reward")
        calls = [list(c) for c in self.calls]
        return dataclasses.replace(result, details={**result.details, "env_calls": calls})

    async def arun_agent(
        self, cfg: OpenAIAgentConfig, task: str, endpoint: GatewayEndpoint, timeout_s: float, threads: Any = None
    ) -> float | None:
        """``rollout.env=openai_agent``: the user's agent runs on the worker (``threads`` are the gateway's, unused)."""
        return await self._remote("run_agent", cfg, task, endpoint, timeout_s)

    async def agrade(self, answer: str | None) -> RewardResult:
        """``rollout.env=openai_agent``: the task's reward for the agent's final answer, on the worker."""
        return await self._remote("grade", answer)

    async def aclose(self) -> None:
        """Close the episode on its worker (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            _, (pid, host) = await self._call("close", self.episode_id)
            self.calls.append(["close", pid, host])
        finally:
            if self._on_close is not None:
                self._on_close()

    def use_tool_format(self, tool_format: ToolFormat) -> None:
        super().use_tool_format(tool_format)
        if tool_format != self.tool_format:
            raise ValueError(
                f"this remote environment was opened with tool format {self.tool_format!r}, but the "
                f"agent loop uses {tool_format!r}; open it with the loop's tool format"
            )

    @property
    def tools(self) -> list[dict]:
        return self._tools

    @property
    def system_prompt(self) -> str | None:
        return self._system

    def reset(self, sample: Sample) -> str:
        raise RuntimeError(_SYNC.format(method="reset"))

    def step(self, action: str) -> StepResult:
        raise RuntimeError(_SYNC.format(method="step"))

    def reward(self) -> RewardResult:
        raise RuntimeError(_SYNC.format(method="reward"))

    def close(self) -> None:
        raise RuntimeError(_SYNC.format(method="close"))


def _close_orphan(call: WorkerCall, opening: asyncio.Future) -> None:
    """An open whose caller was cancelled: close the episode the worker opened anyway."""
    if opening.cancelled() or opening.exception() is not None:
        return
    closing = asyncio.ensure_future(call("close", opening.result()[0]))
    closing.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody awaits it
