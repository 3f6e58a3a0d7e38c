"""``sao plan`` output: Markdown tables (also used verbatim in docs/launch.md) and JSON."""

from __future__ import annotations

import dataclasses

from sao_megatron.plan.fit import Plan, role_nodes
from sao_megatron.plan.memory import RESERVED_GIB, GiB, route_memory


def _gb(x: float) -> str:
    return f"{x / GiB:,.1f}" if x >= 0.05 * GiB or x == 0 else f"{x / 2**20:,.1f} MB"


def _billions(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.3f} M"


def _millions(n: float) -> str:
    return f"{n / 1e6:,.1f}" if n >= 1e7 else f"{n / 1e6:,.3f}"


def render(plan: Plan) -> str:
    """Markdown tables (also used verbatim in docs/launch.md)."""
    cfg, c = plan.cfg, plan.cfg.cluster
    nodes = role_nodes(cfg)
    lines = [
        f"model `{cfg.model.name}`: {_billions(plan.counts['total'])} parameters, "
        f"{_billions(plan.counts['active'])} active per token; sequence {cfg.rollout.loop.max_context_tokens:,} "
        f"tokens, batch {cfg.algo.batch_size}; per-rank counts by {plan.method}",
        "",
        "| role | GPUs | nodes | layout | params/GPU (M) | weights | grads | optimizer (other) | "
        "activations (other) | logits | total GB | fits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cap = c.gpu_memory_gb * GiB
    for r in plan.roles:
        p = getattr(cfg, r.role).parallel
        opt = "dist" if p.use_distributed_optimizer else "full"
        act = "recompute" if p.recompute_activations else "stored"
        fits = "n/a (CPU)" if not c.gpus_per_node else ("yes" if r.total <= cap else "**no**")
        lines.append(
            f"| {r.role} (stage {r.stage}) | {r.gpus} | {nodes[r.role]} | {r.layout} | {_millions(r.params)} "
            f"({_millions(r.trainable)} trainable) | {_gb(r.weights)} | {_gb(r.grads)} | "
            f"{_gb(r.optimizer)} {opt} ({_gb(r.optimizer_alt)}) | {_gb(r.activations)} {act} "
            f"({_gb(r.activations_alt)}) | {_gb(r.logits)} | {_gb(r.total)} | {fits} |"
        )
    e = plan.engine
    seq = cfg.rollout.loop.max_context_tokens
    lines += [
        "",
        "| rollout | engines x GPUs | nodes | layout | weights/GPU GB | KV budget/GPU GB | KV KB/token/GPU | "
        "KV tokens/engine | full contexts/engine | weight sync/step GB | sync s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| SGLang | {e.engines} x {e.gpus_per_engine} | {nodes['rollout']} | {e.layout} | {_gb(e.weights)} | "
        f"{_gb(e.kv_budget)} | {e.kv_bytes_per_token / 1024:,.1f} | {e.tokens_per_engine:,} | "
        f"{e.tokens_per_engine / seq:,.1f} | {_gb(e.sync_bytes)} | "
        f"{e.sync_bytes / (cfg.rollout.weight_sync_gb_per_s * 1e9):,.1f} |",
        *_routes_line(plan),
        "",
        f"GPU memory {c.gpu_memory_gb:g} GB (GiB) per GPU, {c.gpus_per_node} GPUs per node; "
        f"{RESERVED_GIB:g} GB reserved per training GPU; optimizer/activations in parentheses: the "
        "other use_distributed_optimizer / recompute_activations setting. Total: the larger of the logits "
        "and, on CPU's local layer spec, the attention-score workspace "
        f"({max((r.scores for r in plan.roles), default=0) / GiB:,.1f} GB). Sync s/step: weight sync/step "
        f"at rollout.weight_sync_gb_per_s = {cfg.rollout.weight_sync_gb_per_s:g} GB/s (engines paused meanwhile; "
        "measure it with benchmarks/bench_weight_sync.py).",
    ]
    return "\n".join(lines)


def _size(x: float) -> str:
    return f"{x / GiB:,.1f} GB" if x >= GiB else f"{x / 2**20:,.1f} MB"


def _routes_line(plan: Plan) -> list[str]:
    """Routing replay's bytes (nothing when ``rollout.routing_replay`` is off)."""
    cfg = plan.cfg
    r = route_memory(cfg)
    if r is None:
        return []
    dp = cfg.actor.parallel.data_parallel
    kind = "uint8" if r.width == 1 else "int16"
    return [
        "",
        f"routing replay (rollout.routing_replay={cfg.rollout.routing_replay}): {r.moe_layers} MoE layers x "
        f"top-{r.topk} x {r.width} B ({kind}) + 1 B flag = {r.bytes_per_token:,} B/token; "
        f"{_size(r.per_trajectory)} per {cfg.rollout.loop.max_context_tokens:,}-token trajectory; "
        f"{_size(r.per_batch)} per batch of {cfg.algo.batch_size} (driver, host memory); "
        f"{_size(r.per_actor_rank)} per actor DP rank (DP {dp}, host memory); "
        f"{_size(r.device)} per micro-batch as int64 on each actor GPU (transient, in the actor's total).",
    ]


def to_json(plan: Plan) -> dict:
    return {
        "counts": plan.counts,
        "method": plan.method,
        "mismatches": plan.mismatches,
        "roles": [dataclasses.asdict(r) | {"total": r.total} for r in plan.roles],
        "engine": dataclasses.asdict(plan.engine) | {"tokens_per_engine": plan.engine.tokens_per_engine},
        "routes": dataclasses.asdict(r) if (r := route_memory(plan.cfg)) else None,
        "nodes": role_nodes(plan.cfg),
        "failures": plan.failures(),
    }
