"""Run untrusted, model-written Python in a separate, resource-limited process.

Contract: :func:`run_python` / :func:`arun_python` never raise on anything the *code* does; every
outcome is a :class:`SandboxResult` whose ``status`` is one of ``ok``, ``error``, ``timeout``,
``memory``, ``output_limit`` or ``sandbox_error`` (the sandbox itself could not start), and
:meth:`SandboxResult.observation` turns it into the text a tool call returns to the model
(for example ``Error: timeout after 2.0s``).

The child is spawned (from a worker thread, without a ``preexec_fn``, so the event loop never
waits on a fork) as ``python -I -S -c <bootstrap>``; the bootstrap (the ``_c_*`` functions of
:mod:`sao_megatron.envs.sandbox_child`) isolates the process before it compiles a byte of the model's code. Layers,
outermost first (what this host provides is reported by :func:`detect_isolation`;
``docs/envs.md`` lists what is and is not guaranteed):

1. **Process group and uid.** The child starts a new session (``os.killpg`` reaches every
   descendant that stays in it). Running as root, the interpreter drops to an unprivileged
   uid/gid unique to the sandbox (``uid_base + pid``), so ``RLIMIT_NPROC`` is enforced per
   sandbox and, at the end, a helper running as that uid sends ``kill(-1, SIGKILL)``, which
   also reaches descendants that left the process group (``setsid``, double fork).
2. **Namespaces** (when the kernel lets us): a new network namespace (only a downed loopback,
   so no connection leaves the sandbox) and a new mount namespace in which ``/`` is read-only,
   ``/tmp`` is a private size-limited tmpfs holding the working directory, and the project
   directory, ``/root`` and ``/home`` are hidden under empty tmpfs mounts (the interpreter's
   own prefix is bound back read-only so the stdlib still imports); with the mount namespace, a
   new PID namespace whose init reaps every orphan and ends, so the kernel kills and reaps the
   rest, when the code's process (its child) ends: nothing the code started outlives the call,
   not even as a zombie.
3. **rlimits**: CPU seconds, address space, file size, open files, processes, no core dumps.
4. **Interpreter**: ``python -I -S`` (no user site, no site-packages, no ``PYTHON*`` env),
   an environment of four fixed variables (the parent's environment never reaches the child),
   stdin at EOF, and an audit hook refusing internet/packet/netlink sockets and DNS lookups.
5. **Supervisor**: wall-clock deadline, incremental reading of stdout/stderr with a byte cap
   (the process is killed as soon as a cap is exceeded), then kill-and-reap of everything the
   sandbox started, and removal of the host-side temporary directory.

The same bootstrap and supervisor run the SWE agent's shell (:mod:`sao_megatron.envs.shell`),
which adds bind mounts, a PID namespace, a fixed uid, merged output and an ``execv`` of
``bash`` after the set-up (the keyword arguments of :func:`_argv` and :func:`_supervised`), and a
user's command agent (:mod:`sao_megatron.envs.agent_sandbox`), whose network namespace's loopback is
up for its relay to the gateway. A supervisor whose task is cancelled kills the sandbox all the same.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from sao_megatron.envs.sandbox_child import KILL_UID, bootstrap_source

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "sandbox_error"]

REPO_ROOT = Path(__file__).resolve().parents[2]
_NOBODY = 65534
_MIB = 1 << 20
_SETUP_FAILED = 125  # exit code of the bootstrap when isolation could not be set up

# Modules imported before the uid drop when the stdlib is not readable by an unprivileged user
# and no mount namespace can expose it (the fallback mode); other imports may then fail.
_PRELOAD = "math cmath fractions decimal itertools functools collections statistics random re json string"


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run. Every field is enforced per run."""

    wall_s: float = 5.0
    """Wall-clock deadline in seconds from the process start; then the whole sandbox is killed."""
    cpu_s: int = 5
    """RLIMIT_CPU in seconds per process (SIGXCPU at the limit, SIGKILL one second later)."""
    memory_bytes: int = 512 * _MIB
    """RLIMIT_AS (virtual address space) per process, in bytes."""
    max_stdout_bytes: int = 64 * 1024
    """stdout bytes kept; more output kills the process with status ``output_limit``."""
    max_stderr_bytes: int = 64 * 1024
    """stderr bytes kept; more output kills the process with status ``output_limit``."""
    file_size_bytes: int = 8 * _MIB
    """RLIMIT_FSIZE: largest file the code may write, in bytes."""
    tmpfs_bytes: int = 32 * _MIB
    """Size of the private /tmp (the working directory) and /dev/shm, each capped at 16384 inodes."""
    nice: int = 10
    """Added to the sandbox's nice value, so busy hostile code cannot starve the supervisor."""
    open_files: int = 64
    """RLIMIT_NOFILE: open file descriptors per process."""
    processes: int = 32
    """RLIMIT_NPROC: processes of the sandbox uid (enforced only once the uid is dropped)."""
    max_code_bytes: int = 1 * _MIB
    """Longer code is refused with status ``error`` without starting a process."""
    hide_paths: tuple[str, ...] = ()
    """Extra host directories hidden from the code (mount namespace only)."""
    require_isolation: bool = False
    """If True, refuse to run (``sandbox_error``) unless net+mount namespaces and uid drop work."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run. ``stdout``/``stderr`` are decoded UTF-8 (invalid bytes replaced)."""

    status: Status
    stdout: str
    stderr: str
    returncode: int | None
    """Exit code, negative signal number when killed, None when no process ran."""
    wall_s: float
    """Seconds from the process start until the sandbox was reaped."""
    detail: str
    """Human-readable reason for a non-ok status (empty when ok)."""
    pid: int | None = None
    """Pid of the sandbox process, which was also its process-group and session id."""
    uid: int | None = None
    """Uid the code ran as (None when it kept the parent's uid)."""

    def observation(self, max_chars: int = 1024) -> str:
        """The tool observation for the model: stdout, then ``Error: ...`` when not ok.

        Trailing newlines are dropped; output longer than ``max_chars`` keeps its head and says
        how much was cut.
        """
        out = self.stdout.rstrip("\n")
        if self.status == "ok":
            return _truncate(out, max_chars) if out else "(no output)"
        msg = f"Error: {self.detail}"
        if not out:
            return _truncate(msg, max_chars)
        head = _truncate(out, max(0, max_chars - len(msg) - 1))
        return f"{head}\n{msg}"[:max_chars]


