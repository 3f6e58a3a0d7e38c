"""DeepSeek-V3 / V3.1 and Kimi-K2 (``DeepseekV3ForCausalLM``, issue 31): their published config.json
files -> our model shape -> Megatron's ``MLATransformerConfig``; YaRN; what is refused, naming the key;
the model files in ``configs/models/`` and their parameter counts against the published totals."""

import dataclasses
import math

import pytest

from sao_megatron.config import ConfigError, ParallelConfig, validate_model
from sao_megatron.config.hf import hf_config_from_model, load_model_yaml, model_config_from_hf
from sao_megatron.config.schema import MODEL_CONFIG_DIR
from sao_megatron.config.shape import same_shape
from sao_megatron.models.builder import transformer_config
from sao_megatron.models.counting import parameter_counts

_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# config.json of deepseek-ai/DeepSeek-V3 as published (DeepSeek-V3.1 has the same shapes), auto_map left out.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": _FP8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
# config.json of moonshotai/Kimi-K2-Instruct as published (the DeepSeek-V3 architecture), auto_map left out.
KIMI_K2 = {
    **DEEPSEEK_V3,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "model_type": "kimi_k2",
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "transformers_version": "4.48.3",
    "vocab_size": 163840,
}


def test_deepseek_v3_maps_to_mla_yarn_and_the_sigmoid_router():
    m = model_config_from_hf(DEEPSEEK_V3, name="deepseek_v3_671b")
    assert m.family == "deepseek_v3" and (m.num_layers, m.hidden_size, m.num_attention_heads) == (61, 7168, 128)
    mla = (m.q_lora_rank, m.kv_lora_rank, m.head_dim, m.qk_rope_head_dim, m.v_head_dim, m.num_query_groups)
    assert mla == (1536, 512, 128, 64, 128, 128)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (256, 8, 2048, 18432)
    assert (m.moe_shared_expert_intermediate_size, m.dense_layers, m.mtp_layers) == (2048, [0, 1, 2], 1)
    assert m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias and m.qk_layernorm
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    yarn = (m.rope_type, m.rope_scaling_factor, m.rope_original_max_position_embeddings, m.rope_theta)
    assert yarn == ("yarn", 40.0, 4096, 10000.0)
    assert (m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_mscale, m.yarn_mscale_all_dim) == (32.0, 1.0, 1.0, 1.0)
    c = transformer_config(dataclasses.replace(m, num_layers=4, dense_layers=[0]), ParallelConfig())
    assert type(c).__name__ == "MLATransformerConfig" and c.multi_latent_attention
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == mla[:5]
    assert (c.rope_type, c.rotary_scaling_factor, c.original_max_position_embeddings) == ("yarn", 40.0, 4096)
    assert (c.beta_fast, c.beta_slow, c.mscale, c.mscale_all_dim, c.rotary_base) == (32.0, 1.0, 1.0, 1.0, 10000.0)
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (8, 4) and not c.apply_rope_fusion
    # the softmax scale MultiLatentAttention derives from these is transformers' DeepseekV3Attention.scaling
    from megatron.core.models.common.embeddings import _yarn_get_mscale
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    megatron = _yarn_get_mscale(c.rotary_scaling_factor, c.mscale_all_dim) ** 2 / math.sqrt(c.qk_head_dim + 64)
    rope = {**DEEPSEEK_V3["rope_scaling"], "rope_type": "yarn"}
    assert megatron == yarn_apply_mscale(rope, (128 + 64) ** -0.5) and megatron > 1.8 * (128 + 64) ** -0.5


def test_the_generated_config_json_maps_back_without_mtp_layers():
    m = model_config_from_hf(DEEPSEEK_V3)
    hf = hf_config_from_model(m, "bfloat16")
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["num_nextn_predict_layers"] == 0
    assert hf["rope_parameters"]["rope_type"] == "yarn" and "head_dim" not in hf
    published = ("moe_layer_freq", "topk_method", "scoring_func")  # SGLang's deepseek_v2 reads them
    assert {k: hf[k] for k in published} == {k: DEEPSEEK_V3[k] for k in published}
    assert model_config_from_hf(hf).mtp_layers == 0 and same_shape(model_config_from_hf(hf), m) == []
    plain = model_config_from_hf({k: v for k, v in DEEPSEEK_V3.items() if k != "rope_scaling"})
    assert (
        plain.rope_type == "default"
        and transformer_config(dataclasses.replace(plain, num_layers=4), ParallelConfig()).rope_type == "rope"
    )
    assert same_shape(model_config_from_hf(hf_config_from_model(plain)), plain) == []


def test_kimi_k2_is_the_same_architecture_without_groups():
    m = model_config_from_hf(KIMI_K2)
    assert m.family == "deepseek_v3" and (m.num_experts, m.num_attention_heads, m.dense_layers) == (384, 64, [0])
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (1, 1, 2.827)
    assert (m.rope_scaling_factor, m.yarn_beta_fast, m.rope_theta, m.mtp_layers) == (32.0, 1.0, 50000.0, 0)


def test_yarn_with_one_mscale_unset_maps_to_what_transformers_computes():
    """transformers scales cos/sin by m(factor, 1) unless both mscales are set: Megatron's ratio with
    mscale 1, mscale_all_dim 0 is that, and its softmax scale is then transformers' unscaled one."""
    rope = {k: v for k, v in DEEPSEEK_V3["rope_scaling"].items() if k not in ("mscale", "mscale_all_dim")}
    m = model_config_from_hf({**DEEPSEEK_V3, "rope_scaling": rope})
    assert (m.yarn_mscale, m.yarn_mscale_all_dim) == (1.0, 0.0)
    with pytest.raises(ConfigError, match=r"mscale=None with mscale_all_dim=1\.0 is not supported"):
        model_config_from_hf({**DEEPSEEK_V3, "rope_scaling": {**rope, "mscale_all_dim": 1.0}})


