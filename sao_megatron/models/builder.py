"""Build Qwen3-MoE-family Megatron-Core models (actor and critic) from our config.

One function turns (model shape, parallel layout, precision) into Megatron's
``TransformerConfig``; layer specs come from Megatron's own spec helpers: the Transformer
Engine spec when TE is importable, the local (pure Megatron-Core) spec otherwise. The critic
is the actor's spec with the LM head swapped for a scalar value head (``models.critic``).

Qwen3-MoE mapping (HF -> Megatron): GQA with ``kv_channels = head_dim``, per-head RMSNorm on
queries and keys (``qk_layernorm``), RoPE over the whole head, SwiGLU MLPs and experts
(``gated_linear_unit`` + SiLU), no linear biases, RMSNorm everywhere, untied LM head.
Qwen2-MoE: no q/k norm, q/k/v biases (``add_qkv_bias``), a shared SwiGLU expert whose output
is scaled by ``sigmoid(x @ shared_expert_gate)`` (``moe_shared_expert_gate``).

Router (HF: ``softmax over all experts -> topk``, then ``/ sum`` with ``norm_topk_prob``):

- renormalised (``moe_router_renormalize``): Megatron's default ``topk -> softmax over the k``,
  the same weights. For top-1 both give exactly 1.0, but ``TransformerConfig`` rejects top-1
  without pre-softmax (the router would get no gradient from the weights, as in HF); it is
  validated with ``moe_router_pre_softmax=True`` and the flag is cleared afterwards (the router
  reads it at every forward).
- not renormalised: ``moe_router_pre_softmax=True`` (softmax over all experts, then top-k).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from sao_megatron.config import ModelConfig, ParallelConfig


def have_transformer_engine() -> bool:
    """TE is used only when a GPU is present and the package imports; never on CPU."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def moe_layer_pattern(m: ModelConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one (HF ``decoder_sparse_step`` and ``mlp_only_layers``)."""
    if not m.num_experts:
        return [0] * m.num_layers
    dense = set(m.dense_layers)
    return [int(i not in dense and (i + 1) % m.moe_layer_freq == 0) for i in range(m.num_layers)]


def transformer_config(m: ModelConfig, p: ParallelConfig, bf16: bool = False):
    """The single place where Megatron's ``TransformerConfig`` is built."""
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    moe: dict[str, Any] = {}
    if m.num_experts:
        moe = dict(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size or None,
            moe_shared_expert_gate=m.moe_shared_expert_gate,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not m.moe_router_renormalize or m.moe_router_topk == 1,
            moe_layer_freq=moe_layer_pattern(m),
            moe_token_dispatcher_type=p.moe_token_dispatcher,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_grouped_gemm=have_transformer_engine(),
            moe_router_dtype="fp32",
        )
    recompute: dict[str, Any] = dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    config = TransformerConfig(
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
        use_cpu_initialization=not torch.cuda.is_available(),
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        batch_p2p_comm=False,
        **(recompute if p.recompute_activations else {}),
        **moe,
    )
    if m.num_experts and m.moe_router_renormalize and m.moe_router_topk == 1:
        config.moe_router_pre_softmax = False  # top-1 renormalised: weight 1.0 (module docstring)
    return config


def layer_spec(config):
    """Decoder block spec: TE layers with a GPU and TE installed, local Megatron-Core layers otherwise."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=have_transformer_engine(), normalization="RMSNorm"
    )


def build_gpt(m: ModelConfig, p: ParallelConfig, bf16: bool = False, pre_process: bool | None = None,
              post_process: bool | None = None):  # fmt: skip
    """The actor: a Megatron ``GPTModel`` for this rank's pipeline stage, vocab-parallel output."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(m, p, bf16)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    return GPTModel(
        config=config,
        # GPTModel annotates a ModuleSpec but hands it to TransformerBlock, which takes a block spec too.
        transformer_layer_spec=layer_spec(config),  # pyright: ignore[reportArgumentType]
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(m.rope_theta),
        parallel_output=True,
    )


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "frozen": total - trainable}
