"""The weight sync's pieces without an engine: the global bucket order, the gather-ahead thread,
bucket specs, the flat wire format (read back with SGLang's own reader), the store gate, and the
disk strategy against fake engine clients.

The gather streams (``weight_sync/streams.py``) run here on the host, through the same object and
calls as on a GPU; their GPU tests (marked ``gpu``) are skipped without a CUDA device.

The whole protocol against a real engine: ``tests/rollout/test_engine_integration.py`` (one
sender) and ``tests/test_from_hf.py`` (a PP=2 actor: two senders).
"""

import threading
import time

import pytest
import torch

from sao_megatron.config import load_config
from sao_megatron.config.rank import ActorRankConfig
from sao_megatron.models.hf_io import TensorSpec
from sao_megatron.weight_sync import BroadcastSync, BucketSpec, GatherStreams, prefetched, resolve_flat, sync_order
from sao_megatron.weight_sync.streams import Bucket
from tests.distributed import run_distributed


def test_sync_order_interleaves_the_senders_round_robin():
    assert sync_order([3, 1, 2]) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]
    assert sync_order([2]) == [(0, 0), (0, 1)]
    assert sync_order([0, 1]) == [(1, 0)]
    assert sync_order([]) == []


def test_prefetched_runs_one_item_ahead_in_order():
    produced: list[int] = []

    def items():
        for i in range(5):
            produced.append(i)
            yield i

    seen = []
    for i in prefetched(items()):
        time.sleep(0.05)  # the producer gets ahead meanwhile, but by one item at most
        seen.append(i)
        assert len(produced) <= i + 3  # this item, the one queued, the one waiting to be queued
    assert seen == list(range(5)) == produced


def test_prefetched_raises_the_producers_error_after_the_items_before_it():
    def items():
        yield 1
        yield 2
        raise ValueError("gather broke")

    seen = []
    with pytest.raises(ValueError, match="gather broke"):
        for i in prefetched(items()):
            seen.append(i)
    assert seen == [1, 2]
    assert not [t for t in threading.enumerate() if t.name == "weight-sync-gather"]


def _gather_and_send(
    streams: GatherStreams, buckets: int, log: list[str], events: list, gather=None, send=None
) -> list[Bucket]:
    """A sender's loop as ``BroadcastSync._data_plane`` runs it: ``gather`` (default: nothing) then
    a bucket of one tensor of value k, on the gather side; ``send`` (default: nothing) per bucket.
    Each bucket's event goes to ``events``."""
    device = streams.device

    def gathers():
        for k in range(buckets):
            assert streams.on_gather_stream(), f"bucket {k} gathered off the gather stream"
            if gather is not None:
                gather()
            bucket = [(f"w{k}", torch.full((256,), float(k), device=device))]
            log.append(f"gathered {k}")
            yield bucket

    sent = []
    for k, g in enumerate(prefetched(streams.gathered(gathers()))):
        assert not streams.on_gather_stream(), "the sending thread runs on its own stream"
        bucket = streams.ready(g)
        assert f"gathered {k}" in log, f"bucket {k} handed over before its gather"
        events.append(g.event)
        log.append(f"sent {k}")
        if send is not None:
            send()
        sent.append([(n, t.clone()) for n, t in bucket])
    return sent


def test_gather_streams_on_the_host_hand_each_bucket_over_after_its_gather_in_order():
    """The same calls as on a GPU: gathers run with the gather stream current (in the prefetch
    thread), each bucket goes to the sender after its gather, with its event complete, unchanged
    and in order."""
    streams = GatherStreams(torch.device("cpu"))
    log: list[str] = []
    events: list = []
    sent = _gather_and_send(streams, 4, log, events)
    assert len(events) == 4 and all(e.query() for e in events)  # host work is done when recorded
    assert [n for b in sent for n, _ in b] == ["w0", "w1", "w2", "w3"]
    for k, bucket in enumerate(sent):
        torch.testing.assert_close(bucket[0][1], torch.full((256,), float(k)), rtol=0, atol=0)
    for k in range(4):
        assert log.index(f"gathered {k}") < log.index(f"sent {k}")
    assert not streams.on_gather_stream()


