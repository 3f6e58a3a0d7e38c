"""A sandboxed, emulated long-lived ``bash`` over one workspace: the SWE agent's shell tool.

:class:`ShellSession` runs each command as a *fresh* ``bash`` started by the Python sandbox's
bootstrap (:mod:`sao_megatron.envs.sandbox`: new session, rlimits, namespaces, uid drop, then
``execv`` of ``/bin/bash``) and supervised by the same code (wall deadline, output cap,
kill-and-reap). :meth:`ShellSession.run` never raises on what the command does; every outcome
is a :class:`ShellResult` (``ok``, ``error``, ``timeout``, ``memory``, ``output_limit``,
``sandbox_error``) whose :meth:`~ShellResult.observation` is the text the model sees.

Guaranteed when :func:`~sao_megatron.envs.sandbox.detect_isolation` reports full isolation
(``require_isolation=True`` refuses to run otherwise):

* The workspace is bind-mounted read-write at ``/workspace`` (:attr:`ShellSession.workdir`;
  an empty ``/workspace`` is created on the host as the mount point, else its own path is used);
  ``/`` is read-only, ``/tmp`` and ``/dev/shm`` are private tmpfs (fresh for every command),
  the project directory, ``/root`` and ``/home`` are hidden (only the interpreter prefixes,
  ``sys.prefix`` and ``ShellLimits.expose_paths`` are bound back read-only, so ``python``
  and its site-packages, e.g. pytest, work), and there is no network.
* One unprivileged uid per session (``uid_base + 2**30 + slot``, the slot held by a lock file
  so concurrent processes never share it); the workspace is chowned to it when the session
  starts and back to its original owner on :meth:`~ShellSession.close` (so host-side git, as
  root, accepts it again). After **every** command all processes of that uid are killed:
  background and daemonised processes do not survive a call.
* A PID namespace per command (where the kernel allows it; ``Isolation.pidns``): ``bash`` is
  its init and ``/proc`` shows only the command's processes; when the shell ends or is killed,
  the kernel kills and reaps everything in it, so no zombie is left to count against the uid's
  process limit.
* Per-command rlimits (CPU, address space, file size, open files, processes of the uid),
  a wall deadline and a cap on the merged stdout+stderr; either kills the command.
* Emulated state: the working directory and the exported variables persist from one command
  to the next (saved by an ``EXIT`` trap into a host-side session directory outside the
  workspace, restored before the next command). A command that is killed (timeout, output
  cap) or that replaces the shell (``exec``) keeps the previous state. Shell options,
  functions, aliases and unexported variables do not persist; ``$HOME`` is a writable
  directory in the session directory (kept across commands).

Not guaranteed: without mount namespaces the command runs at the host path of the workspace
with rlimits and the uid drop only (the rest of the host is readable as for any unprivileged
user); without a PID namespace the host's processes are visible in ``/proc`` (not signalable)
and killed processes wait for the host's init to reap them; without a uid range of its own the
session shares ``nobody`` and its background processes are reaped only through the process
group. Disk use of the workspace is bounded only by the per-file size limit.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shlex
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sao_megatron.envs.sandbox import (
    _NOBODY,
    Isolation,
    SandboxLimits,
    _argv,
    _kill_uid,
    _supervised,
    _uid_map_covers,
    detect_isolation,
    run_blocking,
)
from sao_megatron.envs.swe.reward import CommandResult

_MIB = 1 << 20
_UID_OFFSET, _UID_SLOTS = 1 << 30, 1 << 16  # session uids: uid_base + 2**30 + slot
_LOCK_DIR = Path(tempfile.gettempdir()) / "sao_shell_uids"
_STATE_AT = "/tmp/.sao_shell"  # the session directory inside the sandbox (mount namespace)
_END = "\n#sao-end "  # the state file's last line: marker, then the raw working directory
_MAX_COMMAND_BYTES = _MIB
_RUNNER_OUTPUT_BYTES = 16 * _MIB
_SETUP_FAILED = 125


@dataclass(frozen=True)
class ShellLimits:
    """Per-command limits, sized for running a repository's test suite."""

    wall_s: float = 30.0
    cpu_s: int = 60
    memory_bytes: int = 2 << 30
    max_output_bytes: int = 256 * 1024
    """stdout+stderr combined (merged, in order); more kills the command (``output_limit``)."""
    file_size_bytes: int = 64 << 20
    processes: int = 64
    open_files: int = 256
    tmpfs_bytes: int = 64 << 20
    expose_paths: tuple[str, ...] = ()
    """Host directories made visible read-only at the same path (``sys.prefix`` always is)."""
    require_isolation: bool = False
    """If True, every command is refused (``sandbox_error``) unless isolation is full."""


