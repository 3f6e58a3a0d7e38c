"""Checks of a model shape (:class:`~sao_megatron.config.schema.ModelConfig`) on its own, whatever its source."""

from __future__ import annotations

import dataclasses

from sao_megatron.config.schema import ConfigError, ModelConfig


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_model(m: ModelConfig) -> None:
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "vocab_size"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name} must be > 0 (got {getattr(m, name)}); set it in the model file")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={m.num_query_groups} must divide "
            f"model.num_attention_heads={m.num_attention_heads}; use one of {divisors(m.num_attention_heads)}"
        )
    if m.num_experts < 0:
        raise ConfigError(f"model.num_experts must be >= 0 (got {m.num_experts}); use 0 for a dense model")
    if m.num_experts:
        if not 1 <= m.moe_router_topk <= m.num_experts:
            raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} must be in [1, num_experts={m.num_experts}]")
        if m.moe_ffn_hidden_size <= 0:
            raise ConfigError("model.moe_ffn_hidden_size must be > 0 for an MoE model; set the expert width")
        if m.moe_shared_expert_intermediate_size < 0:
            raise ConfigError(
                f"model.moe_shared_expert_intermediate_size must be >= 0 (got "
                f"{m.moe_shared_expert_intermediate_size}); use 0 for no shared expert"
            )
    elif m.ffn_hidden_size <= 0:
        raise ConfigError("model.ffn_hidden_size must be > 0 for a dense model; set the MLP width")
    if m.moe_shared_expert_gate and not (m.num_experts and m.moe_shared_expert_intermediate_size):
        raise ConfigError(
            "model.moe_shared_expert_gate=true needs a shared expert: set "
            "model.moe_shared_expert_intermediate_size > 0 (and num_experts > 0)"
        )


def same_shape(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Fields (other than the name) on which two model configs disagree."""
    return [
        f.name for f in dataclasses.fields(ModelConfig) if f.name != "name" and getattr(a, f.name) != getattr(b, f.name)
    ]
