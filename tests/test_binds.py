"""What the project listens on and what it unpickles.

Servers started on one machine listen on loopback, on a cluster on the node's cluster address;
never on every interface. Rendezvous stores (role worlds, weight sync, spawned worlds) listen
only on the address they are opened with. ``torch.load`` never unpickles objects from a file.
"""

from __future__ import annotations

import ast
import asyncio
import socket
from pathlib import Path

import pytest

import sao_megatron
from sao_megatron.parallel import join_store, open_store
from sao_megatron.rollout.engine import EngineSpec, RouterSpec, _command, _router_command


def _listening(port: int) -> list[str]:
    """Local addresses (``ip``) listening on TCP ``port``, from /proc/net/tcp and tcp6."""
    found = []
    for name, width in (("tcp", 8), ("tcp6", 32)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if width == 8:
                    found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.append(socket.inet_ntop(socket.AF_INET6, words))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_a_store_listens_only_on_the_address_it_is_opened_with():
    store = open_store("127.0.0.1", 2, timeout_s=10)
    assert _listening(store.port) == ["127.0.0.1"]  # PyTorch's own server would listen on '*'
    client = join_store("127.0.0.1", store.port, 2, timeout_s=10)
    client.set("k", "v")
    assert store.get("k") == b"v"
    fixed = open_store("127.0.0.1", 1, port=0, timeout_s=10)
    assert fixed.port not in (0, store.port)


def _args(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == flag]


def test_engines_listen_on_loopback_locally(monkeypatch, tmp_path):
    from sao_megatron.config import load_config
    from sao_megatron.driver import engines

    started: list[EngineSpec] = []

    class FakeProcess:
        def __init__(self, spec: EngineSpec):
            started.append(spec)

        def start(self):
            return self

        def wait_healthy(self) -> float:
            return 0.0

    monkeypatch.setattr(engines, "EngineProcess", FakeProcess)
    cfg = load_config(None, ["rollout.num_engines=2"])
    asyncio.run(engines.start_engines(cfg, tmp_path, tmp_path))
    assert len(started) == 2
    for spec in started:
        cmd = _command(spec, cpu=True)
        assert _args(cmd, "--host") == ["127.0.0.1"] and "0.0.0.0" not in cmd


def test_engines_listen_on_the_node_address_on_a_cluster(monkeypatch):
    import ray

    from sao_megatron.driver.engines import EngineHost

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    host = EngineHost.__ray_metadata__.modified_class(EngineSpec(model_path="m", port=0, nnodes=2))  # pyright: ignore[reportAttributeAccessIssue]  # Ray's wrapped class
    spec = host.spec
    spec.node_rank, spec.dist_init_addr = 0, host.init_address()
    cmd = _command(spec, cpu=False)
    assert _args(cmd, "--host") == ["10.1.2.3"] and "0.0.0.0" not in cmd
    assert _args(cmd, "--dist-init-addr")[0].startswith("10.1.2.3:")


def test_the_router_and_its_metrics_listen_on_loopback_by_default():
    cmd = _router_command(RouterSpec(worker_urls=["http://127.0.0.1:30000"], port=30001), 30002)
    assert _args(cmd, "--host") == ["127.0.0.1"] and _args(cmd, "--prometheus-host") == ["127.0.0.1"]
    assert "0.0.0.0" not in cmd  # the router's own default for metrics


def test_torch_load_never_unpickles_objects():
    """Every ``torch.load`` in the package passes ``weights_only=True`` (plain tensors and data)."""
    root = Path(sao_megatron.__file__).parent
    calls = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                calls.append((f"{path.relative_to(root)}:{node.lineno}", safe))
    assert calls, "no torch.load found: the scan is broken"
    assert [where for where, safe in calls if not safe] == []
