"""Validation of the ``cluster`` section: node groups, engines on whole nodes, containers, env;
the GPUs of a run on one node (:func:`one_node_gpus`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sao_megatron.algo.choices import uses_critic
from sao_megatron.config.schema import ConfigError, SAOConfig


def check_env(key: str, env: dict) -> None:
    """Environment variables of a config key: shell identifiers with scalar values, no SAO_*."""
    for name, value in env.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(
                f"{key}: {name!r} is not a valid environment variable name (letters, digits "
                "and _, not starting with a digit)"
            )
        if name.startswith("SAO_"):
            raise ConfigError(
                f"{key}.{name}: SAO_* variables configure the launch script itself; set them "
                "in the environment of sao submit instead"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{key}.{name}={value!r}: values must be strings or numbers; quote it")


def _check_cpu_engines(cfg: SAOConfig) -> None:
    """Engine layouts SGLang's CPU engine (0.5.23, the version the CPU launcher accepts) dies on,
    measured by hand (issue 30): refused here, before any process starts, with SGLang's error."""
    c, r = cfg.cluster, cfg.rollout
    if r.expert_parallel > 1:
        raise ConfigError(
            f"rollout.expert_parallel={r.expert_parallel} on CPU engines (cluster.gpus_per_node=0): SGLang's CPU "
            "MoE (moe_forward_native) cannot route to experts held by another rank and its scheduler dies on the "
            "first batch ('index -1 is out of bounds'); use rollout.expert_parallel=1 on CPU"
        )
    if c.engine_dp_attention > 1:
        raise ConfigError(
            f"cluster.engine_dp_attention={c.engine_dp_attention} on CPU engines (cluster.gpus_per_node=0): SGLang's "
            "CPU engine dies on its first batch with attention DP ('TorchNativeAttnBackend' object has no attribute "
            "'get_cpu_graph_seq_len_fill_value'); use cluster.engine_dp_attention=1 on CPU"
        )


def engine_nodes(tensor_parallel: int, gpus_per_node: int, nodes_per_engine: int = 0) -> tuple[int, int]:
    """(nodes, ranks per node) of one engine: ``nodes_per_engine`` when set, else the fewest whole
    nodes holding its GPUs (one on a CPU-only run, ``gpus_per_node`` = 0)."""
    if nodes_per_engine:
        return nodes_per_engine, tensor_parallel // nodes_per_engine
    if not gpus_per_node or tensor_parallel <= gpus_per_node:
        return 1, tensor_parallel
    return tensor_parallel // gpus_per_node, gpus_per_node


def _check_engine_nodes(cfg: SAOConfig) -> None:
    c, r = cfg.cluster, cfg.rollout
    n = r.nodes_per_engine
    if n < 0 or (n and r.tensor_parallel % n):
        raise ConfigError(
            f"rollout.nodes_per_engine={n} must be 0 (derived) or divide rollout.tensor_parallel="
            f"{r.tensor_parallel}: an engine's ranks split evenly over its nodes"
        )
    if not n:
        return
    if c.gpus_per_node and r.tensor_parallel // n > c.gpus_per_node:
        raise ConfigError(
            f"rollout.nodes_per_engine={n}: {r.tensor_parallel // n} ranks per node (rollout.tensor_parallel="
            f"{r.tensor_parallel}) exceed cluster.gpus_per_node={c.gpus_per_node}; use "
            f"{-(-r.tensor_parallel // c.gpus_per_node)} or more nodes, or 0 (derived)"
        )
    need = n * (r.num_engines if c.gpus_per_node else 1)  # CPU engines may share a node; GPU ones cannot
    if n > 1 and c.rollout_nodes < need:
        raise ConfigError(
            f"rollout.nodes_per_engine={n} needs cluster.rollout_nodes >= {need} (an engine's nodes are "
            f"distinct nodes of the rollout group; got {c.rollout_nodes}); set it, or rollout.nodes_per_engine=0"
        )


