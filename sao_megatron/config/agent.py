"""The gateway's and the user's agent's sections of the run config, ``rollout.gateway`` and ``rollout.agent``
(``rollout.env=openai_agent``; docs/envs.md, "Train an existing agent").

Kept apart from :mod:`sao_megatron.config.schema` (which uses them as ``RolloutConfig.gateway`` and
``RolloutConfig.agent``) to keep that module readable; validation is
:func:`sao_megatron.config.load.validate_gateway`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

AgentSandbox = Literal["auto", "require", "off"]
"""How a ``command`` agent is isolated (``rollout.agent.sandbox``)."""


@dataclass
class GatewayConfig:
    """The OpenAI-compatible gateway (``rollout.env=openai_agent``; docs/rollout.md "The gateway"):
    a user's agent reaches the engines through it and every session is recorded as trajectories."""

    host: str = "127.0.0.1"
    """Address the gateway listens on; loopback by default (the agents run beside the rollout
    process). ``0.0.0.0`` serves agents on other hosts (a cluster's env workers: loopback is refused
    there), and the agents' URL then names this node's address; each session still needs its own key.
    Sandboxed command agents reach it through a Unix socket (docs/envs.md, "The sandbox")."""
    port: int = 0
    """TCP port; 0 picks a free one (the agents get the URL, so a fixed port is rarely needed)."""
    served_model_name: str = "sao-policy"
    """The one model ``GET /v1/models`` lists; a request naming another is refused (404)."""
    session_timeout_s: float = 600.0
    """Seconds an episode's agent may run (all its requests and tool calls) before the session is
    dropped, counted in ``gateway/sessions_dropped`` and the episode failed."""


@dataclass
class OpenAIAgentConfig:
    """The user's agent that ``rollout.env=openai_agent`` runs once per episode (docs/envs.md,
    "Train an existing agent"). Exactly one of ``entry_point`` and ``command``."""

    entry_point: str = ""
    """``package.module:function`` called as ``function(task, base_url, api_key)`` (async or sync;
    a sync one runs in a thread); it returns the episode's reward, or None to leave it to
    ``POST /sessions/{id}/reward`` or the task's reward function on the final answer."""
    command: list[str] = field(default_factory=list)
    """A program run per episode, e.g. ``["python", "my_agent.py"]``: the task on its stdin,
    ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` in its environment; exit code 0 ends the episode,
    any other fails it (its stderr's tail in the reason). In the sandbox, whose working directory is
    private, relative paths in it that name files of the run's working directory are made absolute."""
    sandbox: AgentSandbox = "auto"
    """Where a ``command`` runs. ``auto``: in the sandbox (its own process group and uid, rlimits,
    the session timeout as wall clock, everything it started killed at the end; where the host
    allows namespaces also: no network but its gateway session, the project directory, ``/root``
    and ``/home`` hidden, a private ``/tmp``); ``require``: the same, but every episode fails
    (naming what is missing) unless network and mount namespaces and the uid drop all work;
    ``off``: a plain subprocess with the rollout process's environment, files and network."""
    readable_paths: list[str] = field(default_factory=list)
    """Host directories the sandboxed agent may read (bound read-only at the same path; relative
    ones from the run's working directory; none may be or hold the project directory, ``/root`` or
    ``/home``, which stay hidden). Always readable: the interpreter and the run's Python environment
    (``sys.prefix``, its site-packages with ``openai``), the directories of ``command``'s program and
    first argument (its script) when they are files, and the rest of ``/`` (``/usr``, ``/etc``, ...)."""
    memory_mb: int = 4096
    """Sandbox: address space of each of the agent's processes (RLIMIT_AS), in MiB."""
    cpu_s: int = 600
    """Sandbox: CPU seconds of each of the agent's processes (RLIMIT_CPU)."""
    processes: int = 64
    """Sandbox: processes and threads the agent may have at once (RLIMIT_NPROC of its uid; the
    relay to the gateway counts too, with up to 4); with the uid drop only."""
