"""The broadcast weight sync on one trainer rank (:class:`BroadcastSync`): every rank of the
trainer world calls :meth:`BroadcastSync.sync` together. The protocol: :mod:`sao_megatron.weight_sync`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from sao_megatron.config import ModelConfig
from sao_megatron.runtime.strict_nccl import is_nccl_like
from sao_megatron.weight_sync.gate import SyncGate
from sao_megatron.weight_sync.streams import GatherStreams
from sao_megatron.weight_sync.transport import (
    BucketSpec,
    EngineControl,
    SyncAborted,
    WeightSync,
    prefetched,
    resolve_flat,
    sync_order,
)

if TYPE_CHECKING:  # imported by sync() when it runs: Megatron stays out of the package's import
    from sao_megatron.models.hf_weights import HFWeightStream


ANSWER_MARGIN_S = 10.0
"""What the coordinator adds to ``rollout.weight_sync_timeout_s`` when it waits for the engines'
answers to one bucket. The sender's wait for the broadcast (that timeout) starts at the bucket's
release, just before the requests are posted; an engine answers after its part of the broadcast and
its load of the bucket, so an answer may come a little after a broadcast that completed in time.
The margin covers that load and the answer over HTTP, a few seconds at most on a loaded host."""
GIVEN_UP_POLL_S = 0.1
"""How often the coordinator looks for a sender's word that it gave up a bucket (a store read)."""


def sync_backend(world_backend: str) -> str:
    """The sync groups' backend for a trainer world on ``world_backend``: the world's own when it is
    NCCL-like (``nccl``, or ``strict_nccl``: NCCL's contract on CPU, for tests), else nccl with CUDA
    and gloo without."""
    if is_nccl_like(world_backend):
        return world_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


