"""HF ``config.json`` <-> our :class:`~sao_megatron.config.ModelConfig`.

Mapped architectures: Qwen3, Qwen3-MoE, Qwen2-MoE (``family: qwen``), Mixtral (``mixtral``),
GLM-4.5/4.6 (``Glm4MoeForCausalLM``, ``glm4_moe``) and DeepSeek-V3 / V3.1 / Kimi-K2
(``DeepseekV3ForCausalLM``, ``deepseek_v3``). Pure dictionaries in, dataclasses out: no
``transformers`` import, so ``sao convert hf-config`` works on a bare ``config.json``. Features
Megatron would compute differently are refused with a :class:`~sao_megatron.config.ConfigError`
naming the HF key, never silently dropped:

===========================  ===================================================================
HF key                        why it is refused
===========================  ===================================================================
``architectures``             only the six above are mapped
``quantization_config``       quantised weights are not read, except DeepSeek's FP8 block scaling
                              (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size``), which the
                              reader dequantises (``models/hf_io.py``)
``hidden_act`` != silu         experts and MLPs are built as SwiGLU
``attention_bias`` true        Qwen3's ``attention_bias`` also puts a bias on ``o_proj``; Megatron
(Qwen3)                       has q/k/v-only biases (``add_qkv_bias``) or biases on every linear
                              layer (``add_bias_linear``, MLPs and experts too). GLM's biases
                              only q/k/v: mapped
``mlp_bias`` true              the builder has no MLP biases
``shared_expert_intermediate_  Qwen2-MoE always builds a (gated) shared expert
size`` 0 (Qwen2-MoE)
``use_sliding_window`` true,   every layer is full causal attention in Megatron
``layer_types`` sliding
``sliding_window`` (Mixtral)  set and shorter than ``max_position_embeddings``: Megatron's local
                              attention builds its sliding-window mask in place of the one it is
                              given (packed sequences) and on CUDA; refused
``router_jitter_noise`` > 0   HF's training-time noise scales the experts' input too; Megatron's
(Mixtral)                     ``moe_input_jitter_eps`` only the router's
``rope_scaling`` /             only plain RoPE (``rope_type: default``) is built; DeepSeek-V3 also
``rope_parameters.rope_type``  ``yarn`` (Megatron's MLA YaRN), except ``attention_factor``,
                              ``truncate: false`` and ``mscale`` unset with ``mscale_all_dim`` set
``q_lora_rank`` null           MLA without a query LoRA (DeepSeek-V2-Lite): Megatron fuses a norm
(DeepSeek-V3)                 into its query projection, a module the local layer spec lacks
``scoring_func``,              DeepSeek-V3's sigmoid / ``noaux_tc`` / 1 / true only
``topk_method``,
``moe_layer_freq``,
``rope_interleave``
``rms_norm_eps`` != 1e-6       transformers normalises DeepSeek's q/kv latents with 1e-6 always
(DeepSeek-V3)
``num_key_value_heads`` !=     MLA has one key and value per head
heads (DeepSeek-V3)
``n_group`` / ``topk_group``   Megatron ranks a group by its best ``topk // topk_group`` experts,
(GLM, DeepSeek)               HF by its best 2: groups with ``topk // topk_group != 2`` refused
``norm_topk_prob`` (GLM,      Megatron renormalises sigmoid weights exactly when top-k > 1
DeepSeek)
``n_shared_experts`` 0        GLM and DeepSeek-V3 always build a shared expert
any other key (Mixtral, GLM,  not known to the bridge, which cannot tell whether it changes the
DeepSeek)
                              model: refused (``_KNOWN_KEYS``)
===========================  ===================================================================

Routing: ``norm_topk_prob`` (HF default false) maps to ``moe_router_renormalize``; the builder
picks Megatron's router settings for both (``models/builder.py``), top-1 included. Qwen2-MoE:
``qkv_bias`` (default true) -> ``add_qkv_bias``, no q/k norm, ``shared_expert_gate`` ->
``moe_shared_expert_gate``. Mixtral: softmax, top-k renormalised, no q/k norm, no biases, every
layer MoE with experts ``intermediate_size`` wide. GLM-4.5: sigmoid scores with an expert bias
(``e_score_correction_bias``), ``routed_scaling_factor``, expert groups (``n_group``,
``topk_group``), ``first_k_dense_replace`` dense layers first, an ungated shared expert
``n_shared_experts x moe_intermediate_size`` wide, q/k/v biases (``attention_bias``), optional q/k
norm (``use_qk_norm``), RoPE on the first ``partial_rotary_factor`` (default 0.5) of each head.
DeepSeek-V3: GLM's MoE layers (defaults of ``DeepseekV3Config``: 8 groups, top-4 groups, 3 dense
layers) and multi-latent attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim`` ->
``head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; q/kv latent norms -> ``qk_layernorm``), plain
RoPE or YaRN (``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
``mscale``, ``mscale_all_dim``). Multi-token-prediction layers (``num_nextn_predict_layers``;
DeepSeek-V3's count is kept in ``mtp_layers``) are not part of the model: not loaded (as
``transformers`` 5.19, which ignores them), carried through unchanged by ``sao convert`` and ``sao
export`` (``models/hf_mtp.py``).

Keys that name a shape (layers, widths, heads, vocabulary, experts) must be present; the rest
default as in ``transformers`` 5.19 (``head_dim``: ``hidden_size / num_attention_heads`` except
Qwen3's 128; ``rope_theta`` 1e6 for Mixtral, 10000 otherwise).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from sao_megatron.config import hf_deepseek
from sao_megatron.config.hf_deepseek import DEEPSEEK_V3_ARCH
from sao_megatron.config.model import ModelConfig
from sao_megatron.config.parse import build, read_yaml
from sao_megatron.config.schema import ConfigError
from sao_megatron.config.shape import validate_model

MOE_ARCH = "Qwen3MoeForCausalLM"
DENSE_ARCH = "Qwen3ForCausalLM"
QWEN2_MOE_ARCH = "Qwen2MoeForCausalLM"
MIXTRAL_ARCH = "MixtralForCausalLM"
GLM4_MOE_ARCH = "Glm4MoeForCausalLM"
SUPPORTED_ARCHITECTURES = (MOE_ARCH, DENSE_ARCH, QWEN2_MOE_ARCH, MIXTRAL_ARCH, GLM4_MOE_ARCH, DEEPSEEK_V3_ARCH)
_MODEL_TYPE = {
    MOE_ARCH: "qwen3_moe",
    DENSE_ARCH: "qwen3",
    QWEN2_MOE_ARCH: "qwen2_moe",
    MIXTRAL_ARCH: "mixtral",
    GLM4_MOE_ARCH: "glm4_moe",
    DEEPSEEK_V3_ARCH: "deepseek_v3",
}
_MOE_ARCHS = (MOE_ARCH, QWEN2_MOE_ARCH)
_FAMILY = {MIXTRAL_ARCH: "mixtral", GLM4_MOE_ARCH: "glm4_moe", DEEPSEEK_V3_ARCH: "deepseek_v3"}
_ARCH_OF_FAMILY = {v: k for k, v in _FAMILY.items()}

# Keys of transformers' PreTrainedConfig (and old configs' generation settings) that do not change
# the model's forward pass.
_GENERIC_KEYS = set(
    "architectures model_type transformers_version _name_or_path auto_map dtype torch_dtype use_cache "
    "initializer_range attention_dropout bos_token_id eos_token_id pad_token_id sep_token_id "
    "decoder_start_token_id output_router_logits output_attentions output_hidden_states return_dict "
    "torchscript is_encoder_decoder id2label label2id problem_type tokenizer_class prefix "
    "task_specific_params chunk_size_feed_forward tie_word_embeddings max_length do_sample temperature "
    "top_p top_k".split()
)
_COMMON_KEYS = set(
    "num_hidden_layers hidden_size num_attention_heads num_key_value_heads head_dim intermediate_size "
    "vocab_size max_position_embeddings rope_theta rope_scaling rope_parameters rms_norm_eps hidden_act "
    "num_experts_per_tok attention_bias mlp_bias quantization_config".split()
)  # quantization_config: checked by fp8_block (DeepSeek's FP8 block scaling is read, dequantised)
_KNOWN_KEYS = {
    MIXTRAL_ARCH: _GENERIC_KEYS
    | _COMMON_KEYS
    | set("num_local_experts sliding_window router_aux_loss_coef router_jitter_noise".split()),
    GLM4_MOE_ARCH: _GENERIC_KEYS
    | _COMMON_KEYS
    | set(
        "moe_intermediate_size n_routed_experts n_shared_experts routed_scaling_factor n_group topk_group "
        "first_k_dense_replace norm_topk_prob use_qk_norm partial_rotary_factor num_nextn_predict_layers".split()
    ),
    DEEPSEEK_V3_ARCH: _GENERIC_KEYS | _COMMON_KEYS | hf_deepseek.KEYS,
}
"""Every ``config.json`` key the Mixtral, GLM and DeepSeek-V3 bridges accept; any other is refused."""
_GLM_ROUTER_DEFAULTS = dict(
    n_group=1, topk_group=1, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True
)
"""``Glm4MoeConfig``'s defaults (transformers 5.19) for routing keys a config.json may omit."""


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


