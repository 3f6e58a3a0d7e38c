"""A user's ``command`` agent (``rollout.agent.command``) in the sandbox, reaching only its gateway session.

:func:`run_sandboxed_command` runs one episode's agent under the sandbox's bootstrap and supervisor
(:mod:`sao_megatron.envs.sandbox`, ``rollout.agent.sandbox``: ``auto`` or ``require``)::

    supervisor (rollout process or env worker, root)
      sandbox: own session/process group, uid drop (one uid per sandbox), rlimits (rollout.agent.*),
               net + mount + PID namespaces where the host allows them
        relay  (sao_megatron.envs.agent_relay): 127.0.0.1:<port> -> the gateway's Unix socket
          COMMAND < task   OPENAI_BASE_URL=http://127.0.0.1:<port>/sessions/<id>/v1, OPENAI_API_KEY

Network: the sandbox's network namespace has only its loopback, brought up; the relay forwards each
connection to a Unix socket on which the gateway listens (:attr:`GatewayEndpoint.unix_socket`), bound
read-only into the sandbox at :data:`SOCKET_DIR`. So the agent reaches the gateway, whose every
session needs its own key, and nothing else: no other host port, no other host. Files: ``/`` is
read-only; the project directory, ``/root`` and ``/home`` are hidden except what is bound back
read-only (the interpreter, ``sys.prefix``, the directories of the files the command names,
``rollout.agent.readable_paths``); ``/tmp`` (the working directory and ``$HOME``) is private.
The session timeout is the wall clock: then, and whenever the agent ends, everything it started
is killed (process group, uid and PID namespace), also children that ignore SIGTERM or left the
process group.

Without namespaces (``auto`` on a host that forbids them; :func:`~sao_megatron.envs.sandbox.detect_isolation`
decides) the agent keeps the process group, rlimits, wall clock and, as root, the uid drop, but
shares the host's network and sees its files as an unprivileged user would; ``require`` fails
every episode instead, naming what is missing.

Every failure is an :class:`~sao_megatron.envs.openai_agent.AgentError` naming its cause (the
sandbox could not start, a non-zero exit, a limit, the gateway out of reach), or TimeoutError at the
session timeout: a failed episode, never a failed run.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sao_megatron.envs import agent_relay
from sao_megatron.envs.sandbox import (
    Isolation,
    SandboxLimits,
    _argv,
    _hidden_paths,
    _interpreter,
    _supervised,
    _uid_of,
    detect_isolation,
)

if TYPE_CHECKING:
    from sao_megatron.config.agent import OpenAIAgentConfig

SOCKET_DIR = "/tmp/.sao_gateway"
"""Where the directory of the gateway's socket is bound inside the sandbox (mount namespace)."""
_MIB = 1 << 20
_STDERR_BYTES = 64 * 1024
_SETUP_FAILED = 125


class SandboxedAgentError(RuntimeError):
    """Raised as :class:`~sao_megatron.envs.openai_agent.AgentError` by the caller (a message naming the cause)."""


@dataclass(frozen=True)
class GatewayEndpoint:
    """Where an agent reaches its gateway session (handed from the gateway to wherever the agent runs)."""

    base_url: str
    """The session's URL over TCP, ``http://HOST:PORT/sessions/<id>/v1`` (agents outside the sandbox)."""
    api_key: str
    """The session's key (``OPENAI_API_KEY``)."""
    session_path: str
    """The session's base path, ``/sessions/<id>/v1`` (a sandboxed agent's ``OPENAI_BASE_URL`` is its relay's
    address plus it)."""
    unix_socket: str = ""
    """Host path of a Unix socket on which the gateway listens (on an env worker: the worker's
    :class:`GatewayRelay` to it); '' where none is (``rollout.agent.sandbox=off``)."""


