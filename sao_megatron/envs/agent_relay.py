"""The program a sandboxed ``command`` agent runs under (:mod:`sao_megatron.envs.agent_sandbox`).

It runs inside the sandbox *from its source text* (``python -I -S -c <this file> SOCKET PATH
COMMAND...``, as the sandbox's uid, in its network namespace whose only interface is loopback), so
it uses the standard library only (an env worker's relay to the gateway reuses :func:`pump`, an
unsandboxed command :func:`keep_tail`)::

    127.0.0.1:<free port>  --each connection-->  SOCKET (a Unix socket on which the gateway listens)
    COMMAND < task  with  OPENAI_BASE_URL=http://127.0.0.1:<port>PATH,  OPENAI_API_KEY (inherited)

The task is the file ``main.py`` of the working directory (the sandbox's payload), the agent's
stdin (removed once the agent started). The agent's stdout is discarded; the last
:data:`TAIL_BYTES` of its stderr are written to this program's stderr when it ends, followed by
one status line: ``sao-agent-status <code>`` (the agent's exit code, minus the signal number when a
signal ended it) or ``sao-agent-cannot-start <error>``, and before it ``sao-agent-unreachable
<error>`` when a connection to SOCKET failed. The program then exits 0, and the sandbox ends
whatever the agent left running.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from typing import IO

TAIL_BYTES = 4096
"""The end of the agent's stderr that is kept (for the failed episode's reason)."""


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until EOF, then half-close ``writer`` (an env worker's relay uses it too)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        pass


async def _relay(socket_path: str, failures: list[str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(socket_path)
    except OSError as err:
        failures.append(f"{type(err).__name__}: {err}")
        writer.close()
        return
    try:
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
    finally:
        up_writer.close()
        writer.close()


def keep_tail(stderr: IO[bytes], tail: bytearray) -> None:
    """Read ``stderr`` to EOF, keeping its last :data:`TAIL_BYTES` in ``tail`` (a thread's target)."""
    while data := stderr.read1(65536):  # type: ignore[attr-defined]  # a BufferedReader
        tail += data
        del tail[:-TAIL_BYTES]


async def _main(socket_path: str, url_path: str, command: list[str]) -> str:
    """Serve the relay, run the agent; the status line. Its exit is waited for in a thread, not by
    asyncio's subprocess, whose ``wait`` also waits for the pipes that the agent's children may hold."""
    failures: list[str] = []
    server = await asyncio.start_server(lambda r, w: _relay(socket_path, failures, r, w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    env = dict(os.environ, OPENAI_BASE_URL=f"http://127.0.0.1:{port}{url_path}")
    try:
        with open("main.py", "rb") as task:
            agent = subprocess.Popen(command, stdin=task, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    except OSError as err:
        return f"sao-agent-cannot-start {type(err).__name__}: {err}"
    finally:
        os.unlink("main.py")
    tail = bytearray()
    reader = threading.Thread(target=keep_tail, args=(agent.stderr, tail), daemon=True)
    reader.start()
    code = await asyncio.to_thread(agent.wait)
    await asyncio.to_thread(reader.join, 0.5)  # what it left running may hold the pipe open
    sys.stderr.write(bytes(tail).decode("utf-8", "replace").rstrip("\n") + "\n")
    if failures:
        sys.stderr.write(f"sao-agent-unreachable {failures[0]}\n")
    return f"sao-agent-status {code}"


if __name__ == "__main__":
    status = asyncio.run(_main(sys.argv[1], sys.argv[2], sys.argv[3:]))
    sys.stderr.write(status + "\n")
    sys.stderr.flush()
    os._exit(0)  # the relay's open connections and the agent's leftovers are the sandbox's to end
