"""SGLang engines of a run: started here (local) or on the rollout node group via Ray (cluster)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

import ray

from sao_megatron.config import SAOConfig
from sao_megatron.rollout.engine import EngineProcess, EngineSpec
from sao_megatron.spawn import free_port


class Engine(Protocol):
    @property
    def url(self) -> str: ...

    def wait_healthy(self) -> float: ...

    def stop(self) -> None: ...


@ray.remote
class EngineHost:
    """Starts one SGLang server on the node Ray placed it on (the rollout node group) and owns it."""

    def __init__(self, spec: EngineSpec):
        spec.host = ray.util.get_node_ip_address()
        self.proc = EngineProcess(spec).start()

    def wait_healthy(self) -> str:
        self.proc.wait_healthy()
        return self.proc.url

    def stop(self) -> None:
        self.proc.stop()


class RemoteEngine:
    """The driver's handle on an engine started by an :class:`EngineHost` (same API as EngineProcess)."""

    def __init__(self, spec: EngineSpec, gpus_per_engine: int):
        resources = {"sao_rollout": gpus_per_engine if gpus_per_engine else 0.01}
        self.host: Any = EngineHost.options(
            num_cpus=0.1, num_gpus=gpus_per_engine, resources=resources
        ).remote(spec)
        self.url: str = ""

    def wait_healthy(self) -> float:
        self.url = str(ray.get(self.host.wait_healthy.remote()))
        return 0.0

    def stop(self) -> None:
        try:
            ray.get(self.host.stop.remote(), timeout=60)
        finally:
            ray.kill(self.host)


async def start_engines(cfg: SAOConfig, model_path: Path, run_dir: Path) -> list[Engine]:
    """``rollout.num_engines`` servers of ``model_path``, healthy when this returns."""
    r = cfg.rollout
    specs = [EngineSpec(model_path=str(model_path), port=free_port(), tensor_parallel=r.tensor_parallel,
                        expert_parallel=r.expert_parallel, dtype=r.dtype, max_total_tokens=r.max_total_tokens,
                        random_seed=cfg.run.seed + i, log_path=str(run_dir / "logs" / f"engine{i}.log"))
             for i in range(r.num_engines)]  # fmt: skip
    engines: list[Engine]
    if cfg.cluster.ray_address:  # the rollout node group (the run directory is on a shared filesystem)
        gpus = r.tensor_parallel if cfg.cluster.gpus_per_node else 0
        engines = [RemoteEngine(spec, gpus) for spec in specs]
    else:
        engines = [EngineProcess(spec).start() for spec in specs]
    await asyncio.gather(*(asyncio.to_thread(e.wait_healthy) for e in engines))
    return engines
