"""Typed handles on the role groups: each rank of the actor and critic worlds is a Ray actor.

A role group is one Megatron world (its own ``torch.distributed`` rendezvous) placed by Ray:
one GPU per rank on a cluster, fractional CPUs locally. Every method of a handle is a
collective: it runs the same worker method on every rank and waits for all of them, so a
failure on any rank raises here instead of hanging. Handles call worker methods by reference
(``ActorWorker.update``), so a wrong argument is a static error, not a runtime surprise.

Batches travel through Ray's object store once per step: :meth:`RoleGroup.place` splits a
batch into one shard per data-parallel replica and puts each shard once; every rank of a
replica (its TP/PP/CP peers) resolves the same reference, and no rank receives rows it does
not train on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, cast

import ray
import torch

from sao_megatron.batch import BatchShard, RowOutputs, TrainBatch, assemble_rows
from sao_megatron.config import SAOConfig
from sao_megatron.spawn import free_port
from sao_megatron.workers.actor import ActorWorker, ExportReport
from sao_megatron.workers.common import RankCoordinates
from sao_megatron.workers.critic import CriticWorker


@dataclass(frozen=True)
class _PerReplica:
    """Object-store references, one per data-parallel replica; rank r resolves its replica's."""

    refs: list[ray.ObjectRef]
    rows: list[list[int]] | None = None
    """For a placed batch: each replica's row indices in the whole batch."""


@ray.remote
class RankActor:
    """One rank of one role; owns the process and its ``ActorWorker`` or ``CriticWorker``."""

    def __init__(self, kind: str, cfg: SAOConfig, rank: int, world: int, master_addr: str, master_port: int,
                 log_path: str, init_from: str | None = None):  # fmt: skip
        from sao_megatron import parallel
        from sao_megatron.logs import quiet_third_party, redirect_process_output

        redirect_process_output(Path(log_path))
        quiet_third_party()
        parallel.init_distributed(rank, world, master_addr, master_port, backend=cfg.run.backend)
        self.worker = ActorWorker(cfg) if kind == "actor" else CriticWorker(cfg, init_from)
        from sao_megatron.workers.common import coordinates

        self.coords = coordinates()

    def coordinates(self) -> RankCoordinates:
        return self.coords

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        resolve = self._resolve
        return getattr(self.worker, method)(*map(resolve, args), **{k: resolve(v) for k, v in kwargs.items()})

    def _resolve(self, value: Any) -> Any:
        return ray.get(value.refs[self.coords.dp_rank]) if isinstance(value, _PerReplica) else value

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