@dataclass(frozen=True)
class Isolation:
    """What this host lets the sandbox do; decided once per process by :func:`detect_isolation`."""

    netns: bool
    """A new network namespace can be created (no network at all)."""
    mountns: bool
    """A new mount namespace with tmpfs/bind mounts can be created (private /tmp, hidden dirs)."""
    uid_drop: bool
    """We run as root and can switch the child to an unprivileged uid."""
    unique_uids: bool
    """Each sandbox gets its own uid (``uid_base + pid``); otherwise all share ``nobody``."""
    uid_base: int
    """First uid of the per-sandbox range (ignored unless ``unique_uids``)."""
    pidns: bool = False
    """A new PID namespace with its own /proc can be created (used by the shell, with mountns)."""

    @property
    def full(self) -> bool:
        return self.netns and self.mountns and self.uid_drop


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    note = f"...[truncated {len(text) - max_chars} chars]"
    return text[: max(0, max_chars - len(note))] + note


# ----------------------------------------------------------------------------------------------
# Parent side: plan, host capability detection
# ----------------------------------------------------------------------------------------------
def _interpreter() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable) or sys.executable)


def _hidden_paths(limits: SandboxLimits) -> tuple[str, ...]:
    cands = [str(REPO_ROOT), "/root", "/home", os.path.expanduser("~"), *limits.hide_paths]
    out: list[str] = []
    for p in cands:
        rp = os.path.realpath(p)
        if os.path.isdir(rp) and rp not in ("/", "/tmp", "/proc", "/dev", "/usr", "/etc") and rp not in out:
            out.append(rp)
    return tuple(sorted(out, key=len))


