"""The strict NCCL-contract backend: each rule fires, in spawned two-rank worlds.

Every world here is made by ``parallel.init_distributed`` as a run makes it (the world bound to the
rank's device), so what the rules see is what the project's code does."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from sao_megatron.runtime import strict_nccl
from sao_megatron.spawn import WorldFailed, run_world

STRICT = strict_nccl.NAME


def _store():
    return dist.distributed_c10d._get_default_store()


def _root_broadcast_returns_before_the_peer_joins(rank: int, world: int) -> list[float]:
    """The root's broadcast returns while the other rank has not called it yet (rank 1 waits for the
    root's word that it returned): under gloo this deadlocks, under NCCL it is an enqueue."""
    store = _store()
    t = torch.arange(4, dtype=torch.float32) if rank == 0 else torch.zeros(4)
    if rank == 0:
        work = dist.broadcast(t, src=0, async_op=True)
        assert not work.is_completed()  # nobody received yet
        dist.broadcast(torch.ones(2), src=0)  # synchronous call: still only an enqueue on the root
        store.set("root_returned", "1")
        work.wait()
    else:
        store.wait(["root_returned"], timedelta(seconds=60))
        dist.broadcast(t, src=0)  # reads the result: blocks until it arrives
        second = torch.zeros(2)
        dist.broadcast(second, src=0)
        assert second.tolist() == [1.0, 1.0]
    dist.barrier()
    return t.tolist()


def test_ops_enqueue_and_return_at_once_where_the_rank_reads_no_result():
    got = run_world(_root_broadcast_returns_before_the_peer_joins, 2, backend=STRICT, timeout_s=120)
    assert got == [[0.0, 1.0, 2.0, 3.0]] * 2


def _inputs_are_taken_at_the_call(rank: int, world: int) -> list[float]:
    """A send returns at once; the host changing the tensor afterwards does not change what is sent
    (the stream orders that write after the send)."""
    store = _store()
    if rank == 0:
        t = torch.full((3,), 7.0)
        dist.send(t, dst=1)
        t.fill_(-1.0)
        store.set("overwritten", "1")
        dist.barrier()  # completes after the send (one group's ops complete in order)
        return t.tolist()
    store.wait(["overwritten"], timedelta(seconds=60))
    out = torch.zeros(3)
    dist.recv(out, src=0)
    dist.barrier()
    return out.tolist()


def test_a_send_returns_before_its_receiver_and_sends_the_values_of_the_call():
    got = run_world(_inputs_are_taken_at_the_call, 2, backend=STRICT, timeout_s=120)
    assert got[1] == [7.0, 7.0, 7.0]


def _wait_with_a_timeout_raises_and_aborts(rank: int, world: int) -> str:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=300))
    if rank == 1:
        _store().wait(["done"], timedelta(seconds=120))
        return ""
    work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=1))
    except dist.DistBackendError as err:
        message = str(err)
    else:
        message = "no error"
    try:  # aborted: the next op on the group fails at the call
        dist.all_reduce(torch.ones(2), group=group)
    except dist.DistBackendError as err:
        message += " | next: " + str(err)
    _store().set("done", "1")
    return message


def test_wait_with_a_timeout_blocks_then_raises_and_aborts_the_group():
    message = run_world(_wait_with_a_timeout_raises_and_aborts, 2, backend=STRICT, timeout_s=120)[0]
    assert "Watchdog caught collective operation timeout" in message and "ALLREDUCE" in message
    assert "next:" in message and "aborted" in message


def _watchdog(rank: int, world: int, handling: str) -> str:
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = handling  # read by each group at construction
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    if rank == 1:
        _store().wait(["done"], timedelta(seconds=120))
        return "peer"
    work = dist.all_reduce(torch.ones(1), group=group, async_op=True)  # rank 1 never joins
    deadline = time.monotonic() + 60
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome = "completed" if work.is_completed() else "pending"
    try:
        work.wait()
    except dist.DistBackendError as err:
        outcome += f": {err}"
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except dist.DistBackendError as err:
        outcome += f" | next: {err}"
    _store().set("done", "1")
    return outcome


def test_the_watchdog_takes_the_process_down_at_the_groups_timeout_by_default():
    with pytest.raises(WorldFailed, match="SIGABRT"):
        run_world(_watchdog, 2, "3", backend=STRICT, timeout_s=120)


def test_the_watchdog_aborts_the_group_without_killing_under_handling_2():
    """The pending op then completes without an error (NCCL: an aborted communicator's work is
    complete); the next op on the group raises at its call."""
    outcome = run_world(_watchdog, 2, "2", backend=STRICT, timeout_s=120)[0]
    assert outcome.startswith("completed | next:") and "aborted" in outcome, outcome


