"""A multi-node engine's nodes meet at a port of node 0 chosen probe-and-release: when another
process took it first, every node starts again meeting at a new address (restarting node 0
alone retried the taken port, and the other nodes waited on it)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from sao_megatron import spawn
from sao_megatron.driver import engines as engines_mod
from sao_megatron.driver.engines import EngineHost, RemoteEngine
from sao_megatron.rollout.engine import EngineSpec, EngineStartError

HostClass = EngineHost.__ray_metadata__.modified_class  # pyright: ignore[reportAttributeAccessIssue]  # Ray's wrapped class


class MeetingPortServer:
    """Stands in for a node's SGLang server: node 0 binds the meeting port (SGLang's TCP store
    does) and exits on a clash, as the real one does, "address already in use" in its log."""

    launches: list[tuple[int, str, int]] = []
    solo_retries: list[int] = []
    """Node ranks whose server would have retried a clash by itself (``EngineProcess.wait_healthy``
    restarts it alone on a new HTTP port, at the same meeting port)."""

    def __init__(self, spec: EngineSpec):
        self.spec, self.sock, self.clashed = spec, None, False
        self.port_retries = 3

    def start(self) -> MeetingPortServer:
        self.launches.append((self.spec.node_rank, self.spec.dist_init_addr, self.spec.port))
        if self.spec.node_rank == 0:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", int(self.spec.dist_init_addr.rsplit(":", 1)[1])))
                sock.listen()
                self.sock = sock
            except OSError:
                sock.close()
                self.clashed = True
        return self

    def alive(self) -> bool:
        return not self.clashed

    def _port_clash(self) -> bool:
        return self.clashed

    def wait_healthy(self) -> float:
        if self.clashed:
            if self.port_retries:
                self.solo_retries.append(self.spec.node_rank)
            raise EngineStartError("exited with 1; log: address already in use")
        return 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Remote:
    """An :class:`EngineHost` whose calls run here: ``host.method.remote(...)`` returns the value."""

    def __init__(self, host):
        self.host = host

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self.host, name))


def test_a_taken_meeting_port_starts_every_node_again_meeting_elsewhere(monkeypatch):
    monkeypatch.setattr(engines_mod.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(engines_mod, "EngineProcess", MeetingPortServer)
    MeetingPortServer.launches, MeetingPortServer.solo_retries = [], []
    hosts = [HostClass(EngineSpec(model_path="m", port=0)) for _ in range(2)]
    first_port = hosts[0].spec.port
    monkeypatch.setattr(engines_mod, "ray", SimpleNamespace(get=lambda value, timeout=None: value))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])  # the first meeting port handed out is already taken
        monkeypatch.setattr(engines_mod, "free_port", lambda: next(ports, None) or spawn.free_port())
        engine = RemoteEngine.__new__(RemoteEngine)
        engine._launch_on([Remote(h) for h in hosts])
        engine.wait_healthy()
    (r0, a0, _), (r1, a1, _), (r2, a2, p2), (r3, a3, _) = MeetingPortServer.launches
    assert (r0, r1, r2, r3) == (0, 1, 0, 1) and MeetingPortServer.solo_retries == []
    assert a0 == a1 == f"127.0.0.1:{taken}"  # both nodes were told the taken port
    assert a2 == a3 != a0  # then both meet at a new one
    assert p2 != first_port and engine.url == f"http://127.0.0.1:{p2}"  # node 0 serves on a new port too
    hosts[0].stop()


def test_a_failure_other_than_a_clash_is_not_retried(monkeypatch):
    monkeypatch.setattr(engines_mod.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(engines_mod, "EngineProcess", MeetingPortServer)
    MeetingPortServer.launches = []
    hosts = [HostClass(EngineSpec(model_path="m", port=0)) for _ in range(2)]
    monkeypatch.setattr(engines_mod, "ray", SimpleNamespace(get=lambda value, timeout=None: value))
    engine = RemoteEngine.__new__(RemoteEngine)
    engine._launch_on([Remote(h) for h in hosts])

    def out_of_memory(self) -> float:
        raise EngineStartError("exited with 1; log: CUDA out of memory")

    monkeypatch.setattr(MeetingPortServer, "wait_healthy", out_of_memory)
    with pytest.raises(EngineStartError, match="out of memory"):
        engine.wait_healthy()
    assert len(MeetingPortServer.launches) == 2
    hosts[0].stop()