def _exposed_paths() -> tuple[str, ...]:
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    roots.add(os.path.dirname(os.path.dirname(_interpreter())))
    return tuple(sorted(roots))


def _uid_rule(iso: Isolation) -> str:
    """The bootstrap's uid argument: ``-1`` (keep), a fixed uid, or ``pid+<base>``."""
    if not iso.uid_drop:
        return "-1"
    return f"pid+{iso.uid_base}" if iso.unique_uids else str(_NOBODY)


def _uid_of(iso: Isolation, pid: int) -> int | None:
    """The uid the sandbox with ``pid`` runs as; must agree with :func:`_uid_rule`."""
    if not iso.uid_drop:
        return None
    return iso.uid_base + pid if iso.unique_uids else _NOBODY


def _stdlib_world_readable() -> bool:
    path = Path(os.path.dirname(os.__file__))
    return all(os.stat(part).st_mode & 0o005 == 0o005 for part in (path, *path.parents))


def _argv(
    limits: SandboxLimits,
    iso: Isolation,
    *,
    uid_rule: str | None = None,
    expose: tuple[str, ...] = (),
    binds: tuple[tuple[str, str, str], ...] = (),
    exec_argv: tuple[str, ...] = (),
    pidns: bool = False,
    program_is_init: bool = True,
    loopback: bool = False,
) -> list[str]:
    """The sandbox's command line. The keyword arguments serve other sandboxed programs (the shell,
    a user's agent): a fixed uid rule, extra read-only paths, ``(mode, source, target)`` binds, a
    program to exec, a PID namespace (when ``iso`` allows it) whose init is the program itself or, with
    ``program_is_init=False``, a reaper whose child the program is (``sandbox_child._c_reaping_init``),
    and the network namespace's loopback up (``127.0.0.1`` inside; still nothing outside)."""
    hidden, expose = _hidden_paths(limits), (*_exposed_paths(), *expose)
    bind_paths = [p for b in binds for p in b]
    if any("\n" in p for p in (*hidden, *expose, *bind_paths)) or any("\t" in p for p in bind_paths):
        raise ValueError("sandbox paths must not contain newlines or tabs")
    preload = _PRELOAD if (iso.uid_drop and not iso.mountns and not _stdlib_world_readable()) else "-"
    lim = (limits.cpu_s, limits.memory_bytes, limits.file_size_bytes, limits.open_files, limits.processes)
    return [
        _interpreter(),
        "-I",
        "-S",
        "-c",
        bootstrap_source(),
        uid_rule or _uid_rule(iso),
        f"{(2 if loopback else 1) if iso.netns else 0}{int(iso.mountns)}{(1 if program_is_init else 2) if pidns and iso.pidns and iso.mountns else 0}",
        preload,
        ",".join(str(max(1, int(x))) for x in (*lim, limits.tmpfs_bytes)) + f",{max(0, limits.nice)}",
        "\n".join(hidden),
        "\n".join(expose),
        "\n".join("\t".join(b) for b in binds),
        *exec_argv,
    ]


def _child_env(iso: Isolation, host_dir: str) -> dict[str, str]:
    workdir = "/tmp/work" if iso.mountns else host_dir
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _uid_map_covers(lo: int, hi: int) -> bool:
    """Whether uids [lo, hi) are all mapped in our user namespace (so setuid to them works)."""
    try:
        nums = [int(x) for x in Path("/proc/self/uid_map").read_text().split()]
    except (OSError, ValueError):
        return hi <= 65536
    ranges = [(nums[i], nums[i + 2]) for i in range(0, len(nums) - 2, 3)]  # (inside start, count)
    return any(start <= lo and hi <= start + count for start, count in ranges)


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 1 << 22


