"""Memory per GPU of the training roles (worst pipeline stage) and of one SGLang engine.

GiB = 2**30 bytes ("GB" in the tables). A training role's GPU holds:

==============  ============================================================================
weights         parameters x 2 bytes (bf16) or 4 (fp32); frozen ones included
grads           trainable x :func:`grad_bytes_per_param` (Megatron DDP's gradient buffer: fp32 under our
                ``grad_reduce_in_fp32``, not sharded by the distributed optimizer)
optimizer       Adam: trainable x :func:`optimizer_bytes_per_param` (12 with bf16: fp32 main copy, m, v;
                8 with fp32 params, which are their own main copy);
                the distributed optimizer divides dense params by DP x CP and expert params by
                the expert-DP size ``world / (PP x EP x expert-TP)``
activations     tensors saved for backward per layer and micro-batch (training dtype), x layers per
                stage x micro-batches in flight under 1F1B (``min(PP - stage, micro-batches)``); full
                recompute keeps only each layer's input plus one layer's activations. Two layer specs
                (:func:`activation_bytes_per_layer`): Transformer Engine's on GPUs (flash attention,
                no s^2 term; not yet measured) and the local spec on CPU (unfused; its fp32 attention
                scores ``[b, a/TP, s, s]`` are saved per layer, checked against measurement by
                ``tests/test_plan_measured.py``)
logits          last stage of the actor: ``LOGIT_COPIES`` logits-sized tensors ``[s*b/CP, V/TP]`` in the
                training dtype plus the logprob function's float32 chunk work; the peak holds the
                larger of this and ``scores`` (unfused attention's workspace, which comes earlier)
routes          actor, with ``rollout.routing_replay`` not ``off``: one micro-batch's engine routes as
                int64 on the GPU while it runs (:class:`RouteMemory`, transient)
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
from sao_megatron.models.builder import GRAD_REDUCE_IN_FP32, moe_layer_pattern
from sao_megatron.models.counting import parameter_counts
from sao_megatron.models.logprobs import CHUNK_ELEMENTS
from sao_megatron.plan.params import StageParams, stage_parameters

GiB = 2**30
RESERVED_GIB = 4.0
"""CUDA context, NCCL buffers and allocator fragmentation per GPU."""
LOGIT_COPIES = 2
"""Logits-sized tensors in the training dtype live at once at the actor's last stage: the output layer's
``[s, b, V/TP]`` result and its ``[b, s, V/TP]`` contiguous copy (Megatron's ``GPTModel`` output) in the
forward; the copy (which :func:`~sao_megatron.models.logprobs.vocab_parallel_logprobs` saves) and its
gradient in the backward; plus the logprob function's float32 work on one chunk of at most
``CHUNK_ELEMENTS`` logits (two chunks when the logits are bf16: the converted chunk and its scaled copy;
tests/models/test_logprobs_memory.py)."""


def grad_bytes_per_param(bf16: bool) -> int:
    """Bytes of one trainable parameter's gradient in Megatron DDP's buffer: 4 under
    :data:`~sao_megatron.models.builder.GRAD_REDUCE_IN_FP32` (the buffer is fp32), else the parameter's
    own dtype. The distributed optimizer reduce-scatters this buffer but keeps it whole on every rank."""
    return 4 if GRAD_REDUCE_IN_FP32 or not bf16 else 2


def optimizer_bytes_per_param(bf16: bool) -> int:
    """Adam's bytes per trainable parameter (before the distributed optimizer's sharding), as megatron-core
    0.19.2 allocates them without its precision-aware optimizer: ``exp_avg`` and ``exp_avg_sq`` in fp32
    (8), plus with bf16 parameters an fp32 main copy (``optimizer/distrib_optimizer.py``
    ``shard_model_param.clone().float()``; ``Float16OptimizerWithFloat16Params`` likewise unsharded).
    Its main gradients are views of the fp32 gradient buffer, so they add nothing."""
    return 12 if bf16 else 8


def _is_expert(name: str) -> bool:
    return ".experts." in name


def activation_bytes_per_layer(
    m: ModelConfig, p: ParallelConfig, moe: bool, seq: int, spec: str = "te", dtype_bytes: int = 2
) -> float:
    """Bytes one layer saves for backward for one micro-batch on one rank (no recompute).

    T = micro-batch tokens / CP; tensors outside TP regions are split by TP under SP (``sp``);
    element counts below are multiplied by ``dtype_bytes`` (2 in bf16, 4 in fp32; router scores are
    fp32 either way).

    ``spec="te"`` (Transformer Engine: fused norms, flash attention, no s^2 term; not yet measured):
    attention: norm input and QKV input (2 T h), QKV output, q/k-norm outputs, RoPE'd q/k, attention
    output ((a + 2g) + 2 (a + g) + a) T d / TP. Dense MLP: 2 T h + 3 T f / TP. MoE: 2 T h + router
    logits/probs + per routed token (T k / sp x expert-TP on average) its input and output (2 h) and
    3 f_e / expert-TP; shared experts as dense.

    ``spec="local"`` (Megatron-Core's local layer spec, unfused torch ops; counted tensor by tensor
    from what autograd saves, checked against measurement by ``tests/test_plan_measured.py``):
    each RMSNorm saves its input, its normalised input and the reciprocal RMS (2 h + 1 per token)
    and the next linear its output (h); with q/k norm, q and its normalised copy, the QKV output
    (which holds k) and normalised k, with their reciprocal RMS ((2a + (a + 2g) + g) d + a + g per
    token / TP); core attention q, k and v with k and v expanded to all a heads (3 a d / TP) and the
    output projection its input (a d / TP); the softmax output ``[b, a/TP, s, s]`` in fp32 (counted
    by :func:`attention_score_bytes`, not here). MLP: the pre-MLP norm (2 h + 1), the first linear's
    input (h), and per token through a SwiGLU of width f: the first linear's output (2 f), the
    gate, up and activated halves (3 f) and the second linear's input (f); an expert also saves its
    routing probability (1) per routed token, the router its fp32 logits (E per token) and the
    dispatcher the permuted tokens (h per routed token)."""
    tp, etp = p.tensor_parallel, p.expert_tensor_parallel
    sp = tp if p.effective_sequence_parallel else 1
    t = micro_tokens(p, seq) / p.context_parallel
    h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    if spec == "te":
        elems = 2 * t * h / sp + t * d * ((a + 2 * g) + 2 * (a + g) + a) / tp
        if moe:
            routed = t / sp * m.moe_router_topk * etp
            elems += 2 * t * h / sp + 4 * t * m.num_experts / sp  # fp32 logits and probs, in bf16 units
            elems += routed * (2 * h + 3 * m.moe_ffn_hidden_size / etp)
            if m.moe_shared_expert_intermediate_size:
                elems += t * h / sp + 3 * t * m.moe_shared_expert_intermediate_size / tp
        else:
            elems += 2 * t * h / sp + 3 * t * m.ffn_hidden_size / tp
        return 2.0 * elems * dtype_bytes / 2
    if spec != "local":
        raise ValueError(f"spec={spec!r}: expected 'te' or 'local'")
    norm = 2 * h + 1
    elems = t * (norm + h) / sp  # input norm, QKV input
    if m.qk_layernorm:
        elems += t * ((2 * a + (a + 2 * g) + g) * d + a + g) / tp
    elems += t * 4 * a * d / tp  # core attention q, k, v (all heads), output projection input
    elems += t * (norm + h) / sp  # pre-MLP norm, first linear's (or router's) input
    swiglu = 6  # per unit of width: 2 f first output, 3 f gate/up/activated, f second input
    if moe:
        routed = t / sp * m.moe_router_topk * etp
        fp32 = 4 / dtype_bytes
        elems += fp32 * t * m.num_experts / sp
        elems += routed * (h + swiglu * m.moe_ffn_hidden_size / etp + 1)
        if m.moe_shared_expert_intermediate_size:
            elems += t * swiglu * m.moe_shared_expert_intermediate_size / tp
    else:
        elems += t * swiglu * m.ffn_hidden_size / tp
    return elems * dtype_bytes


def attention_score_bytes(m: ModelConfig, p: ParallelConfig, seq: int) -> float:
    """fp32 bytes of one ``[rows, a/TP, s, s]`` attention score tensor of one micro-batch under the
    local spec's unfused attention (rows x length: the micro-batch's full-length rows, or one packed
    row of the token budget)."""
    if p.max_tokens_per_micro_batch:
        rows, length = 1, micro_tokens(p, seq)
    else:
        rows, length = p.micro_batch_size, seq
    return 4.0 * rows * m.num_attention_heads / p.tensor_parallel * (length / p.context_parallel) * length


SCORE_WORKSPACE = 4
"""Score-sized tensors the local spec's attention holds beyond the saved softmaxes while a layer computes
its own: at that peak five (the scores ``baddbmm`` writes, Megatron's global score buffer, and the
copies made for the mask and the scaling; counted in tests/test_plan_measured.py's long-sequence case),
one of them in place of the layer's own softmax, which the per-layer activations already count."""


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
    """The logits step (last stage of the actor): live after the layers' forward, with their activations."""
    scores: float
    """Unfused attention's score workspace while one layer computes its softmax (local spec), with the
    earlier layers' activations; before the logits exist, so the peak holds the larger of the two."""
    reserved: float
    routes: float = 0.0
    """Routing replay: one micro-batch's routes as int64 on the actor's GPU (:attr:`RouteMemory.device`)."""

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.activations
            + max(self.logits, self.scores)
            + self.routes
            + self.reserved
        )


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


