"""openai_agent: the episodes of a user's own agent, which talks to the policy through the OpenAI API.

``rollout.env=openai_agent`` trains an existing agent unchanged (docs/envs.md, "Train an existing
agent"). Per episode the agent loop opens a session on the run's OpenAI-compatible gateway
(:mod:`sao_megatron.rollout.gateway`) and runs the agent (``rollout.agent``, :func:`run_agent`) with
the task's question, the session's ``base_url`` and ``api_key``::

    question = env.reset(sample)                       the task env's prompt (``task_env``)
    reward   = agent(question, base_url, api_key)      entry point: its return value, or None
               | command < question                    (OPENAI_BASE_URL / OPENAI_API_KEY set; in the
                                                        sandbox, :mod:`sao_megatron.envs.agent_sandbox`)
    if None: POST /sessions/{id}/reward, else env.grade(last answer)   (the task env's reward)

The prompts and the reward function are those of another registered environment, ``task_env``
(``rollout.env_kwargs.task_env`` and ``rollout.task_kwargs.task_env``, default ``arith_tool``); the
agent brings its own tools and prompt. Its exceptions, non-zero exit codes and timeouts fail the
episode (:class:`AgentError`), never the run. The gateway runs the agent through
:meth:`OpenAIAgentEnv.arun_agent`, so with ``rollout.env_workers`` > 0 a command runs on the env worker
holding the episode (:class:`~sao_megatron.rollout.env_workers.RemoteEnv` forwards the call).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sao_megatron.envs.agent_relay import keep_tail
from sao_megatron.envs.agent_sandbox import GatewayEndpoint, SandboxedAgentError, run_sandboxed_command
from sao_megatron.envs.base import Env, RewardResult, Sample, Split, StepResult, Task
from sao_megatron.envs.format import ToolFormat, Turn, final_answer
from sao_megatron.envs.registry import make_env, make_task
from sao_megatron.envs.tool_env import ToolEnv

if TYPE_CHECKING:
    from sao_megatron.config.agent import OpenAIAgentConfig


class AgentError(RuntimeError):
    """The user's agent failed: it raised, exited non-zero, or returned something not a reward."""


class AgentTask(Task):
    """The prompts of ``task_env``'s task (built with the other keyword arguments)."""

    def __init__(self, task_env: str = "arith_tool", **kwargs: Any) -> None:
        self.inner = make_task(task_env, **kwargs)

    def get(self, split: Split, index: int) -> Sample:
        return self.inner.get(split, index)

    def member(self, sample: Sample, group_index: int) -> Sample:
        return self.inner.member(sample, group_index)

    def size(self, split: Split) -> int | None:
        return self.inner.size(split)


class OpenAIAgentEnv(Env):
    """An episode driven by the user's agent through the gateway; ``task_env`` gives the question and
    grades the final answer."""

    task_class = AgentTask
    external_agent = True
    """The agent loop runs this env's episodes through the gateway instead of its turn loop."""

    def __init__(self, task_env: str = "arith_tool", **kwargs: Any) -> None:
        self.inner = make_env(task_env, **kwargs)

    def use_tool_format(self, tool_format: ToolFormat) -> None:
        super().use_tool_format(tool_format)
        self.inner.use_tool_format(tool_format)

    def reset(self, sample: Sample) -> str:
        """The task the agent gets (the task env's question)."""
        return self.inner.reset(sample)

    def step(self, action: str) -> StepResult:
        raise RuntimeError("openai_agent episodes are driven by the user's agent through the gateway, not by step()")

    def grade(self, answer: str | None) -> RewardResult:
        """The task env's reward for ``answer``, the agent's final message (None: no answer, reward 0)."""
        if answer is None:
            return RewardResult(0.0, False, {"answer": None})
        action = self.inner.answer_text(answer) if isinstance(self.inner, ToolEnv) else final_answer(answer)
        self.inner.step(action)
        return self.inner.reward()

    async def agrade(self, answer: str | None) -> RewardResult:
        return self.grade(answer)

    async def arun_agent(
        self, cfg: OpenAIAgentConfig, task: str, endpoint: GatewayEndpoint, timeout_s: float, threads=None
    ) -> float | None:
        """:func:`run_agent` here (the rollout process, or the env worker holding this episode)."""
        return await run_agent(cfg, task, endpoint, timeout_s, threads)

    def reward(self) -> RewardResult:
        return self.inner.reward()

    def close(self) -> None:
        self.inner.close()

    def demonstration(self, sample: Sample) -> list[Turn]:
        """The task env's demonstrations (SFT before RL teaches its format)."""
        return self.inner.demonstration(sample)


