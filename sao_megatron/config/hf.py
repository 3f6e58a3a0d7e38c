"""HF ``config.json`` <-> our :class:`~sao_megatron.config.ModelConfig` (Qwen3, Qwen3-MoE, Qwen2-MoE).

Pure dictionaries in, dataclasses out: no ``transformers`` import, so ``sao convert hf-config``
works on a bare ``config.json``. Features Megatron would compute differently are refused with a
:class:`~sao_megatron.config.ConfigError` naming the HF key, never silently dropped:

===========================  ===================================================================
HF key                        why it is refused
===========================  ===================================================================
``architectures``             only ``Qwen3MoeForCausalLM``, ``Qwen3ForCausalLM`` and
                              ``Qwen2MoeForCausalLM`` are mapped
``hidden_act`` != silu         experts and MLPs are built as SwiGLU
``attention_bias`` true        Qwen3's ``attention_bias`` also puts a bias on ``o_proj``; Megatron
                              has q/k/v-only biases (``add_qkv_bias``) or biases on every linear
                              layer (``add_bias_linear``, MLPs and experts too)
``mlp_bias`` true              the builder has no MLP biases
``shared_expert_intermediate_  Qwen2-MoE always builds a (gated) shared expert
size`` 0 (Qwen2-MoE)
``use_sliding_window`` true,   every layer is full causal attention in Megatron
``layer_types`` sliding
``rope_scaling`` /             only plain RoPE (``rope_type: default``) is built
``rope_parameters.rope_type``
===========================  ===================================================================

Routing: ``norm_topk_prob`` (HF default false) maps to ``moe_router_renormalize``; the builder
picks Megatron's router settings for both (``models/builder.py``), top-1 included. Qwen2-MoE:
``qkv_bias`` (default true) -> ``add_qkv_bias``, no q/k norm, ``shared_expert_gate`` ->
``moe_shared_expert_gate``.

Keys that name a shape (layers, widths, heads, vocabulary, experts) must be present; the rest
default as in ``transformers`` 5.19 (``head_dim``: ``hidden_size / num_attention_heads`` for
Qwen3-MoE, 128 for Qwen3).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from sao_megatron.config.parse import build, read_yaml
from sao_megatron.config.schema import ConfigError, ModelConfig
from sao_megatron.config.shape import validate_model

MOE_ARCH = "Qwen3MoeForCausalLM"
DENSE_ARCH = "Qwen3ForCausalLM"
QWEN2_MOE_ARCH = "Qwen2MoeForCausalLM"
SUPPORTED_ARCHITECTURES = (MOE_ARCH, DENSE_ARCH, QWEN2_MOE_ARCH)
_MODEL_TYPE = {MOE_ARCH: "qwen3_moe", DENSE_ARCH: "qwen3", QWEN2_MOE_ARCH: "qwen2_moe"}
_MOE_ARCHS = (MOE_ARCH, QWEN2_MOE_ARCH)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF model directory, or the file itself."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{file} not found; pass an HF model directory or its config.json") from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{file}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno}); fix the file "
            "or re-download the checkpoint's config.json"
        ) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file}: not UTF-8 (byte {err.start}); re-download the checkpoint's config.json") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: top level must be a JSON object")
    return data


def architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"architectures={archs!r} is not supported; the bridge maps exactly one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _require(hf: dict[str, Any], key: str, arch: str) -> Any:
    if hf.get(key) is None:
        raise ConfigError(f"config.json lacks '{key}', which {arch} needs to know the model's shape")
    return hf[key]


def _rope_theta(hf: dict[str, Any]) -> float:
    """Plain RoPE only: ``rope_scaling`` (<= 4.x) or ``rope_parameters`` (5.x) must be default."""
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ConfigError(
            f"rope_scaling={scaling!r} is not supported (only plain RoPE); remove it or "
            "convert a checkpoint without RoPE scaling"
        )
    params = hf.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.rope_type={params['rope_type']!r} is not supported (only 'default' RoPE)")
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


def _refuse_unsupported(hf: dict[str, Any], arch: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported; Megatron builds SwiGLU (silu)")
    if hf.get("attention_bias", False):
        raise ConfigError(
            "attention_bias=true is not supported: it biases o_proj too, and Megatron has only "
            "q/k/v biases (add_qkv_bias) or biases on every linear layer (add_bias_linear)"
        )
    if hf.get("use_sliding_window", False):
        raise ConfigError("use_sliding_window=true is not supported; Megatron layers use full attention")
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise ConfigError(f"layer_types contains {sorted(set(sliding))}; only full_attention is supported")
    if hf.get("mlp_bias", False):
        raise ConfigError("mlp_bias=true is not supported; the Megatron builder has no MLP biases")
    if arch == QWEN2_MOE_ARCH and not hf.get("shared_expert_intermediate_size", 5632):
        raise ConfigError(
            "shared_expert_intermediate_size=0 is not supported: Qwen2-MoE always builds a "
            "gated shared expert, which needs a width > 0"
        )


def model_config_from_hf(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """Map an HF Qwen3 / Qwen3-MoE / Qwen2-MoE ``config.json`` to our model shape (raises ``ConfigError``)."""
    arch = architecture(hf)
    _refuse_unsupported(hf, arch)
    heads = int(_require(hf, "num_attention_heads", arch))
    hidden = int(_require(hf, "hidden_size", arch))
    default_head_dim = hidden // heads if arch in _MOE_ARCHS else 128
    m = ModelConfig(
        name=name or str(hf.get("_name_or_path") or "").rstrip("/").split("/")[-1],
        num_layers=int(_require(hf, "num_hidden_layers", arch)),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or default_head_dim),
        ffn_hidden_size=int(hf.get("intermediate_size") or 0),
        vocab_size=int(_require(hf, "vocab_size", arch)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        rope_theta=_rope_theta(hf),
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        qk_layernorm=arch != QWEN2_MOE_ARCH,
        add_qkv_bias=arch == QWEN2_MOE_ARCH and bool(hf.get("qkv_bias", True)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if arch in _MOE_ARCHS:
        # Qwen3-MoE has no shared expert (transformers ignores the key there); Qwen2-MoE always has one.
        shared = int(hf.get("shared_expert_intermediate_size", 5632)) if arch == QWEN2_MOE_ARCH else 0
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise ConfigError(f"config.json lacks 'num_experts' (or 'num_local_experts'), which {arch} needs")
        m = dataclasses.replace(
            m,
            num_experts=int(experts),
            moe_router_topk=int(_require(hf, "num_experts_per_tok", arch)),
            moe_ffn_hidden_size=int(_require(hf, "moe_intermediate_size", arch)),
            moe_router_renormalize=bool(hf.get("norm_topk_prob", False)),
            moe_shared_expert_intermediate_size=shared,
            moe_shared_expert_gate=arch == QWEN2_MOE_ARCH,
            moe_layer_freq=int(hf.get("decoder_sparse_step", 1)),
            dense_layers=[int(i) for i in hf.get("mlp_only_layers") or []],
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
        )
    elif not m.ffn_hidden_size:
        raise ConfigError(f"config.json lacks 'intermediate_size', which {arch} needs")
    validate_model(m)
    return m


def hf_config_from_model(m: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` for ``m`` in ``transformers`` 5.19 form (used when no HF template exists).

    Qwen3 / Qwen3-MoE for models with q/k norm, Qwen2-MoE for MoE models without it; shapes
    that neither architecture builds raise ``ConfigError`` naming the field.
    """
    arch = hf_architecture_of(m)
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE[arch],
        "dtype": dtype,
        "num_hidden_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim,
        "intermediate_size": m.ffn_hidden_size,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rope_parameters": {"rope_theta": m.rope_theta, "rope_type": "default"},
        "rms_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": m.tie_word_embeddings,
        "hidden_act": "silu",
        "use_sliding_window": False,
    }
    if arch == QWEN2_MOE_ARCH:
        hf["qkv_bias"] = m.add_qkv_bias
        hf["shared_expert_intermediate_size"] = m.moe_shared_expert_intermediate_size
    else:
        hf["attention_bias"] = False
    if m.num_experts:
        hf.update(
            num_experts=m.num_experts,
            num_experts_per_tok=m.moe_router_topk,
            moe_intermediate_size=m.moe_ffn_hidden_size,
            decoder_sparse_step=m.moe_layer_freq,
            mlp_only_layers=list(m.dense_layers),
            norm_topk_prob=m.moe_router_renormalize,
            router_aux_loss_coef=m.moe_aux_loss_coeff,
        )
    return hf


