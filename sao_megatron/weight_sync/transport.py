"""The broadcast transport: one sender's group to every engine (:class:`WeightSync`), the engines'
control plane of one update (:class:`EngineControl`), what an engine is told about a bucket
(:class:`BucketSpec`) and the order the buckets travel in (:func:`sync_order`). The protocol:
:mod:`sao_megatron.weight_sync`."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import Store  # pyright: ignore[reportPrivateImportUsage]  # public API

from sao_megatron.faults import kill_point
from sao_megatron.parallel import open_store
from sao_megatron.rollout.client import EngineClient, EngineError
from sao_megatron.runtime.strict_nccl import is_nccl_like

log = logging.getLogger(__name__)


@dataclass
class SyncReport:
    version: int
    tensors: int
    bytes: int
    seconds: float
    paused_s: float = 0.0
    """How long the engines stopped generating: from the pause request to the resume's answer."""
    caches_kept: int = 0
    """Engines whose prefix cache the sync did not flush (``in_place`` with requests running)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class SyncAborted(RuntimeError):
    """A bucket's broadcast failed or did not complete within ``rollout.weight_sync_timeout_s``; the
    sender aborted its group. Every engine of that group may still wait in (NCCL: hold a kernel of)
    a collective that never completes, so the run restarts them all (docs/training.md)."""


_UNWATCHED = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""What a weight-sync group's ``ProcessGroupNCCL`` reads from the environment when it is built: no
async error handling (its watchdog does not take the process down on a timeout or an error, which
the sender handles: :meth:`WeightSync.send`) and no dump of its own. Other groups, built before or
after, keep the defaults.

That is not all a timeout would do: on a timeout or an error any group's watchdog raises the
process-wide dump signal, and the first group's (the trainer world's) heartbeat monitor acts on
it, ending the process after ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` unless monitoring is off (read in
a recent ``ProcessGroupNCCL.cpp``: ``Watchdog::runLoop``, ``HeartbeatMonitor::runLoop``; not run on a
GPU). So the group's own timeout is :func:`group_timeout_s`, well past the sender's wait: the wait
aborts the communicator first and the watchdog finds the op ended, not timed out. An error NCCL
reports on the group itself (a remote error) would still raise the signal."""


def group_timeout_s(bucket_timeout_s: float, backend: str) -> float:
    """A weight-sync group's timeout for a sender that waits ``bucket_timeout_s`` for a bucket:
    NCCL-like backends ``2 x + 60`` s, so the sender's ``Work.wait`` (timed from the same enqueue)
    always ends an op before the group's watchdog would see it late (:data:`_UNWATCHED`); gloo the
    bucket's own (its collective timeout frees the worker thread, which an abort's destructor joins)."""
    return 2 * bucket_timeout_s + 60 if is_nccl_like(backend) else bucket_timeout_s


_env_lock = threading.Lock()


