"""Closed-form parameter counts of a model config (total and active per token)."""

from __future__ import annotations

from sao_megatron.config import ModelConfig
from sao_megatron.models.builder import moe_layer_pattern


def attention_parameters(m: ModelConfig) -> int:
    """One layer's attention with its input norm. Multi-latent attention (``deepseek_v3``): the
    query down-projection, its norm and up-projection, the key/value down-projection (latent plus
    the shared RoPE key), its norm and up-projection (keys' unrotated part and values per head),
    the output projection. Otherwise q/k/v/o projections, q/k/v biases (``add_qkv_bias``: GLM-4.5,
    Qwen2-MoE) and q/k norms."""
    h, hd, n = m.hidden_size, m.head_dim, m.num_attention_heads
    if m.family == "deepseek_v3":
        q, kv, rope, v = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim
        query = h * q + q + q * n * (hd + rope)
        key_value = h * (kv + rope) + kv + kv * n * (hd + v)
        return query + key_value + n * v * h + h
    qkv = hd * (n + 2 * m.num_query_groups)
    attention = h * qkv + n * hd * h + (qkv if m.add_qkv_bias else 0)
    return attention + h + (2 * hd if m.qk_layernorm else 0)  # input norm, q/k norms


def parameter_counts(m: ModelConfig) -> dict[str, int]:
    """``total`` parameters and ``active`` ones per token (top-k experts instead of all); ``mtp``:
    the multi-token-prediction layers the checkpoint carries besides (``m.mtp_layers``, not part of
    ``total``: DeepSeek-V3's 671 B excludes them), each an MoE decoder layer plus its two input norms,
    its ``[h, 2h]`` projection and its output norm (the embedding and head it shares are not counted again)."""
    h = m.hidden_size
    attention = attention_parameters(m)
    dense_mlp = 3 * h * m.ffn_hidden_size + h
    expert = 3 * h * m.moe_ffn_hidden_size
    shared = 3 * h * m.moe_shared_expert_intermediate_size
    router = h * m.num_experts + h + shared
    total = active = 0
    for is_moe in moe_layer_pattern(m):
        total += attention
        active += attention
        if is_moe:
            total += router + m.num_experts * expert
            active += router + m.moe_router_topk * expert
        else:
            total += dense_mlp
            active += dense_mlp
    embeddings = m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h  # + final norm
    mtp = m.mtp_layers * (attention + router + m.num_experts * expert + 2 * h + 2 * h * h + h)
    return {"total": total + embeddings, "active": active + embeddings, "mtp": mtp}
