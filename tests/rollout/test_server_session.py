"""A server's session (``rollout.server_session``): its health counts only when the process that was
started holds the port, and its leader ends what the server leaves behind.

``spawn.free_port`` probes and releases, so between the pick and the server's bind another process can
take the port. The fresh-clone CI of 2789b4f lost ``sao train`` that way: the engine's health check
reached a non-HTTP server on the engine's port and raised ``http.client.BadStatusLine``. A squatter
that answers ``/health`` with 200 is worse: the start returned at once, pointing at somebody else's
server. Both squatters here sit on the port a small HTTP server is asked to take; it waits before it
binds (as SGLang loads its model first), dies on the clash, and is restarted on a fresh port.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sao_megatron.rollout import server_session
from sao_megatron.rollout.engine import _ServerProcess
from sao_megatron.rollout.server_session import listening_sockets, session_listens, session_pids
from tests.rollout.engine_fixtures import squatter

SERVER = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))  # a server that loads before it binds, as SGLang does
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ours")
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class SlowServer(_ServerProcess):
    kind = "test server"

    def __init__(self, port: int, log_path: str, delay_s: float = 1.0):
        super().__init__("127.0.0.1", port, log_path, startup_timeout_s=60.0)
        self.delay_s = delay_s

    def _command(self) -> list[str]:
        return [sys.executable, "-c", SERVER, str(self.port), str(self.delay_s)]

    def body(self) -> bytes:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
            return response.read()


def _serve(sock: socket.socket, answer) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            answer(conn)


@pytest.fixture
def binary_squatter() -> Iterator[int]:
    """A port held by a server of another protocol: it answers any request with binary bytes."""
    sock = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket) -> None:
        conn.recv(4096)
        conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\xff\xff@\x00\x01\x00")

    threading.Thread(target=_serve, args=(sock, answer), daemon=True).start()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.fixture
def healthy_squatter() -> Iterator[int]:
    """A port held by another HTTP server whose ``/health`` answers 200 (another run's engine)."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"theirs")

        def log_message(self, *args):
            pass

    with squatter(Health) as port:
        yield port


@pytest.mark.parametrize("holder", ["binary_squatter", "healthy_squatter"])
def test_a_server_whose_port_was_taken_is_restarted_on_a_fresh_one_whatever_holds_it(holder, request, tmp_path, caplog):
    taken = request.getfixturevalue(holder)
    server = SlowServer(taken, str(tmp_path / "server.log"))
    with server:
        assert server.port != taken, f"took the squatter on {taken} for the server"
        assert server.serves_port() and server.body() == b"ours"
    assert f"port {taken} was taken; restarting on {server.port}" in caplog.text


def test_a_binary_answer_is_not_healthy(binary_squatter):
    assert not _ServerProcess("127.0.0.1", binary_squatter, None, 1.0).healthy()


class _Unreadable(type(Path())):
    """``Path`` under which no ``/proc/PID/fd`` can be listed (a server that dropped privileges)."""

    def iterdir(self):
        if self.name == "fd":
            raise PermissionError(13, "Permission denied", str(self))
        return super().iterdir()


def test_the_listener_of_a_port_is_found_in_its_session_only(monkeypatch):
    """Where no member's descriptors can be read, ownership cannot be told: the check gives way (the
    health answer decides, as before it) instead of failing every start at its timeout."""
    listener = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys; s = socket.create_server(('127.0.0.1', 0)); "
            "print(s.getsockname()[1], flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert listener.stdout is not None
        port = int(listener.stdout.readline())
        assert listening_sockets(port)
        assert session_listens(listener.pid, port)
        assert not session_listens(os.getsid(0), port)  # ours is another session
        with monkeypatch.context() as patch:
            patch.setattr(server_session, "Path", _Unreadable)
            assert session_listens(listener.pid, port)
            assert not session_listens(2**22 + 1, port)  # above pid_max: a session with no member
    finally:
        assert listener.stdin is not None
        listener.stdin.close()
        listener.wait(timeout=10)
    assert listening_sockets(port) == set() and not session_listens(listener.pid, port)


class Command(_ServerProcess):
    def __init__(self, code: str, log_path: str):
        super().__init__("127.0.0.1", 0, log_path, startup_timeout_s=60.0)
        self.code = code

    def _command(self) -> list[str]:
        return [sys.executable, "-c", self.code]


LEAVES_A_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
sys.exit(3)
"""


def test_a_server_that_exits_leaves_nothing_in_its_session_and_its_status_is_the_leaders(tmp_path):
    """A server that dies on its own (a port clash, a crash) left its children running; the leader ends
    them and exits with the server's status."""
    server = Command(LEAVES_A_CHILD, str(tmp_path / "server.log")).start()
    assert server.proc is not None
    assert server.proc.wait(timeout=30) == 3
    child = int((tmp_path / "server.log").read_text().split()[0])
    assert child not in session_pids(server.proc.pid) and not session_pids(server.proc.pid)  # gone, or a zombie


def test_stop_ends_the_session_and_the_server_was_signalled(tmp_path):
    server = Command("import time; print(flush=True); time.sleep(60)", str(tmp_path / "server.log")).start()
    assert server.proc is not None
    while not (tmp_path / "server.log").read_text():
        assert server.proc.poll() is None
        time.sleep(0.05)
    members = session_pids(server.proc.pid)
    assert len(members) == 2, members  # the leader and the server
    server.stop()
    assert server.proc.returncode == -signal.SIGTERM
    assert not session_pids(server.proc.pid)


def test_a_leader_that_does_not_lead_its_session_refuses_and_ends_nothing():
    """Run by hand (not in a session of its own) the leader would end its caller's session: it refuses.
    Checked inside a session made for the test, so a failure cannot reach pytest's."""
    outer = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; "
            "sibling = subprocess.Popen(['sleep', '30']); "
            "led = subprocess.run([sys.executable, '-m', 'sao_megatron.rollout.server_session', '1', '--', 'true'], "
            "capture_output=True, text=True); "
            "print(led.returncode, sibling.poll(), flush=True); print(led.stderr, file=sys.stderr); sibling.kill()",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert outer.returncode == 0, outer
    assert outer.stdout.split() == ["2", "None"], outer  # refused; the sibling still runs
    assert "not the leader of its session" in outer.stderr
