"""Build Megatron-Core models (actor and critic) of the mapped HF families from our config.

One function turns (model shape, parallel layout, precision) into Megatron's
``TransformerConfig``; layer specs come from Megatron's own spec helpers: the Transformer
Engine spec when TE is importable, the local (pure Megatron-Core) spec otherwise. The critic
is the actor's spec with the LM head swapped for a scalar value head (``models.critic``).

Qwen3-MoE mapping (HF -> Megatron): GQA with ``kv_channels = head_dim``, per-head RMSNorm on
queries and keys (``qk_layernorm``), RoPE over the whole head, SwiGLU MLPs and experts
(``gated_linear_unit`` + SiLU), no linear biases, RMSNorm everywhere, untied LM head.
Qwen2-MoE: no q/k norm, q/k/v biases (``add_qkv_bias``), a shared SwiGLU expert whose output
is scaled by ``sigmoid(x @ shared_expert_gate)`` (``moe_shared_expert_gate``). Mixtral: no q/k
norm, no biases, every layer MoE. GLM-4.5: q/k/v biases, optional q/k norm, RoPE on the first
``rotary_percent`` of each head (``rotary_percent``, HF ``partial_rotary_factor``), an ungated
shared expert, the first k layers dense, and the sigmoid router below. DeepSeek-V3: GLM's MoE
layers and multi-latent attention (``MLATransformerConfig``, :func:`mla_kwargs`; on the local spec
with :class:`~sao_megatron.models.mla_attention.LocalMLACoreAttention`, :func:`layer_spec`).

Softmax router (HF: ``softmax over all experts -> topk``, then ``/ sum`` with ``norm_topk_prob``):

- renormalised (``moe_router_renormalize``): Megatron's default ``topk -> softmax over the k``,
  the same weights. For top-1 both give exactly 1.0, but ``TransformerConfig`` rejects top-1
  without pre-softmax (the router would get no gradient from the weights, as in HF); it is
  validated with ``moe_router_pre_softmax=True`` and the flag is cleared afterwards (the router
  reads it at every forward).
- not renormalised: ``moe_router_pre_softmax=True`` (softmax over all experts, then top-k).

Sigmoid router (GLM-4.5; HF ``Glm4MoeTopkRouter``): ``s = sigmoid(logits)``; the top-k (inside
the best ``moe_router_group_topk`` of ``moe_router_num_groups`` groups) by ``s + expert_bias``;
weights ``s`` of those, ``/ sum`` when top-k > 1, times ``moe_router_topk_scaling_factor``.
Megatron's ``topk_routing_with_score_function`` computes the same, ranking groups by their best
``topk // group_topk`` scores where HF takes the best 2 (``config/shape.py`` allows groups only
where the two agree). The expert bias is a buffer, ``router.expert_bias``, that Megatron moves
after every optimizer step by ``moe_router_bias_update_rate`` (``actor.router_bias_update``:
0 when frozen, the default, and always 0 for the critic).

GPU performance knobs (``parallel.fusions``, ``selective_recompute``, ``overlap_grad_reduce``,
``overlap_param_gather``; ``None`` = on exactly when Transformer Engine is in use) are resolved
once by :func:`resolved`; :func:`fusion_kwargs`, :func:`recompute_kwargs` and :func:`ddp_config`
turn them into Megatron settings.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sao_megatron.config import ConfigError, ModelConfig, ParallelConfig
from sao_megatron.models.layout import check_expert_tp_attributes


def have_transformer_engine() -> bool:
    """TE is used only when a GPU is present and the package imports; never on CPU."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _te_at_least(version: str) -> bool:
    from megatron.core.utils import is_te_min_version

    return is_te_min_version(version)  # False without TE (Megatron reports version 0.0.0)


def _have_apex_wgrad_fusion() -> bool:
    """APEX's ``fused_weight_gradient_mlp_cuda``, which the (non-TE) output layer needs for
    ``gradient_accumulation_fusion``; GPTModel builds it even with the TE spec."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


@dataclass(frozen=True)
class PerfKnobs:
    """One role's GPU performance settings with every ``None`` resolved (see ``ParallelConfig``)."""

    transformer_engine: bool
    """TE layer spec in use (a GPU and the ``transformer_engine`` package)."""
    fusions: bool
    selective_recompute: bool
    """False whenever full recompute (``recompute_activations``) is on: full wins."""
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    """Only with the distributed optimizer (there is no parameter all-gather otherwise)."""