@dataclass(frozen=True)
class ShellResult:
    """One command's outcome. ``output`` is stdout+stderr merged in order, decoded as UTF-8."""

    status: str
    """``ok`` | ``error`` (nonzero exit) | ``timeout`` | ``memory`` | ``output_limit`` | ``sandbox_error``."""
    output: str
    returncode: int | None
    """Exit code; negative signal number when the shell was killed; None when nothing ran."""
    wall_s: float
    detail: str
    cwd: str
    """The shell's working directory after the command, as seen inside."""

    def observation(self, max_chars: int = 16000) -> str:
        """OpenHands-style: the output (head and tail kept when clipped), then a status line."""
        out = self.output.rstrip("\n")
        if len(out) > max_chars:
            note = f"\n[... {len(out) - max_chars} characters cut ...]\n"
            head = max(0, max_chars - len(note)) // 2
            out = out[:head] + note + out[len(out) - head :]
        if self.status == "timeout":
            end = f"[Command timed out after {self.detail} and was killed]"
        elif self.status == "output_limit":
            end = f"[Command was killed: {self.detail}]"
        elif self.status == "sandbox_error":
            end = f"[Command could not run: {self.detail}]"
        else:
            memory = f" ({self.detail})" if self.status == "memory" else ""
            end = (
                f"[Current working directory: {self.cwd}]\n[Command finished with exit code {self.returncode}{memory}]"
            )
        return f"{out}\n{end}" if out else end


def _claim_uid(iso: Isolation) -> tuple[int | None, int | None]:
    """The session's uid (None: keep ours) and the fd of the lock file that reserves it."""
    if not iso.uid_drop:
        return None, None
    base = iso.uid_base + _UID_OFFSET
    if not (iso.unique_uids and _uid_map_covers(base, base + _UID_SLOTS)):
        return _NOBODY, None
    _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    held = os.lstat(_LOCK_DIR)
    if not stat.S_ISDIR(held.st_mode) or held.st_uid != os.geteuid() or held.st_mode & 0o022:
        return _NOBODY, None  # not ours alone: its locks could not be trusted
    for slot in range(_UID_SLOTS):  # the lowest free slot, so few lock files ever exist
        fd = os.open(_LOCK_DIR / str(slot), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return base + slot, fd
        except BlockingIOError:
            os.close(fd)
    return _NOBODY, None


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """``lchown`` ``root`` and everything below it (symlinks are never followed)."""
    os.chown(root, uid, gid, follow_symlinks=False)
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(top, name), uid, gid, follow_symlinks=False)


def _read_state(path: Path) -> str | None:
    """The state file the command's ``EXIT`` trap wrote, if complete (never follows a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = f.read(_MIB + 1).decode("utf-8", "surrogateescape")
    return text if _END in text and len(text) <= _MIB else None


def _wrapper(state: str, workdir: str, persist: bool, command_file: str = "main.py") -> str:
    """The ``bash -c`` program: restore cwd and env, arm the saving trap, ``eval`` the command file.

    One line, so the command's own errors report its line numbers (``bash: line 1: ...``)."""
    steps = [
        f"declare -r __sao_s={shlex.quote(state)} __sao_w={shlex.quote(workdir)}",
        f'__sao_cmd=$(<{shlex.quote(command_file)}) && cd -- "$__sao_w" || exit 125',
    ]
    if persist:
        steps += [
            'if [ -f "$__sao_s/state.sh" ]; then for __sao_v in $(compgen -e); do unset "$__sao_v" 2>/dev/null;'
            ' done; . "$__sao_s/state.sh"; cd -- "$__sao_cwd" 2>/dev/null; fi',
            "unset __sao_v __sao_cwd",
            'trap \'__sao_rc=$?; trap - EXIT; { export -p; printf "__sao_cwd=%q\\n#sao-end %s" "$PWD" "$PWD"; }'
            ' >"$__sao_s/rw/next.sh" 2>/dev/null; exit $__sao_rc\' EXIT',
        ]
    return "; ".join([*steps, 'eval "$__sao_cmd"'])


