"""Validation of the ``cluster`` section: node groups, engines on whole nodes, containers, env."""

from __future__ import annotations

import re

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
    if c.engine_dp_attention < 1 or r.tensor_parallel % c.engine_dp_attention:
        raise ConfigError(
            f"cluster.engine_dp_attention={c.engine_dp_attention} must divide "
            f"rollout.tensor_parallel={r.tensor_parallel}; use 1 (off) or a divisor"
        )
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
