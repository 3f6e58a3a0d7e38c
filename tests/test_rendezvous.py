"""Rendezvous that cannot hang: a port collision injected into each rendezvous is either avoided
or fails within its timeout with an error naming the endpoint.

* role worlds and the weight-sync group: rank 0's store binds a port the OS picks while the
  store holds it (no probe-and-release), so a collision cannot happen; forcing a taken port, or
  joining a store nobody opened, fails at once / within the timeout, naming host:port;
* the weight-sync group fails before any engine is asked to join when its store cannot open;
* spawned worlds (``spawn.run_world``): the parent holds the store, ranks join it: ``tests/test_spawn.py``;
* SGLang engines (HTTP ports picked by probe-and-release) restart on a fresh port when theirs was
  taken: ``tests/rollout/test_engine_integration.py::test_an_engine_whose_port_was_taken_restarts_on_a_fresh_one``.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from sao_megatron.parallel import RendezvousError, join_store, open_store
from sao_megatron.weight_sync import WeightSync


@pytest.fixture
def taken_port():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        yield squatter.getsockname()[1]


def test_a_store_on_port_0_never_collides_and_holds_its_port():
    stores = [open_store("127.0.0.1", 2) for _ in range(20)]  # each binds while choosing
    ports = [s.port for s in stores]
    assert len(set(ports)) == 20
    with socket.socket() as probe, pytest.raises(OSError):
        probe.bind(("127.0.0.1", ports[0]))  # held: nobody else can take it


def test_a_taken_port_fails_at_once_naming_the_endpoint(taken_port):
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{taken_port} \(.*in use.*another process holds"):
        open_store("127.0.0.1", 2, taken_port)
    assert time.monotonic() - t0 < 2


def test_joining_a_store_nobody_opened_fails_within_its_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"no rendezvous store answered at 127\.0\.0\.1:{port} within 2 s"):
        join_store("127.0.0.1", port, 2, timeout_s=2)
    assert time.monotonic() - t0 < 15  # torch retries once within the timeout budget


def test_the_weight_sync_group_fails_before_any_engine_is_asked(taken_port):
    with socket.socket() as engine:  # an "engine" that would hang any request made to it
        engine.bind(("127.0.0.1", 0))
        engine.listen()
        url = f"http://127.0.0.1:{engine.getsockname()[1]}"
        sync = WeightSync([url], master_address="127.0.0.1", master_port=taken_port)
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{taken_port}"):
            asyncio.run(asyncio.wait_for(sync.connect(), timeout=10))
        assert time.monotonic() - t0 < 2
        engine.settimeout(0.1)
        with pytest.raises(TimeoutError):
            engine.accept()  # the engine was never contacted