def _side_group_with_a_peer_that_dies(rank: int, world: int, backend: str) -> str:
    """This rank and an outside process form a group; the outside one exits; this rank then waits
    3 s on a broadcast from it."""
    import multiprocessing as mp

    from sao_megatron.parallel import open_store, resolve_backend
    from sao_megatron.weight_sync.transport import new_group

    resolve_backend(backend)
    store = open_store("127.0.0.1", 2)
    peer = mp.get_context("spawn").Process(target=_dying_member, args=(store.port, backend), daemon=True)
    peer.start()
    group = new_group(backend, store, 2, 0, "side", timeout_s=300)
    peer.join(60)
    t0 = time.monotonic()
    work = dist.broadcast(torch.ones(1), src=1, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=3))
    except Exception as err:
        return f"{time.monotonic() - t0:.1f}|{type(err).__name__}: {err}"
    return "completed"


def _dying_member(port: int, backend: str) -> None:
    from sao_megatron.parallel import join_store, resolve_backend
    from sao_megatron.weight_sync.transport import new_group

    resolve_backend(backend)
    strict_nccl.set_device(1)  # another GPU than the world's rank
    store = join_store("127.0.0.1", port, 2)
    new_group(backend, store, 2, 1, "side", timeout_s=300)
    os._exit(0)  # no goodbye: its sockets close


def test_an_op_whose_peer_died_hangs_until_the_timeout_where_gloo_fails_at_once():
    strict = run_world(_side_group_with_a_peer_that_dies, 1, STRICT, backend="gloo", timeout_s=120)[0]
    seconds, message = strict.split("|", 1)
    assert "Watchdog caught collective operation timeout" in message and float(seconds) >= 2.9, strict
    gloo = run_world(_side_group_with_a_peer_that_dies, 1, "gloo", backend="gloo", timeout_s=120)[0]
    assert "timed out" not in gloo and gloo != "completed", gloo  # gloo: the closed connection, at once


def _side_group(backend: str, store, world_size: int, rank: int, name: str, split: bool):
    """A group outside the world, made as ``weight_sync.transport.new_group`` made it at 27cb784
    (``split``: torch's helper with the world bound, which splits) or as it makes it now."""
    from torch.distributed.distributed_c10d import GroupName, PrefixStore, _new_process_group_helper

    from sao_megatron.weight_sync.transport import new_group

    if not split:
        return new_group(backend, store, world_size, rank, name, timeout_s=30)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        PrefixStore(name, store),
        group_name=GroupName(name),
        timeout=timedelta(seconds=30),
    )
    return group


def _split_outside_the_world(rank: int, world: int, split: bool) -> str:
    """A side group whose other member is outside the bound world (an engine's rank)."""
    import multiprocessing as mp

    from sao_megatron.parallel import open_store

    store = open_store("127.0.0.1", 2)
    peer = mp.get_context("spawn").Process(target=_outside_member, args=(store.port, split), daemon=True)
    peer.start()
    try:
        group = _side_group(STRICT, store, 2, 0, "side", split)
    except strict_nccl.NcclWouldHang as err:
        peer.join(60)
        return str(err)
    dist.broadcast(torch.ones(2), src=0, group=group)
    peer.join(60)
    return "formed" if peer.exitcode == 0 else f"peer exit {peer.exitcode}"


def _outside_member(port: int, split: bool) -> None:
    from sao_megatron.parallel import join_store

    strict_nccl.register()
    strict_nccl.set_device(1)
    store = join_store("127.0.0.1", port, 2)
    try:
        group = _side_group(STRICT, store, 2, 1, "side", split)
    except strict_nccl.NcclWouldHang:
        return
    t = torch.zeros(2)
    group.broadcast([t], dist.BroadcastOptions()).wait()
    assert t.tolist() == [1.0, 1.0]


def test_a_group_split_from_the_bound_world_with_members_outside_it_fails_naming_the_call_site(monkeypatch):
    monkeypatch.setenv(strict_nccl.SPLIT_WAIT_ENV, "5")
    got = run_world(_split_outside_the_world, 1, True, backend=STRICT, timeout_s=120)[0]
    assert "NCCL would hang here" in got and "splitting the bound world" in got
    assert "test_strict_nccl.py" in got  # the call site


def test_the_weight_syncs_side_group_is_made_without_splitting_the_bound_world(monkeypatch):
    monkeypatch.setenv(strict_nccl.SPLIT_WAIT_ENV, "5")
    assert run_world(_split_outside_the_world, 1, False, backend=STRICT, timeout_s=120) == ["formed"]