def _memory_exhausted(output: str) -> bool:
    tail = output[-2000:]
    return any(m in tail for m in ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory"))


_CMD_AT = "/tmp/.sao_cmd"  # the command file's directory inside a container
_PLAIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ContainerSpec:
    """Run every command of a session in a container image instead of the namespace sandbox.

    The runtime provides the isolation (Apptainer: ``--containall``, a PID namespace, a writable
    tmpfs over the read-only image, no network unless ``network``; enroot: its read-only root
    filesystem, and it shares the host's network); this module adds the wall deadline, the output
    cap, the kill of the whole process group and the emulated persistent shell. The workspace is
    bound read-write at ``workdir`` (SWE-bench images keep the repository, installed in
    development mode, at ``/testbed``: binding the episode's copy there keeps that install
    pointing at it)."""

    image: str
    """Apptainer: a SIF path or ``docker://...`` reference; enroot: a container name made by
    ``enroot create`` on every node (or an image path ``enroot start`` accepts)."""
    runtime: str = "apptainer"
    """``apptainer`` or ``enroot``."""
    workdir: str = "/testbed"
    executable: str = ""
    """The runtime's program (default: ``runtime`` on PATH)."""
    network: bool = False
    """Apptainer only: keep the host network (default: ``--net --network none``)."""
    env: Mapping[str, str] | None = None
    """Variables every command sees (e.g. a conda environment's ``PATH``)."""

    def __post_init__(self) -> None:
        if self.runtime not in ("apptainer", "enroot"):
            raise ValueError(f"container runtime {self.runtime!r}: use 'apptainer' or 'enroot'")
        if not self.image:
            raise ValueError("container image is empty: name the image (Apptainer SIF/docker://, enroot name)")
        if not self.workdir.startswith("/"):
            raise ValueError(f"container workdir {self.workdir!r} must be an absolute path inside the image")

    def argv(self, binds: Sequence[tuple[str, str]], env: Mapping[str, str], command: Sequence[str]) -> list[str]:
        """The runtime's command line: ``binds`` (host, inside) read-write; ``command`` runs under
        ``env -i`` with exactly ``env`` (nothing of the host's environment leaks in)."""
        exe = self.executable or self.runtime
        inner = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), *command]
        if self.runtime == "apptainer":
            net = [] if self.network else ["--net", "--network", "none"]
            mounts = [a for src, dst in binds for a in ("--bind", f"{src}:{dst}")]
            return [
                exe,
                "exec",
                "--containall",
                "--writable-tmpfs",
                *net,
                *mounts,
                "--pwd",
                _CMD_AT,
                self.image,
                *inner,
            ]
        mounts = [a for src, dst in binds for a in ("--mount", f"{src}:{dst}")]
        return [exe, "start", *mounts, self.image, *inner]