def validate_cluster(cfg: SAOConfig) -> None:
    """Node groups must hold their role's GPUs; SGLang engines must tile whole nodes; a container
    runtime needs an image; ``cluster.env`` names are shell identifiers with scalar values."""
    c, r = cfg.cluster, cfg.rollout
    for name in ("gpus_per_node", "actor_nodes", "critic_nodes", "rollout_nodes"):
        if getattr(c, name) < 0:
            raise ConfigError(f"cluster.{name} must be >= 0 (got {getattr(c, name)})")
    if c.gpu_memory_gb <= 0:
        raise ConfigError(f"cluster.gpu_memory_gb={c.gpu_memory_gb} must be > 0; e.g. 80 (H100), 141 (H200)")
    if not 0 < c.engine_mem_fraction < 1:
        raise ConfigError(f"cluster.engine_mem_fraction={c.engine_mem_fraction} must be in (0, 1), e.g. 0.85")
    if c.cpus_per_rank < 0:
        raise ConfigError(f"cluster.cpus_per_rank={c.cpus_per_rank} must be >= 0 (Ray CPUs per trainer rank)")
    if c.checkpoint_gb_per_s <= 0:
        raise ConfigError(
            f"cluster.checkpoint_gb_per_s={c.checkpoint_gb_per_s} must be > 0 (GiB/s a training node "
            "writes its checkpoint shards at; e.g. 2)"
        )
    k = c.container
    if k.runtime != "none" and not k.image:
        raise ConfigError(
            f"cluster.container.runtime={k.runtime} needs cluster.container.image (pyxis: an enroot "
            "image such as nvcr.io#nvidia/pytorch:25.01-py3 or a .sqsh file; apptainer: a .sif file)"
        )
    if k.runtime == "none" and (k.image or k.mounts or k.workdir):
        raise ConfigError(
            "cluster.container.image/mounts/workdir are set but cluster.container.runtime=none; set "
            "runtime to pyxis or apptainer, or clear them"
        )
    for i, mount in enumerate(k.mounts):
        if not mount or "," in mount or any(ch.isspace() for ch in mount) or not mount.split(":")[0]:
            raise ConfigError(
                f"cluster.container.mounts[{i}]={mount!r}: write one SRC[:DST[:FLAGS]] per list "
                "entry, without commas or spaces"
            )
    check_env("cluster.env", c.env)
    check_env("rollout.engine_env", r.engine_env)
    if not r.engine_start_timeout_s > 0:
        raise ConfigError(f"rollout.engine_start_timeout_s={r.engine_start_timeout_s} must be > 0 seconds, e.g. 300")
    if c.gpus_per_node and "CUDA_VISIBLE_DEVICES" in r.engine_env:
        raise ConfigError(
            "rollout.engine_env.CUDA_VISIBLE_DEVICES is set on a GPU run (cluster.gpus_per_node="
            f"{c.gpus_per_node}): the run assigns each engine its GPUs (Ray on a cluster, disjoint from "
            "the trainers' on one node); remove it (docs/launch.md, GPU placement)"
        )
    if c.engine_dp_attention < 1 or r.tensor_parallel % c.engine_dp_attention:
        raise ConfigError(
            f"cluster.engine_dp_attention={c.engine_dp_attention} must divide "
            f"rollout.tensor_parallel={r.tensor_parallel}; use 1 (off) or a divisor"
        )
    if not c.gpus_per_node:
        _check_cpu_engines(cfg)
    _check_engine_nodes(cfg)
    g = c.gpus_per_node
    groups = {"actor_nodes": c.actor_nodes, "critic_nodes": c.critic_nodes, "rollout_nodes": c.rollout_nodes}
    if not g and any(groups.values()):
        if not uses_critic(cfg.algo.advantage):
            groups.pop("critic_nodes")
        for key, nodes in groups.items():
            if not nodes:
                raise ConfigError(
                    f"cluster.{key}=0 on a CPU-only run (gpus_per_node=0) with other node groups "
                    f"set: give every role its nodes (e.g. cluster.{key}=1) or set all three to 0 "
                    "(one shared node)"
                )
    if not g:
        return
    if r.tensor_parallel % g and g % r.tensor_parallel:
        raise ConfigError(
            f"rollout.tensor_parallel={r.tensor_parallel} GPUs per engine must divide or be a "
            f"multiple of cluster.gpus_per_node={g}; engines cannot straddle part nodes"
        )
    for key, nodes, gpus in (
        ("actor_nodes", c.actor_nodes, cfg.actor.parallel.world_size),
        ("critic_nodes", c.critic_nodes, cfg.critic.parallel.world_size),
        ("rollout_nodes", c.rollout_nodes, r.num_engines * r.tensor_parallel),
    ):
        if nodes and nodes * g < gpus:
            raise ConfigError(
                f"cluster.{key}={nodes} x gpus_per_node={g} < {gpus} GPUs the role needs; set it "
                f"to {-(-gpus // g)} or 0 (derived)"
            )


@dataclass(frozen=True)
class OneNodeGpus:
    """GPU ids of a run on one node: the trainers' ranks take ``0 .. trainers - 1`` (the local Ray
    holds exactly these), engine ``i`` the ``engine_tp`` ids after them, engine after engine."""

    trainers: int
    engine_tp: int

    def engine(self, index: int) -> range:
        """Device ids (indices into the node's visible GPUs) of engine ``index``."""
        first = self.trainers + index * self.engine_tp
        return range(first, first + self.engine_tp)


def one_node_gpus(cfg: SAOConfig) -> OneNodeGpus | None:
    """The GPU split of a run on one node (no ``cluster.ray_address``, ``cluster.gpus_per_node`` > 0);
    None when Ray places every GPU (a cluster) or the run has none (``gpus_per_node=0``).

    Checked where the run starts its local Ray and its engines, not when a config is loaded: a
    cluster config has no ``ray_address`` until the launcher adds it (``sao submit``, ``sao plan``
    read it without). Raises :class:`ConfigError` when the actor, the critic (if the advantage
    estimator uses one) and the engines need more GPUs than the node has."""
    c, r = cfg.cluster, cfg.rollout
    if c.ray_address or not c.gpus_per_node:
        return None
    actor, critic = cfg.actor.parallel.world_size, cfg.critic.parallel.world_size
    critic_key = f"critic.parallel.world_size={critic}"
    if not uses_critic(cfg.algo.advantage):
        critic, critic_key = 0, f"no critic (algo.advantage={cfg.algo.advantage})"
    engines = r.num_engines * r.tensor_parallel
    if actor + critic + engines > c.gpus_per_node:
        raise ConfigError(
            f"cluster.gpus_per_node={c.gpus_per_node} < {actor + critic + engines} GPUs this run needs on one "
            f"node (no cluster.ray_address): actor.parallel.world_size={actor} + {critic_key} + "
            f"rollout.num_engines={r.num_engines} x rollout.tensor_parallel={r.tensor_parallel}; shrink them "
            "to fit, or run on several nodes (sao submit; launch/slurm sets cluster.ray_address)"
        )
    return OneNodeGpus(trainers=actor + critic, engine_tp=r.tensor_parallel)