def _probe(iso: Isolation) -> bool:
    """Whether a sandbox with this isolation starts and runs ``pass`` here."""
    with tempfile.TemporaryDirectory(prefix="sao_sandbox_probe_") as tmp:
        Path(tmp, "main.py").write_bytes(b"pass\n")
        try:
            argv = _argv(SandboxLimits(), iso, pidns=iso.pidns)
            proc = subprocess.run(argv, cwd=tmp, env=_child_env(iso, tmp), capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError, ValueError):
            return False
    return proc.returncode == 0


@functools.cache
def detect_isolation() -> Isolation:
    """Probe (once per process, ~50 ms) which isolation features this host allows.

    Memoised: it is a fixed property of the host and user. Each feature is kept only if a
    real sandbox using it starts, so a container that forbids namespaces degrades gracefully.
    """
    root = os.geteuid() == 0
    uid_base = 1_000_000_000
    unique = root and _uid_map_covers(uid_base, uid_base + _pid_max() + 1)
    uid_drop = root and (unique or _uid_map_covers(_NOBODY, _NOBODY + 1))
    base = Isolation(netns=False, mountns=False, uid_drop=uid_drop, unique_uids=unique, uid_base=uid_base)
    if not root:
        return base
    netns = _probe(replace(base, netns=True))
    mountns = _probe(replace(base, mountns=True))
    pidns = mountns and _probe(replace(base, mountns=True, pidns=True))
    return replace(base, netns=netns, mountns=mountns, pidns=pidns)


# ----------------------------------------------------------------------------------------------
# Supervisor
# ----------------------------------------------------------------------------------------------
class _Collector:
    """Buffers the pipes (fd 1, and 2 unless merged) up to their caps; futures for exit,
    overflow and every pipe's EOF."""

    def __init__(self, loop: asyncio.AbstractEventLoop, caps: dict[int, int]) -> None:
        self.caps = caps
        self.bufs: dict[int, bytearray] = {fd: bytearray() for fd in caps}
        self.open_pipes = set(caps)
        self.exited: asyncio.Future[None] = loop.create_future()
        self.overflow: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def feed(self, fd: int, data: bytes) -> None:
        buf = self.bufs[fd]
        room = self.caps[fd] - len(buf)
        buf += data[: max(0, room)]
        if len(data) > room and not self.overflow.done():
            self.overflow.set_result(fd)  # later data is read and dropped so the pipe reaches EOF

    def eof(self, fd: int) -> None:
        self.open_pipes.discard(fd)
        if not self.open_pipes and not self.closed.done():
            self.closed.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