def resolved(p: ParallelConfig) -> PerfKnobs:
    """The single place where ``None`` knobs become booleans: ``None`` follows TE presence.

    Raises ``ConfigError`` for ``fusions=true`` without TE: Megatron refuses fused RoPE and
    fused MoE permutation without it (``TransformerConfig`` raises at construction).
    """
    te = have_transformer_engine()
    if p.fusions and not te:
        raise ConfigError(
            "parallel.fusions=true needs Transformer Engine (a CUDA GPU and the transformer_engine "
            "package), which this process lacks; set parallel.fusions to null (on exactly with TE) or false"
        )

    def on(value: bool | None) -> bool:
        return te if value is None else value

    return PerfKnobs(
        transformer_engine=te,
        fusions=on(p.fusions),
        selective_recompute=on(p.selective_recompute) and not p.recompute_activations,
        overlap_grad_reduce=on(p.overlap_grad_reduce),
        # None: off. The policy's weights are exported right after every step, so the gather
        # has no forward to hide behind (true still works: the step gathers synchronously).
        overlap_param_gather=bool(p.overlap_param_gather) and p.use_distributed_optimizer,
    )


def fusion_kwargs(m: ModelConfig, k: PerfKnobs) -> dict[str, bool]:
    """Megatron's fused kernels for this model, each only where Megatron 0.19 can run it.

    On with ``k.fusions`` (which implies TE): fused RoPE (TE >= 1.4), bias-SwiGLU and
    bias-dropout-add (Megatron's own ``torch.compile`` kernels; no bias here, so they fuse the
    activation / residual add), grouped expert GEMM (TE ``GroupedLinear``), fused token
    permutation (TE >= 2.1) and fused top-k routing + aux-loss scores (TE >= 2.7, as Megatron
    documents). ``gradient_accumulation_fusion`` only with APEX's ``fused_weight_gradient_mlp_cuda``:
    the LM head is Megatron's own ``ColumnParallelLinear`` on every spec and raises without it.
    Always off: ``masked_softmax_fusion`` (read only by the local spec's attention; the TE spec
    uses TE's fused attention) and ``persist_layer_norm`` (APEX LayerNorm only; TE's RMSNorm
    ignores it, the local torch RMSNorm refuses it).
    """
    on, moe = k.fusions, bool(m.num_experts)
    return dict(
        apply_rope_fusion=on and _te_at_least("1.4.0"),
        bias_activation_fusion=on,
        bias_dropout_fusion=on,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=on and _have_apex_wgrad_fusion(),
        moe_grouped_gemm=on and moe,
        moe_permute_fusion=on and moe and _te_at_least("2.1.0"),
        moe_router_fusion=on and moe and _te_at_least("2.7.0"),
    )


def recompute_kwargs(m: ModelConfig, p: ParallelConfig, k: PerfKnobs, grouped_gemm: bool) -> dict[str, Any]:
    """Full recompute (every layer) when ``recompute_activations``; else selective when on.

    With TE: the separate norms (``layernorm``; TE fuses the input norm into QKV, leaving MoE
    layers' pre-MLP norm) and, with grouped GEMM, the experts' SwiGLU (``moe_act``, which Megatron
    allows only there): cheap to recompute, and their outputs are discarded. Not ``core_attn``:
    TE's fused attention stores no ``[b, heads, s, s]`` softmax (Megatron advises against it).
    Without TE: ``core_attn`` only, the local attention's softmax; the output-discarding
    checkpoint behind ``layernorm`` / ``moe_act`` reads TE's FP8 state in Megatron 0.19
    (``CheckpointWithoutOutput(fp8=False)`` sets ``fp8 = True``), so it needs TE.
    """
    if p.recompute_activations:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if not k.selective_recompute:
        return {}
    if not k.transformer_engine:
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    modules = ["layernorm"]
    if m.num_experts and grouped_gemm:
        modules.append("moe_act")
    return dict(recompute_granularity="selective", recompute_modules=modules)


GRAD_REDUCE_IN_FP32 = True
"""Megatron DDP accumulates and reduces gradients in fp32 whatever the parameters' dtype: its gradient
buffer is ``torch.float`` (megatron-core 0.19.2 ``distributed/param_and_grad_buffer.py``, ``grad_dtype =
torch.float if grad_reduce_in_fp32 else param.dtype``). ``sao plan`` counts gradient bytes from it."""


