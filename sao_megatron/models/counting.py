"""Closed-form parameter counts of a model config (total and active per token)."""

from __future__ import annotations

from sao_megatron.config import ModelConfig
from sao_megatron.models.builder import moe_layer_pattern


def parameter_counts(m: ModelConfig) -> dict[str, int]:
    """``total`` parameters and ``active`` ones per token (top-k experts instead of all)."""
    h, hd = m.hidden_size, m.head_dim
    attention = h * hd * (m.num_attention_heads + 2 * m.num_query_groups) + m.num_attention_heads * hd * h
    attention += h + (2 * hd if m.qk_layernorm else 0)  # input norm, q/k norms
    dense_mlp = 3 * h * m.ffn_hidden_size + h
    expert = 3 * h * m.moe_ffn_hidden_size
    shared = 3 * h * m.moe_shared_expert_intermediate_size
    total = active = 0
    for is_moe in moe_layer_pattern(m):
        total += attention
        active += attention
        if is_moe:
            router = h * m.num_experts + h + shared
            total += router + m.num_experts * expert
            active += router + m.moe_router_topk * expert
        else:
            total += dense_mlp
            active += dense_mlp
    embeddings = m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h  # + final norm
    return {"total": total + embeddings, "active": active + embeddings}