class BroadcastSync:
    """This rank's part of every broadcast weight sync of ``module`` (its HF weights, named by
    ``model_cfg``): on a pipeline stage's sender its group to the engines, and the state that
    outlives one sync (the engines the groups were formed with, the counts that name the groups
    and the store keys, the store gate, the gather group).

    ``engine_tp``: every engine's tensor-parallel size (``rollout.tensor_parallel``); ``flat``:
    send a bucket of one dtype as one byte buffer (``rollout.weight_sync_flat``; None: on NCCL only,
    :func:`~sao_megatron.weight_sync.transport.resolve_flat`); ``bucket_mb``:
    the bucket size (``rollout.weight_sync_bucket_mb``); ``inflight_mb``: what a TP / EP / DP peer
    may have sent its stage's sender unacknowledged (``run.export_inflight_mb``); ``timeout_s``:
    the gather group's timeout (``run.export_timeout_s``; 0: sized from the model's HF bytes at
    ``gb_per_s``, ``run.export_gb_per_s``); ``policy``: what a sync does to the engines' running
    requests (``rollout.update_policy``, :class:`~sao_megatron.weight_sync.EngineControl`);
    ``bucket_timeout_s``: how long a sender waits for one bucket's broadcast before it aborts its
    group (``rollout.weight_sync_timeout_s``, :meth:`WeightSync.send
    <sao_megatron.weight_sync.WeightSync.send>`), and, plus :data:`ANSWER_MARGIN_S`, how long the
    coordinator waits for the engines' answers to one bucket; ``senders``: senders per pipeline stage, at most
    (``rollout.weight_sync_senders`` over the stages; ``HFWeightStream(senders=...)``)."""

    def __init__(
        self,
        module: torch.nn.Module,
        model_cfg: ModelConfig,
        *,
        engine_tp: int,
        flat: bool | None,
        bucket_mb: int,
        inflight_mb: int = 1024,
        timeout_s: float = 0.0,
        gb_per_s: float = 0.5,
        policy: str = "retract",
        bucket_timeout_s: float = 120.0,
        senders: int = 8,
    ):
        self.module, self.model_cfg, self.policy = module, model_cfg, policy
        self.bucket_timeout_s, self.senders = bucket_timeout_s, senders
        self._feed_groups: dict = {}  # the gathers' process groups, by members (HFWeightStream)
        self.backend = sync_backend(dist.get_backend() if dist.is_initialized() else "gloo")
        self.engine_tp, self.flat, self.bucket_bytes = engine_tp, resolve_flat(flat, self.backend), bucket_mb << 20
        self.inflight_bytes, self.timeout_s, self.gb_per_s = inflight_mb << 20, timeout_s, gb_per_s
        self.sender: WeightSync | None = None  # this rank's group, on a pipeline stage's sender
        self._urls: list[str] | None = None  # the engines the groups were formed with
        self._groups = 0  # group formations so far (each has its own names)
        self._calls = 0  # syncs so far (each has its own store keys)
        self._gate: SyncGate | None = None  # the coordinator's word to the senders (store connections)
        self._gather_group: dist.ProcessGroup | None = None

    def sync(
        self, engine_urls: list[str], version: int, addresses: str | list[str], master_port: int = 0
    ) -> dict[str, float]:
        """Stream HF-named weights to the engines, tagged ``version`` (every rank calls it).

        Each sender (a *lane*: up to ``senders`` per pipeline stage, ``HFWeightStream(senders=...)``)
        gathers its buckets from its TP / EP peers by collectives, a bucket ahead, and broadcasts
        them over a group of its own; global rank 0 pauses the engines and posts every bucket's
        request in one order, releasing each bucket to its sender through the world's store
        (:class:`SyncGate`). ``addresses``: every global rank's node address (or one for all), where a
        sender's group store listens; ``master_port`` 0: any free port, else lane ``l``'s sender
        listens at ``master_port + l``.

        The groups are re-formed (new names; the old ones destroyed on the engines still
        listed) when ``engine_urls`` differ from the last call's (an engine restarted or
        dropped), and after a failed update (an engine died during it), which raises on rank 0:
        :class:`~sao_megatron.weight_sync.SyncAborted` when a sender aborted its group (a bucket's
        broadcast failed or timed out), else RuntimeError. Rank 0 returns the timing; the others ``{}``."""
        from sao_megatron.models import hf_io
        from sao_megatron.models.hf_weights import EXPORT_FLOOR_S, HFWeightStream, hf_bytes

        timeout = self.timeout_s or hf_io.transfer_timeout_s(
            hf_bytes(self.model_cfg, next(self.module.parameters()).dtype), self.gb_per_s, EXPORT_FLOOR_S
        )
        if self._gather_group is None:  # the gathers run in a thread of their own, on groups of their own
            group = dist.new_group(timeout=timedelta(seconds=timeout))  # every rank is a member
            self._gather_group = cast(dist.ProcessGroup, group)
        stream = HFWeightStream(
            self.module,
            self.model_cfg,
            group=self._gather_group,
            senders=self.senders,
            feed_groups=self._feed_groups,
            feed_timeout_s=timeout,
        )
        rank = dist.get_rank()
        if self._gate is None:
            self._gate = SyncGate.of_world()
        self._calls += 1
        gate = self._gate.next_update(self._calls)
        results: list = [None] * dist.get_world_size()
        formed: list[str | None] = [None] * dist.get_world_size()
        if self._urls != engine_urls:
            dist.all_gather_object(formed, self._connect(stream, engine_urls, addresses, master_port, gate))
        t0 = time.perf_counter()
        paused, kept = 0.0, 0
        if any(formed):  # skipped everywhere: an engine would wait for that sender's buckets forever
            results = [(0, 0, error, False) for error in formed]
        elif rank == 0:
            try:
                nbytes, tensors, error, aborted, paused, kept = asyncio.run(
                    self._coordinate(stream, gate, engine_urls, version)
                )
            except Exception as err:  # a bug: the other ranks still get their word below
                nbytes, tensors, error, aborted = 0, 0, f"{type(err).__name__}: {err}", False
            gate.done()  # the engines were resumed
            dist.all_gather_object(results, (nbytes, tensors, error, aborted))
        else:
            mine = self._data_plane(stream, gate)
            gate.wait_done()  # not in the collective: the coordinator may take longer than its timeout
            dist.all_gather_object(results, mine)
        errors = [f"trainer rank {r}: {e}" for r, (_, _, e, _) in enumerate(results) if e]
        if errors:  # the groups are broken (an aborted one on this side already): the next call forms new ones
            self.close()
            if rank == 0:
                failed = SyncAborted if any(a for *_, a in results) else RuntimeError
                raise failed(f"weight sync to version {version} failed: {'; '.join(errors)}")
            return {}
        if rank != 0:
            return {}
        seconds = time.perf_counter() - t0
        total = sum(b for b, *_ in results)
        return {
            "sync_s": seconds,
            "sync_pause_s": paused,
            "sync_caches_kept": float(kept),
            "sync_gb_per_s": total / max(seconds, 1e-9) / 1e9,
            "sync_tensors": float(sum(t for _, t, *_ in results)),
            "sync_senders": float(len(stream.senders)),
        }

    def close(self) -> None:
        """Give up this rank's group (destroyed on its engines and here); the next sync forms new ones."""
        self._urls = None
        if self.sender is not None:
            sender, self.sender = self.sender, None
            asyncio.run(sender.close())

    def _connect(
        self,
        stream: HFWeightStream,
        engine_urls: list[str],
        addresses: str | list[str],
        master_port: int,
        gate: SyncGate,
    ) -> str | None:
        """(Re-)form every sender's group, one at a time (an engine joins one group at a time; the
        next sender starts on the previous one's word in the store). Why this rank's group failed to
        form, or None (the update is skipped everywhere on any)."""
        rank = dist.get_rank()
        if self.sender is not None:
            old, self.sender = self.sender, None
            asyncio.run(old.close([u for u in old.engine_urls if u in engine_urls]))
        self._groups += 1
        error = None
        for lane, sender in enumerate(stream.senders):
            if rank == sender and lane == stream.lane:
                name = self._group_name(stream.lane_label(lane))
                address = addresses if isinstance(addresses, str) else addresses[rank]
                port = master_port + lane if master_port else 0  # two senders may share a node
                where = (
                    f"{self.backend} group {name} at {address}:%s (trainer rank {rank}, "
                    f"stage {stream.lane_stages[lane]})"
                )
                sync = WeightSync(
                    list(engine_urls),
                    engine_tp=self.engine_tp,
                    backend=self.backend,
                    master_address=address,
                    master_port=port,
                    group_name=name,
                    flat=self.flat,
                    timeout_s=self.bucket_timeout_s,
                )
                try:
                    asyncio.run(sync.connect())  # bounded by the engines' HTTP and the group's timeouts
                    self.sender = sync
                    print(
                        f"[sao-weight-sync] {where % sync.master_port} -> engines {' '.join(engine_urls)}",
                        flush=True,
                    )
                except Exception as err:
                    error = f"{where % (sync.master_port or 'any port')} failed to form: {type(err).__name__}: {err}"
                    print(f"[sao-weight-sync] {error}", flush=True)
                gate.formed(lane)
            gate.wait_formed(lane)
        self._urls = list(engine_urls)
        return error

    async def _coordinate(
        self, stream: HFWeightStream, gate: SyncGate, engine_urls: list[str], version: int
    ) -> tuple[int, int, str | None, bool, float, int]:
        """Rank 0: pause the engines, start the update, then for every bucket in the global order wait
        until its sender holds it, release and post it (while sending its own stage's); end, flush
        the caches and resume. ``(bytes, tensors, error, aborted, paused_s, caches_kept)`` (``aborted``:
        this rank's group). On an error the senders are stopped at their next bucket and the engines
        resumed before this rank's own sending is awaited.

        A bucket's answers are awaited for at most ``bucket_timeout_s`` plus :data:`ANSWER_MARGIN_S`,
        and only until a sender says it gave up a released bucket (:meth:`SyncGate.gave_up`): an
        engine whose sender aborted its group would never answer, and the HTTP client's own timeout
        is 600 s."""
        control = EngineControl(
            engine_urls,
            self.policy,
            answer_timeout_s=self.bucket_timeout_s + ANSWER_MARGIN_S,
            answer_timeout_why=f"rollout.weight_sync_timeout_s={self.bucket_timeout_s:g} plus "
            f"{ANSWER_MARGIN_S:g} s for the engines' load and answer",
        )
        try:
            plan = [[BucketSpec.planned(b, self.flat) for b in lane] for lane in stream.bucket_plan(self.bucket_bytes)]
            names = [self._group_name(stream.lane_label(lane)) for lane in range(len(plan))]
            await control.__aenter__()
        except Exception as err:  # nothing was sent: the other ranks are told to skip the update
            error = f"{type(err).__name__}: {err}"
            gate.start(error)
            return 0, 0, error, False, control.paused_s, 0
        gate.start()
        sending = asyncio.ensure_future(asyncio.to_thread(self._data_plane, stream, gate))
        gave_up = asyncio.ensure_future(_given_up(gate))
        released = [0] * len(plan)  # per stage: buckets released so far
        error, silent = None, False
        try:
            for s, k in sync_order([len(p) for p in plan]):
                if (reason := await asyncio.to_thread(gate.wait_ready, s, k)) is not None:
                    raise RuntimeError(reason)
                gate.release(s, k)
                released[s] = k + 1
                await control.load(names[s], plan[s][k], version, abandon=gave_up)
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
            # an engine that never answered a bucket (EngineControl.load's TimeoutError) leaves the group
            # in an unknown state (inside its load, or in a receive that never completes): the group
            # counts as aborted, so the driver restarts every engine of it, as after a sender's abort
            silent = isinstance(err, TimeoutError)
            gate.stop((s, k) for s, k in enumerate(released) if k < len(plan[s]))
            await control.__aexit__(type(err), err, None)  # resumes
            sent = await sending
            if sent[2] is not None:  # this rank's own sender failed too (e.g. it aborted its group)
                error += f"; this rank's sender: {sent[2]}"
        else:
            sent = await sending
            if sent[2] is not None:  # a sender failed after its last bucket's request was answered
                error = sent[2]
            try:
                await control.__aexit__(RuntimeError if error else None, None, None)
            except Exception as err:
                error = error or f"{type(err).__name__}: {err}"
        finally:
            gave_up.cancel()
            if gave_up.done() and not gave_up.cancelled():
                gave_up.exception()  # a store error there is the final all-gather's to report
        return sent[0], sent[1], error, sent[3] or silent, control.paused_s, control.caches_kept

    def _group_name(self, label: str) -> str:
        """``sao_weight_sync``, then the formation count from the second on, then the lane's label."""
        return "sao_weight_sync" + (f"_{self._groups}" if self._groups > 1 else "") + (f"_{label}" if label else "")

    def _data_plane(self, stream: HFWeightStream, gate: SyncGate) -> tuple[int, int, str | None, bool]:
        """This rank's part of an update: gather its stage's buckets and, on the stage's sender, say
        it holds each and broadcast it once the coordinator releases it, while the next is
        gathered (:class:`~sao_megatron.weight_sync.streams.GatherStreams`: on a GPU the gathers
        queue on a side stream, and each bucket's broadcast waits for its event). Ranks other than
        0 first wait for the coordinator's start (and skip the update if it reports an error).
        ``(bytes, tensors, error, aborted)``: ``aborted``, this sender aborted its group
        (:class:`~sao_megatron.weight_sync.SyncAborted`). Never raises; a sender's error reaches the
        coordinator at once (its next bucket "failed"), then the stream is drained (the stage's
        other ranks are inside the gathers)."""
        rank = dist.get_rank()
        try:
            if rank != 0 and gate.started() is not None:
                return 0, 0, None, False  # rank 0 reports it
        except Exception as err:  # the store is gone with rank 0
            return 0, 0, f"waiting for the coordinator's start: {type(err).__name__}: {err}", False
        sender = stream.lane is not None
        lane = stream.lane if stream.lane is not None else -1  # gate keys: a sender's lane only
        plan = stream.bucket_plan(self.bucket_bytes)[lane] if sender else []
        nbytes = tensors = declared = 0  # declared: buckets this sender said it holds
        error: str | None = None
        aborted = False
        stopped = not sender  # a sender sends until an error or the coordinator's stop

        def fail(reason: str) -> None:
            nonlocal error
            error = reason
            if declared < len(plan):  # the coordinator waits for that bucket's word
                try:
                    gate.failed(lane, declared, f"trainer rank {rank} (stage {stream.stage}): {reason}")
                except Exception as err:  # the store is gone with rank 0: the final all-gather fails too
                    error += f"; telling the coordinator failed: {err}"

        if sender and self.sender is None:
            fail("no weight-sync group")
        try:
            buckets = stream.buckets(self.bucket_bytes)
            if sender:  # its own buckets, gathered a bucket ahead, in a thread and on a stream of their own
                steps = stream.steps(self.bucket_bytes)
                buckets = (b for step, b in zip(steps, buckets, strict=True) if step.writer == rank)
                streams = GatherStreams(stream.device)
                buckets = (streams.ready(g) for g in prefetched(streams.gathered(buckets)))
            for k, bucket in enumerate(buckets):
                if stopped or error is not None:
                    continue  # drained: the stage's other ranks are inside the gathers
                try:
                    got, planned = BucketSpec.of(bucket, self.flat), BucketSpec.planned(plan[k], self.flat)
                    if got != planned:  # a bug: the engines would be told the plan
                        fail(f"bucket {k} holds {got.names[:3]}..., planned {planned.names[:3]}...")
                        continue
                    gate.ready(lane, k)
                    declared = k + 1
                    if not gate.wait(lane, k):
                        stopped = True  # the coordinator reports why
                        continue
                    try:
                        nbytes += cast(WeightSync, self.sender).send(bucket)
                    except Exception as err:  # the engines' requests for it will never be answered
                        with contextlib.suppress(Exception):  # the store is gone with rank 0: fail() says so
                            gate.gave_up(lane, k, f"trainer rank {rank} (stage {stream.stage}): {type(err).__name__}")
                        raise
                    tensors += len(bucket)
                except Exception as err:  # a broadcast failed or timed out (SyncAborted), or the store is gone
                    aborted = aborted or isinstance(err, SyncAborted)
                    fail(f"{type(err).__name__}: {err}")
        except Exception as err:  # a gather failed: the stream cannot be drained
            if error is None:
                fail(f"{type(err).__name__}: {err}")
        return nbytes, tensors, error, aborted


async def _given_up(gate: SyncGate) -> str:
    """A sender's word that it gave up a released bucket, once there is one (polled: a blocking read
    in a thread could not be cancelled when the update ends without one)."""
    while (word := await asyncio.to_thread(gate.given_up)) is None:
        await asyncio.sleep(GIVEN_UP_POLL_S)
    return word
