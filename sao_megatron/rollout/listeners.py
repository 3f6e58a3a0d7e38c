"""Which process listens on a TCP port: the health check's proof that a server answering on a port is
the one this process started, not another that took the port first (``spawn.free_port`` probes and
releases, so a port can be taken between the pick and the server's bind).

Linux only: the listening sockets of this network namespace (``/proc/net/tcp``, ``tcp6``) and the
socket descriptors of the processes in one session (``/proc/PID/fd``).
"""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"
"""The kernel's TCP_LISTEN state as ``/proc/net/tcp`` writes it."""


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


def session_listens(sid: int, port: int) -> bool:
    """A process of session ``sid`` (a server started with ``start_new_session``: its pid) holds a socket
    listening on ``port``. True where this cannot be read (no ``/proc``): then the health answer is
    all there is to go on."""
    inodes = listening_sockets(port)
    if inodes is None:
        return True
    targets = {f"socket:[{inode}]" for inode in inodes}
    if not targets:
        return False
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[3]) != sid:  # state ppid pgrp session ...
                continue
            if any(os.readlink(fd) in targets for fd in (proc / "fd").iterdir()):
                return True
        except (OSError, ValueError):  # ended meanwhile, or not ours to read
            continue
    return False
