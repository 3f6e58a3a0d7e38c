"""Checks of a model shape (:class:`~sao_megatron.config.schema.ModelConfig`) on its own, whatever its source."""

from __future__ import annotations

import dataclasses

from sao_megatron.config.model import ModelConfig
from sao_megatron.config.schema import ConfigError


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
    rotary = m.head_dim * m.rotary_percent
    if not 0 < m.rotary_percent <= 1 or rotary != int(rotary) or int(rotary) % 2:
        raise ConfigError(
            f"model.rotary_percent={m.rotary_percent} must be in (0, 1] and rotate an even number of "
            f"each head's {m.head_dim} dimensions (HF partial_rotary_factor)"
        )
    if m.num_experts:
        _validate_router(m)
    _validate_family(m)


def _validate_router(m: ModelConfig) -> None:
    """Routing settings Megatron computes as the HF families do (``models/builder.py``)."""
    sigmoid = m.moe_router_score_function == "sigmoid"
    if sigmoid and m.moe_router_renormalize != (m.moe_router_topk > 1):
        raise ConfigError(
            f"model.moe_router_renormalize={str(m.moe_router_renormalize).lower()} with sigmoid scores and "
            f"moe_router_topk={m.moe_router_topk}: Megatron renormalises sigmoid top-k weights exactly when "
            f"top-k > 1; set moe_router_renormalize={str(m.moe_router_topk > 1).lower()}"
        )
    if m.moe_router_enable_expert_bias and not sigmoid:
        raise ConfigError(
            "model.moe_router_enable_expert_bias=true needs model.moe_router_score_function=sigmoid "
            "(Megatron's aux-loss-free expert bias is defined for sigmoid scores only)"
        )
    if m.moe_router_topk_scaling_factor <= 0:
        raise ConfigError(f"model.moe_router_topk_scaling_factor must be > 0 (got {m.moe_router_topk_scaling_factor})")
    groups, chosen = m.moe_router_num_groups, m.moe_router_group_topk
    if groups < 1 or not 1 <= chosen <= groups:
        raise ConfigError(
            f"model.moe_router_group_topk={chosen} must be in [1, model.moe_router_num_groups={groups}] and "
            "model.moe_router_num_groups >= 1"
        )
    if groups == 1:
        if chosen != 1:
            raise ConfigError(f"model.moe_router_group_topk={chosen} needs moe_router_num_groups > 1")
        return
    if m.num_experts % groups or m.num_experts // groups < 2:
        raise ConfigError(
            f"model.moe_router_num_groups={groups} must divide num_experts={m.num_experts} into groups of >= 2 "
            "experts (HF ranks a group by its best two)"
        )
    if m.moe_router_topk // chosen != 2:
        raise ConfigError(
            f"model.moe_router_group_topk={chosen} with moe_router_topk={m.moe_router_topk}: Megatron ranks a "
            f"group by its best topk // group_topk = {m.moe_router_topk // chosen} scores, HF by its best 2; "
            "they agree only when moe_router_topk // moe_router_group_topk == 2 (or num_groups == 1)"
        )
    if chosen * (m.num_experts // groups) < m.moe_router_topk:
        raise ConfigError(
            f"model.moe_router_group_topk={chosen} groups of {m.num_experts // groups} experts hold fewer than "
            f"moe_router_topk={m.moe_router_topk}"
        )


_ROUTER_DEFAULTS = dict(
    moe_router_score_function="softmax",
    moe_router_enable_expert_bias=False,
    moe_router_topk_scaling_factor=1.0,
    moe_router_num_groups=1,
)


_NO_MLA = dict(
    q_lora_rank=0,
    kv_lora_rank=0,
    qk_rope_head_dim=0,
    v_head_dim=0,
    rope_type="default",
    rope_scaling_factor=1.0,
    rope_original_max_position_embeddings=0,
)


def _validate_mla(m: ModelConfig) -> dict[str, object]:
    """Multi-latent attention's widths (``deepseek_v3``); returns the fields the family fixes."""
    for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, name) <= 0:
            raise ConfigError(
                f"model.{name}={getattr(m, name)} must be > 0 for deepseek_v3 (multi-latent attention; "
                "a query without LoRA, q_lora_rank 0, is not built on the local layer spec)"
            )
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if m.rope_type == "yarn" and (m.rope_scaling_factor <= 1 or m.rope_original_max_position_embeddings <= 0):
        raise ConfigError(
            f"model.rope_type=yarn needs rope_scaling_factor > 1 (got {m.rope_scaling_factor}) and "
            f"rope_original_max_position_embeddings > 0 (got {m.rope_original_max_position_embeddings})"
        )
    if m.mtp_layers < 0:
        raise ConfigError(f"model.mtp_layers must be >= 0 (got {m.mtp_layers})")
    # every head has its own keys and values (HF num_key_value_heads = num_attention_heads)
    return dict(
        num_query_groups=m.num_attention_heads,
        qk_layernorm=True,
        add_qkv_bias=False,
        rotary_percent=1.0,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )


