"""Typed handles on the role groups: each rank of the actor and critic worlds is a Ray actor.

A role group is one Megatron world (its own ``torch.distributed`` rendezvous) placed by Ray:
one GPU per rank when ``cluster.gpus_per_node`` > 0, else a share of a CPU. Every method of a handle is a
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
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, cast

import ray
import torch

from sao_megatron.batch import BatchShard, RowOutputs, TrainBatch, assemble_rows
from sao_megatron.config import SAOConfig
from sao_megatron.config.cluster import one_node_gpus
from sao_megatron.config.rank import ActorRankConfig, CriticRankConfig
from sao_megatron.workers.actor import ActorWorker, ExportReport
from sao_megatron.workers.critic import CriticWorker
from sao_megatron.workers.rank import RankCoordinates

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _PerReplica:
    """Object-store references, one per data-parallel replica; rank r resolves its replica's."""

    refs: list[ray.ObjectRef]
    rows: list[list[int]] | None = None
    """For a placed batch: each replica's row indices in the whole batch."""


@ray.remote
class RankActor:
    """One rank of one role; owns the process and its ``ActorWorker`` or ``CriticWorker``.

    Built in two steps so that each role world meets at its own rank 0: rank 0 opens the
    rendezvous store on its node (:meth:`rendezvous`), then every rank joins it and builds its
    model (:meth:`start`)."""

    def __init__(
        self,
        cfg: ActorRankConfig | CriticRankConfig,
        rank: int,
        world: int,
        log_path: str,
        init_from: str | None = None,
        gpus_per_node: int = 0,
    ):
        """``cfg``: the sections of the run's config this rank reads (:mod:`sao_megatron.config.rank`);
        ``gpus_per_node``: ``cluster.gpus_per_node`` (> 0: this rank must see a GPU)."""
        from sao_megatron.logs import quiet_third_party, redirect_process_output

        redirect_process_output(Path(log_path))
        quiet_third_party()
        self.cfg, self.rank, self.world, self.init_from = cfg, rank, world, init_from
        self.gpus_per_node = gpus_per_node
        self._store = None

    def rendezvous(self, host: str) -> tuple[str, int]:
        """Rank 0: open the world's store on ``host`` (this node's address) at a port the OS picks."""
        from sao_megatron.parallel import open_store

        self._store = open_store(host, self.world)
        return host, self._store.port

    def start(self, host: str, port: int) -> RankCoordinates:
        """Join the world at rank 0's store, build the worker; this rank's place in the world."""
        from sao_megatron import parallel
        from sao_megatron.workers.rank import check_cuda, coordinates

        role = "actor" if isinstance(self.cfg, ActorRankConfig) else "critic"
        check_cuda(self.gpus_per_node, f"{role} rank {self.rank}", self.node_ip())
        store = self._store or parallel.join_store(host, port, self.world)
        parallel.init_distributed(self.rank, self.world, host, port, backend=self.cfg.backend, store=store)
        self.worker = (
            ActorWorker(self.cfg) if isinstance(self.cfg, ActorRankConfig) else CriticWorker(self.cfg, self.init_from)
        )
        self.coords = coordinates()
        return self.coords

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        resolve = self._resolve
        return getattr(self.worker, method)(*map(resolve, args), **{k: resolve(v) for k, v in kwargs.items()})

    def _resolve(self, value: Any) -> Any:
        return ray.get(value.refs[self.coords.dp_rank]) if isinstance(value, _PerReplica) else value

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