class ShellSession:
    """One episode's shell over one workspace directory (a git repo on the host).

    Commands of one session run one at a time (concurrent calls wait); many sessions may run
    concurrently from one event loop. Call :meth:`close` (or use ``async with``) at the end.
    """

    WORKDIR = "/workspace"

    def __init__(
        self,
        workspace: str | Path,
        limits: ShellLimits | None = None,
        env: Mapping[str, str] | None = None,
        container: ContainerSpec | None = None,
    ) -> None:
        self.host_workspace = Path(workspace).resolve()
        if not self.host_workspace.is_dir():
            raise NotADirectoryError(f"workspace {workspace} is not a directory")
        self.limits = limits or ShellLimits()
        self.container = container
        iso = detect_isolation()
        if container is not None:  # the runtime isolates: no uid, namespaces or binds of ours
            iso = replace(iso, netns=False, mountns=False, pidns=False, uid_drop=False, unique_uids=False)
        self._refused = f"isolation unavailable: {iso}" if self.limits.require_isolation and not iso.full else ""
        self.uid, self._lock_fd = _claim_uid(iso)
        # kill(-1) as the uid is safe only when the uid is this session's alone
        self._iso = replace(iso, unique_uids=self._lock_fd is not None)
        self._pidns = iso.pidns and iso.mountns
        self._owner = os.stat(self.host_workspace)
        self._dir = Path(tempfile.mkdtemp(prefix="sao_shell_"))
        self._dir.chmod(0o755)
        (self._dir / "rw" / "home").mkdir(parents=True)
        self._workdir = container.workdir if container is not None else str(self.host_workspace)
        if iso.mountns:
            try:
                os.makedirs(self.WORKDIR, mode=0o755, exist_ok=True)  # an empty mount point on the host
                self._workdir = self.WORKDIR
            except OSError:
                pass  # the workspace is then bound at its own path
        self._inside = _STATE_AT if iso.mountns or container is not None else str(self._dir)
        self.cwd = self._workdir
        prefix = os.path.realpath(sys.prefix)
        self._binds: tuple[tuple[str, str, str], ...] = ()
        if iso.mountns:
            ro = dict.fromkeys(os.path.realpath(p) for p in (prefix, *self.limits.expose_paths))
            self._binds = (
                ("rw", str(self.host_workspace), self._workdir),
                ("rw", str(self._dir), _STATE_AT),
                *sorted((("ro", p, p) for p in ro if os.path.isdir(p)), key=lambda b: len(b[2])),
            )
        self.env = {
            "PATH": _PLAIN_PATH if container is not None else f"{prefix}/bin:{_PLAIN_PATH}",
            "HOME": f"{self._inside}/rw/home",
            "TMPDIR": "/tmp" if iso.mountns or container is not None else f"{self._inside}/rw/home",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": "safe.directory",
            "GIT_CONFIG_VALUE_0": "*",
            **((container.env or {}) if container is not None else {}),
            **(env or {}),
        }
        self._lock = threading.Lock()
        self._started = False
        self._closed = False

    @property
    def workdir(self) -> str:
        """Where commands see the workspace: ``/workspace`` with a mount namespace, else its host path."""
        return self._workdir

    def _start(self) -> None:
        """Blocking, once: reap leftovers of a previous holder of the uid, give it the files."""
        if self.uid is not None:
            if self._iso.unique_uids:
                _kill_uid(self.uid)
            _chown_tree(self.host_workspace, self.uid, self.uid)
            _chown_tree(self._dir / "rw", self.uid, self.uid)
        self._started = True

    async def run(self, command: str, timeout_s: float | None = None) -> ShellResult:
        """Run ``command`` in the session's shell; never raises on what the command does."""
        return await self._serial(command, timeout_s, True, self.limits.max_output_bytes)

    async def _acquire(self) -> None:
        while not self._lock.acquire(blocking=False):  # one command at a time, any thread or loop
            await asyncio.sleep(0.01)

    async def _serial(self, command: str, timeout_s: float | None, persist: bool, max_output: int) -> ShellResult:
        await self._acquire()
        try:
            return await self._run(command, timeout_s, persist, max_output)
        finally:
            self._lock.release()

    async def _run(self, command: str, timeout_s: float | None, persist: bool, max_output: int) -> ShellResult:
        wall = self.limits.wall_s if timeout_s is None else timeout_s
        if self._closed or self._refused:
            return ShellResult("sandbox_error", "", None, 0.0, self._refused or "session closed", self.cwd)
        data = command.encode("utf-8", "surrogateescape")
        if len(data) > _MAX_COMMAND_BYTES:
            return ShellResult("error", "", None, 0.0, f"command longer than {_MAX_COMMAND_BYTES} bytes", self.cwd)
        if not self._started:
            await asyncio.to_thread(self._start)
        lim = self.limits
        box = SandboxLimits(
            wall_s=wall,
            cpu_s=lim.cpu_s,
            memory_bytes=lim.memory_bytes,
            file_size_bytes=lim.file_size_bytes,
            tmpfs_bytes=lim.tmpfs_bytes,
            open_files=lim.open_files,
            processes=lim.processes,
        )
        host_dir = tempfile.mkdtemp(prefix="sao_shell_cmd_")
        try:
            Path(host_dir, "main.py").write_bytes(data)
            env = self.env
            if self.container is not None:
                script = _wrapper(self._inside, self._workdir, persist, f"{_CMD_AT}/main.py")
                binds = [
                    (str(self.host_workspace), self._workdir),
                    (str(self._dir), _STATE_AT),
                    (host_dir, _CMD_AT),
                ]
                argv = self.container.argv(binds, self.env, ("/bin/bash", "-c", script, "bash"))
                env = {"PATH": os.environ.get("PATH", _PLAIN_PATH)}  # finds the runtime; the command gets self.env
            else:
                script = _wrapper(self._inside, self._workdir, persist)
                uid_rule = "-1" if self.uid is None else str(self.uid)
                argv = _argv(
                    box,
                    self._iso,
                    uid_rule=uid_rule,
                    binds=self._binds,
                    exec_argv=("/bin/bash", "-c", script, "bash"),
                    pidns=self._pidns,
                )
            run = await _supervised(
                argv, host_dir, env, wall, {1: max_output}, self._iso, lambda _: self.uid, self._pidns
            )
        except ValueError as exc:
            return ShellResult("sandbox_error", "", None, 0.0, str(exc), self.cwd)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)
        out = run.coll.bufs[1].decode("utf-8", "replace")
        rc = None if run.proc is None else run.proc.returncode
        if run.proc is None:
            status, detail = "sandbox_error", run.error
        elif rc == _SETUP_FAILED and out.startswith("sandbox setup failed"):
            status, detail = "sandbox_error", out.splitlines()[0]
        elif run.coll.overflow.done():
            status, detail = "output_limit", f"output exceeded {max_output} bytes"
        elif run.timed_out:
            status, detail = "timeout", f"{wall:g}s"
        elif rc == 0:
            status, detail = "ok", ""
        elif _memory_exhausted(out):
            status, detail = "memory", f"memory limit {lim.memory_bytes // _MIB} MiB"
        else:
            status, detail = "error", f"exit code {rc}"
        if persist and status in ("ok", "error", "memory"):
            self._save_state()
        return ShellResult(status, out, rc, run.wall_s, detail, self.cwd)

    def _save_state(self) -> None:
        """Adopt the state the trap wrote (else keep the previous one) and learn the new cwd."""
        nxt = self._dir / "rw" / "next.sh"
        text = _read_state(nxt)
        if text is not None:
            (self._dir / "state.sh").write_text(text, encoding="utf-8", errors="surrogateescape")
            self.cwd = text.rsplit(_END, 1)[1]
        try:
            nxt.unlink()
        except OSError:
            pass

    def run_sync(self, command: str, timeout_s: float | None = None) -> ShellResult:
        """Blocking :meth:`run` (own event loop; a worker thread if this thread runs one)."""
        return run_blocking(self.run(command, timeout_s))

    def runner(self) -> Callable[[Sequence[str], Path, float], CommandResult]:
        """A reward ``Runner``: ``argv`` in this isolation, in ``cwd`` (a host path in the workspace,
        mapped inside), with a clean environment and none of the session's saved state."""

        def run(argv: Sequence[str], cwd: Path, timeout_s: float) -> CommandResult:
            try:
                rel = Path(cwd).resolve().relative_to(self.host_workspace)
            except ValueError:
                rel = Path()
            inside = os.path.normpath(os.path.join(self._workdir, rel))
            env = {
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONHASHSEED": "0",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            }
            command = f"cd -- {shlex.quote(inside)} && HOME=$PWD {' '.join(f'{k}={v}' for k, v in env.items())} exec {shlex.join(argv)}"
            res = run_blocking(self._serial(command, timeout_s, False, _RUNNER_OUTPUT_BYTES))
            timed_out = res.status == "timeout"
            output = res.output if res.status != "sandbox_error" else f"{res.output}{res.detail}\n"
            return CommandResult(None if timed_out else res.returncode, output, timed_out, res.wall_s)

        return run

    async def close(self) -> None:
        """Kill anything left of this session, give the workspace back to its owner; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.uid is not None and self._iso.unique_uids:
            await asyncio.to_thread(_kill_uid, self.uid)
        await self._acquire()
        try:
            if self._started and self.uid is not None:
                await asyncio.to_thread(_chown_tree, self.host_workspace, self._owner.st_uid, self._owner.st_gid)
            shutil.rmtree(self._dir, ignore_errors=True)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
        finally:
            self._lock.release()

    async def __aenter__(self) -> ShellSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