_YARN = DEEPSEEK_V3["rope_scaling"]


@pytest.mark.parametrize(
    "change, key",
    [
        ({"q_lora_rank": None}, r"^q_lora_rank=null \(multi-latent attention without a query LoRA, DeepSeek-V2-Lite"),
        (
            {"rope_scaling": {**_YARN, "type": "dynamic"}},
            r"^rope_scaling rope type 'dynamic' is not supported for Deep",
        ),
        ({"rope_scaling": {**_YARN, "attention_factor": 1.2}}, r"^rope_scaling\.attention_factor=1\.2 is not mapped"),
        ({"rope_scaling": {**_YARN, "truncate": False}}, r"^rope_scaling\.truncate=False is not supported"),
        ({"topk_group": 2}, r"^n_group=8, topk_group=2 with num_experts_per_tok=8 is not supported"),
        ({"scoring_func": "softmax"}, r"^scoring_func='softmax' is not supported for DeepseekV3ForCausalLM"),
        ({"topk_method": "greedy"}, r"^topk_method='greedy' is not supported"),
        ({"rope_interleave": False}, r"^rope_interleave=False is not supported"),
        ({"moe_layer_freq": 2}, r"^moe_layer_freq=2 is not supported"),
        ({"num_key_value_heads": 16}, r"^num_key_value_heads=16 differs from num_attention_heads=128"),
        ({"rms_norm_eps": 1e-5}, r"^rms_norm_eps=1e-05 is not supported for DeepseekV3ForCausalLM"),
        ({"attention_bias": True}, r"^attention_bias=true is not supported"),
        ({"n_shared_experts": 0}, r"^n_shared_experts=0 is not supported"),
        ({"index_topk": 2048}, r"^config\.json key 'index_topk' is not known to the DeepseekV3ForCausalLM bridge"),
        ({"kv_lora_rank": None}, r"^config\.json lacks 'kv_lora_rank'"),
    ],
)
def test_deepseek_refusals_name_the_key(change, key):
    with pytest.raises(ConfigError, match=key):
        model_config_from_hf({**DEEPSEEK_V3, **change})


@pytest.mark.parametrize(
    "change, key",
    [
        ({"q_lora_rank": 0}, r"model\.q_lora_rank=0 must be > 0 for deepseek_v3"),
        ({"num_query_groups": 8}, r"model\.num_query_groups=8 is not expressible in model\.family=deepseek_v3"),
        ({"qk_layernorm": False}, r"model\.qk_layernorm=False is not expressible"),
        ({"qk_rope_head_dim": 63}, r"model\.qk_rope_head_dim=63 must be even"),
        ({"rope_scaling_factor": 1.0}, r"model\.rope_type=yarn needs rope_scaling_factor > 1"),
    ],
)
def test_deepseek_shapes_outside_the_architecture_are_refused(change, key):
    m = dataclasses.replace(model_config_from_hf(DEEPSEEK_V3), **change)
    with pytest.raises(ConfigError, match=key):
        validate_model(m)


def test_mla_fields_outside_deepseek_are_refused():
    from tests.models.test_hf_config import GLM_45

    glm = model_config_from_hf(GLM_45)
    for change in ({"kv_lora_rank": 512}, {"rope_type": "yarn"}, {"mtp_layers": 1}):
        with pytest.raises(
            ConfigError, match=f"model.{next(iter(change))}=.* is not expressible in model.family=glm4_moe"
        ):
            validate_model(dataclasses.replace(glm, **change))


@pytest.mark.parametrize(
    "name, source, total, total_precision",
    [("deepseek_v3_671b", DEEPSEEK_V3, 671e9, 0.005), ("kimi_k2_1t", KIMI_K2, 1.04e12, 0.02)],
)
def test_model_files_are_the_published_configs_and_count_the_published_totals(name, source, total, total_precision):
    """The model files are the published config.json mapped (``sao convert hf-config``). Totals: DeepSeek-V3's
    671 B to 0.5%; Kimi-K2's card says "1T" (1.04 T is quoted elsewhere), so 2%. The totals exclude the
    MTP layer (DeepSeek-V3: 671 B, besides a 14 B MTP module on disk holding its own copies of the
    embedding and head). Active per token: the published 37 B / 32 B state two digits, so they are
    checked to half a billion, counting the matrices each token's activations multiply (the input
    embedding is a row lookup: ``counting``'s ``active`` minus it)."""
    m = load_model_yaml(MODEL_CONFIG_DIR / f"{name}.yaml")
    assert same_shape(m, model_config_from_hf(source)) == [] and m.name == name
    counts = parameter_counts(m)
    embedding = m.vocab_size * m.hidden_size
    assert abs(counts["total"] / total - 1) <= total_precision, counts
    assert abs(counts["active"] - embedding - {"deepseek_v3_671b": 37e9, "kimi_k2_1t": 32e9}[name]) <= 0.5e9, counts
    if m.mtp_layers:
        assert abs((counts["mtp"] + 2 * embedding) / 14e9 - 1) <= 0.05, counts  # "14B": two digits