class RoleGroup[W: (ActorWorker, CriticWorker)]:
    """All ranks of one role (one Megatron world)."""

    def __init__(self, kind: str, cfg: SAOConfig, run_dir: Path, init_from: str | None = None):
        role = cfg.actor if kind == "actor" else cfg.critic
        world = role.parallel.world_size
        gpus = 1 if torch.cuda.is_available() else 0
        remote = bool(cfg.cluster.ray_address)
        # Under launch/slurm every node advertises the role it belongs to (sao_actor, sao_critic,
        # sao_rollout: one unit per GPU); ranks then land on their role's node group.
        resources = {f"sao_{kind}": 1 if gpus else 0.01} if remote else {}
        master = ray.util.get_node_ip_address() if gpus else "127.0.0.1"
        port = free_port()
        self.kind = kind
        self.ranks: list[Any] = [  # Ray actor handles (untyped); the typed boundary is _all()
            RankActor.options(num_cpus=cfg.cluster.cpus_per_rank, num_gpus=gpus, resources=resources).remote(
                kind, cfg, r, world, master, port, str(run_dir / "logs" / f"{kind}_rank{r}.log"), init_from
            )
            for r in range(world)
        ]
        self.coords: list[RankCoordinates] = []

    async def started(self) -> None:
        """Wait until every rank built its model; learn each rank's place in the world."""
        self.coords = list(await asyncio.gather(*(r.coordinates.remote() for r in self.ranks)))

    @property
    def dp_size(self) -> int:
        return self.coords[0].dp_size

    @property
    def reporter(self) -> int:
        """Index of the rank whose metrics the group returns (last PP stage, TP/CP/DP rank 0)."""
        return next(i for i, c in enumerate(self.coords) if c.reports and c.dp_rank == 0)

    def place(self, batch: TrainBatch) -> BatchShard:
        """Put one shard per DP replica in the object store; each rank receives its own.

        Statically this is the shard a worker method receives; at run time it is a set of
        object references that each rank resolves to its replica's shard."""
        shards = batch.shard(self.dp_size)
        placed = cast(_PerReplica, self.scatter(shards))
        return cast(BatchShard, _PerReplica(placed.refs, [s.rows for s in shards]))

    def scatter[T](self, parts: Sequence[T]) -> T:
        """One value per DP replica, each put once; every rank receives its replica's value."""
        if len(parts) != self.dp_size:
            raise ValueError(f"{self.kind}: {len(parts)} parts for {self.dp_size} data-parallel replicas")
        return cast(T, _PerReplica([ray.put(p) for p in parts]))

    def rows(self, shard: BatchShard, per_row: torch.Tensor) -> torch.Tensor:
        """Split a whole-batch ``[B, ...]`` tensor like ``shard`` (returned by :meth:`place`)."""
        rows = cast(_PerReplica, shard).rows
        if rows is None:
            raise TypeError(f"{self.kind}: rows() needs a batch returned by place()")
        return self.scatter([per_row[r] for r in rows])

    async def _all[**P, R](
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """Run ``method`` on every rank; the results in rank order."""
        name = method.__name__
        return list(await asyncio.gather(*(r.call.remote(name, args, kwargs) for r in self.ranks)))

    async def _reported[**P, R](
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        return (await self._all(method, *args, **kwargs))[self.reporter]

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        self.ranks = []


class ActorGroup(RoleGroup[ActorWorker]):
    """The policy's world."""

    def __init__(self, cfg: SAOConfig, run_dir: Path):
        super().__init__("actor", cfg, run_dir)

    async def save(self, directory: Path) -> None:
        await self._all(ActorWorker.save, str(directory))

    async def load(self, directory: Path) -> None:
        await self._all(ActorWorker.load, str(directory))

    async def update(self, batch: BatchShard, advantages: torch.Tensor, version: int) -> dict[str, float]:
        """One policy step; ``batch`` from :meth:`place`, ``advantages`` ``[B, T]`` for the whole batch."""
        return await self._reported(ActorWorker.update, batch, self.rows(batch, advantages), version)

    async def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` logprobs of every label under the current policy."""
        parts = await self._all(ActorWorker.logprobs, self.place(batch))
        return assemble_rows(parts, batch.size, batch.tokens.shape[1])

    async def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        return await self._reported(ActorWorker.sft_step, self.place(batch))

    async def set_lr(self, lr: float) -> None:
        await self._all(ActorWorker.set_lr, lr)

    async def export_hf(self, out_dir: Path) -> ExportReport:
        return (await self._all(ActorWorker.export_hf, str(out_dir)))[0]

    async def sync_weights(
        self, engine_urls: list[str], version: int, address: str, port: int = 0
    ) -> dict[str, float]:
        """Broadcast the weights to the engines from global rank 0 (which reports the timing)."""
        return (await self._all(ActorWorker.sync_weights, engine_urls, version, address, port))[0]

    async def node_ip(self) -> str:
        return await self.ranks[0].node_ip.remote()


class CriticGroup(RoleGroup[CriticWorker]):
    """The value model's world."""

    def __init__(self, cfg: SAOConfig, run_dir: Path, init_from: str | None = None):
        """``init_from``: the trunk's checkpoint directory (``""``: random; ``None``:
        ``critic.init_from``); every rank reads only its own slices of it."""
        super().__init__("critic", cfg, run_dir, init_from)

    async def save(self, directory: Path) -> None:
        await self._all(CriticWorker.save, str(directory))

    async def load(self, directory: Path) -> None:
        await self._all(CriticWorker.load, str(directory))

    async def values(self, batch: BatchShard, size: int, width: int) -> torch.Tensor:
        """``[B, T]`` values V(s) on action positions of the placed batch (zero elsewhere)."""
        parts: list[RowOutputs | None] = await self._all(CriticWorker.values, batch)
        return assemble_rows(parts, size, width)

    async def update(
        self, batch: BatchShard, returns: torch.Tensor, old_values: torch.Tensor
    ) -> dict[str, float]:
        """One value-loss step; ``returns`` and ``old_values`` ``[B, T]`` for the whole batch."""
        return await self._reported(
            CriticWorker.update, batch, self.rows(batch, returns), self.rows(batch, old_values)
        )


def init_ray(address: str = "", num_cpus: int | None = None) -> None:
    """Local Ray by default; the job's cluster when ``address`` is given (``cluster.ray_address``)."""
    import os

    from sao_megatron.logs import RAY_WORKER_SETUP_HOOK

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    quiet = {"worker_process_setup_hook": RAY_WORKER_SETUP_HOOK}  # before any actor argument is unpickled
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, runtime_env=quiet)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 << 20, runtime_env=quiet)  # fmt: skip
