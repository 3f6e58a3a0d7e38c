"""Memory per GPU of the training roles (worst pipeline stage) and of one SGLang engine.

GiB = 2**30 bytes ("GB" in the tables). A training role's GPU holds:

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

Sequence length = ``rollout.loop.max_context_tokens`` (every trajectory at full length: the worst
case), micro-batch = ``parallel.micro_batch_size`` sequences, or with a token budget
(``parallel.max_tokens_per_micro_batch``) the larger of the budget and one full sequence;
micro-batches per step = ``ceil(algo.batch_size x tokens per sequence / (tokens per micro-batch x DP))``.

SGLang engines (bf16 unless ``rollout.dtype`` is ``float32``/``float``): attention, norms and
embeddings split over the attention TP (``rollout.tensor_parallel / cluster.engine_dp_attention``),
experts and dense MLPs over all of the engine's GPUs; the KV cache gets
``engine_mem_fraction x GPU memory - weights`` per GPU, ``layers x 2 x max(1, KV heads /
attention TP) x head_dim x 2 bytes`` per token per GPU, one pool per DP-attention rank. An
engine fits when one full-context trajectory fits one pool. Weight sync moves every parameter
once per step in the engine dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sao_megatron.config import ModelConfig, ParallelConfig, SAOConfig
from sao_megatron.models.builder import moe_layer_pattern
from sao_megatron.models.counting import parameter_counts
from sao_megatron.plan.params import StageParams, stage_parameters

GiB = 2**30
RESERVED_GIB = 4.0
"""CUDA context, NCCL buffers and allocator fragmentation per GPU."""
LOGIT_BYTES = 10
"""Per vocab-parallel logit element at the actor's last stage: bf16 logits + fp32 copy + fp32 probs."""


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
    t = micro_tokens(p, seq) / p.context_parallel
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
    return (
        f"TP{p.tensor_parallel} PP{p.pipeline_parallel} CP{p.context_parallel} DP{p.data_parallel} "
        f"EP{p.expert_parallel} ETP{p.expert_tensor_parallel}"
    )


def micro_tokens(p: ParallelConfig, seq: int) -> int:
    """Tokens of the largest micro-batch: ``micro_batch_size`` full sequences, or under a token
    budget the budget (a longer sequence gets a micro-batch of its own)."""
    if p.max_tokens_per_micro_batch:
        return max(p.max_tokens_per_micro_batch, seq)
    return seq * p.micro_batch_size


def role_memory(cfg: SAOConfig, role: str, stages: list[StageParams]) -> RoleMemory:
    """Memory per GPU of ``role`` (``actor`` or ``critic``) from its per-stage parameters."""
    rc = getattr(cfg, role)
    p, m = rc.parallel, cfg.model
    seq = cfg.rollout.loop.max_context_tokens
    pp, dp = p.pipeline_parallel, p.data_parallel
    dense_shard = p.world_size // (p.tensor_parallel * pp)  # DP x CP
    expert_shard = p.world_size // (pp * p.expert_parallel * p.expert_tensor_parallel)
    state_bytes = 12 if rc.bf16 else 8
    micro = math.ceil(cfg.algo.batch_size * seq / (micro_tokens(p, seq) * dp))
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
        layers = [activation_bytes_per_layer(m, p, bool(pattern[s * per_stage + i]), seq) for i in range(per_stage)]
        layer_input = 2.0 * micro_tokens(p, seq) / p.context_parallel * m.hidden_size
        layer_input /= p.tensor_parallel if p.effective_sequence_parallel else 1
        in_flight = min(pp - s, micro)
        full = sum(layers) * in_flight
        recompute = layer_input * per_stage * in_flight + max(layers)
        logits = 0.0
        if s == pp - 1 and role == "actor":
            logits = LOGIT_BYTES * micro_tokens(p, seq) / p.context_parallel * m.vocab_size / p.tensor_parallel
        mem = RoleMemory(
            role=role,
            gpus=p.world_size,
            layout=_layout(p),
            stage=s,
            params=total,
            trainable=sum(trainable.values()),
            weights=total * (2 if rc.bf16 else 4),
            grads=4.0 * sum(trainable.values()),
            optimizer=opt_dist if p.use_distributed_optimizer else opt_full,
            optimizer_alt=opt_full if p.use_distributed_optimizer else opt_dist,
            activations=recompute if p.recompute_activations else full,
            activations_alt=full if p.recompute_activations else recompute,
            logits=logits,
            reserved=RESERVED_GIB * GiB,
        )
        if worst is None or mem.total > worst.total:
            worst = mem
    assert worst is not None, f"{role}: no pipeline stages"
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
    dtype_bytes = 4 if r.dtype in ("float32", "float") else 2
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
        engines=r.num_engines,
        gpus_per_engine=tp,
        layout=f"TP{tp} EP{r.expert_parallel} DP-attn{dp_attn}",
        weights=weights,
        kv_budget=budget,
        kv_bytes_per_token=kv_per_token,
        tokens_per_pool=max(0, int(budget // kv_per_token)),
        pools=dp_attn,
        sync_bytes=total * dtype_bytes,
    )