def load_entry_point(spec: str) -> Callable[..., Any]:
    """``package.module:function`` or ``path/to/file.py:function``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AgentError(f"agent entry point {spec!r} is not 'package.module:function' nor 'file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as err:
        raise AgentError(f"importing the agent {module_name!r} failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AgentError(f"agent entry point {spec!r}: {module_name!r} has no function {attr!r}")
    return fn


async def run_agent(
    cfg: OpenAIAgentConfig, task: str, endpoint: GatewayEndpoint, timeout_s: float, threads: Executor | None = None
) -> float | None:
    """Run the agent once against its gateway session; its reward, or None. Anything the agent does
    wrong is an :class:`AgentError`. A sync function runs on ``threads`` (asyncio's default pool,
    ``min(32, cpus + 4)`` threads, when None); it cannot be interrupted, so past the session's timeout
    it runs on until its next request is refused (the session is closed by then). A command runs in
    the sandbox (:mod:`sao_megatron.envs.agent_sandbox`) unless ``rollout.agent.sandbox=off``, killed
    after ``timeout_s`` (TimeoutError) with everything it started."""
    if cfg.command and cfg.sandbox != "off":
        try:
            await run_sandboxed_command(cfg, task, endpoint, timeout_s)
        except SandboxedAgentError as err:
            raise AgentError(str(err)) from err
        return None
    if cfg.command:
        await _run_command(cfg.command, task, endpoint.base_url, endpoint.api_key)
        return None
    fn = load_entry_point(cfg.entry_point)
    base_url, api_key = endpoint.base_url, endpoint.api_key
    try:
        if inspect.iscoroutinefunction(fn):
            result = await fn(task, base_url, api_key)
        else:
            result = await asyncio.get_running_loop().run_in_executor(threads, fn, task, base_url, api_key)
            if inspect.isawaitable(result):
                result = await result
    except Exception as err:
        raise AgentError(f"{type(err).__name__}: {err}") from err
    if result is not None and (isinstance(result, bool) or not isinstance(result, int | float)):
        raise AgentError(f"the agent returned {result!r}, not a reward (a number) or None")
    return None if result is None else float(result)


async def _run_command(command: list[str], task: str, base_url: str, api_key: str) -> None:
    """``rollout.agent.sandbox=off``: the command as a plain subprocess, in a process group of its own.
    Its exit is waited for in a thread, not by asyncio's subprocess, whose ``wait`` also waits for the
    pipes a child of the agent may hold (the episode would hang to its session's timeout); then the
    group is killed, so nothing the agent left in it outlives the episode (a child that leaves the
    group does: ``off`` is no sandbox). Cancelled (the session timed out), the agent goes with its group."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as err:
        raise AgentError(f"cannot start {command[0]!r}: {err}") from err
    tail = bytearray()
    reader = threading.Thread(target=keep_tail, args=(proc.stderr, tail), daemon=True)
    reader.start()
    try:
        code = await asyncio.to_thread(_feed_and_wait, proc, task.encode())
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group the agent led: what it left running
        except OSError:
            pass  # nothing left in it
    await asyncio.to_thread(reader.join, 0.5)  # a child outside the group may still hold the pipe
    if code != 0:
        message = bytes(tail).decode(errors="replace").strip()[-500:]
        raise AgentError(f"{command[0]} exited with code {code}: {message}")


def _feed_and_wait(proc: subprocess.Popen, task: bytes) -> int:
    """Write the task to the agent's stdin and close it (an agent that exits unread is fine); its exit code."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(task)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    return proc.wait()
