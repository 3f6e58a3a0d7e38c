"""SGLang engines of a run: started here (local) or on the rollout node group via Ray (cluster)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.exceptions import GetTimeoutError

from sao_megatron.config import ConfigError, SAOConfig
from sao_megatron.config.cluster import engine_nodes, one_node_gpus
from sao_megatron.rollout.client import run_api_key
from sao_megatron.rollout.engine import EngineProcess, EngineSpec, check_engine_args
from sao_megatron.spawn import free_port


class Engine(Protocol):
    @property
    def url(self) -> str: ...

    def wait_healthy(self) -> float: ...

    def alive(self) -> bool:
        """The server process (every node's, for a multi-node engine) is running."""
        ...

    def stop(self) -> None: ...


@ray.remote
class EngineHost:
    """Starts one SGLang server process on the node Ray placed it on (the rollout node group) and
    owns it. An engine spanning several nodes has one host per node; node 0 serves HTTP."""

    def __init__(self, spec: EngineSpec):
        spec.host = ray.util.get_node_ip_address()
        spec.port = spec.port or free_port()  # chosen on the node that binds it
        self.spec = spec
        self.log_path = spec.log_path
        self.proc: EngineProcess | None = None

    def init_address(self) -> str:
        """``host:port`` on this node where the engine's nodes meet (node 0 only). The port was free a
        moment ago (probe-and-release): :meth:`RemoteEngine.wait_healthy` retries a clash on new ports."""
        return f"{self.spec.host}:{free_port()}"

    def launch(self, node_rank: int, nnodes: int, dist_init_addr: str, fresh_port: bool = False) -> None:
        """Start this node's server; ``fresh_port``: on a new HTTP port (a retry after a clash)."""
        if fresh_port:
            self.spec.port = free_port()
        self.spec.node_rank, self.spec.nnodes, self.spec.dist_init_addr = node_rank, nnodes, dist_init_addr
        if node_rank and self.log_path:  # the run directory is shared: one log per node
            self.spec.log_path = self.log_path.removesuffix(".log") + f".node{node_rank}.log"
        proc = EngineProcess(self.spec)
        if nnodes > 1:  # a clash needs every node started again, meeting elsewhere: RemoteEngine does it
            proc.port_retries = 0
        self.proc = proc.start()

    def port_clash(self) -> bool:
        """This node's server exited because a port it binds (HTTP, or the nodes' meeting port) was taken."""
        return self.proc is not None and not self.proc.alive() and self.proc._port_clash()

    def wait_healthy(self) -> str:
        assert self.proc is not None, "launch() first"
        self.proc.wait_healthy()
        return self.proc.url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class RemoteEngine:
    """The driver's handle on an engine started by :class:`EngineHost` s (same API as EngineProcess).

    One placement group per engine, one bundle per node it spans (``STRICT_SPREAD``: a node
    each), on the rollout node group (the ``sao_rollout`` resource); the engine's nodes meet at
    node 0's address (``--nnodes``, ``--node-rank``, ``--dist-init-addr``)."""

    def __init__(self, spec: EngineSpec, nodes: int = 1, gpus_per_node: int = 0, placement_timeout_s: float = 600.0):
        """``nodes``: nodes the engine spans; ``gpus_per_node``: GPUs it takes on each (0: a CPU engine)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        per_node = gpus_per_node
        bundle = {"CPU": 0.1, "sao_rollout": per_node or 0.01, **({"GPU": per_node} if per_node else {})}
        self.group = placement_group([bundle] * nodes, strategy="STRICT_SPREAD" if nodes > 1 else "PACK")
        try:
            ray.get(self.group.ready(), timeout=placement_timeout_s)
        except GetTimeoutError:
            from ray.util.placement_group import remove_placement_group

            from sao_megatron.driver.roles import placement_error

            remove_placement_group(self.group)
            raise placement_error(f"an engine over {nodes} node(s)", bundle, placement_timeout_s) from None
        hosts = [
            EngineHost.options(
                num_cpus=0.1,
                num_gpus=per_node,
                resources={"sao_rollout": bundle["sao_rollout"]},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=n),
            ).remote(spec)
            for n in range(nodes)
        ]
        self._launch_on(hosts)

    port_retries = 3
    """Times a multi-node engine is started again on new ports after node 0 found one taken."""

    def _launch_on(self, hosts: list[Any]) -> None:
        """Start the engine's server on ``hosts`` (their :class:`EngineHost` s, node 0 first)."""
        self.hosts, self.host, self.url = hosts, hosts[0], ""
        self._launch(fresh_port=False)

    def _launch(self, fresh_port: bool) -> str:
        nodes = len(self.hosts)
        address = str(ray.get(self.host.init_address.remote())) if nodes > 1 else ""
        ray.get([h.launch.remote(n, nodes, address, fresh_port) for n, h in enumerate(self.hosts)])
        return address

    def wait_healthy(self) -> float:
        """Until node 0 serves. Node 0 of a multi-node engine that died on a port clash (its HTTP port
        or the nodes' meeting port, both probe-and-release) is started again with every other node,
        meeting at a new address, up to :attr:`port_retries` times: restarting it alone would retry
        the taken meeting port, and the other nodes wait on the old one."""
        retries = self.port_retries if len(self.hosts) > 1 else 0
        while True:
            try:
                self.url = str(ray.get(self.host.wait_healthy.remote()))
                return 0.0
            except Exception:
                if not retries or not ray.get(self.host.port_clash.remote()):
                    raise
            retries -= 1
            ray.get([h.stop.remote() for h in self.hosts], timeout=60)
            address = self._launch(fresh_port=True)
            logging.getLogger(__name__).warning(
                "an engine over %d nodes: node 0 found a port taken; every node started again, meeting at %s",
                len(self.hosts),
                address,
            )

    def alive(self) -> bool:
        try:
            return all(ray.get([h.alive.remote() for h in self.hosts], timeout=30))
        except Exception:  # a host (or its node) is gone, or does not answer
            return False

    def stop(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([h.stop.remote() for h in self.hosts], timeout=60)
        finally:
            for h in self.hosts:
                ray.kill(h)
            remove_placement_group(self.group)


def engine_model_dir(cfg: SAOConfig, run_dir: Path) -> Path:
    """``<run_dir>/hf/engine``: the actor's ``config.json`` and tokenizer files, no weights; what the
    engines start from with random weights (``--load-format dummy``) when a broadcast weight sync
    gives them the actor's weights before their first episode. The files are those of the
    actor's HF export (same generated config and dtype, same tokenizer source), rewritten each call."""
    import json

    from sao_megatron.config.hf import hf_config_from_model
    from sao_megatron.tokenizer import copy_tokenizer_files

    out = Path(run_dir) / "hf" / "engine"
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config_from_model(cfg.model, "bfloat16" if cfg.actor.bf16 else "float32")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_tokenizer_files(getattr(cfg.actor, "init_from", ""), out)
    return out


def engine_env(cfg: SAOConfig, index: int, parent_visible: str | None) -> dict[str, str]:
    """Environment variables of engine ``index``: ``rollout.engine_env``, and on a GPU run on one node
    (:func:`~sao_megatron.config.cluster.one_node_gpus`) ``CUDA_VISIBLE_DEVICES`` naming the engine's
    own GPUs, the ids after the trainers' (which the local Ray hands out). ``parent_visible``: this
    process's ``CUDA_VISIBLE_DEVICES`` (None: unset, every GPU visible); when set, the engine's ids
    index into its list, as Ray's do for the trainers. On a cluster Ray sets the variable for the
    engine's host (:class:`RemoteEngine`)."""
    env = {str(k): str(v) for k, v in cfg.rollout.engine_env.items()}
    gpus = one_node_gpus(cfg)
    if gpus is None:
        return env
    ids = gpus.engine(index)
    if parent_visible is None:
        return {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}
    visible = [d.strip() for d in parent_visible.split(",") if d.strip()]
    if ids[-1] >= len(visible):
        raise RuntimeError(
            f"CUDA_VISIBLE_DEVICES={parent_visible!r} lists {len(visible)} GPUs, but engine {index} needs "
            f"GPUs {ids[0]}..{ids[-1]} of them (the trainers take the first {gpus.trainers}); make it "
            f"list cluster.gpus_per_node={cfg.cluster.gpus_per_node} GPUs, or unset it"
        )
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(visible[i] for i in ids)}


def launch_engines(
    cfg: SAOConfig,
    model_path: Path,
    run_dir: Path,
    indices: list[int] | None = None,
    restart: int = 0,
    load_format: str = "auto",
) -> list[Engine]:
    """Start ``rollout.num_engines`` servers of ``model_path`` (or only engines ``indices``), each on
    a fresh port, without waiting for them (:func:`wait_healthy`). ``restart`` > 0: the engines'
    ``restart``-th start (its own log, ``engine<i>.restart<k>.log``, so the dead server's log stays).
    On one node each engine gets its own GPUs (:func:`engine_env`); a restarted engine the same."""
    r, c = cfg.rollout, cfg.cluster
    remote = bool(c.ray_address)  # the rollout node group (the run directory is on a shared filesystem)
    suffix = f".restart{restart}" if restart else ""
    parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if r.engine_args:  # before any process starts
        check_engine_args(r.engine_args)
    nodes, ranks_per_node = engine_nodes(r.tensor_parallel, c.gpus_per_node, r.nodes_per_engine)
    if nodes > 1 and not remote:
        raise ConfigError(
            f"rollout.nodes_per_engine={r.nodes_per_engine}: an engine over {nodes} nodes needs a Ray cluster "
            "(cluster.ray_address, which launch/local.sh and the Slurm launcher set); use 0 on one machine"
        )
    specs = [
        EngineSpec(
            model_path=str(model_path),
            port=0 if remote else free_port(),
            tensor_parallel=r.tensor_parallel,
            expert_parallel=r.expert_parallel,
            dtype=r.dtype,
            max_total_tokens=r.max_total_tokens,
            dp_attention=c.engine_dp_attention,
            mem_fraction_static=c.engine_mem_fraction if c.gpus_per_node else None,
            random_seed=cfg.run.seed + i,
            load_format=load_format,
            return_routed_experts=r.routing_replay != "off",
            log_path=str(run_dir / "logs" / f"engine{i}{suffix}.log"),
            env=engine_env(cfg, i, parent_visible),
            cpu=not c.gpus_per_node,
            extra_args=[str(a) for a in r.engine_args],
            api_key=run_api_key(),
            startup_timeout_s=r.engine_start_timeout_s,
            startup_timeout_key="rollout.engine_start_timeout_s",
        )
        for i in (range(r.num_engines) if indices is None else indices)
    ]
    engines: list[Engine] = []
    try:
        for spec in specs:
            if remote:
                gpus = ranks_per_node if c.gpus_per_node else 0
                engines.append(RemoteEngine(spec, nodes, gpus, c.placement_timeout_s))
            else:
                engines.append(EngineProcess(spec).start())
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


async def wait_healthy(engines: list[Engine]) -> list[Engine]:
    """``engines`` once every one answers; if one does not become healthy, all are stopped and the
    error raised."""
    try:
        await asyncio.gather(*(asyncio.to_thread(e.wait_healthy) for e in engines))
    except BaseException:
        for e in engines:
            await asyncio.to_thread(e.stop)
        raise
    return engines


async def start_engines(
    cfg: SAOConfig,
    model_path: Path,
    run_dir: Path,
    indices: list[int] | None = None,
    restart: int = 0,
    load_format: str = "auto",
) -> list[Engine]:
    """:func:`launch_engines`, healthy when this returns (:func:`wait_healthy`)."""
    return await wait_healthy(launch_engines(cfg, model_path, run_dir, indices, restart, load_format))
