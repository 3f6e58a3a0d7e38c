"""The plan of a config: node groups, per-rank parameters and memory of every role, fit checks."""

from __future__ import annotations

from dataclasses import dataclass

from sao_megatron import algo
from sao_megatron.config import ParallelConfig, SAOConfig
from sao_megatron.models.counting import parameter_counts
from sao_megatron.plan.memory import EngineMemory, GiB, RoleMemory, engine_memory, role_memory
from sao_megatron.plan.meta import MetaJob, meta_parameters
from sao_megatron.plan.params import StageParams, analytic_parameters


class PlanError(RuntimeError):
    """A role does not fit its GPUs; the message names the role and how many GB it is short."""


def uses_critic(cfg: SAOConfig) -> bool:
    """Whether the run trains a critic (its advantage estimator bootstraps from values)."""
    return algo.uses_critic(cfg.algo.advantage)


def role_nodes(cfg: SAOConfig) -> dict[str, int]:
    """Nodes per role group. CPU-only (``gpus_per_node == 0``): the explicit counts when any is
    given (a multi-node CPU cluster, e.g. CI's), else 0 for every role (one shared node)."""
    c = cfg.cluster
    gpus = {
        "actor": cfg.actor.parallel.world_size,
        "critic": cfg.critic.parallel.world_size if uses_critic(cfg) else 0,
        "rollout": cfg.rollout.num_engines * cfg.rollout.tensor_parallel,
    }
    explicit = {"actor": c.actor_nodes, "critic": c.critic_nodes, "rollout": c.rollout_nodes}
    if not c.gpus_per_node:
        if not any(explicit.values()):
            return {"actor": 0, "critic": 0, "rollout": 0}
        return {k: explicit[k] if gpus[k] else 0 for k in gpus}
    g = c.gpus_per_node
    return {k: explicit[k] or -(-gpus[k] // g) for k in gpus}


@dataclass
class Plan:
    cfg: SAOConfig
    counts: dict[str, int]
    roles: list[RoleMemory]
    engine: EngineMemory
    method: str
    mismatches: list[str]

    def failures(self) -> list[str]:
        """One line per role that does not fit its GPUs (empty on CPU-only configs)."""
        c = self.cfg.cluster
        if not c.gpus_per_node:
            return []
        cap = c.gpu_memory_gb * GiB
        out = []
        for r in self.roles:
            if r.total > cap:
                out.append(
                    f"{r.role} does not fit: {r.total / GiB:.1f} GB per GPU needed on {c.gpu_memory_gb:g} GB "
                    f"GPUs (stage {r.stage}), short by {(r.total - cap) / GiB:.1f} GB; "
                    f"{_advice(getattr(self.cfg, r.role).parallel, r.role)}"
                )
        e, seq = self.engine, self.cfg.rollout.loop.max_context_tokens
        need = e.weights + seq * e.kv_bytes_per_token
        have = c.engine_mem_fraction * cap
        if need > have:
            out.append(
                f"rollout does not fit: an engine GPU needs {need / GiB:.1f} GB (weights + one {seq}-token "
                f"context) of {have / GiB:.1f} GB (engine_mem_fraction x {c.gpu_memory_gb:g}), short by "
                f"{(need - have) / GiB:.1f} GB; raise rollout.tensor_parallel or lower "
                f"cluster.engine_dp_attention"
            )
        elif self.cfg.rollout.max_total_tokens > e.tokens_per_engine:
            out.append(
                f"rollout does not fit: rollout.max_total_tokens={self.cfg.rollout.max_total_tokens:,} "
                f"exceeds the {e.tokens_per_engine:,} KV-cache tokens an engine holds; lower it"
            )
        return out


def _advice(p: ParallelConfig, role: str) -> str:
    tips = []
    if not p.recompute_activations:
        tips.append(f"{role}.parallel.recompute_activations=true")
    if not p.use_distributed_optimizer:
        tips.append(f"{role}.parallel.use_distributed_optimizer=true")
    tips.append("more expert_parallel / pipeline_parallel / context_parallel GPUs")
    return "try " + ", ".join(tips)


def make_plan(cfg: SAOConfig, analytic: bool = False) -> Plan:
    """Per-rank parameters (meta build unless ``analytic``) and memory of every role."""
    names = ["actor", "critic"] if uses_critic(cfg) else ["actor"]
    jobs = [
        MetaJob(cfg.model, getattr(cfg, r).parallel, cfg.critic if r == "critic" else None, getattr(cfg, r).bf16)
        for r in names
    ]
    stages = [analytic_parameters(j.model, j.parallel, j.critic) for j in jobs]
    mismatches = []
    method = "analytic"
    if not analytic and cfg.model.tie_word_embeddings and any(j.parallel.pipeline_parallel > 1 for j in jobs):
        method = "analytic (tied embeddings with PP > 1: Megatron syncs the tied copy on CUDA at build time)"
    elif not analytic:
        method = "meta-device build"
        built = meta_parameters(jobs)
        mismatches = [
            f"{role} stage {s}: meta build {_summary(b)} vs analytic {_summary(a)}"
            for role, ours, theirs in zip(names, stages, built, strict=True)
            for s, (a, b) in enumerate(zip(ours, theirs, strict=True))
            if a != b
        ]
        stages = built
    roles = [role_memory(cfg, role, st) for role, st in zip(names, stages, strict=True)]
    return Plan(cfg, parameter_counts(cfg.model), roles, engine_memory(cfg), method, mismatches)


def _summary(stage: StageParams) -> str:
    return f"{len(stage)} tensors / {sum(n for n, _ in stage.values()):,} params"