def _splits_in_different_orders(rank: int, world: int) -> str:
    order = [[0], [1]] if rank == 0 else [[1], [0]]
    try:
        for ranks in order:
            dist.new_group(ranks)
    except strict_nccl.NcclWouldHang as err:
        return str(err)
    return "formed"


def test_splits_taken_in_different_orders_fail_on_a_member():
    got = run_world(_splits_in_different_orders, 2, backend=STRICT, timeout_s=120)
    assert any("different orders" in g for g in got), got


def _split_a_peer_never_joins(rank: int, world: int) -> str:
    if rank == 1:
        _store().wait(["done"], timedelta(seconds=120))
        return ""
    try:
        dist.new_group([0], use_local_synchronization=True)
    except strict_nccl.NcclWouldHang as err:
        return str(err)
    finally:
        _store().set("done", "1")
    return "formed"


def test_a_split_that_a_parent_rank_never_joins_fails_naming_the_missing_rank(monkeypatch):
    monkeypatch.setenv(strict_nccl.SPLIT_WAIT_ENV, "3")
    got = run_world(_split_a_peer_never_joins, 2, backend=STRICT, timeout_s=120)[0]
    assert "parent ranks [1]" in got and "never took part" in got


def _same_device(rank: int, world: int) -> str:
    strict_nccl.set_device(0)
    try:
        dist.new_group([0, 1])
    except strict_nccl.DuplicateDevice as err:
        return str(err)
    return "formed"


def test_two_ranks_of_one_communicator_on_one_device_are_refused():
    got = run_world(_same_device, 2, backend=STRICT, timeout_s=120)
    assert all("duplicate GPU" in g for g in got), got


def _megatron_style_groups(rank: int, world: int) -> list[float]:
    """Every rank makes every group in one order (members split, the others take a no-colour
    split), then the usual collectives run on them."""
    groups = [dist.new_group(r) for r in ([0, 1], [0], [1])]
    mine = groups[0]
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=mine)
    out = torch.zeros(2)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=mine)
    rs = torch.zeros(1)
    dist.reduce_scatter_tensor(rs, torch.tensor([1.0, 2.0]), group=mine)
    a2a = torch.zeros(2)
    dist.all_to_all_single(a2a, torch.tensor([float(rank), float(rank + 10)]), group=mine)
    ops = [
        dist.P2POp(dist.isend, torch.tensor([float(rank)]), 1 - rank),
        dist.P2POp(dist.irecv, got := torch.zeros(1), 1 - rank),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    # Megatron's DDP buckets: coalesced reduce-scatters / all-gathers / all-reduces
    rs2 = [torch.zeros(1), torch.zeros(1)]
    with dist._coalescing_manager(group=mine, async_ops=True) as cm:
        for i, o in enumerate(rs2):
            dist.reduce_scatter_tensor(o, torch.tensor([1.0 + i, 2.0 + i]) * (rank + 1), group=mine, async_op=True)
    cm.wait()
    ag2 = [torch.zeros(2), torch.zeros(2)]
    with dist._coalescing_manager(group=mine, async_ops=True) as cm:
        for i, o in enumerate(ag2):
            dist.all_gather_into_tensor(o, torch.tensor([float(rank + i)]), group=mine, async_op=True)
    cm.wait()
    ar2 = [torch.tensor([1.0 + rank]), torch.tensor([10.0 * (rank + 1)])]
    with dist._coalescing_manager(group=mine, async_ops=True) as cm:
        for o in ar2:
            dist.all_reduce(o, group=mine, async_op=True)
    cm.wait()
    coalesced = [x.tolist() for x in rs2 + ag2 + ar2]
    return [t.item(), *out.tolist(), rs.item(), *a2a.tolist(), got.item(), coalesced]


def test_groups_made_in_one_order_carry_every_collective_as_gloo_does():
    got = run_world(_megatron_style_groups, 2, backend=STRICT, timeout_s=120)
    ref = run_world(_megatron_style_groups, 2, backend="gloo", timeout_s=120)
    assert got == ref


def _groups_leave_no_threads(rank: int, world: int) -> list[int]:
    import threading

    def workers() -> int:
        return sum(t.name.startswith("strict-nccl-") and t.is_alive() for t in threading.enumerate())

    before = workers()
    for _ in range(5):
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1), group=group)
        dist.destroy_process_group(group)
    deadline = time.monotonic() + 30
    while workers() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    return [before, workers()]


def test_a_destroyed_group_ends_its_worker_thread():
    """A world that changes layout many times (the tests' reused worlds) must not grow by a thread
    per group it made."""
    for before, after in run_world(_groups_leave_no_threads, 2, backend=STRICT, timeout_s=120):
        assert after == before, (before, after)