class GatewayRelay:
    """A Unix socket on this host relaying each connection to the gateway's TCP address: a sandboxed agent
    on an env worker reaches the gateway on the rollout process's node through it (one per episode:
    :meth:`start`, then :meth:`close`, which removes the socket's directory)."""

    def __init__(self, base_url: str) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.failures: list[str] = []
        """Connections to the gateway that failed, as ``Error: message`` (the first names the cause)."""
        self.path = ""
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        """Listen (any uid may connect: the sandboxes run as unprivileged uids); the socket's path."""
        directory = tempfile.mkdtemp(prefix="sao_gw_relay_")
        os.chmod(directory, 0o755)
        path = os.path.join(directory, "gateway.sock")
        self._server = await asyncio.start_unix_server(self._relay, path)
        os.chmod(path, 0o666)
        self.path = path
        return path

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError as err:
            self.failures.append(f"{type(err).__name__}: {err}")
            writer.close()
            return
        try:
            await asyncio.gather(agent_relay.pump(reader, up_writer), agent_relay.pump(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.path:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def missing_isolation(iso: Isolation) -> str:
    """What ``rollout.agent.sandbox=require`` misses on this host ('' when nothing)."""
    missing = [name for name, ok in (("network namespace", iso.netns), ("mount namespace", iso.mountns)) if not ok]
    if not iso.uid_drop:
        missing.append("uid drop (run as root)")
    return ", ".join(missing)


def resolve_command(command: list[str], cwd: str | None = None) -> list[str]:
    """``command`` with relative paths to files of ``cwd`` (the run's working directory) made absolute."""
    base = Path(cwd or os.getcwd())
    out = []
    for i, arg in enumerate(command):
        path = base / arg
        relative = not os.path.isabs(arg) and (i > 0 or "/" in arg)
        out.append(str(path.resolve()) if relative and path.is_file() else arg)
    return out


def readable_dirs(cfg: OpenAIAgentConfig, command: list[str], cwd: str | None = None) -> list[str]:
    """The host directories bound read-only into the sandbox: ``sys.prefix``, the directories of the
    program and of its first argument (an interpreter's script) when they are files, ``readable_paths``.
    None may be or hold a directory the sandbox hides (the project directory, ``/root``, ``/home``)."""
    dirs = [os.path.realpath(sys.prefix)]
    dirs += [
        os.path.dirname(os.path.realpath(arg)) for arg in command[:2] if os.path.isabs(arg) and os.path.isfile(arg)
    ]
    for path in cfg.readable_paths:
        full = os.path.realpath(os.path.join(cwd or os.getcwd(), path))
        if not os.path.isdir(full):
            raise SandboxedAgentError(f"rollout.agent.readable_paths: {path!r} is not a directory on this host")
        dirs.append(full)
    hidden = _hidden_paths(SandboxLimits())
    for path in dirs:
        covered = [h for h in hidden if h == path or h.startswith(path.rstrip("/") + "/")]
        if covered:
            raise SandboxedAgentError(
                f"sandbox: the agent would read {path}, which is or holds {covered[0]}, hidden in the sandbox; "
                "name the subdirectories it needs in rollout.agent.readable_paths (its script's own, e.g. examples/)"
            )
    return sorted(dict.fromkeys(dirs), key=len)


async def run_sandboxed_command(
    cfg: OpenAIAgentConfig, task: str, endpoint: GatewayEndpoint, wall_s: float, cwd: str | None = None
) -> None:
    """Run ``cfg.command`` once in the sandbox with ``task`` on its stdin (see the module docstring).

    Raises :class:`SandboxedAgentError` naming the cause of a failure, TimeoutError past ``wall_s``."""
    iso = detect_isolation()
    missing = missing_isolation(iso)
    if cfg.sandbox == "require" and missing:
        raise SandboxedAgentError(
            f"sandbox: this host lacks {missing}, which rollout.agent.sandbox=require needs; "
            "run where namespaces are allowed, as root, or set rollout.agent.sandbox=auto"
        )
    command = resolve_command(cfg.command, cwd)
    socket_at = endpoint.unix_socket
    readable = readable_dirs(cfg, command, cwd)
    if iso.uid_drop:
        for path in readable:
            if os.stat(path).st_mode & 0o005 != 0o005:
                raise SandboxedAgentError(
                    f"sandbox: the agent runs as an unprivileged uid and cannot read {path} "
                    f"(mode {os.stat(path).st_mode & 0o777:o}); make it world-readable (chmod o+rx)"
                )
    binds = [("ro", d, d) for d in readable]
    if iso.mountns:
        binds.append(("ro", os.path.dirname(socket_at), SOCKET_DIR))
        socket_at = f"{SOCKET_DIR}/{os.path.basename(socket_at)}"
    limits = SandboxLimits(
        wall_s=wall_s,
        cpu_s=cfg.cpu_s,
        memory_bytes=cfg.memory_mb * _MIB,
        max_stdout_bytes=_STDERR_BYTES,
        max_stderr_bytes=_STDERR_BYTES,
        file_size_bytes=64 * _MIB,
        tmpfs_bytes=256 * _MIB,
        open_files=1024,
        processes=cfg.processes,
    )
    pidns = iso.pidns and iso.mountns
    relay = (_interpreter(), "-I", "-S", "-c", _relay_source(), socket_at, endpoint.session_path, *command)
    with tempfile.TemporaryDirectory(prefix="sao_agent_") as host_dir:
        Path(host_dir, "main.py").write_text(task, encoding="utf-8", errors="surrogateescape")
        workdir = "/tmp/work" if iso.mountns else host_dir
        env = {
            "PATH": f"{os.path.realpath(sys.prefix)}/bin:/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": workdir,
            "TMPDIR": workdir,
            "OPENAI_API_KEY": endpoint.api_key,
        }
        try:
            argv = _argv(
                limits, iso, binds=tuple(binds), exec_argv=relay, pidns=pidns, program_is_init=False, loopback=True
            )
        except ValueError as err:
            raise SandboxedAgentError(f"sandbox: cannot start: {err}") from err
        caps = {1: _STDERR_BYTES, 2: _STDERR_BYTES}
        run = await _supervised(argv, host_dir, env, wall_s, caps, iso, functools.partial(_uid_of, iso), pidns)
    if run.proc is None:
        raise SandboxedAgentError(f"sandbox: {run.error}")
    if run.timed_out:
        raise TimeoutError(f"the agent ran past {wall_s:g}s")
    err = run.coll.bufs[2].decode("utf-8", "replace")
    _check_outcome(cfg, command[0], err, run.proc.returncode, run.coll.overflow.done())


def _check_outcome(cfg: OpenAIAgentConfig, program: str, err: str, rc: int | None, overflow: bool) -> None:
    """Raise :class:`SandboxedAgentError` unless the relay reports that the agent exited 0 and reached its gateway."""
    lines = err.rstrip("\n").split("\n")
    if rc == _SETUP_FAILED and lines[0].startswith("sandbox setup failed"):
        raise SandboxedAgentError(f"sandbox: {lines[0]}")
    if overflow:
        raise SandboxedAgentError(f"sandbox: the agent's relay wrote more than {_STDERR_BYTES} bytes")
    status = lines[-1]
    if status.startswith("sao-agent-cannot-start "):
        raise SandboxedAgentError(f"cannot start {program!r} in the sandbox: {status.split(' ', 1)[1]}")
    if rc != 0 or not status.startswith("sao-agent-status "):
        raise SandboxedAgentError(f"sandbox: the agent's relay ended with code {rc}: {err.strip()[-500:]}")
    code = int(status.split(" ", 1)[1])
    unreachable = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("sao-agent-unreachable ")]
    tail = "\n".join(ln for ln in lines[:-1] if not ln.startswith("sao-agent-unreachable ")).strip()[-500:]
    if code == 0 and not unreachable:
        return
    if code < 0:
        cause = f"{program} was killed by {_signal_name(-code)}"
        if -code == signal.SIGXCPU:
            cause += f" (CPU time limit rollout.agent.cpu_s={cfg.cpu_s})"
    else:
        cause = f"{program} exited with code {code}"
        if any(m in tail for m in ("MemoryError", "Cannot allocate memory", "std::bad_alloc")):
            cause += f" (memory limit rollout.agent.memory_mb={cfg.memory_mb})"
    if unreachable:
        cause += f"; it could not reach the gateway ({unreachable[0]})"
    raise SandboxedAgentError(f"{cause}: {tail}" if tail else cause)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@functools.cache
def _relay_source() -> str:
    return Path(agent_relay.__file__).read_text(encoding="utf-8")