class _PipeReader(asyncio.Protocol):
    def __init__(self, coll: _Collector, fd: int) -> None:
        self.coll, self.fd = coll, fd

    def data_received(self, data: bytes) -> None:
        self.coll.feed(self.fd, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.coll.eof(self.fd)


def _spawn(argv: list[str], cwd: str, env: dict[str, str], merge: bool = False) -> subprocess.Popen:
    """Start the sandbox (blocking: called in a worker thread so the event loop never waits)."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
        close_fds=True,
    )


def _kill_uid(uid: int) -> None:
    """Blocking: a helper running as ``uid`` sends SIGKILL to every process of that uid."""
    subprocess.run([_interpreter(), "-I", "-S", "-c", KILL_UID, str(uid)], env={}, close_fds=True, check=False)


async def _reap(proc: subprocess.Popen, uid: int | None, iso: Isolation) -> None:
    """Kill the sandbox's process group and, with a unique uid, every process of that uid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if iso.unique_uids and uid is not None:
        await asyncio.to_thread(_kill_uid, uid)


def _kill_children(pid: int) -> None:
    """SIGKILL the direct children of ``pid`` (best effort: needs /proc/PID/task/TID/children)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return
    for child in children:
        try:
            os.kill(int(child), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_now(proc: subprocess.Popen, uid: int | None, iso: Isolation, pidns: bool) -> None:
    """Blocking :func:`_reap` (with a PID namespace, its init first), for a supervisor being cancelled."""
    if pidns:
        _kill_children(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if iso.unique_uids and uid is not None:
        _kill_uid(uid)


class _ExitWatch:
    """Resolves ``coll.exited`` when the child exits: a pidfd reader, or 20 ms polling without one."""

    def __init__(self, loop: asyncio.AbstractEventLoop, proc: subprocess.Popen, coll: _Collector) -> None:
        self.loop, self.proc, self.coll = loop, proc, coll
        self.pidfd: int | None = None
        self.poller: asyncio.Task | None = None
        try:
            self.pidfd = os.pidfd_open(proc.pid)
            loop.add_reader(self.pidfd, self._check)
        except (AttributeError, OSError):
            self.poller = loop.create_task(self._poll())

    def _check(self) -> None:
        if self.proc.poll() is not None:
            self.coll.process_exited()

    async def _poll(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(0.02)
        self.coll.process_exited()

    def close(self) -> None:
        if self.pidfd is not None:
            self.loop.remove_reader(self.pidfd)
            os.close(self.pidfd)
        if self.poller is not None:
            self.poller.cancel()


def _classify(coll: _Collector, timed_out: bool, rc: int | None, limits: SandboxLimits) -> tuple[Status, str]:
    err_lines = [ln for ln in coll.bufs[2].decode("utf-8", "replace").splitlines() if ln.strip()]
    last = err_lines[-1].strip() if err_lines else ""
    if rc == _SETUP_FAILED and err_lines and err_lines[0].startswith("sandbox setup failed"):
        return "sandbox_error", err_lines[0]
    if coll.overflow.done():
        fd = coll.overflow.result()
        cap = limits.max_stdout_bytes if fd == 1 else limits.max_stderr_bytes
        return "output_limit", f"output limit exceeded ({'stdout' if fd == 1 else 'stderr'} > {cap} bytes)"
    if last.startswith("MemoryError"):  # even if the deadline hit while it was shutting down
        return "memory", f"MemoryError (memory limit {limits.memory_bytes // _MIB} MiB)"
    if timed_out:
        return "timeout", f"timeout after {limits.wall_s:g}s"
    if rc == -signal.SIGXCPU:
        return "timeout", f"CPU time limit of {limits.cpu_s}s exceeded"
    if rc == 0:
        return "ok", ""
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return "error", f"process killed by signal {name}"
    return "error", last[:300] or f"exit code {rc}"


async def arun_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandbox and return its result; never raises on the code's behaviour.

    Safe to call concurrently from one event loop: each run is one child process (spawned with
    ``vfork``, so the loop is not held up) plus, at the end, one short reaper helper.
    """
    limits = limits or SandboxLimits()
    data = code.encode("utf-8", "surrogatepass")
    if len(data) > limits.max_code_bytes:
        return SandboxResult("error", "", "", None, 0.0, f"code longer than {limits.max_code_bytes} bytes")
    iso = detect_isolation()
    if limits.require_isolation and not iso.full:
        return SandboxResult("sandbox_error", "", "", None, 0.0, f"isolation unavailable: {iso}")
    host_dir = tempfile.mkdtemp(prefix="sao_sandbox_")
    try:
        Path(host_dir, "main.py").write_bytes(data)
        return await _supervise(limits, iso, host_dir)
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


@dataclass
class _Supervised:
    """What :func:`_supervised` saw: the pipes' bytes, the process (None if it never started)."""

    coll: _Collector
    proc: subprocess.Popen | None
    timed_out: bool
    wall_s: float
    uid: int | None
    error: str = ""


async def _supervised(
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    wall_s: float,
    caps: dict[int, int],
    iso: Isolation,
    uid_of: Callable[[int], int | None],
    pidns: bool = False,
) -> _Supervised:
    """Spawn ``argv`` (stderr merged into stdout when ``caps`` has only fd 1), read its pipes up to
    ``caps`` until it exits, overflows or ``wall_s`` passes, then kill and reap all of it. With
    ``pidns`` (``argv`` forks into a PID namespace) the namespace's init is killed first, so the
    kernel kills the rest and the root parent reaps it: no zombie is left to the host's init."""
    loop = asyncio.get_running_loop()
    coll = _Collector(loop, caps)
    start = time.monotonic()
    try:
        proc = await asyncio.to_thread(_spawn, argv, cwd, env, 2 not in caps)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return _Supervised(coll, None, False, time.monotonic() - start, None, f"cannot start: {exc}")
    start = time.monotonic()  # the limit counts from a started process, not from the spawn queue
    uid = uid_of(proc.pid)
    watch = _ExitWatch(loop, proc, coll)
    transports, reaped = [], False
    try:
        for fd, pipe in ((1, proc.stdout), (2, proc.stderr)):
            if pipe is not None:
                transport, _ = await loop.connect_read_pipe(functools.partial(_PipeReader, coll, fd), pipe)
                transports.append(transport)
        done, _ = await asyncio.wait({coll.exited, coll.overflow}, timeout=wall_s, return_when=asyncio.FIRST_COMPLETED)
        if pidns and not coll.exited.done():  # let the root parent reap the namespace first
            _kill_children(proc.pid)
            await asyncio.wait({coll.exited}, timeout=0.5)
        await _reap(proc, uid, iso)
        reaped = True
        await asyncio.wait({coll.closed, coll.exited}, timeout=1.0, return_when=asyncio.ALL_COMPLETED)
    finally:
        if not reaped:  # cancelled (the caller's own deadline): the sandbox must not outlive the call
            _kill_now(proc, uid, iso, pidns)
        watch.close()
        for transport in transports:
            transport.close()
        proc.poll()
    return _Supervised(coll, proc, not done, time.monotonic() - start, uid)


async def _supervise(limits: SandboxLimits, iso: Isolation, host_dir: str) -> SandboxResult:
    # A PID namespace (where the host allows one) whose init reaps: a double-forked or setsid
    # descendant dies with it and is reaped inside, so none is left, zombie included, once the
    # call returns (without one it became a zombie of the host's init, reaped seconds later or never).
    pidns = iso.pidns and iso.mountns
    try:
        argv = _argv(limits, iso, pidns=pidns, program_is_init=False)
    except ValueError as exc:
        return SandboxResult("sandbox_error", "", "", None, 0.0, f"cannot start: {exc}")
    run = await _supervised(
        argv,
        host_dir,
        _child_env(iso, host_dir),
        limits.wall_s,
        {1: limits.max_stdout_bytes, 2: limits.max_stderr_bytes},
        iso,
        functools.partial(_uid_of, iso),
        pidns,
    )
    if run.proc is None:
        return SandboxResult("sandbox_error", "", "", None, run.wall_s, run.error)
    status, detail = _classify(run.coll, run.timed_out, run.proc.returncode, limits)
    out, err = (run.coll.bufs[fd].decode("utf-8", "replace") for fd in (1, 2))
    return SandboxResult(status, out, err, run.proc.returncode, run.wall_s, detail, pid=run.proc.pid, uid=run.uid)


def run_blocking[T](coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code: its own event loop, or a worker thread
    with one when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: list[T] = []
    worker = threading.Thread(target=lambda: box.append(asyncio.run(coro)))
    worker.start()
    worker.join()
    return box[0]


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Blocking variant of :func:`arun_python` (own event loop; a worker thread if one is running)."""
    return run_blocking(arun_python(code, limits))