def _validate_family(m: ModelConfig) -> None:
    """What the shape's HF architecture can express: the engines build that architecture, so a
    field it lacks would train one model and serve another."""
    fixed: dict[str, object] = {}
    if m.family in ("qwen", "mixtral"):
        fixed = {**_ROUTER_DEFAULTS, "rotary_percent": 1.0}
    if m.family == "mixtral":
        fixed |= dict(
            qk_layernorm=False,
            add_qkv_bias=False,
            moe_shared_expert_intermediate_size=0,
            dense_layers=[],
            moe_layer_freq=1,
            moe_router_renormalize=True,
        )
        if not m.num_experts:
            raise ConfigError("model.family=mixtral needs num_experts > 0 (every Mixtral layer is MoE)")
        if m.ffn_hidden_size != m.moe_ffn_hidden_size:
            raise ConfigError(
                f"model.ffn_hidden_size={m.ffn_hidden_size} must equal moe_ffn_hidden_size={m.moe_ffn_hidden_size} "
                "for mixtral (one HF intermediate_size sizes its experts)"
            )
    if m.family in ("glm4_moe", "deepseek_v3"):
        fixed = dict(moe_layer_freq=1, moe_shared_expert_gate=False)
        if not m.num_experts:
            raise ConfigError(f"model.family={m.family} needs num_experts > 0")
        shared = m.moe_shared_expert_intermediate_size
        if not shared or shared % m.moe_ffn_hidden_size:
            raise ConfigError(
                f"model.moe_shared_expert_intermediate_size={shared} must be a positive multiple of "
                f"moe_ffn_hidden_size={m.moe_ffn_hidden_size} for {m.family} (HF n_shared_experts x moe_intermediate_size)"
            )
        if m.dense_layers != list(range(len(m.dense_layers))):
            raise ConfigError(
                f"model.dense_layers={m.dense_layers} must be the first k layers for {m.family} (HF first_k_dense_replace)"
            )
    if m.family == "deepseek_v3":
        fixed |= _validate_mla(m)
    else:
        fixed |= {**_NO_MLA, "mtp_layers": 0}
    for key, value in fixed.items():
        if getattr(m, key) != value:
            raise ConfigError(
                f"model.{key}={getattr(m, key)!r} is not expressible in model.family={m.family}'s HF "
                f"architecture (it has {value!r}); change the field or the family"
            )


_NOT_SHAPE = ("name", "mtp_layers")
"""Fields that do not change the built model: its name, and the MTP layers a checkpoint may carry
besides (an export has none, its source may have one)."""


def same_shape(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Fields (other than :data:`_NOT_SHAPE`) on which two model configs disagree."""
    return [
        f.name
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _NOT_SHAPE and getattr(a, f.name) != getattr(b, f.name)
    ]