def hf_architecture_of(m: ModelConfig) -> str:
    """The HF architecture that builds exactly ``m`` (raises ``ConfigError`` naming the field)."""
    if not m.qk_layernorm:
        if not m.num_experts:
            raise ConfigError(
                "model.qk_layernorm=false without experts has no mapped HF architecture "
                "(Qwen3 has q/k norm; Qwen2-MoE needs num_experts > 0)"
            )
        if not (m.moe_shared_expert_intermediate_size and m.moe_shared_expert_gate):
            raise ConfigError(
                "model.qk_layernorm=false is Qwen2-MoE, which needs a gated shared expert: set "
                "moe_shared_expert_intermediate_size > 0 and moe_shared_expert_gate=true"
            )
        return QWEN2_MOE_ARCH
    if m.add_qkv_bias:
        raise ConfigError(
            "model.add_qkv_bias=true with qk_layernorm has no HF architecture (Qwen3 has no "
            "q/k/v-only biases); pass --hf-template with a config.json"
        )
    if m.moe_shared_expert_intermediate_size:
        raise ConfigError(
            "model.moe_shared_expert_intermediate_size > 0 with qk_layernorm has no HF "
            "architecture (Qwen3-MoE has no shared experts); pass --hf-template"
        )
    return MOE_ARCH if m.num_experts else DENSE_ARCH


def model_yaml(m: ModelConfig, source: str = "") -> str:
    """A model shape file for ``configs/models/`` (loadable by ``load_config``)."""
    header = f"# Generated by `sao convert hf-config` from {source}\n" if source else ""
    return header + yaml.safe_dump(dataclasses.asdict(m), sort_keys=False)


def load_model_yaml(path: str | Path) -> ModelConfig:
    """Read a model shape file written by :func:`model_yaml` (unknown keys are errors)."""
    m = build(ModelConfig, read_yaml(Path(path)), "model")
    validate_model(m)
    return m
