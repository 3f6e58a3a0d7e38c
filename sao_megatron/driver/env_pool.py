"""The env worker pool: Ray actors that hold the episodes' environments, off the driver.

``rollout.env_workers`` = N > 0 starts N :class:`~sao_megatron.rollout.env_workers.EnvWorker`
actors, each reserving ``rollout.env_worker_cpus`` CPUs and holding up to
``rollout.env_worker_episodes`` episodes at once. On a cluster (``cluster.ray_address``) they run
on the nodes of ``rollout.env_node_group``: the nodes advertising ``sao_<group>``, selected by node
id without taking any of that resource (the group's ranks and engines hold all of it); locally
they share the one node. One placement group holds their CPU bundles, spread over the nodes, and a
placement that cannot happen fails within ``cluster.placement_timeout_s`` naming what was asked.

A call the driver stops waiting for (a tool call past ``rollout.loop.env_step_timeout_s``: the
agent loop cancels its wait) is cancelled in the worker too (``ray.cancel``), so a hung tool does
not linger there after its episode was closed.

Each episode goes to the live worker with the fewest open episodes (ties in turn). A worker that
dies fails the episodes it held (``environment: env worker ...``) and takes no new ones; with
every worker dead, new episodes fail the same way. The manager never crashes on either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from sao_megatron.driver.roles import offered, wait_placed
from sao_megatron.envs.base import Env
from sao_megatron.envs.format import ToolFormat
from sao_megatron.rollout.env_workers import EnvFactory, EnvWorker, EnvWorkerError, RemoteEnv

EnvWorkerActor: Any = ray.remote(EnvWorker)  # handles are untyped, as the role groups' ranks


@dataclass
class _Worker:
    """One worker actor, where it runs, its open episodes (as placed by the pool) and whether it died."""

    index: int
    actor: Any
    pid: int
    host: str
    load: int = 0
    died: str = ""

    @property
    def name(self) -> str:
        return f"env worker {self.index} (pid {self.pid} on {self.host})"

    async def call(self, method: str, *args: Any) -> Any:
        """Run ``EnvWorker.<method>(*args)`` on this worker (a :data:`WorkerCall`)."""
        if self.died:
            raise EnvWorkerError(f"{self.name} died earlier ({self.died}); {method} not run")
        ref = getattr(self.actor, method).remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:  # e.g. rollout.loop.env_step_timeout_s: end the call in the worker too
            ray.cancel(ref)
            raise
        except RayTaskError as err:  # the environment raised: its own exception, as in the driver
            raise (err.cause if isinstance(err.cause, Exception) else err) from None
        except RayActorError as err:
            self.died = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
            raise EnvWorkerError(f"{self.name} died during {method}: {self.died}") from None

    def release(self) -> None:
        self.load -= 1


class EnvWorkerPool:
    """N env workers; :meth:`factory` opens each episode's :class:`RemoteEnv` on one of them."""

    def __init__(self, workers: list[_Worker], group: Any = None):
        self.workers = workers
        self.group = group  # the placement group
        self._turn = 0

    @classmethod
    async def start(
        cls,
        num_workers: int,
        episodes_per_worker: int = 16,
        cpus: float = 1.0,
        node_group: str | None = None,
        timeout_s: float = 600.0,
    ) -> EnvWorkerPool:
        """Place and start the workers; ``node_group`` (a cluster run's ``rollout.env_node_group``)
        keeps them on the nodes advertising ``sao_<node_group>``, None lets them go anywhere."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if num_workers < 1:
            raise ValueError(f"an env worker pool needs at least one worker, got {num_workers}")
        bundle = {"CPU": float(cpus)}
        what = f"{num_workers} env workers"
        selector: Any = None  # None: any node; else one label selector per bundle
        if node_group:
            resource = f"sao_{node_group}"
            what += f" on the {node_group} nodes (those advertising {resource})"
            nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and resource in n.get("Resources", {})]
            if not nodes:
                raise RuntimeError(
                    f"Ray cannot place {what}: no node advertises {resource}; the cluster's nodes "
                    f"offer {offered()}. Set rollout.env_node_group to a group this job has nodes "
                    "for (actor, critic, rollout)"
                )
            selector = [{"ray.io/node-id": f"in({','.join(nodes)})"}] * num_workers
        group = placement_group([bundle] * num_workers, strategy="SPREAD", bundle_label_selector=selector)
        await wait_placed(group, what, bundle, timeout_s)
        actors = [
            EnvWorkerActor.options(
                num_cpus=cpus,
                max_concurrency=max(1000, 4 * episodes_per_worker),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote(episodes_per_worker)
            for i in range(num_workers)
        ]
        try:
            infos = await asyncio.wait_for(asyncio.gather(*(a.info.remote() for a in actors)), timeout_s)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(group)
            raise
        workers = [
            _Worker(i, a, info["pid"], info["host"]) for i, (a, info) in enumerate(zip(actors, infos, strict=True))
        ]
        return cls(workers, group)

    def _pick(self) -> _Worker:
        live = [w for w in self.workers if not w.died]
        if not live:
            raise EnvWorkerError(
                f"env worker pool: all {len(self.workers)} env workers died "
                f"(first: {self.workers[0].name}: {self.workers[0].died})"
            )
        self._turn += 1
        n = len(self.workers)
        return min(live, key=lambda w: (w.load, (w.index - self._turn) % n))

    async def open(self, env_name: str, env_kwargs: Mapping[str, Any], tool_format: ToolFormat) -> RemoteEnv:
        """One episode's environment on the least loaded live worker (waits for one of its slots)."""
        worker = self._pick()
        worker.load += 1
        try:
            return await RemoteEnv.open(worker.call, env_name, env_kwargs, tool_format, on_close=worker.release)
        except BaseException:
            worker.release()
            raise

    def factory(self, env_name: str, env_kwargs: Mapping[str, Any], tool_format: ToolFormat) -> EnvFactory:
        """Episodes' environments of ``env_name`` on this pool, in ``tool_format`` (the agent loops')."""
        kwargs = dict(env_kwargs)

        async def make() -> Env:
            return await self.open(env_name, kwargs, tool_format)

        return make

    async def info(self) -> list[dict[str, Any]]:
        """Each live worker's :meth:`EnvWorker.info`; a dead one's ``{"died": why}``."""

        async def one(w: _Worker) -> dict[str, Any]:
            try:
                return await w.call("info")
            except EnvWorkerError:
                return {"pid": w.pid, "host": w.host, "died": w.died}

        return list(await asyncio.gather(*(one(w) for w in self.workers)))

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w.actor)
        self.workers = []
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None
