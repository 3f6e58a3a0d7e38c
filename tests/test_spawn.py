"""``spawn.run_world``: the world's rendezvous cannot be taken by another process, and a hang
fails at its timeout with every rank's Python stacks (where it hung)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sao_megatron import spawn
from sao_megatron.spawn import WorldTimeout, run_world


def _sum_of_ranks(rank: int, world_size: int) -> int:
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return int(x.item())


def _rank_0_waits_for_an_event() -> None:
    threading.Event().wait()


def _rank_1_sleeps() -> None:
    time.sleep(3600)


def _hang(rank: int, world_size: int) -> None:
    """Each rank stuck in a function of its own (outside any collective, whose timeout would end it)."""
    (_rank_1_sleeps if rank else _rank_0_waits_for_an_event)()


def test_a_world_never_uses_a_probed_port_another_process_may_take(monkeypatch) -> None:
    """Every port ``free_port`` would hand out is taken by another process first: the world still
    meets, because its store binds a port of its own choosing while it holds it."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        monkeypatch.setattr(spawn, "free_port", lambda: squatter.getsockname()[1])
        assert run_world(_sum_of_ranks, 2, backend="gloo", timeout_s=120) == [1, 1]


def test_a_hung_world_fails_at_its_timeout_naming_where_each_rank_waits() -> None:
    """One line (a CLI prints it as is) naming a file with every rank's stacks (also on the error)."""
    t0 = time.monotonic()
    with pytest.raises(WorldTimeout) as err:
        run_world(_hang, 2, backend="gloo", timeout_s=20)
    assert time.monotonic() - t0 < 60  # the timeout, the stacks' dump, the kill
    message = str(err.value)
    assert message.startswith("_hang on 2 ranks exceeded 20 s; the ranks' Python stacks then: "), message
    assert "\n" not in message
    path = Path(message.rsplit(": ", 1)[1])
    try:
        assert path.read_text() == err.value.stacks
    finally:
        path.unlink()
    rank0, rank1 = err.value.stacks.split("--- rank 1 stacks ---")
    assert rank0.startswith("--- rank 0 stacks ---")
    assert "in _rank_0_waits_for_an_event" in rank0 and "_rank_1_sleeps" not in rank0, rank0
    assert "in _rank_1_sleeps" in rank1 and "_rank_0_waits" not in rank1, rank1


def _context(rank: int, world_size: int) -> list:
    import os

    print(f"rank {rank} says hello", flush=True)
    return [os.environ.get("SAO_TEST_CALLER_VALUE"), os.getcwd()]


@pytest.mark.parametrize("method", spawn.START_METHODS)
def test_a_rank_sees_the_callers_environment_directory_and_output_now(method, monkeypatch, tmp_path, capfd) -> None:
    """A forked rank (from a server started before this test) gets what a spawned one does: the
    caller's environment, working directory and stdout as they are when the world starts."""
    monkeypatch.setenv(spawn.START_METHOD_ENV, method)
    run_world(_sum_of_ranks, 2, backend="gloo", timeout_s=120)  # the server, if any, starts before the changes
    monkeypatch.setenv("SAO_TEST_CALLER_VALUE", f"set after the server started ({method})")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    results = run_world(_context, 2, backend="gloo", timeout_s=120)
    assert results == [[f"set after the server started ({method})", str(tmp_path)]] * 2
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out


def test_an_unknown_start_method_is_refused_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(spawn.START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="SAO_WORLD_START_METHOD='fork': use one of spawn, forkserver"):
        run_world(_sum_of_ranks, 2, backend="gloo", timeout_s=120)


def _threads(rank: int, world_size: int) -> int:
    return torch.get_num_threads()


@pytest.mark.parametrize("method", spawn.START_METHODS)
def test_a_rank_computes_on_one_thread_unless_the_caller_says_otherwise(method, monkeypatch) -> None:
    """Ranks share the node's cores with each other (a conversion world, a CPU learner): one torch
    thread each, or the caller's ``OMP_NUM_THREADS``, however the rank was started."""
    monkeypatch.setenv(spawn.START_METHOD_ENV, method)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert run_world(_threads, 2, backend="gloo", timeout_s=120) == [1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert run_world(_threads, 2, backend="gloo", timeout_s=120) == [3, 3]