@pytest.mark.gpu
def test_gather_streams_on_a_gpu_overlap_the_next_gather_with_this_send_and_send_gathered_values():
    """On a CUDA device: each bucket's values are written after a long kernel on the gather stream,
    so a send that did not wait for the bucket's event would read them unwritten; and gathers of
    bucket k+1 run during the send of bucket k (4 gathers and 4 sends of one kernel each take about
    5 kernels' time, not 8)."""
    device = torch.device("cuda")
    cycles = 100_000_000
    sleep = torch.cuda._sleep  # pyright: ignore[reportAttributeAccessIssue]  # a kernel that spins

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(lambda: sleep(cycles))  # CUDA's start-up out of the measurement
    one = timed(lambda: sleep(cycles))
    log: list[str] = []
    sent: list[Bucket] = []
    streams = GatherStreams(device)
    took = timed(
        lambda: sent.extend(_gather_and_send(streams, 4, log, [], lambda: sleep(cycles), lambda: sleep(cycles)))
    )
    for k, bucket in enumerate(sent):
        torch.testing.assert_close(bucket[0][1].cpu(), torch.full((256,), float(k)), rtol=0, atol=0)
    assert took < 6.5 * one, f"4 gathers and 4 sends took {took / one:.1f} kernels' time: no overlap"


def test_flat_buckets_default_to_nccl_only_and_an_explicit_choice_wins():
    assert resolve_flat(None, "nccl") is True
    assert resolve_flat(None, "gloo") is False
    for backend in ("nccl", "gloo"):
        assert resolve_flat(True, backend) is True
        assert resolve_flat(False, backend) is False
    sync = BroadcastSync(torch.nn.Linear(2, 2), None, engine_tp=1, flat=None, bucket_mb=1)  # type: ignore[arg-type]
    assert (sync.backend, sync.flat) == (("nccl", True) if torch.cuda.is_available() else ("gloo", False))
    assert BroadcastSync(torch.nn.Linear(2, 2), None, engine_tp=1, flat=True, bucket_mb=1).flat  # type: ignore[arg-type]
    cfg = load_config(None, [])
    assert cfg.rollout.weight_sync_flat is None and ActorRankConfig.of(cfg).sync_flat is None  # resolved at start


def test_bucket_spec_is_flat_when_asked_and_of_one_dtype():
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.bfloat16)
    assert BucketSpec.of([("a", a), ("a2", a)]) == BucketSpec(["a", "a2"], ["float32", "float32"], [[2, 3], [2, 3]])
    assert BucketSpec.of([("a", a), ("a2", a)], flat=True).flat
    assert not BucketSpec.of([("a", a), ("a2", a)]).flat
    assert not BucketSpec.of([("a", a), ("b", b)], flat=True).flat  # mixed dtypes: tensor by tensor
    planned = [TensorSpec("a", (2, 3), torch.float32), TensorSpec("a2", (2, 3), torch.float32)]
    assert BucketSpec.planned(planned, flat=True) == BucketSpec.of([("a", a), ("a2", a)], flat=True)


def _flat_round_trip(rank, world):
    """Rank 0 sends mixed-shape float32 and (separately) bfloat16 buckets flat; rank 1 reads them
    with SGLang's FlattenedTensorBucket, as an engine does."""
    import torch.distributed as dist

    from sao_megatron.weight_sync import WeightSync

    g = torch.Generator().manual_seed(0)
    buckets = [
        [
            ("w", torch.randn(3, 5, generator=g)),
            ("b", torch.randn(7, generator=g)),
            ("s", torch.randn(1, generator=g)),
        ],
        [
            ("h", torch.randn(4, 2, generator=g).to(torch.bfloat16)),
            ("o", torch.randn(3, generator=g).bfloat16()),
        ],
    ]
    if rank == 0:
        sync = WeightSync([], group_name="test", flat=True)
        sync.group = dist.group.WORLD
        return [sync.send(b) for b in buckets]
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    out = []
    for bucket in buckets:
        spec = BucketSpec.of(bucket, flat=True)
        assert spec.flat
        received = FlattenedTensorBucket.empty(spec.names, spec.dtypes, spec.shapes, torch.device("cpu"))
        dist.broadcast(received.get_flattened_tensor(), src=0)
        got = dict(received.reconstruct_tensors())
        out.append(all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in bucket))
    return out


def test_a_flat_bucket_is_what_sglangs_reader_expects():
    sent, read = run_distributed(_flat_round_trip, 2, timeout_s=120)
    assert sent == [(15 + 7 + 1) * 4, (8 + 3) * 2] and read == [True, True]