class RoleGroup[W: (ActorWorker, CriticWorker)]:
    """All ranks of one role (one Megatron world), placed by one Ray placement group.

    One bundle per rank (a GPU, or a share of a CPU locally; on a cluster also a unit of the
    node group's ``sao_<role>`` resource, so ranks land on their role's nodes). Ranks follow the
    bundles node by node, rank 0's node first, so tensor-parallel neighbours share a node; the
    world meets at rank 0's store on rank 0's node (:meth:`started`)."""

    def __init__(self, kind: str, cfg: SAOConfig, run_dir: Path, init_from: str | None = None):
        self.kind, self.cfg, self.run_dir, self.init_from = kind, cfg, run_dir, init_from
        self.ranks: list[Any] = []  # Ray actor handles (untyped); the typed boundary is _all()
        self.coords: list[RankCoordinates] = []
        self.group: Any = None  # the placement group

    def _bundle(self) -> dict[str, float]:
        """A GPU iff the config says the run has GPUs (``cluster.gpus_per_node`` > 0), whatever the
        driver's process sees: a rank that gets none then fails at start (:func:`check_cuda`)."""
        gpus = 1 if self.cfg.cluster.gpus_per_node > 0 else 0
        bundle: dict[str, float] = {"CPU": self.cfg.cluster.cpus_per_rank}
        if gpus:
            bundle["GPU"] = gpus
        if self.cfg.cluster.ray_address:  # launch/slurm: every node advertises its role (sao_actor, ...)
            bundle[f"sao_{self.kind}"] = 1 if gpus else 0.01
        return bundle

    async def started(self) -> None:
        """Place the ranks, open the rendezvous at rank 0, build every rank's model."""
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        role = self.cfg.actor if self.kind == "actor" else self.cfg.critic
        world = role.parallel.world_size
        one_node_gpus(self.cfg)  # refuses a one-node run whose trainers and engines overflow the node
        self.group = placement_group([self._bundle()] * world, strategy="PACK", name=f"sao_{self.kind}")
        await wait_placed(
            self.group, f"the {self.kind}'s {world} ranks", self._bundle(), self.cfg.cluster.placement_timeout_s
        )
        order = rank_order(placement_group_table(self.group)["bundles_to_node_id"])
        logs = self.run_dir / "logs"
        rank_cfg = ActorRankConfig.of(self.cfg) if self.kind == "actor" else CriticRankConfig.of(self.cfg)
        gpus_per_node = self.cfg.cluster.gpus_per_node
        self.ranks = [
            RankActor.options(
                num_cpus=self.cfg.cluster.cpus_per_rank,
                num_gpus=self._bundle().get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=b),
            ).remote(rank_cfg, r, world, str(logs / f"{self.kind}_rank{r}.log"), self.init_from, gpus_per_node)
            for r, b in enumerate(order)
        ]
        host = await self.ranks[0].node_ip.remote() if self.cfg.cluster.ray_address else "127.0.0.1"
        host, port = await self.ranks[0].rendezvous.remote(host)
        self.coords = list(await asyncio.gather(*(r.start.remote(host, port) for r in self.ranks)))

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

    async def _all[**P, R](self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run ``method`` on every rank; the results in rank order."""
        name = method.__name__
        return list(await asyncio.gather(*(r.call.remote(name, args, kwargs) for r in self.ranks)))

    async def _reported[**P, R](self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return (await self._all(method, *args, **kwargs))[self.reporter]

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def offered() -> list[tuple[str, dict[str, float]]]:
    """``(address, resources)`` of every live node of the Ray cluster, for error messages."""
    return [(n["NodeManagerAddress"], n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def placement_error(what: str, bundle: dict[str, float], timeout_s: float) -> RuntimeError:
    """What to say when Ray could not place ``what`` (bundles of ``bundle``) in ``timeout_s``."""
    return RuntimeError(
        f"Ray could not place {what} within {timeout_s:.0f} s: each needs {bundle}; the cluster's nodes "
        f"offer {offered()}. Check the node groups (cluster.*_nodes) and the CPUs/GPUs each node advertises "
        "to Ray, or raise cluster.placement_timeout_s"
    )


async def wait_placed(group: Any, what: str, bundle: dict[str, float], timeout_s: float) -> None:
    """Wait for a placement group; fail after ``timeout_s`` instead of waiting forever for a
    bundle no node can hold (the group is removed)."""
    from ray.util.placement_group import remove_placement_group

    try:
        await asyncio.wait_for(group.ready(), timeout_s)
    except TimeoutError:
        remove_placement_group(group)
        raise placement_error(what, bundle, timeout_s) from None


def rank_order(bundle_nodes: dict[int, str]) -> list[int]:
    """Bundle index of each rank: bundles grouped node by node (bundle 0's node first, then in
    order of each node's first bundle), in index order within a node. Consecutive ranks (TP
    groups, then PP/DP) thus share a node wherever the placement allows."""
    first: dict[str, int] = {}
    for b in sorted(bundle_nodes):
        first.setdefault(bundle_nodes[b], b)
    return sorted(bundle_nodes, key=lambda b: (first[bundle_nodes[b]], b))


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

    async def routed_logprobs(self, batch: TrainBatch, replay: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """:meth:`logprobs` with the routers replaying ``batch.routes`` or routing themselves, and route
        agreement (``ActorWorker.routed_logprobs``)."""
        parts = await self._all(ActorWorker.routed_logprobs, self.place(batch), replay)
        rows = assemble_rows([p[0] for p in parts], batch.size, batch.tokens.shape[1])
        return rows, parts[0][1]

    async def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        return await self._reported(ActorWorker.sft_step, self.place(batch))

    async def set_lr(self, lr: float) -> None:
        await self._all(ActorWorker.set_lr, lr)

    async def export_hf(self, out_dir: Path) -> ExportReport:
        return (await self._all(ActorWorker.export_hf, str(out_dir)))[0]

    async def sync_weights(
        self, engine_urls: list[str], version: int, addresses: str | list[str], port: int = 0
    ) -> dict[str, float]:
        """Broadcast the weights to the engines from every pipeline stage's sender; global rank 0
        coordinates and reports the timing. ``addresses``: per global rank (or one for all)."""
        return (await self._all(ActorWorker.sync_weights, engine_urls, version, addresses, port))[0]

    async def node_ips(self) -> list[str]:
        """Every rank's node address, by global rank."""
        return list(await asyncio.gather(*(r.node_ip.remote() for r in self.ranks)))


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
        """``[B, T]`` values V(s) of the placed batch where :attr:`TrainBatch.value_mask` is 1 (the action
        positions and each row's last position), zero elsewhere."""
        parts: list[RowOutputs | None] = await self._all(CriticWorker.values, batch)
        return assemble_rows(parts, size, width)

    async def update(self, batch: BatchShard, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One value-loss step; ``returns`` and ``old_values`` ``[B, T]`` for the whole batch."""
        return await self._reported(CriticWorker.update, batch, self.rows(batch, returns), self.rows(batch, old_values))


def ray_args(cfg: SAOConfig) -> dict[str, Any]:
    """:func:`init_ray`'s arguments for a run: the job's cluster (``cluster.ray_address``), else a
    local instance. On a GPU run on one node the local Ray holds only the trainers' GPUs, so it hands
    the actor and critic ranks ids ``0 .. n-1`` and the engines, started outside Ray, take the ids
    after them (:func:`~sao_megatron.driver.engines.engine_env`); too many GPUs for the node raise
    :class:`~sao_megatron.config.ConfigError` (:func:`~sao_megatron.config.cluster.one_node_gpus`)."""
    if cfg.cluster.ray_address:
        return {"address": cfg.cluster.ray_address}
    gpus = one_node_gpus(cfg)
    return {"num_gpus": gpus.trainers} if gpus else {}


def start_ray(cfg: SAOConfig) -> None:
    """:func:`init_ray` for the run ``cfg`` (:func:`ray_args`)."""
    init_ray(**ray_args(cfg))


def local_ray_token() -> None:
    """Token authentication for a Ray this process starts, as a Slurm job's Ray has
    (``launch/common.sh``: ``sao_ray_auth``): a fresh random token, held in this process's
    environment (``RAY_AUTH_TOKEN``, which Ray's processes inherit; never on a command line), unless
    the caller chose (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` set). Without
    it, anyone who reaches the local GCS port could run code as this user."""
    import os
    import secrets

    from ray._raylet import Config  # pyright: ignore[reportAttributeAccessIssue]  (compiled; no stub names it)

    if "RAY_AUTH_MODE" in os.environ:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    if "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ:
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    Config.initialize("")  # this process read the mode when Ray was imported: read it again (as Ray's own default does)


def init_ray(
    address: str = "",
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    num_gpus: int | None = None,
) -> None:
    """Local Ray by default; the job's cluster when ``address`` is given (``cluster.ray_address``).
    ``resources``: custom resources the local node advertises (tests: a node group's ``sao_<group>``);
    ``num_gpus``: GPUs the local node gives Ray (None: every GPU it detects)."""
    import os

    from sao_megatron.logs import RAY_WORKER_SETUP_HOOK
    from sao_megatron.rollout.client import API_KEY_ENV, run_api_key

    if ray.is_initialized():
        return
    if address:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the launcher sets token mode (launch/common.sh)
    else:
        local_ray_token()
    # One engine API key per run, drawn here (the driver's first step into Ray) unless given, and
    # handed to every Ray worker: the engines' hosts start them with it, the actor's weight sync sends it.
    key = run_api_key()
    quiet = {
        "worker_process_setup_hook": RAY_WORKER_SETUP_HOOK,  # before any actor argument is unpickled
        "env_vars": {API_KEY_ENV: key},
    }
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, runtime_env=quiet)
        return
    for attempt in range(1, LOCAL_RAY_ATTEMPTS + 1):
        try:
            ray.init(
                num_cpus=num_cpus or os.cpu_count(),
                num_gpus=num_gpus,
                resources=resources,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=512 << 20,
                runtime_env=quiet,
            )
            return
        except Exception as err:  # Ray raises a bare Exception for it
            if RAY_START_TIMED_OUT not in str(err) or attempt == LOCAL_RAY_ATTEMPTS:
                raise
            ray.shutdown()  # ends the GCS and raylet this attempt started
            log.warning(
                "Ray's local node did not register within Ray's fixed 30 s (attempt %d of %d; is the "
                "machine loaded?): starting it again",
                attempt,
                LOCAL_RAY_ATTEMPTS,
            )


LOCAL_RAY_ATTEMPTS = 3
"""Starts of a local Ray before its start-up timeout fails the run: Ray waits a fixed 30 s for its
raylet to register, which a loaded machine can miss (one run of 40 in a two-at-a-time sweep did)."""
RAY_START_TIMED_OUT = "timed out during startup"