def _rope(hf: dict[str, Any], arch: str) -> tuple[float, float]:
    """``(rope_theta, rotary_percent)``. Plain RoPE only: ``rope_scaling`` (<= 4.x) or
    ``rope_parameters`` (5.x) must be default. GLM's ``partial_rotary_factor`` sits at the top
    level (4.x) or in ``rope_parameters`` (5.x); its default is 0.5, the others rotate the whole head."""
    scaling = hf.get("rope_scaling")
    if arch != DEEPSEEK_V3_ARCH and scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ConfigError(
            f"rope_scaling={scaling!r} is not supported (only plain RoPE); remove it or "
            "convert a checkpoint without RoPE scaling"
        )
    params = hf.get("rope_parameters") or {}
    if arch != DEEPSEEK_V3_ARCH and params.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.rope_type={params['rope_type']!r} is not supported (only 'default' RoPE)")
    theta = float(hf.get("rope_theta", params.get("rope_theta", 1e6 if arch == MIXTRAL_ARCH else 10000.0)))
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if arch != GLM4_MOE_ARCH and factor not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={factor} is not mapped for {arch} (only GLM-4.5's)")
    return theta, float(0.5 if factor is None else factor)


def fp8_block(hf: dict[str, Any]) -> tuple[int, int] | None:
    """The ``(rows, cols)`` block of an FP8 block-scaled checkpoint (DeepSeek-V3's layout: a linear
    weight in ``float8_e4m3fn`` with one ``weight_scale_inv`` factor per block), None when
    ``config.json`` has no ``quantization_config``; any other quantisation is refused naming it."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method, fmt, block = q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2):
        raise ConfigError(
            f"quantization_config (quant_method={method!r}, fmt={fmt!r}, weight_block_size={block!r}) is not "
            "supported: only DeepSeek's FP8 block scaling is read (quant_method 'fp8', fmt 'e4m3', "
            "weight_block_size [rows, cols]); convert the checkpoint to bf16 first"
        )
    return int(block[0]), int(block[1])


def _refuse_unsupported(hf: dict[str, Any], arch: str) -> None:
    fp8_block(hf)
    if arch in _KNOWN_KEYS:
        unknown = sorted(set(hf) - _KNOWN_KEYS[arch])
        if unknown:
            raise ConfigError(
                f"config.json key {unknown[0]!r} is not known to the {arch} bridge, which cannot tell whether "
                "it changes the model; remove it if it does not, else this checkpoint cannot be converted"
            )
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported; Megatron builds SwiGLU (silu)")
    if hf.get("attention_bias", False) and arch != GLM4_MOE_ARCH:
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
    if arch == MIXTRAL_ARCH:
        _refuse_mixtral(hf)
    if arch in (GLM4_MOE_ARCH, DEEPSEEK_V3_ARCH):
        _refuse_sigmoid_router(hf, arch)
    if arch == DEEPSEEK_V3_ARCH:
        hf_deepseek.refuse(hf)


def _router_key(hf: dict[str, Any], key: str, arch: str) -> Any:
    """A routing key of GLM or DeepSeek-V3, or its default in transformers' config class."""
    if arch == DEEPSEEK_V3_ARCH:
        return hf.get(key, hf_deepseek.ROUTER_DEFAULTS.get(key))
    return hf.get(key, _GLM_ROUTER_DEFAULTS.get(key))


def _refuse_mixtral(hf: dict[str, Any]) -> None:
    window, positions = hf.get("sliding_window"), int(hf.get("max_position_embeddings", 131072))
    if window is not None and int(window) < positions:
        raise ConfigError(
            f"sliding_window={window} < max_position_embeddings={positions} is not supported: Megatron's local "
            "attention builds its sliding-window mask in place of the mask it is given (packed sequences) and "
            "on CUDA; use a checkpoint without a window (null) or one at least max_position_embeddings long"
        )
    if float(hf.get("router_jitter_noise", 0.0)):
        raise ConfigError(
            f"router_jitter_noise={hf['router_jitter_noise']} is not supported: HF's training-time noise scales "
            "the experts' input too, Megatron's moe_input_jitter_eps only the router's; set it to 0.0"
        )


def _refuse_sigmoid_router(hf: dict[str, Any], arch: str) -> None:
    topk = int(_router_key(hf, "num_experts_per_tok", arch))
    groups, chosen = int(_router_key(hf, "n_group", arch)), int(_router_key(hf, "topk_group", arch))
    if groups > 1 and topk // max(chosen, 1) != 2:
        raise ConfigError(
            f"n_group={groups}, topk_group={chosen} with num_experts_per_tok={topk} is not supported: HF ranks "
            f"an expert group by its best 2 scores, Megatron by its best topk // topk_group = {topk // max(chosen, 1)}; "
            "they agree only when num_experts_per_tok // topk_group == 2 (or n_group == 1)"
        )
    norm = bool(_router_key(hf, "norm_topk_prob", arch))
    if norm != (topk > 1):
        raise ConfigError(
            f"norm_topk_prob={str(norm).lower()} with num_experts_per_tok={topk} is not supported: Megatron "
            "renormalises sigmoid top-k weights exactly when top-k > 1"
        )
    if not int(_router_key(hf, "n_shared_experts", arch)):
        raise ConfigError(f"n_shared_experts=0 is not supported: the {arch} bridge maps exactly its shared expert")


def model_config_from_hf(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """Map an HF ``config.json`` of a supported architecture to our model shape (raises ``ConfigError``)."""
    arch = architecture(hf)
    _refuse_unsupported(hf, arch)
    heads = int(_require(hf, "num_attention_heads", arch))
    hidden = int(_require(hf, "hidden_size", arch))
    head_dim = int(hf.get("head_dim") or (128 if arch == DENSE_ARCH else hidden // heads))
    if arch == DEEPSEEK_V3_ARCH:  # transformers' head_dim is qk_rope_head_dim there; ours is the unrotated part
        head_dim = int(_require(hf, "qk_nope_head_dim", arch))
    theta, rotary = _rope(hf, arch)
    m = ModelConfig(
        name=name or str(hf.get("_name_or_path") or "").rstrip("/").split("/")[-1],
        family=_FAMILY.get(arch, "qwen"),  # pyright: ignore[reportArgumentType]  # a ModelFamily value
        num_layers=int(_require(hf, "num_hidden_layers", arch)),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        ffn_hidden_size=int(hf.get("intermediate_size") or 0),
        vocab_size=int(_require(hf, "vocab_size", arch)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        rope_theta=theta,
        rotary_percent=rotary if arch == GLM4_MOE_ARCH else 1.0,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        qk_layernorm=arch in (MOE_ARCH, DENSE_ARCH, DEEPSEEK_V3_ARCH)
        or (arch == GLM4_MOE_ARCH and bool(hf.get("use_qk_norm"))),
        add_qkv_bias=(arch == QWEN2_MOE_ARCH and bool(hf.get("qkv_bias", True)))
        or (arch == GLM4_MOE_ARCH and bool(hf.get("attention_bias", False))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if arch in _MOE_ARCHS:
        m = _qwen_moe(hf, arch, m)
    elif arch == MIXTRAL_ARCH:
        width = int(_require(hf, "intermediate_size", arch))
        m = dataclasses.replace(
            m,
            num_experts=int(_require(hf, "num_local_experts", arch)),
            moe_router_topk=int(hf.get("num_experts_per_tok", 2)),
            moe_ffn_hidden_size=width,
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
        )
    elif arch in (GLM4_MOE_ARCH, DEEPSEEK_V3_ARCH):
        m = _glm(hf, m, arch)
        if arch == DEEPSEEK_V3_ARCH:
            m = hf_deepseek.with_mla(hf, m)
    elif not m.ffn_hidden_size:
        raise ConfigError(f"config.json lacks 'intermediate_size', which {arch} needs")
    validate_model(m)
    return m


def _qwen_moe(hf: dict[str, Any], arch: str, m: ModelConfig) -> ModelConfig:
    # Qwen3-MoE has no shared expert (transformers ignores the key there); Qwen2-MoE always has one.
    shared = int(hf.get("shared_expert_intermediate_size", 5632)) if arch == QWEN2_MOE_ARCH else 0
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ConfigError(f"config.json lacks 'num_experts' (or 'num_local_experts'), which {arch} needs")
    return dataclasses.replace(
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


def _glm(hf: dict[str, Any], m: ModelConfig, arch: str) -> ModelConfig:
    """GLM-4.5's MoE layers; DeepSeek-V3's are the same (sigmoid router with expert bias, groups,
    scaling, an ungated shared expert, the first k layers dense)."""
    width = int(_require(hf, "moe_intermediate_size", arch))
    topk = int(_router_key(hf, "num_experts_per_tok", arch))
    groups = int(_router_key(hf, "n_group", arch))
    if not m.ffn_hidden_size:
        raise ConfigError(f"config.json lacks 'intermediate_size', which {arch} needs (its dense layers)")
    return dataclasses.replace(
        m,
        num_experts=int(_require(hf, "n_routed_experts", arch)),
        moe_router_topk=topk,
        moe_ffn_hidden_size=width,
        moe_shared_expert_intermediate_size=width * int(_router_key(hf, "n_shared_experts", arch)),
        moe_router_renormalize=topk > 1,  # _refuse_sigmoid_router: norm_topk_prob says the same
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_num_groups=groups,
        moe_router_group_topk=int(_router_key(hf, "topk_group", arch)) if groups > 1 else 1,
        dense_layers=list(range(min(int(_router_key(hf, "first_k_dense_replace", arch)), m.num_layers))),
        moe_aux_loss_coeff=0.0,  # aux-loss-free: the expert bias balances the load
    )


def hf_config_from_model(m: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` for ``m`` in ``transformers`` 5.19 form (used when no HF template exists).

    The family's architecture; in the qwen family Qwen3 / Qwen3-MoE for models with q/k norm,
    Qwen2-MoE for MoE models without it. Shapes the architecture does not build raise
    ``ConfigError`` naming the field.
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
    }
    if arch == MIXTRAL_ARCH:
        hf.update(
            intermediate_size=m.moe_ffn_hidden_size,
            num_local_experts=m.num_experts,
            num_experts_per_tok=m.moe_router_topk,
            sliding_window=None,
            router_aux_loss_coef=m.moe_aux_loss_coeff,
            router_jitter_noise=0.0,
        )
        return hf
    if arch == GLM4_MOE_ARCH:
        return hf | _glm_keys(m)
    if arch == DEEPSEEK_V3_ARCH:
        return {k: v for k, v in hf.items() if k != "head_dim"} | hf_deepseek.config_keys(m, _glm_keys(m))
    hf["use_sliding_window"] = False
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


def _glm_keys(m: ModelConfig) -> dict[str, Any]:
    rope = {"rope_theta": m.rope_theta, "rope_type": "default", "partial_rotary_factor": m.rotary_percent}
    return dict(
        rope_parameters=rope,
        partial_rotary_factor=m.rotary_percent,
        attention_bias=m.add_qkv_bias,
        use_qk_norm=m.qk_layernorm,
        moe_intermediate_size=m.moe_ffn_hidden_size,
        n_routed_experts=m.num_experts,
        num_experts_per_tok=m.moe_router_topk,
        n_shared_experts=m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size,
        first_k_dense_replace=len(m.dense_layers),
        norm_topk_prob=m.moe_router_renormalize,
        routed_scaling_factor=m.moe_router_topk_scaling_factor,
        n_group=m.moe_router_num_groups,
        topk_group=m.moe_router_group_topk,
        num_nextn_predict_layers=0,
    )


def hf_architecture_of(m: ModelConfig) -> str:
    """The HF architecture that builds exactly ``m`` (raises ``ConfigError`` naming the field)."""
    validate_model(m)  # the family's own limits (config/shape.py)
    if m.family in _ARCH_OF_FAMILY:
        return _ARCH_OF_FAMILY[m.family]
    if not m.qk_layernorm:
        if not m.num_experts:
            raise ConfigError(
                "model.qk_layernorm=false without experts has no mapped HF architecture "
                "(Qwen3 has q/k norm; Qwen2-MoE needs num_experts > 0)"
            )
        if not (m.moe_shared_expert_intermediate_size and m.moe_shared_expert_gate):
            raise ConfigError(
                "model.qk_layernorm=false is Qwen2-MoE, which needs a gated shared expert: set "
                "moe_shared_expert_intermediate_size > 0 and moe_shared_expert_gate=true (or "
                "family: mixtral, which has neither)"
            )
        return QWEN2_MOE_ARCH
    if m.add_qkv_bias:
        raise ConfigError(
            "model.add_qkv_bias=true with qk_layernorm has no HF architecture in the qwen family "
            "(Qwen3 has no q/k/v-only biases); pass --hf-template with a config.json or use family: glm4_moe"
        )
    if m.moe_shared_expert_intermediate_size:
        raise ConfigError(
            "model.moe_shared_expert_intermediate_size > 0 with qk_layernorm has no HF "
            "architecture in the qwen family (Qwen3-MoE has no shared experts); pass --hf-template "
            "or use family: glm4_moe"
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