def _gate_store():
    from datetime import timedelta

    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public API

    return TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))


def test_gate_releases_each_bucket_to_a_sender_waiting_in_another_thread_of_the_same_process():
    """Rank 0 coordinates on its event loop while its own sender waits on another thread: one
    blocking get on a shared store connection would hold it until the store's timeout."""
    from sao_megatron.weight_sync import SyncGate

    store = _gate_store()
    gate = SyncGate(store).next_update(1)
    seen: list[tuple[int, bool, float]] = []

    def sender():
        if gate.started() is None:
            for k in range(3):
                seen.append((k, gate.wait(0, k), time.monotonic()))

    thread = threading.Thread(target=sender)
    thread.start()
    gate.start()
    released = []
    for k in range(2):
        time.sleep(0.2)
        released.append(time.monotonic())
        gate.release(0, k)
    time.sleep(0.2)
    gate.stop([(0, 2)])
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert [(k, ok) for k, ok, _ in seen] == [(0, True), (1, True), (2, False)]
    assert all(t >= r for (_, _, t), r in zip(seen, released, strict=False))  # not before its release
    assert not any(store.check([f"sao_weight_sync/1/go/0/{k}"]) for k in range(3))  # deleted once read


def test_gate_carries_skip_ready_failed_and_done_between_two_ranks_gates():
    from sao_megatron.weight_sync import SyncGate

    store = _gate_store()
    coordinator, rank1 = SyncGate(store).next_update(7), SyncGate(store).next_update(7)
    coordinator.start("EngineError: /begin_weight_update refused")
    assert rank1.started() == "EngineError: /begin_weight_update refused"
    rank1.ready(1, 0)
    rank1.failed(1, 1, "trainer rank 1 (stage 1): gloo: connection closed")
    assert coordinator.wait_ready(1, 0) is None
    assert coordinator.wait_ready(1, 1) == "trainer rank 1 (stage 1): gloo: connection closed"
    assert not store.check(["sao_weight_sync/7/ready/1/0"])  # deleted once read
    coordinator.formed(0)
    rank1.wait_formed(0)
    coordinator.done()
    rank1.wait_done()
    assert not store.check(["sao_weight_sync/8/start"])  # the next update has keys of its own


class _DiskEngine:
    """An engine client that records ``update_weights_from_disk`` calls into a shared log."""

    def __init__(self, name: str, log: list[tuple]):
        self.name, self.log = name, log

    async def update_weights_from_disk(self, model_path: str, version: str) -> dict:
        self.log.append((self.name, model_path, version))
        return {"success": True}


def test_disk_sync_exports_then_every_engine_loads_the_export_under_the_version(tmp_path):
    import asyncio
    from types import SimpleNamespace

    from sao_megatron.weight_sync import sync_from_disk

    log: list[tuple] = []

    async def export(out_dir):
        log.append(("export", str(out_dir)))
        return SimpleNamespace(tensors=3, bytes=12, seconds=0.25)

    engines = [_DiskEngine("engine0", log), _DiskEngine("engine2", log)]
    metrics = asyncio.run(sync_from_disk(export, tmp_path / "policy", engines, 7))  # type: ignore[arg-type]
    assert metrics == {"time/sync_s": 0.25}
    policy = str(tmp_path / "policy")
    assert log[0] == ("export", policy)
    assert sorted(log[1:]) == [("engine0", policy, "7"), ("engine2", policy, "7")]


def test_disk_sync_asks_no_engine_to_load_when_the_export_fails(tmp_path):
    import asyncio

    from sao_megatron.weight_sync import sync_from_disk

    log: list[tuple] = []

    async def export(out_dir):
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        asyncio.run(sync_from_disk(export, tmp_path, [_DiskEngine("engine0", log)], 1))  # type: ignore[arg-type]
    assert log == []


def test_a_sync_groups_watchdog_never_sees_a_bucket_late_under_nccl():
    """Under NCCL the group's timeout is past the sender's wait (both count from the enqueue), so the
    wait aborts first and the watchdog raises no process-wide dump signal (transport._UNWATCHED);
    under gloo it is the bucket's own."""
    from sao_megatron.weight_sync.transport import group_timeout_s

    for backend in ("nccl", "strict_nccl"):
        assert group_timeout_s(120.0, backend) == 300.0 and group_timeout_s(5.0, backend) > 2 * 5.0
    assert group_timeout_s(120.0, "gloo") == 120.0
