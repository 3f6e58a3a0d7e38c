"""DeepSeek-V3 / V3.1 / Kimi-K2 (``DeepseekV3ForCausalLM``) ``config.json`` <-> multi-latent attention
fields of :class:`~sao_megatron.config.ModelConfig`: the parts of :mod:`sao_megatron.config.hf` that
only this architecture has (its MoE layers are GLM-4.5's, mapped there). Pure dictionaries, no
``transformers`` import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sao_megatron.config.model import ModelConfig
from sao_megatron.config.schema import ConfigError

DEEPSEEK_V3_ARCH = "DeepseekV3ForCausalLM"
KEYS = set(
    "moe_intermediate_size n_routed_experts n_shared_experts routed_scaling_factor n_group topk_group "
    "first_k_dense_replace norm_topk_prob num_nextn_predict_layers q_lora_rank kv_lora_rank qk_nope_head_dim "
    "qk_rope_head_dim v_head_dim qk_head_dim rope_interleave moe_layer_freq scoring_func topk_method "
    "aux_loss_alpha seq_aux ep_size pretraining_tp".split()
)
"""The architecture's own ``config.json`` keys. ``aux_loss_alpha`` / ``seq_aux`` (a training loss),
``ep_size`` and ``pretraining_tp`` (parallel layouts of DeepSeek's code) do not change the forward
pass; ``head_dim`` is transformers' copy of ``qk_rope_head_dim`` and ``qk_head_dim`` the query head
width (both recomputed by transformers, unused here)."""
ROUTER_DEFAULTS = dict(
    n_group=8, topk_group=4, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, norm_topk_prob=True
)
"""``DeepseekV3Config``'s defaults (transformers 5.19) for routing keys a config.json may omit."""


_YARN_KEYS = set(
    "rope_type type rope_theta factor original_max_position_embeddings beta_fast beta_slow mscale mscale_all_dim "
    "truncate".split()
)


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's RoPE as ModelConfig fields: plain (none) or YaRN, from ``rope_scaling`` (<= 4.x,
    ``type``) or ``rope_parameters`` (5.x, ``rope_type``). transformers scales cos/sin by
    ``m(factor, mscale) / m(factor, mscale_all_dim)`` when both are set, else by ``m(factor, 1)``,
    and the softmax by ``m(factor, mscale_all_dim)^2`` when that is set (``m(s, a) = 0.1 a ln s + 1``);
    Megatron's MLA YaRN always uses the ratio and the square, so the second case maps to
    ``mscale 1, mscale_all_dim 0``."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {}
    if kind != "yarn":
        raise ConfigError(
            f"{key} rope type {kind!r} is not supported for {DEEPSEEK_V3_ARCH} (only plain RoPE and 'yarn', "
            "which Megatron's multi-latent attention builds); convert a checkpoint without it"
        )
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]}={params[unknown[0]]!r} is not mapped to Megatron's YaRN (it takes factor, "
            "original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim); remove it"
        )
    if params.get("truncate", True) is not True:
        raise ConfigError(
            f"{key}.truncate={params['truncate']!r} is not supported: Megatron's YaRN rounds its correction range"
        )
    factor, original = params.get("factor"), params.get("original_max_position_embeddings")
    if factor is None or original is None:
        raise ConfigError(f"{key} of type yarn needs 'factor' and 'original_max_position_embeddings'; set both")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        if mscale_all_dim:
            raise ConfigError(
                f"{key}.mscale={mscale!r} with mscale_all_dim={mscale_all_dim!r} is not supported: transformers then "
                "scales cos/sin by m(factor, 1), Megatron by m(factor, mscale) / m(factor, mscale_all_dim); set mscale"
            )
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(
        rope_type="yarn",
        rope_scaling_factor=float(factor),
        rope_original_max_position_embeddings=int(original),
        yarn_beta_fast=float(params.get("beta_fast") or 32.0),
        yarn_beta_slow=float(params.get("beta_slow") or 1.0),
        yarn_mscale=float(mscale),
        yarn_mscale_all_dim=float(mscale_all_dim),
    )


def refuse(hf: dict[str, Any]) -> None:
    """What Megatron's multi-latent attention and sigmoid router would compute differently."""
    if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
        raise ConfigError(
            "q_lora_rank=null (multi-latent attention without a query LoRA, DeepSeek-V2-Lite style) is not supported: "
            "Megatron then fuses a norm into the query projection, a norm+linear module its local layer spec lacks; "
            "use a checkpoint with q_lora_rank set"
        )
    fixed = dict(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, rope_interleave=True)
    for key, value in fixed.items():
        if hf.get(key, value) != value:
            raise ConfigError(
                f"{key}={hf[key]!r} is not supported for {DEEPSEEK_V3_ARCH}: the bridge maps DeepSeek-V3's "
                f"{key}={value!r} (sigmoid scores, expert bias, every layer after the dense ones MoE, "
                "interleaved RoPE pairs as Megatron's multi-latent attention rotates them)"
            )
    heads = hf.get("num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise ConfigError(
            f"num_key_value_heads={hf['num_key_value_heads']} differs from num_attention_heads={heads}: "
            "multi-latent attention expands its latent into one key and value per head"
        )
    if float(hf.get("rms_norm_eps", 1e-6)) != 1e-6:
        raise ConfigError(
            f"rms_norm_eps={hf['rms_norm_eps']} is not supported for {DEEPSEEK_V3_ARCH}: transformers normalises "
            "the q/kv latents with epsilon 1e-6 whatever rms_norm_eps says, Megatron with rms_norm_eps; use 1e-6"
        )


def _require(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ConfigError(f"config.json lacks '{key}', which {DEEPSEEK_V3_ARCH} needs to know the model's shape")
    return hf[key]


def with_mla(hf: dict[str, Any], m: ModelConfig) -> ModelConfig:
    """``m`` (GLM's MoE layers mapped) with multi-latent attention's widths, YaRN and the MTP layers
    (:func:`refuse` checked the rest)."""
    return dataclasses.replace(
        m,
        num_query_groups=m.num_attention_heads,
        q_lora_rank=int(_require(hf, "q_lora_rank")),
        kv_lora_rank=int(_require(hf, "kv_lora_rank")),
        qk_rope_head_dim=int(_require(hf, "qk_rope_head_dim")),
        v_head_dim=int(_require(hf, "v_head_dim")),
        mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
        **rope_fields(hf),
    )


def config_keys(m: ModelConfig, glm_keys: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's keys over GLM's MoE keys ``glm_keys``; no MTP layer (``num_nextn_predict_layers:
    0``): exports do not carry one. ``moe_layer_freq``, ``topk_method`` and ``scoring_func`` are the
    published values transformers' config class lacks and SGLang's ``deepseek_v2`` class reads."""
    rope: dict[str, Any] = {"rope_theta": m.rope_theta, "rope_type": m.rope_type}
    if m.rope_type == "yarn":
        rope |= dict(
            factor=m.rope_scaling_factor,
            original_max_position_embeddings=m.rope_original_max_position_embeddings,
            beta_fast=m.yarn_beta_fast,
            beta_slow=m.yarn_beta_slow,
            mscale=m.yarn_mscale,
            mscale_all_dim=m.yarn_mscale_all_dim,
        )
    glm = {k: v for k, v in glm_keys.items() if k not in ("partial_rotary_factor", "use_qk_norm")}
    return glm | dict(
        rope_parameters=rope,
        attention_bias=False,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=True,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )
