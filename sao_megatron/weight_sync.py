"""Trainer -> engines weight sync over a broadcast group (gloo on CPU, NCCL on GPU).

Group: trainer rank 0 is rank 0; engine ``e`` with TP size t holds ranks
``1 + e*t .. (e+1)*t``. Each update, bucket by bucket (HF names, full tensors gathered from
the trainer's TP/EP/PP shards by ``models.hf_weights``):

    engines: /pause_generation (retract: in-flight requests are kept) -> /begin_weight_update
    per bucket: POST /update_weights_from_distributed {names, dtypes, shapes}  (each engine)
                || trainer broadcasts each tensor from rank 0, in the same order
    engines: /end_weight_update -> /flush_cache (done by the update) -> /continue_generation

In-flight episodes continue under the new version; their later tokens carry it. When the
engines change (one restarted on a new port, or dropped), the group is re-formed under a new
name: :meth:`WeightSync.close` destroys the old one on the engines still running
(``/destroy_weights_update_group``) and here. The disk path
(``update_weights_from_disk``) is the fallback when no broadcast group can be formed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import Store  # pyright: ignore[reportPrivateImportUsage]  # public API

from sao_megatron.faults import kill_point
from sao_megatron.parallel import open_store
from sao_megatron.rollout.client import EngineClient

log = logging.getLogger(__name__)


@dataclass
class SyncReport:
    version: int
    tensors: int
    bytes: int
    seconds: float
    paused_s: float = 0.0
    """How long the engines stopped generating: from the pause request to the resume's answer."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def new_group(backend: str, store: Store, world_size: int, rank: int, group_name: str,
              timeout_s: float = 300.0) -> dist.ProcessGroup:  # fmt: skip
    """A process group outside the default world (SGLang engines join it from their side).

    torch has no public API for a second, independent world in one process; this builds it
    from a TCP store the same way ``init_process_group`` does, under a prefix of its own.
    """
    from torch.distributed.distributed_c10d import GroupName, PrefixStore, _new_process_group_helper, _world

    prefixed = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), prefixed,
                                         group_name=GroupName(group_name), timeout=timedelta(seconds=timeout_s))  # fmt: skip
    # No global ranks given: the default-group path, which never returns the non-member sentinel.
    group = cast(dist.ProcessGroup, group)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class WeightSync:
    """Held by trainer rank 0: the broadcast group and the engine clients."""

    def __init__(self, engine_urls: list[str], engine_tp: int = 1, backend: str = "gloo",
                 master_address: str = "127.0.0.1", master_port: int = 0, group_name: str = "sao_weight_sync"):  # fmt: skip
        """``master_port`` 0 (the default): any free port on ``master_address``, bound at connect()."""
        self.engine_urls = engine_urls
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
        now, so no other process can have taken it since it was chosen)."""
        store = open_store(self.master_address, self.world_size, self.master_port, timeout_s=300.0)
        self.master_port = store.port
        loop = asyncio.get_running_loop()
        local = loop.run_in_executor(None, lambda: new_group(self.backend, store, self.world_size, 0,
                                                              self.group_name))  # fmt: skip

        async def join(i: int, url: str):
            async with EngineClient(url) as client:
                await client.init_weights_update_group(self.master_address, self.master_port,
                                                       1 + i * self.engine_tp, self.world_size,
                                                       self.group_name, self.backend)  # fmt: skip

        await asyncio.gather(*(join(i, u) for i, u in enumerate(self.engine_urls)))
        self.group = await local

    async def update(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> SyncReport:
        """Pause engines, stream every bucket, resume. ``buckets`` yields HF-named full tensors."""
        if self.group is None:
            raise RuntimeError("WeightSync.update before connect()")
        t0 = time.perf_counter()
        clients = [EngineClient(u) for u in self.engine_urls]
        for c in clients:
            await c.__aenter__()
        tensors = nbytes = 0
        paused = time.perf_counter()
        try:
            await asyncio.gather(*(c.pause("retract") for c in clients))
            await asyncio.gather(*(c.begin_weight_update() for c in clients))
            for bucket in buckets:
                names = [n for n, _ in bucket]
                dtypes = [_DTYPE_NAMES[t.dtype] for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]
                posts = asyncio.gather(*(c.update_weights_from_distributed(names, dtypes, shapes, self.group_name,
                                                                             str(version)) for c in clients))  # fmt: skip
                await asyncio.get_running_loop().run_in_executor(None, self._broadcast, bucket)
                await posts
                kill_point("weight_sync:bucket")  # engines hold a partly updated model
                tensors += len(bucket)
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            await asyncio.gather(*(c.end_weight_update() for c in clients))
        finally:
            await asyncio.gather(*(c.resume() for c in clients), return_exceptions=True)
            paused = time.perf_counter() - paused
            for c in clients:
                await c.close()
        return SyncReport(version, tensors, nbytes, time.perf_counter() - t0, paused)

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

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in bucket:
            dist.broadcast(tensor.contiguous(), src=0, group=self.group)