def ddp_config(p: ParallelConfig):
    """Megatron's ``DistributedDataParallelConfig`` for a role (:data:`GRAD_REDUCE_IN_FP32`)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    k = resolved(p)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=GRAD_REDUCE_IN_FP32,
        overlap_grad_reduce=k.overlap_grad_reduce,
        overlap_param_gather=k.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
    )


def moe_layer_pattern(m: ModelConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one (HF ``decoder_sparse_step`` and ``mlp_only_layers``)."""
    if not m.num_experts:
        return [0] * m.num_layers
    dense = set(m.dense_layers)
    return [int(i not in dense and (i + 1) % m.moe_layer_freq == 0) for i in range(m.num_layers)]


def transformer_config(
    m: ModelConfig,
    p: ParallelConfig,
    bf16: bool = False,
    for_loading: bool = False,
    *,
    router_bias_update_rate: float = 0.0,
    routing_replay: bool = False,
):
    """The single place where Megatron's ``TransformerConfig`` is built.

    ``router_bias_update_rate``: Megatron's step of the routers' expert bias per optimizer step
    (``moe_router_bias_update_rate``; 0 keeps it as loaded). ``routing_replay``: the routers' top-k
    goes through Megatron's ``RouterReplay`` hook (``models.replay``), which the fused top-k bypasses,
    so ``moe_router_fusion`` stays off.

    ``for_loading``: every weight is read from a checkpoint right after building (checkpoint
    conversion): parameters are built on the CPU whatever devices the process sees
    (``use_cpu_initialization``) and only allocated, not initialised (``perform_initialization``
    off), so building touches no memory the load will not fill and no GPU."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    knobs = resolved(p)
    fusions = fusion_kwargs(m, knobs)
    if routing_replay:
        fusions["moe_router_fusion"] = False
    moe: dict[str, Any] = {}
    softmax = m.moe_router_score_function == "softmax"
    scaling, groups = m.moe_router_topk_scaling_factor, m.moe_router_num_groups
    if m.num_experts:
        moe = dict(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size or None,
            moe_shared_expert_gate=m.moe_shared_expert_gate,
            moe_router_score_function=m.moe_router_score_function,
            moe_router_pre_softmax=softmax and (not m.moe_router_renormalize or m.moe_router_topk == 1),
            moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=router_bias_update_rate,
            moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=m.moe_router_group_topk if groups > 1 else None,
            moe_layer_freq=moe_layer_pattern(m),
            moe_token_dispatcher_type=p.moe_token_dispatcher,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_router_dtype="fp32",
        )
    else:  # the MoE fusions are MoE-only settings
        fusions = {k: v for k, v in fusions.items() if not k.startswith("moe_")}
    config_class, mla = TransformerConfig, {}
    if m.family == "deepseek_v3":
        config_class, mla = MLATransformerConfig, mla_kwargs(m)
        fusions["apply_rope_fusion"] = False  # Megatron 0.19: MLA's fused RoPE is experimental, training only
    config = config_class(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size or m.moe_ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim,
        qk_layernorm=m.qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        context_parallel_size=p.context_parallel,
        expert_model_parallel_size=p.expert_parallel,
        expert_tensor_parallel_size=p.expert_tensor_parallel,
        sequence_parallel=p.effective_sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        use_cpu_initialization=for_loading or not torch.cuda.is_available(),
        perform_initialization=not for_loading,
        batch_p2p_comm=False,
        **recompute_kwargs(m, p, knobs, grouped_gemm=fusions.get("moe_grouped_gemm", False)),
        **fusions,
        **moe,
        **mla,
    )
    if m.num_experts and softmax and m.moe_router_renormalize and m.moe_router_topk == 1:
        config.moe_router_pre_softmax = False  # top-1 renormalised: weight 1.0 (module docstring)
    return config


def mla_kwargs(m: ModelConfig) -> dict[str, Any]:
    """``MLATransformerConfig``'s fields for a ``deepseek_v3`` shape (HF -> Megatron):
    ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim`` -> ``qk_head_dim``, ``qk_rope_head_dim``
    -> ``qk_pos_emb_head_dim``, ``v_head_dim``; RoPE ``rope`` or ``yarn`` with YaRN's factor, original
    context, betas and mscales. Megatron's MLA rotates interleaved pairs (HF ``rope_interleave``) and
    scales the softmax by ``m(factor, mscale_all_dim)^2 / sqrt(qk_nope + qk_rope)`` (1 without YaRN)."""
    yarn = m.rope_type == "yarn"
    return dict(
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=m.rope_theta,
        rotary_scaling_factor=m.rope_scaling_factor if yarn else 1.0,
        original_max_position_embeddings=m.rope_original_max_position_embeddings or m.max_position_embeddings,
        beta_fast=m.yarn_beta_fast,
        beta_slow=m.yarn_beta_slow,
        mscale=m.yarn_mscale if yarn else 1.0,
        mscale_all_dim=m.yarn_mscale_all_dim if yarn else 0.0,
    )


def layer_spec(config):
    """Decoder block spec: TE layers with a GPU and TE installed, local Megatron-Core layers otherwise.

    Multi-latent attention on the local spec: Megatron's local ``DotProductAttention`` sizes keys,
    values and its output by ``kv_channels`` and refuses MLA's ``k_channels`` / ``v_channels``
    (only TE's attention takes them); :class:`~sao_megatron.models.mla_attention.LocalMLACoreAttention`
    replaces it in every layer's spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = have_transformer_engine()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if config.multi_latent_attention and not te:
        from sao_megatron.models.mla_attention import LocalMLACoreAttention

        layers: list[Any] = list(spec.layer_specs or [])  # ModuleSpecs of TransformerLayerSubmodules
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = LocalMLACoreAttention
    return spec


# TE's layer spec fuses a norm into the following linear layer (``TELayerNormColumnParallelLinear``):
# the input norm into QKV and, in dense layers, the pre-MLP norm into fc1 (MoE layers keep a
# separate ``pre_mlp_layernorm``). Megatron 0.19's local spec maps the same pairs for checkpoints
# (``sharded_state_dict_keys_map`` in ``gpt_layer_specs.get_gpt_layer_local_submodules``).
_TE_FUSED_NORMS = (
    (".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
    (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."),
    (".self_attention.linear_q_up_proj.layer_norm_", ".self_attention.q_layernorm."),  # MLA's latent norms
    (".self_attention.linear_kv_up_proj.layer_norm_", ".self_attention.kv_layernorm."),
)
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def canonical_name(name: str) -> str:
    """A parameter's name on the local layer spec, whichever spec built it.

    TE spec -> local: ``...self_attention.linear_qkv.layer_norm_weight`` (``_bias``) ->
    ``...input_layernorm.weight`` (``.bias``); ``...mlp.linear_fc1.layer_norm_weight`` ->
    ``...pre_mlp_layernorm.weight``; grouped-GEMM experts ``...mlp.experts.linear_fc1.weight3`` ->
    ``...mlp.experts.local_experts.3.linear_fc1.weight``. Other names are returned unchanged.
    Name-based rules (critic freezing, per-module metrics) match these names, so they select
    the same tensors on GPU (TE) and CPU (local).
    """
    for fused, local in _TE_FUSED_NORMS:
        if fused in name:
            return name.replace(fused, local)
    return _GROUPED_EXPERT.sub(r".mlp.experts.local_experts.\2.\1.weight", name)


def build_gpt(
    m: ModelConfig,
    p: ParallelConfig,
    bf16: bool = False,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    *,
    for_loading: bool = False,
    router_bias_update_rate: float = 0.0,
    routing_replay: bool = False,
):
    """The actor: a Megatron ``GPTModel`` for this rank's pipeline stage, vocab-parallel output.

    ``for_loading``: on the CPU, uninitialised, to be filled from a checkpoint;
    ``router_bias_update_rate``: the expert bias's training step (:func:`transformer_config`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(
        m, p, bf16, for_loading, router_bias_update_rate=router_bias_update_rate, routing_replay=routing_replay
    )
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        # GPTModel annotates a ModuleSpec but hands it to TransformerBlock, which takes a block spec too.
        transformer_layer_spec=layer_spec(config),  # pyright: ignore[reportArgumentType]
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=m.rotary_percent,
        rotary_base=int(m.rope_theta),
        parallel_output=True,
    )
    check_expert_tp_attributes(model, p.expert_tensor_parallel)
    norms_in_params_dtype(model, config.params_dtype)
    return model


def norms_in_params_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the local spec's ``torch.nn`` norms (built in torch's default float32) to ``params_dtype``.

    Megatron's own training wraps a bf16 model in ``Float16Module``, which casts every parameter;
    TE's norms are built in ``params_dtype``. Without this a bf16 actor kept float32 norm weights,
    and on a GPU ``torch.rms_norm`` of bf16 activations with a float32 weight falls back from the
    fused kernel (first GPU check, 2026-12-04: "Mismatch dtype between input and weight")."""
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm | torch.nn.LayerNorm):
            module.to(dtype)


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "frozen": total - trainable}