def micro_batches_per_step(cfg: SAOConfig, role: str) -> int:
    """Micro-batches per rank per step at full-length sequences: ``ceil(batch x seq / (micro tokens x DP))``."""
    p = getattr(cfg, role).parallel
    seq = cfg.rollout.loop.max_context_tokens
    return math.ceil(cfg.algo.batch_size * seq / (micro_tokens(p, seq) * p.data_parallel))


def plan_spec(cfg: SAOConfig) -> str:
    """The layer spec a run builds: Transformer Engine's on GPUs (the builder takes it where TE is
    installed, which a GPU cluster image is assumed to have), the local spec on CPU."""
    return "te" if cfg.cluster.gpus_per_node else "local"


def stage_memory(cfg: SAOConfig, role: str, stage: int, params: StageParams, spec: str | None = None) -> RoleMemory:
    """Memory per GPU of a rank of pipeline ``stage`` of ``role`` (``actor`` or ``critic``); ``spec``
    (``te`` or ``local``) defaults to :func:`plan_spec`."""
    rc = getattr(cfg, role)
    p, m = rc.parallel, cfg.model
    spec = spec or plan_spec(cfg)
    seq = cfg.rollout.loop.max_context_tokens
    pp = p.pipeline_parallel
    dense_shard = p.world_size // (p.tensor_parallel * pp)  # DP x CP
    expert_shard = p.world_size // (pp * p.expert_parallel * p.expert_tensor_parallel)
    state_bytes = optimizer_bytes_per_param(rc.bf16)
    dtype_bytes = 2 if rc.bf16 else 4
    micro = micro_batches_per_step(cfg, role)
    per_stage = m.num_layers // pp
    pattern = moe_layer_pattern(m)
    total = sum(n for n, _ in params.values())
    trainable = {k: n for k, (n, t) in params.items() if t}
    expert = sum(n for k, n in trainable.items() if _is_expert(k))
    dense = sum(trainable.values()) - expert
    opt_dist = state_bytes * (dense / dense_shard + expert / expert_shard)
    opt_full = state_bytes * (dense + expert)
    score = attention_score_bytes(m, p, seq) if spec == "local" else 0.0
    layers = [
        activation_bytes_per_layer(m, p, bool(pattern[stage * per_stage + i]), seq, spec, dtype_bytes) + score
        for i in range(per_stage)
    ]
    layer_input = dtype_bytes * micro_tokens(p, seq) / p.context_parallel * m.hidden_size
    layer_input /= p.tensor_parallel if p.effective_sequence_parallel else 1
    in_flight = min(pp - stage, micro)
    full = sum(layers) * in_flight
    recompute = layer_input * per_stage * in_flight + max(layers)
    routes = route_memory(cfg) if role == "actor" else None
    logits = 0.0
    if stage == pp - 1 and role == "actor":
        elements = micro_tokens(p, seq) / p.context_parallel * m.vocab_size / p.tensor_parallel
        chunks = 1 if dtype_bytes == 4 else 2
        logits = LOGIT_COPIES * dtype_bytes * elements + chunks * 4 * min(CHUNK_ELEMENTS, elements)
    return RoleMemory(
        role=role,
        gpus=p.world_size,
        layout=_layout(p),
        stage=stage,
        params=total,
        trainable=sum(trainable.values()),
        weights=total * dtype_bytes,
        grads=float(grad_bytes_per_param(rc.bf16) * sum(trainable.values())),
        optimizer=opt_dist if p.use_distributed_optimizer else opt_full,
        optimizer_alt=opt_full if p.use_distributed_optimizer else opt_dist,
        activations=recompute if p.recompute_activations else full,
        activations_alt=full if p.recompute_activations else recompute,
        logits=logits,
        scores=SCORE_WORKSPACE * score,
        reserved=RESERVED_GIB * GiB,
        routes=routes.device if routes else 0.0,
    )


