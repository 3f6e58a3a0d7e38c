"""``sao plan``: parameters and memory per GPU of every role, before any GPU is touched.

Parameters per rank are counted two independent ways:

- **meta build** (exact, the default): the role's real Megatron model (``builder.build_gpt`` or
  ``critic.build_critic``, local layer spec) is built on torch's ``meta`` device, one rank per
  pipeline stage, inside a one-process ``torch.distributed`` world of the role's size made with
  torch's ``fake`` backend, so ``parallel_state.initialize_model_parallel`` sees the real layout.
  No weights are allocated and no other process or GPU is involved; it runs in a child process
  (``CUDA_VISIBLE_DEVICES=""``) so Megatron's global state never leaks into the caller.
- **analytic** (:func:`stage_parameters`): every parameter of a stage's rank with its Megatron
  name and local shape, from the model shape and layout alone. Tests check it name by name
  against the meta build; ``sao plan --analytic`` uses it without importing Megatron.

TP, CP, EP and expert-TP ranks of one stage hold equally many parameters, so one rank per stage
is exact. Memory per GPU (GiB = 2**30 bytes; "GB" in the tables) of a training role, for the
worst pipeline stage:

==============  ============================================================================
weights         parameters x 2 bytes (bf16) or 4 (fp32); frozen ones included
grads           trainable x 4 bytes (Megatron DDP ``grad_reduce_in_fp32=True``)
optimizer       Adam: trainable x 12 bytes with bf16 (fp32 master, m, v), 8 with fp32 params;
                the distributed optimizer divides dense params by DP x CP and expert params by
                the expert-DP size ``world / (PP x EP x expert-TP)``
activations     bf16 tensors saved for backward per layer and micro-batch (flash attention, no
                s^2 term; SP splits the norm/residual tensors by TP), x layers per stage x
                micro-batches in flight under 1F1B (``min(PP - stage, micro-batches)``); full
                recompute keeps only each layer's input plus one layer's activations
logits          last stage of the actor: ``[s*b/CP, V/TP]`` x 10 bytes (bf16 logits, fp32
                copy, fp32 softmax saved by ``logprobs.vocab_parallel_logprobs``)
reserved        4 GiB: CUDA context, NCCL buffers, allocator fragmentation
==============  ============================================================================

Sequence length = ``rollout.max_context_tokens`` (every trajectory at full length: the worst
case), micro-batch = ``parallel.micro_batch_size``, micro-batches per step =
``ceil(algo.batch_size / (micro_batch_size x DP))``.

SGLang engines (bf16 unless ``rollout.dtype=float32``): attention, norms and embeddings split
over the attention TP (``rollout.tensor_parallel / cluster.engine_dp_attention``), experts and
dense MLPs over all of the engine's GPUs; the KV cache gets
``engine_mem_fraction x GPU memory - weights`` per GPU, ``layers x 2 x max(1, KV heads /
attention TP) x head_dim x 2 bytes`` per token per GPU, one pool per DP-attention rank. An
engine fits when one full-context trajectory fits one pool. Weight sync moves every parameter
once per step in the engine dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sao_megatron.config import CriticConfig, ModelConfig, ParallelConfig, SAOConfig
from sao_megatron.models.builder import moe_layer_pattern
from sao_megatron.models.counting import parameter_counts

GiB = 2**30
RESERVED_GIB = 4.0
"""CUDA context, NCCL buffers and allocator fragmentation per GPU."""
LOGIT_BYTES = 10
"""Per vocab-parallel logit element at the actor's last stage: bf16 logits + fp32 copy + fp32 probs."""

StageParams = dict[str, tuple[int, bool]]
"""Parameter name -> (elements on this rank, trainable)."""


class PlanError(RuntimeError):
    """A role does not fit its GPUs; the message names the role and how many GB it is short."""


