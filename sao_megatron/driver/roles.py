"""Roles on Ray: each rank of the actor and critic worlds is a Ray actor owning one process.

A :class:`RoleGroup` is one Megatron world (its own ``torch.distributed`` rendezvous), placed
by Ray: GPUs per rank on a cluster, fractional CPUs locally. Methods are collectives: the
group calls the worker method on every rank and returns global rank 0's result (an awaitable
``ObjectRef`` in async code).
"""

from __future__ import annotations

import os

import ray
import torch

from sao_megatron.config import SAOConfig
from sao_megatron.spawn import free_port


@ray.remote
class RankActor:
    """One rank of one role; holds an ``ActorWorker`` or ``CriticWorker``."""

    def __init__(self, kind: str, cfg: SAOConfig, rank: int, world: int, master_addr: str, master_port: int,
                 actor_state: dict | None = None):  # fmt: skip
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import warnings

        warnings.filterwarnings("ignore", module="megatron")
        from sao_megatron import parallel
        from sao_megatron.workers.roles import ActorWorker, CriticWorker

        self.rank = rank
        parallel.init_distributed(rank, world, master_addr, master_port, backend=cfg.run.backend)
        self.worker = ActorWorker(cfg) if kind == "actor" else CriticWorker(cfg, actor_state)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


class RoleGroup:
    """All ranks of one role."""

    def __init__(self, kind: str, cfg: SAOConfig, actor_state: dict | None = None):
        role = cfg.actor if kind == "actor" else cfg.critic
        world = role.parallel.world_size
        gpus = 1 if torch.cuda.is_available() else 0
        cpus = float(os.environ.get("SAO_RAY_CPUS_PER_RANK", "0.5"))
        port = free_port()
        state_ref = ray.put(actor_state) if actor_state is not None else None
        self.kind = kind
        # Under launch/slurm every node advertises the role it belongs to (sao_actor, sao_critic,
        # sao_rollout: one unit per GPU); ranks then land on their role's node group.
        resources = {f"sao_{kind}": 1 if gpus else 0.01} if on_cluster() else {}
        self.ranks = [
            RankActor.options(num_cpus=cpus, num_gpus=gpus, resources=resources).remote(
                kind,
                cfg,
                r,
                world,
                "127.0.0.1" if not gpus else ray.util.get_node_ip_address(),
                port,
                state_ref,
            )
            for r in range(world)
        ]

    async def call(self, method: str, *args, **kwargs):
        """Run ``method`` on every rank (a collective); returns global rank 0's result.

        Waits for all ranks, so a failure on any rank raises here instead of hanging."""
        import asyncio

        results = await asyncio.gather(*(r.call.remote(method, *args, **kwargs) for r in self.ranks))
        return results[0]

    def call_sync(self, method: str, *args, **kwargs):
        return ray.get([r.call.remote(method, *args, **kwargs) for r in self.ranks])[0]

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        self.ranks = []


def on_cluster() -> bool:
    """True when launched by launch/slurm (the driver joined the job's Ray cluster)."""
    return bool(os.environ.get("SAO_RAY_ADDRESS"))


@ray.remote
class EngineHost:
    """Starts one SGLang server on the node Ray placed it on (the rollout node group) and owns it."""

    def __init__(self, spec):
        from sao_megatron.rollout.engine import EngineProcess

        spec.host = ray.util.get_node_ip_address()
        self.proc = EngineProcess(spec).start()

    def wait_healthy(self) -> str:
        self.proc.wait_healthy()
        return self.proc.url

    def stop(self) -> None:
        self.proc.stop()


class RemoteEngine:
    """The driver's handle on an engine started by an :class:`EngineHost` (same API as EngineProcess)."""

    def __init__(self, spec, gpus_per_engine: int):
        resources = {"sao_rollout": gpus_per_engine if gpus_per_engine else 0.01}
        self.host = EngineHost.options(num_cpus=0.1, num_gpus=gpus_per_engine, resources=resources).remote(
            spec
        )
        self.url = ""

    def wait_healthy(self) -> float:
        self.url = ray.get(self.host.wait_healthy.remote())
        return 0.0

    def stop(self) -> None:
        try:
            ray.get(self.host.stop.remote(), timeout=60)
        finally:
            ray.kill(self.host)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Local Ray by default; an existing cluster when ``address`` is given."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 object_store_memory=512 << 20)  # fmt: skip