ROUTE_FLAG_BYTES = 1
"""Routing replay: one byte per position saying whether its routes are known."""


@dataclass
class RouteMemory:
    """Routing replay's routes (``rollout.routing_replay`` not ``off``): for every position of a trajectory the
    top-k expert ids of every MoE layer, plus a validity flag. Bytes; host memory except :attr:`device`."""

    moe_layers: int
    """Layers with a router (leading dense layers and ``moe_layer_freq`` gaps excluded)."""
    topk: int
    width: int
    """Bytes per expert id: 1 (uint8) up to 256 experts, else 2 (int16)."""
    bytes_per_token: int
    """``moe_layers x topk x width + ROUTE_FLAG_BYTES``."""
    per_trajectory: float
    """One trajectory at ``rollout.loop.max_context_tokens``."""
    per_batch: float
    """``algo.batch_size`` trajectories: what the driver holds."""
    per_actor_rank: float
    """One actor DP rank's shard of the batch, ``ceil(batch_size / DP)`` trajectories."""
    device: float
    """One actor micro-batch's routes expanded to int64 on its GPU, transient: micro-batch tokens x MoE
    layers x top-k x 8 (the whole micro-batch and every MoE layer, before any CP, SP or PP slicing)."""


def route_memory(cfg: SAOConfig) -> RouteMemory | None:
    """Routing replay's memory, or None when ``rollout.routing_replay`` is ``off`` or the model is dense."""
    m = cfg.model
    if cfg.rollout.routing_replay == "off" or not m.num_experts:
        return None
    moe_layers = sum(moe_layer_pattern(m))
    width = 1 if m.num_experts <= 256 else 2
    per_token = moe_layers * m.moe_router_topk * width + ROUTE_FLAG_BYTES
    seq = cfg.rollout.loop.max_context_tokens
    p = cfg.actor.parallel
    return RouteMemory(
        moe_layers=moe_layers,
        topk=m.moe_router_topk,
        width=width,
        bytes_per_token=per_token,
        per_trajectory=float(per_token * seq),
        per_batch=float(per_token * seq * cfg.algo.batch_size),
        per_actor_rank=float(per_token * seq * math.ceil(cfg.algo.batch_size / p.data_parallel)),
        device=float(micro_tokens(p, seq) * moe_layers * m.moe_router_topk * 8),
    )


def role_memory(cfg: SAOConfig, role: str, stages: list[StageParams], spec: str | None = None) -> RoleMemory:
    """Memory per GPU of ``role`` (``actor`` or ``critic``) at its worst pipeline stage."""
    if not stages:
        raise ValueError(f"{role}: no pipeline stages")
    per_stage = (stage_memory(cfg, role, s, params, spec) for s, params in enumerate(stages))
    return max(per_stage, key=lambda mem: mem.total)


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
    if m.family == "deepseek_v3":  # MLA caches its latent and the shared RoPE key, not per-head keys/values
        kv_per_token = m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2
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