# --------------------------------------------------------------------------------------------
# Parameters per rank
# --------------------------------------------------------------------------------------------
def stage_parameters(
    m: ModelConfig, p: ParallelConfig, stage: int, critic: CriticConfig | None = None
) -> StageParams:
    """Every parameter a rank of pipeline ``stage`` holds (Megatron local-spec names, local layer indices)."""
    tp, ep, etp, pp = p.tensor_parallel, p.expert_parallel, p.expert_tensor_parallel, p.pipeline_parallel
    h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    per_stage = m.num_layers // pp
    pattern = moe_layer_pattern(m)
    out: dict[str, int] = {}
    if stage == 0:
        out["embedding.word_embeddings.weight"] = m.vocab_size // tp * h
    for i in range(per_stage):
        pre = f"decoder.layers.{i}."
        out[pre + "input_layernorm.weight"] = h
        out[pre + "self_attention.linear_proj.weight"] = h * (a * d // tp)
        out[pre + "self_attention.linear_qkv.weight"] = (a + 2 * g) * d // tp * h
        if m.qk_layernorm:
            out[pre + "self_attention.q_layernorm.weight"] = d
            out[pre + "self_attention.k_layernorm.weight"] = d
        out[pre + "pre_mlp_layernorm.weight"] = h
        if pattern[stage * per_stage + i]:
            out[pre + "mlp.router.weight"] = m.num_experts * h
            for j in range(m.num_experts // ep):
                expert = f"{pre}mlp.experts.local_experts.{j}."
                out[expert + "linear_fc1.weight"] = 2 * (m.moe_ffn_hidden_size // etp) * h
                out[expert + "linear_fc2.weight"] = h * (m.moe_ffn_hidden_size // etp)
            if m.moe_shared_expert_intermediate_size:
                width = m.moe_shared_expert_intermediate_size // tp
                out[pre + "mlp.shared_experts.linear_fc1.weight"] = 2 * width * h
                out[pre + "mlp.shared_experts.linear_fc2.weight"] = h * width
        else:
            out[pre + "mlp.linear_fc1.weight"] = 2 * (m.ffn_hidden_size // tp) * h
            out[pre + "mlp.linear_fc2.weight"] = h * (m.ffn_hidden_size // tp)
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = h
        if critic is not None:  # critic.ValueHead replaces the LM head
            out["output_layer.weight"] = h
            out["output_layer.bias"] = 1
        elif not m.tie_word_embeddings or pp > 1:  # tied + PP: the last stage keeps a synced copy
            out["output_layer.weight"] = m.vocab_size // tp * h
    frozen = _frozen(out, critic)
    return {name: (n, name not in frozen) for name, n in out.items()}


def _frozen(names, critic: CriticConfig | None) -> set[str]:
    """``critic.freeze`` semantics: frozen if any freeze regex matches and no train regex does."""
    if critic is None:
        return set()
    freeze = [re.compile(x) for x in critic.freeze_patterns]
    train = [re.compile(x) for x in critic.train_patterns]
    return {n for n in names if any(r.search(n) for r in freeze) and not any(r.search(n) for r in train)}


def analytic_parameters(
    m: ModelConfig, p: ParallelConfig, critic: CriticConfig | None = None
) -> list[StageParams]:
    return [stage_parameters(m, p, s, critic) for s in range(p.pipeline_parallel)]


@dataclass
class MetaJob:
    """One role to build on the meta device: its model, layout, critic settings (None: actor)."""

    model: ModelConfig
    parallel: ParallelConfig
    critic: CriticConfig | None = None
    bf16: bool = True


def meta_parameters(jobs: list[MetaJob], timeout_s: float = 900.0) -> list[list[StageParams]]:
    """Build each role on the meta device in a fake world of its ``world_size`` ranks, one rank per stage.

    All jobs run in one child process with CUDA hidden (local spec, CPU initialisation path:
    nothing is allocated on a GPU even on a GPU node); returns per job one :data:`StageParams`
    per pipeline stage."""
    spec = [dataclasses.asdict(job) for job in jobs]
    with tempfile.TemporaryDirectory(prefix="sao-plan-") as tmp:
        spec_path, result = Path(tmp) / "jobs.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, "-m", "sao_megatron.plan", str(spec_path), str(result)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"meta-device build failed (exit {proc.returncode}):\n{tail}")
        built = json.loads(result.read_text())
    return [[{name: (n, bool(t)) for name, (n, t) in stage.items()} for stage in job] for job in built]


def _meta_build_main(spec_path: str, result_path: str) -> None:
    """Child process of :func:`meta_parameters`."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from sao_megatron import megatron_cpu
    from sao_megatron.config import _build
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.critic import build_critic

    megatron_cpu.apply()
    results = []
    for job in json.loads(Path(spec_path).read_text()):
        m = _build(ModelConfig, job["model"], "model")
        p = _build(ParallelConfig, job["parallel"], "parallel")
        critic = _build(CriticConfig, job["critic"], "critic") if job["critic"] is not None else None
        if p.context_parallel > 1:  # the local spec refuses CP (TE only); CP ranks hold what DP ranks hold
            p = dataclasses.replace(p, context_parallel=1)
        stages = []
        for stage in range(p.pipeline_parallel):
            rank = stage * (
                p.world_size // p.pipeline_parallel
            )  # Megatron order tp-cp-ep-dp-pp: PP outermost
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p.world_size)
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tensor_parallel, pipeline_model_parallel_size=p.pipeline_parallel,
                context_parallel_size=p.context_parallel, expert_model_parallel_size=p.expert_parallel,
                expert_tensor_parallel_size=p.expert_tensor_parallel, create_gloo_process_groups=False,
            )  # fmt: skip
            assert ps.get_pipeline_model_parallel_rank() == stage, "unexpected Megatron rank order"
            with torch.device("meta"):
                model = (
                    build_critic(m, p, critic) if critic is not None else build_gpt(m, p, bf16=job["bf16"])
                )
            stages.append({n: (t.numel(), t.requires_grad) for n, t in model.named_parameters()})
            del model
            ps.destroy_model_parallel()
            dist.destroy_process_group()
        results.append(stages)
    Path(result_path).write_text(json.dumps(results))


# --------------------------------------------------------------------------------------------
# Memory model
# --------------------------------------------------------------------------------------------
def _is_expert(name: str) -> bool:
    return ".experts." in name


def activation_bytes_per_layer(m: ModelConfig, p: ParallelConfig, moe: bool, seq: int) -> float:
    """bf16 bytes one layer saves for backward for one micro-batch on one rank (no recompute).

    T = seq * micro_batch / CP tokens; tensors outside TP regions are split by TP under SP.
    Attention: norm input and QKV input (2 T h), QKV output, q/k-norm outputs, RoPE'd q/k,
    attention output ((a + 2g) + 2 (a + g) + a) T d / TP. Dense MLP: 2 T h + 3 T f / TP.
    MoE: 2 T h + router logits/probs (fp32) + per routed token copy (T k / TP_sp x expert-TP
    on average): its input and output (2 h) and 3 f_e / expert-TP; shared experts as dense."""
    tp, etp = p.tensor_parallel, p.expert_tensor_parallel
    sp = tp if p.effective_sequence_parallel else 1
    t = seq * p.micro_batch_size / p.context_parallel
    h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    elems = 2 * t * h / sp + t * d * ((a + 2 * g) + 2 * (a + g) + a) / tp
    if moe:
        routed = t / sp * m.moe_router_topk * etp
        elems += 2 * t * h / sp + 4 * t * m.num_experts / sp  # fp32 logits and probs, in bf16 units
        elems += routed * (2 * h + 3 * m.moe_ffn_hidden_size / etp)
        if m.moe_shared_expert_intermediate_size:
            elems += t * h / sp + 3 * t * m.moe_shared_expert_intermediate_size / tp
    else:
        elems += 2 * t * h / sp + 3 * t * m.ffn_hidden_size / tp
    return 2.0 * elems


@dataclass
class RoleMemory:
    """Per-GPU memory of one training role at its worst pipeline stage (bytes)."""

    role: str
    gpus: int
    layout: str
    stage: int
    params: int
    trainable: int
    weights: float
    grads: float
    optimizer: float
    optimizer_alt: float
    """Optimizer states with the other ``use_distributed_optimizer`` setting."""
    activations: float
    activations_alt: float
    """Activations with the other ``recompute_activations`` setting."""
    logits: float
    reserved: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.reserved


def _layout(p: ParallelConfig) -> str:
    return (f"TP{p.tensor_parallel} PP{p.pipeline_parallel} CP{p.context_parallel} DP{p.data_parallel} "
            f"EP{p.expert_parallel} ETP{p.expert_tensor_parallel}")  # fmt: skip


def role_memory(cfg: SAOConfig, role: str, stages: list[StageParams]) -> RoleMemory:
    """Memory per GPU of ``role`` (``actor`` or ``critic``) from its per-stage parameters."""
    rc = getattr(cfg, role)
    p, m = rc.parallel, cfg.model
    seq = cfg.rollout.max_context_tokens
    pp, dp = p.pipeline_parallel, p.data_parallel
    dense_shard = p.world_size // (p.tensor_parallel * pp)  # DP x CP
    expert_shard = p.world_size // (pp * p.expert_parallel * p.expert_tensor_parallel)
    state_bytes = 12 if rc.bf16 else 8
    micro = math.ceil(cfg.algo.batch_size / (p.micro_batch_size * dp))
    per_stage = m.num_layers // pp
    pattern = moe_layer_pattern(m)
    worst = None
    for s, params in enumerate(stages):
        total = sum(n for n, _ in params.values())
        trainable = {k: n for k, (n, t) in params.items() if t}
        expert = sum(n for k, n in trainable.items() if _is_expert(k))
        dense = sum(trainable.values()) - expert
        opt_dist = state_bytes * (dense / dense_shard + expert / expert_shard)
        opt_full = state_bytes * (dense + expert)
        layers = [
            activation_bytes_per_layer(m, p, bool(pattern[s * per_stage + i]), seq) for i in range(per_stage)
        ]
        layer_input = 2.0 * seq * p.micro_batch_size / p.context_parallel * m.hidden_size
        layer_input /= p.tensor_parallel if p.effective_sequence_parallel else 1
        in_flight = min(pp - s, micro)
        full = sum(layers) * in_flight
        recompute = layer_input * per_stage * in_flight + max(layers)
        logits = 0.0
        if s == pp - 1 and role == "actor":
            logits = (
                LOGIT_BYTES * seq * p.micro_batch_size / p.context_parallel * m.vocab_size / p.tensor_parallel
            )
        mem = RoleMemory(
            role=role, gpus=p.world_size, layout=_layout(p), stage=s, params=total,
            trainable=sum(trainable.values()), weights=total * (2 if rc.bf16 else 4),
            grads=4.0 * sum(trainable.values()),
            optimizer=opt_dist if p.use_distributed_optimizer else opt_full,
            optimizer_alt=opt_full if p.use_distributed_optimizer else opt_dist,
            activations=recompute if p.recompute_activations else full,
            activations_alt=full if p.recompute_activations else recompute,
            logits=logits, reserved=RESERVED_GIB * GiB,
        )  # fmt: skip
        if worst is None or mem.total > worst.total:
            worst = mem
    return worst


@dataclass
class EngineMemory:
    """One SGLang engine: per-GPU weights and KV-cache capacity."""

    engines: int
    gpus_per_engine: int
    layout: str
    weights: float
    kv_budget: float
    kv_bytes_per_token: float
    tokens_per_pool: int
    pools: int
    sync_bytes: float

    @property
    def tokens_per_engine(self) -> int:
        return self.tokens_per_pool * self.pools


def engine_memory(cfg: SAOConfig) -> EngineMemory:
    m, r, c = cfg.model, cfg.rollout, cfg.cluster
    tp, dp_attn = r.tensor_parallel, c.engine_dp_attention
    attn_tp = tp // dp_attn
    dtype_bytes = 4 if r.dtype == "float32" else 2
    full = stage_parameters(m, ParallelConfig(), 0)
    weights = 0.0
    for name, (n, _) in full.items():
        split = tp if (".mlp." in name and "router" not in name) else attn_tp
        weights += n / split * dtype_bytes
    kv_heads = max(1.0, m.num_query_groups / attn_tp)
    kv_per_token = m.num_layers * 2 * kv_heads * m.head_dim * 2
    budget = c.engine_mem_fraction * c.gpu_memory_gb * GiB - weights
    total = parameter_counts(m)["total"]
    return EngineMemory(
        engines=r.num_engines, gpus_per_engine=tp, layout=f"TP{tp} EP{r.expert_parallel} DP-attn{dp_attn}",
        weights=weights, kv_budget=budget, kv_bytes_per_token=kv_per_token,
        tokens_per_pool=max(0, int(budget // kv_per_token)), pools=dp_attn, sync_bytes=total * dtype_bytes,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------
def uses_critic(cfg: SAOConfig) -> bool:
    from sao_megatron.driver.advantages import uses_critic as _uses

    return _uses(cfg.algo)


def role_nodes(cfg: SAOConfig) -> dict[str, int]:
    """Nodes per role group (0 for every role when ``gpus_per_node == 0``: one shared node)."""
    c = cfg.cluster
    if not c.gpus_per_node:
        return {"actor": 0, "critic": 0, "rollout": 0}
    g = c.gpus_per_node
    gpus = {"actor": cfg.actor.parallel.world_size, "critic": cfg.critic.parallel.world_size if uses_critic(cfg) else 0,
            "rollout": cfg.rollout.num_engines * cfg.rollout.tensor_parallel}  # fmt: skip
    explicit = {"actor": c.actor_nodes, "critic": c.critic_nodes, "rollout": c.rollout_nodes}
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
                out.append(f"{r.role} does not fit: {r.total / GiB:.1f} GB per GPU needed on {c.gpu_memory_gb:g} GB "
                           f"GPUs (stage {r.stage}), short by {(r.total - cap) / GiB:.1f} GB; "
                           f"{_advice(getattr(self.cfg, r.role).parallel, r.role)}")  # fmt: skip
        e, seq = self.engine, self.cfg.rollout.max_context_tokens
        need = e.weights + seq * e.kv_bytes_per_token
        have = c.engine_mem_fraction * cap
        if need > have:
            out.append(f"rollout does not fit: an engine GPU needs {need / GiB:.1f} GB (weights + one {seq}-token "
                       f"context) of {have / GiB:.1f} GB (engine_mem_fraction x {c.gpu_memory_gb:g}), short by "
                       f"{(need - have) / GiB:.1f} GB; raise rollout.tensor_parallel or lower "
                       f"cluster.engine_dp_attention")  # fmt: skip
        elif self.cfg.rollout.max_total_tokens > e.tokens_per_engine:
            out.append(f"rollout does not fit: rollout.max_total_tokens={self.cfg.rollout.max_total_tokens:,} "
                       f"exceeds the {e.tokens_per_engine:,} KV-cache tokens an engine holds; lower it")  # fmt: skip
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
    jobs = [MetaJob(cfg.model, getattr(cfg, r).parallel, cfg.critic if r == "critic" else None, getattr(cfg, r).bf16)
            for r in names]  # fmt: skip
    stages = [analytic_parameters(j.model, j.parallel, j.critic) for j in jobs]
    mismatches = []
    method = "analytic"
    if not analytic and cfg.model.tie_word_embeddings and any(j.parallel.pipeline_parallel > 1 for j in jobs):
        method = "analytic (tied embeddings with PP > 1: Megatron syncs the tied copy on CUDA at build time)"
    elif not analytic:
        method = "meta-device build"
        built = meta_parameters(jobs)
        mismatches = [f"{role} stage {s}: meta build {_summary(b)} vs analytic {_summary(a)}"
                      for role, ours, theirs in zip(names, stages, built, strict=True)
                      for s, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]  # fmt: skip
        stages = built
    roles = [role_memory(cfg, role, st) for role, st in zip(names, stages, strict=True)]
    return Plan(cfg, parameter_counts(cfg.model), roles, engine_memory(cfg), method, mismatches)


def _summary(stage: StageParams) -> str:
    return f"{len(stage)} tensors / {sum(n for n, _ in stage.values()):,} params"


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
        f"{_billions(plan.counts['active'])} active per token; sequence {cfg.rollout.max_context_tokens:,} "
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
        )  # fmt: skip
    e = plan.engine
    seq = cfg.rollout.max_context_tokens
    lines += [
        "",
        "| rollout | engines x GPUs | nodes | layout | weights/GPU GB | KV budget/GPU GB | KV KB/token/GPU | "
        "KV tokens/engine | full contexts/engine | weight sync/step GB |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| SGLang | {e.engines} x {e.gpus_per_engine} | {nodes['rollout']} | {e.layout} | {_gb(e.weights)} | "
        f"{_gb(e.kv_budget)} | {e.kv_bytes_per_token / 1024:,.1f} | {e.tokens_per_engine:,} | "
        f"{e.tokens_per_engine / seq:,.1f} | {_gb(e.sync_bytes)} |",
        "",
        f"GPU memory {c.gpu_memory_gb:g} GB (GiB) per GPU, {c.gpus_per_node} GPUs per node; "
        f"{RESERVED_GIB:g} GB reserved per training GPU; optimizer/activations in parentheses: the "
        "other use_distributed_optimizer / recompute_activations setting.",
    ]  # fmt: skip
    return "\n".join(lines)


def to_json(plan: Plan) -> dict:
    return {"counts": plan.counts, "method": plan.method, "mismatches": plan.mismatches,
            "roles": [dataclasses.asdict(r) | {"total": r.total} for r in plan.roles],
            "engine": dataclasses.asdict(plan.engine) | {"tokens_per_engine": plan.engine.tokens_per_engine},
            "nodes": role_nodes(plan.cfg), "failures": plan.failures()}  # fmt: skip


if __name__ == "__main__":
    _meta_build_main(sys.argv[1], sys.argv[2])