def new_group(
    backend: str, store: Store, world_size: int, rank: int, group_name: str, timeout_s: float = 300.0
) -> dist.ProcessGroup:
    """A process group outside the default world (SGLang engines join it from their side).

    torch has no public API for a second, independent world in one process; this builds it
    from a TCP store the same way ``init_process_group`` does, under a prefix of its own. Under
    NCCL it is built with :data:`_UNWATCHED` set: torch reads those per group, at construction,
    and has no per-group option for them (``ProcessGroupNCCL.Options`` carries none).

    It is never split from this process's world. A world bound to its device (``parallel.py``
    passes ``device_id`` for NCCL, which ends the one-GPU funnel) makes torch 2.14's
    ``_new_process_group_helper`` hand the world's communicator to the new group as ``split_from``
    (``ncclCommSplit``), a collective of the whole world whose other ranks never join it and whose
    engine members are not in it: the first sync hung there. The default group is unbound while
    this group is made (NeMo-RL does the same around its side group), so NCCL makes it from the
    store (``ncclCommInitRank``) with exactly its own members. Meanwhile no other thread of this
    process may make a group or run a barrier on the world (torch reads the binding there): the
    senders form their groups in ``WeightSync.connect`` while their rank does nothing else with
    ``torch.distributed``.

    Unbound, NCCL makes the group's communicator at its first op (a lazy ``ncclCommInitRank``), so a
    sender's first broadcast blocks until every engine rank has joined, with no timeout: an engine
    that dies between joining and the first bucket would hold that sender's thread (a GPU risk,
    noted in docs/training.md; not reproduced by ``strict_nccl``, which connects at once).
    """
    from torch.distributed.distributed_c10d import GroupName, PrefixStore, _new_process_group_helper, _world

    prefixed = PrefixStore(group_name, store)
    world = _world.default_pg if dist.is_initialized() else None
    with _env_lock:
        saved = {k: os.environ.get(k) for k in _UNWATCHED}
        bound = world.bound_device_id if world is not None else None
        if is_nccl_like(backend):
            os.environ.update(_UNWATCHED)
        if world is not None:
            world.bound_device_id = None
        try:
            group, _ = _new_process_group_helper(
                world_size,
                rank,
                [],
                dist.Backend(backend),
                prefixed,
                group_name=GroupName(group_name),
                timeout=timedelta(seconds=timeout_s),
            )
        finally:
            if world is not None:
                world.bound_device_id = bound
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    # No global ranks given: the default-group path, which never returns the non-member sentinel.
    group = cast(dist.ProcessGroup, group)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class BucketSpec:
    """What an engine is told about one bucket before it receives it."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    flat: bool = False
    """Sent as one byte buffer: asked for, and one dtype (each tensor's offset a multiple of its size)."""

    @classmethod
    def of(cls, bucket: Sequence[tuple[str, torch.Tensor]], flat: bool = False) -> BucketSpec:
        return cls._make([(n, t.shape, t.dtype) for n, t in bucket], flat)

    @classmethod
    def planned(cls, specs: Iterable, flat: bool = False) -> BucketSpec:
        """From ``hf_io.TensorSpec`` s (``HFWeightStream.bucket_plan``)."""
        return cls._make([(t.name, t.shape, t.dtype) for t in specs], flat)

    @classmethod
    def _make(cls, rows: list, flat: bool) -> BucketSpec:
        dtypes = [_DTYPE_NAMES[d] for _, _, d in rows]
        return cls([n for n, _, _ in rows], dtypes, [list(s) for _, s, _ in rows], flat and len(set(dtypes)) == 1)


def sync_order(buckets_per_sender: Sequence[int]) -> list[tuple[int, int]]:
    """The global order of ``(sender, bucket)``: the senders' buckets interleaved round robin, so
    every sender has its next bucket gathered while the others send."""
    rounds = max(buckets_per_sender, default=0)
    return [(s, k) for k in range(rounds) for s, n in enumerate(buckets_per_sender) if k < n]


def resolve_flat(flat: bool | None, backend: str) -> bool:
    """``rollout.weight_sync_flat`` for ``backend``: an explicit value wins; None (the default) sends
    a bucket as one byte buffer under NCCL (one collective per bucket instead of one per tensor: a
    Qwen3-30B-A3B sync is ~18.9k tensors) and tensor by tensor under gloo, where the flat copy was
    measured slower (docs/PERFORMANCE.md)."""
    return is_nccl_like(backend) if flat is None else flat


def prefetched[T](items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """``items`` produced by a thread of their own, up to ``depth`` ahead of the consumer (the next
    bucket is gathered and converted while this one is sent). The producer's error is raised here;
    the consumer must exhaust the iterator (the producer may be inside a collective)."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce() -> None:
        try:
            for item in items:
                slots.put((item, None))
        except BaseException as err:  # re-raised in the consumer
            slots.put((None, err))
        slots.put((done, None))

    thread = threading.Thread(target=produce, name="weight-sync-gather", daemon=True)
    thread.start()
    while True:
        item, err = slots.get()
        if err is not None:
            thread.join()
            raise err
        if item is done:
            break
        yield item
    thread.join()


UPDATE_POLICIES = ("retract", "in_place", "abort")
"""``rollout.update_policy``: the ``/pause_generation`` mode of a sync (docs/rollout.md)."""


class EngineControl:
    """The control plane of one update, held by the coordinator: pause (in ``policy``'s mode) and
    begin on entry, every bucket's request to every engine (:meth:`load`, which never flushes the
    cache), then on exit end, flush each engine's cache once and resume (end and resume also after
    an error). ``paused_s``: from the pause request to the resume's answer.

    ``policy`` (``rollout.update_policy``): ``retract`` (running requests go back to the engine's
    queue and are prefilled again after the flush), ``in_place`` (they stay in the batch with their
    KV and continue under the new weights; the engine refuses the flush while its batch holds
    requests: :attr:`caches_kept` counts those engines) or ``abort`` (the engine returns them with
    their partial output; the pause answers once none is left, and the agent loop resubmits them).

    ``answer_timeout_s`` (None: the HTTP client's own, 600 s): how long every engine has to answer
    one bucket's request (:meth:`load`), and each request of the exit after an error and of the
    resume (an engine that does not answer is logged and left to the caller's check);
    ``answer_timeout_why`` says in the timeout's message where that bound comes from."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        policy: str = "retract",
        answer_timeout_s: float | None = None,
        answer_timeout_why: str = "",
    ):
        if policy not in UPDATE_POLICIES:
            raise ValueError(f"update policy {policy!r}: use one of {', '.join(UPDATE_POLICIES)}")
        self.clients = [EngineClient(u) for u in engine_urls]
        self.policy = policy
        self.answer_timeout_s, self.answer_timeout_why = answer_timeout_s, answer_timeout_why
        self.paused_s = 0.0
        self.caches_kept = 0
        self._t0 = 0.0

    async def __aenter__(self) -> EngineControl:
        for c in self.clients:
            await c.__aenter__()
        self._t0 = time.perf_counter()
        try:
            await asyncio.gather(*(c.pause(self.policy) for c in self.clients))
            begun = await asyncio.gather(*(c.begin_weight_update() for c in self.clients), return_exceptions=True)
            refused = [r for r in begun if isinstance(r, BaseException)]
            if refused:  # the engines that began end again: each would refuse the next begin
                opened = [c for c, r in zip(self.clients, begun, strict=True) if not isinstance(r, BaseException)]
                await asyncio.gather(*(c.end_weight_update() for c in opened), return_exceptions=True)
                raise refused[0]
        except BaseException:
            await self._resume()
            raise
        return self

    async def load(
        self, group_name: str, spec: BucketSpec, version: int, abandon: asyncio.Future[str] | None = None
    ) -> None:
        """Every engine receives one bucket over ``group_name`` (its sender broadcasts meanwhile).

        The engines' answers are awaited for at most ``answer_timeout_s`` (then TimeoutError naming
        the bucket and the engines that did not answer) and only until ``abandon`` completes (then
        RuntimeError with its result: why the answers will never come, e.g. the sender aborted its
        group). Either way the requests are given up here; an engine may still be inside its load."""
        requests = [
            asyncio.ensure_future(
                c.update_weights_from_distributed(
                    spec.names, spec.dtypes, spec.shapes, group_name, str(version), flush_cache=False, flat=spec.flat
                )
            )
            for c in self.clients
        ]
        answered = asyncio.gather(*requests)  # raises the first engine's error at once
        try:
            done, _ = await asyncio.wait(
                [answered] if abandon is None else [answered, abandon],
                timeout=self.answer_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        except BaseException:  # cancelled (WeightSync.update): so are the requests
            answered.cancel()
            raise
        if answered not in done:
            silent = [c.url for c, r in zip(self.clients, requests, strict=True) if not r.done()]
            answered.cancel()  # and every request not answered yet
            where = f"bucket {spec.names[0]}... ({len(spec.names)} tensors) over group {group_name}"
            if abandon is not None and abandon in done:
                raise RuntimeError(f"{where}: the engines' answers were given up: {abandon.result()}")
            raise TimeoutError(
                f"{where}: engine(s) {' '.join(silent)} did not answer within {self.answer_timeout_s:g} s "
                f"({self.answer_timeout_why})"
            )
        answered.result()
        kill_point("weight_sync:bucket")  # engines hold a partly updated model

    async def __aexit__(self, exc_type, exc, tb) -> None:
        """End the update session, flush the caches and resume. After an error the session is still
        ended and the caches flushed, best effort (an engine refuses the next ``/begin_weight_update``
        while one is open), and the engines resume with a partly updated model until the next update
        (which the driver retries)."""
        failed = exc_type is not None
        bound = self._bounded if failed else _unbounded  # after an error an engine may never answer
        try:
            ended = await asyncio.gather(
                *(bound(c.end_weight_update()) for c in self.clients), return_exceptions=failed
            )
            for url, result in zip((c.url for c in self.clients), ended, strict=True):
                if isinstance(result, BaseException):
                    log.info("engine %s: ending a failed weight update: %s", url, result)
            flushed = await asyncio.gather(*(bound(self._flush(c)) for c in self.clients), return_exceptions=failed)
            for url, result in zip((c.url for c in self.clients), flushed, strict=True):
                if isinstance(result, BaseException):
                    log.info("engine %s: flushing the cache after a failed weight update: %s", url, result)
        finally:
            await self._resume()

    async def _flush(self, client: EngineClient) -> None:
        """One flush of ``client``'s cache. In place, a refusal (requests in the batch) keeps the cache
        (counted); otherwise a refusal is retried (``EngineClient.flush_cache``)."""
        if self.policy != "in_place":
            return await client.flush_cache()
        try:
            await client.flush_cache(retry_s=0)
        except EngineError as err:
            if err.status != 400:
                raise
            self.caches_kept += 1

    async def _bounded[T](self, call: Awaitable[T]) -> T:
        """``call`` within ``answer_timeout_s`` (None: the client's own timeout)."""
        return await asyncio.wait_for(call, self.answer_timeout_s)

    async def _resume(self) -> None:
        resumed = await asyncio.gather(*(self._bounded(c.resume()) for c in self.clients), return_exceptions=True)
        for c, result in zip(self.clients, resumed, strict=True):
            if isinstance(result, BaseException):
                log.warning("engine %s: resuming after a weight update: %s: %s", c.url, type(result).__name__, result)
        self.paused_s = time.perf_counter() - self._t0
        for c in self.clients:
            await c.close()


async def _unbounded[T](call: Awaitable[T]) -> T:
    return await call


class WeightSync:
    """One sender's broadcast group to every engine (it is the group's rank 0), and, for a lone
    sender, the whole update (:meth:`update`)."""

    def __init__(
        self,
        engine_urls: list[str],
        engine_tp: int = 1,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "sao_weight_sync",
        flat: bool = False,
        policy: str = "retract",
        timeout_s: float = 120.0,
    ):
        """``master_port`` 0 (the default): any free port on ``master_address``, bound at connect().
        ``flat``: send a bucket of one dtype as one byte buffer (:class:`BucketSpec`); ``policy``:
        what :meth:`update` does to the engines' running requests (:class:`EngineControl`);
        ``timeout_s``: how long :meth:`send` waits for a bucket (``rollout.weight_sync_timeout_s``)."""
        self.timeout_s = timeout_s
        self.engine_urls = engine_urls
        self.flat = flat
        self.policy = policy
        self.engine_tp = engine_tp
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return 1 + len(self.engine_urls) * self.engine_tp

    async def connect(self) -> None:
        """Form the group: engines join over HTTP while this process joins as rank 0.

        The store listens before any engine is told its port (``master_port`` 0: a port bound
        now, so no other process can have taken it since it was chosen). An engine joins one
        group at a time: form several senders' groups one after the other."""
        store = open_store(self.master_address, self.world_size, self.master_port, timeout_s=300.0)
        self.master_port = store.port
        loop = asyncio.get_running_loop()
        # The group's own timeout (gloo: its connection set-up and each collective's; NCCL: the
        # watchdog's): group_timeout_s
        timeout_s = group_timeout_s(self.timeout_s, self.backend)
        local = loop.run_in_executor(
            None, lambda: new_group(self.backend, store, self.world_size, 0, self.group_name, timeout_s)
        )

        async def join(i: int, url: str):
            async with EngineClient(url) as client:
                await client.init_weights_update_group(
                    self.master_address,
                    self.master_port,
                    1 + i * self.engine_tp,
                    self.world_size,
                    self.group_name,
                    self.backend,
                )

        await asyncio.gather(*(join(i, u) for i, u in enumerate(self.engine_urls)))
        self.group = await local

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Broadcast one bucket and wait until every engine received it; its bytes.

        The broadcasts are enqueued and their ``Work`` s waited on with ``timeout_s``: under NCCL a
        broadcast only enqueues, and a peer that died or never joins shows up only as that timeout
        (gloo raises at once when a peer's connection closes). Either way the group is aborted
        (:meth:`abort`) and :class:`SyncAborted` raised; the next sync forms a new group."""
        if self.group is None:
            raise RuntimeError("WeightSync.send before connect() or after abort()")
        tensors = [t.contiguous() for _, t in bucket]
        if BucketSpec.of(bucket, self.flat).flat:
            sent = [torch.cat([t.view(-1).view(torch.uint8) for t in tensors])]
        else:
            sent = tensors
        timeout = timedelta(seconds=self.timeout_s)
        try:
            works = [cast(dist.Work, dist.broadcast(t, src=0, group=self.group, async_op=True)) for t in sent]
            for work in works:
                work.wait(timeout=timeout)
        except Exception as err:
            self.abort()
            raise SyncAborted(
                f"{self.backend} group {self.group_name}: a broadcast failed or did not complete within "
                f"rollout.weight_sync_timeout_s={self.timeout_s:g}; the group was aborted: {type(err).__name__}: "
                f"{str(err)[:300]}"
            ) from err
        return sum(t.numel() * t.element_size() for t in tensors)

    def abort(self) -> None:
        """Abort this side of the group: its pending collectives end here (NCCL: the communicator is
        aborted, so no kernel of it stays on this GPU) and it leaves torch's registry. The engines'
        side is theirs: see :class:`SyncAborted`."""
        from torch.distributed.distributed_c10d import _abort_process_group

        group, self.group = self.group, None
        if group is None:
            return
        try:
            _abort_process_group(group)
        except Exception as err:  # aborted already (NCCL's wait aborts on its timeout) or half torn down
            log.info("aborting weight-sync group %s: %s", self.group_name, err)

    async def update(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> SyncReport:
        """Pause engines, stream every bucket (this process sends and posts), resume."""
        if self.group is None:
            raise RuntimeError("WeightSync.update before connect()")
        t0 = time.perf_counter()
        tensors = nbytes = 0
        loop = asyncio.get_running_loop()
        async with EngineControl(self.engine_urls, self.policy) as control:
            for bucket in buckets:
                posted = asyncio.create_task(control.load(self.group_name, BucketSpec.of(bucket, self.flat), version))
                try:
                    nbytes += await loop.run_in_executor(None, self.send, bucket)
                except BaseException:
                    posted.cancel()  # its engine may wait for this bucket forever
                    raise
                await posted
                tensors += len(bucket)
        return SyncReport(version, tensors, nbytes, time.perf_counter() - t0, control.paused_s, control.caches_kept)

    async def close(self, engine_urls: Iterable[str] | None = None) -> None:
        """Destroy the group: on ``engine_urls`` (default: all of this group's engines; a dead one's
        error is ignored) and in this process. Never raises: the group is being given up."""

        async def leave(url: str) -> None:
            try:
                async with EngineClient(url, timeout_s=30.0) as client:
                    await client.destroy_weights_update_group(self.group_name)
            except Exception as err:  # gone with its engine, or broken by a failed update
                log.info("engine %s: destroying weight-sync group %s failed: %s", url, self.group_name, err)

        await asyncio.gather(*(leave(u) for u in (self.engine_urls if engine_urls is None else engine_urls)))
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception as err:  # a group broken by a dead peer may not tear down cleanly
                log.info("destroying weight-sync group %s here failed: %s", self.group_name, err)
            self.group = None
