"""The session a server (an SGLang engine, the router) runs in: who listens on its port, and the
small process that leads it and ends what the server leaves behind.

A server starts in a session of its own, led by :func:`main` (``python -m
sao_megatron.rollout.server_session PARENT_PID -- COMMAND...``), which starts the server and, when the
server ends or the process that started the session dies (``PR_SET_PDEATHSIG``: SIGTERM), ends every
process left in the session, by PID. SGLang's scheduler and detokenizer ask the kernel to kill them
with the server only after their imports: a server killed in that window (its starter SIGKILLed while
the engine starts) left them running for good (seen: an orphaned ``sglang::detokenizer``).

The health check's proof that a server answering on a port is the one started, not another that took
the port first (``spawn.free_port`` probes and releases): a process of the server's session holds
the listening socket (``/proc/net/tcp``, ``tcp6`` of this network namespace; ``/proc/PID/fd``).
Linux only; elsewhere the server runs unled and the health answer is all there is to go on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

_LISTEN = "0A"
"""The kernel's TCP_LISTEN state as ``/proc/net/tcp`` writes it."""
STOP_GRACE_S = 10.0
"""How long the leader waits for the server after SIGTERM before it SIGKILLs it."""
POLL_S = 0.5
"""How often the leader looks at the server and at a stop request. Idle cost measured with
``benchmarks/bench_server_session.py``: 0.00 CPU-s in 20 s, 13 MiB resident (``Popen.wait(timeout)``,
which polls every 50 ms, took 0.02 CPU-s)."""


def listening_sockets(port: int) -> set[str] | None:
    """Inodes of the sockets listening on ``port`` (any address); None where ``/proc/net`` is unreadable."""
    found: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rpartition(":")[2], 16) == port:
                found.add(fields[9])
    return found if readable else None


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, this process excluded."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session ...
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(proc.name))
    return found


def session_listens(sid: int, port: int) -> bool:
    """A process of session ``sid`` (a server started with ``start_new_session``: its pid) holds a socket
    listening on ``port``. True where this cannot be read (no ``/proc``, or no member's descriptors
    readable: a server that dropped privileges or made itself undumpable): then the health answer is
    all there is."""
    inodes = listening_sockets(port)
    if inodes is None:
        return True
    if not inodes:
        return False
    members, targets, readable = session_pids(sid), {f"socket:[{inode}]" for inode in inodes}, False
    for pid in members:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except PermissionError:
            continue
        except OSError:  # ended meanwhile
            readable = True
            continue
        readable = True
        for fd in fds:
            with contextlib.suppress(OSError):  # closed meanwhile
                if os.readlink(fd) in targets:
                    return True
    return bool(members) and not readable


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn``: the child gets ``sig`` when the thread that started it ends (the process killed
    included; servers start on the event loop's thread, or on a restart in one of its executor
    threads, which live as long as the loop); None where the kernel cannot do that. ``prctl`` is
    looked up here, in the parent, so the child only calls it (as Ray does)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype, prctl.argtypes = (
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong],
    )
    pr_set_pdeathsig, parent = 1, os.getpid()

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call
            os.kill(os.getpid(), sig)

    return preexec


def led(command: list[str]) -> list[str]:
    """``command`` run under a session leader (start it with ``start_new_session=True`` and
    ``preexec_fn=die_with_parent(signal.SIGTERM)``); ``command`` itself where there is no ``/proc``."""
    if not Path("/proc/self/stat").exists():
        return command
    return [sys.executable, "-m", "sao_megatron.rollout.server_session", str(os.getpid()), "--", *command]


def _end_the_rest() -> None:
    """SIGKILL every other process of this session until none is left (they may fork meanwhile)."""
    for _ in range(20):
        rest = session_pids(os.getsid(0))
        if not rest:
            return
        for pid in rest:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    """Run the server, end the rest of the session after it, and exit as it did."""
    parent, sep, command = int(argv[0]), argv[1], argv[2:]
    assert sep == "--" and command, "usage: server_session PARENT_PID -- COMMAND..."
    if os.getsid(0) != os.getpid():  # it ends every other process of its session: never the caller's
        print(
            f"server_session: not the leader of its session {os.getsid(0)}; start it with start_new_session=True "
            "(or setsid), as rollout.engine does",
            file=sys.stderr,
        )
        return 2
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    if os.getppid() != parent:  # the starter died before the handlers were in place
        stopping.append(signal.SIGTERM)
    server = None if stopping else subprocess.Popen(command, preexec_fn=die_with_parent())
    deadline = None
    while server is not None and server.poll() is None:
        if stopping and deadline is None:  # stop() signals the whole session; the starter's death only us
            deadline = time.monotonic() + STOP_GRACE_S
            server.send_signal(signal.SIGTERM)
        if deadline is not None and time.monotonic() > deadline:
            server.kill()
        time.sleep(POLL_S)
    _end_the_rest()
    code = server.returncode if server is not None else -signal.SIGTERM
    if code < 0:  # end as the server did, so the starter sees the same status
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's action cannot be set (nor need be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal whose default is to be ignored
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
