"""HF config.json -> model YAML: real Qwen3 / Qwen2-MoE configs, routing variants, refusals that name
the key, `sao convert hf-config`."""

import dataclasses
import json

import pytest

from sao_megatron.cli import main
from sao_megatron.config import ConfigError, ParallelConfig, load_config
from sao_megatron.config.hf import hf_config_from_model, model_config_from_hf
from sao_megatron.config.shape import same_shape
from sao_megatron.models.builder import transformer_config
from sao_megatron.models.counting import parameter_counts

# config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-0.6B as published (transformers 4.51 era keys).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# config.json of Qwen/Qwen1.5-MoE-A2.7B as published (no qkv_bias key: q/k/v biases are always on).
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "model_type": "qwen2_moe",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "norm_topk_prob": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


def test_qwen3_30b_a3b_maps_to_our_fields_and_parameter_count():
    m = model_config_from_hf(QWEN3_30B_A3B, name="qwen3_30b_a3b")
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim)
    assert shape == (48, 2048, 32, 4, 128)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (128, 8, 768, 6144)
    assert (m.moe_layer_freq, m.dense_layers, m.moe_shared_expert_intermediate_size) == (1, [], 0)
    rest = (m.vocab_size, m.max_position_embeddings, m.rope_theta, m.norm_epsilon)
    assert rest == (151936, 40960, 1e6, 1e-6)
    assert m.qk_layernorm and not m.tie_word_embeddings and m.moe_aux_loss_coeff == 0.001
    assert m.moe_router_renormalize and not (m.add_qkv_bias or m.moe_shared_expert_gate)
    counts = parameter_counts(m)  # published: 30.5 B total, 3.3 B active
    assert 30.4e9 < counts["total"] < 30.6e9 and 3.2e9 < counts["active"] < 3.4e9


def test_dense_qwen3_with_tied_embeddings_and_5x_keys():
    m = model_config_from_hf(QWEN3_0_6B)
    assert m.num_experts == 0 and m.tie_word_embeddings and m.ffn_hidden_size == 3072
    assert 0.59e9 < parameter_counts(m)["total"] < 0.61e9  # published: 0.6 B
    # transformers 5.x writes num_local_experts and rope_parameters instead.
    hf5 = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
    hf5 |= {"num_local_experts": 128, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    assert same_shape(model_config_from_hf(hf5), model_config_from_hf(QWEN3_30B_A3B)) == []


def test_generated_hf_config_maps_back():
    for hf in (QWEN3_30B_A3B, QWEN3_0_6B):
        m = model_config_from_hf(hf)
        assert same_shape(model_config_from_hf(hf_config_from_model(m, "bfloat16")), m) == []


@pytest.mark.parametrize(
    "change, key",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"architectures": None}, "architectures"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "rope_parameters.rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention"] * 48}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_unsupported_features_are_refused_naming_the_key(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        model_config_from_hf({**QWEN3_30B_A3B, **change})


@pytest.mark.parametrize(
    "change, key",
    [
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_qwen2_moe_refusals_name_the_key(change, key):
    with pytest.raises(ConfigError, match=key):
        model_config_from_hf({**QWEN15_MOE_A27B, **change})


@pytest.mark.parametrize("topk", [1, 2, 8])
@pytest.mark.parametrize("norm", [True, False, None])
def test_norm_topk_prob_maps_to_megatron_router_settings(topk, norm):
    """HF softmax -> topk [-> / sum]: renormalised = Megatron topk -> softmax (pre_softmax off; top-1:
    weight 1.0 either way); not renormalised (HF default when missing) = pre_softmax on."""
    hf = {k: v for k, v in QWEN3_30B_A3B.items() if k != "norm_topk_prob"} | {"num_experts_per_tok": topk}
    if norm is not None:
        hf["norm_topk_prob"] = norm
    m = model_config_from_hf(hf)
    assert m.moe_router_renormalize is bool(norm) and m.moe_router_topk == topk
    assert hf_config_from_model(m)["norm_topk_prob"] is bool(norm)
    assert same_shape(model_config_from_hf(hf_config_from_model(m)), m) == []

    c = transformer_config(dataclasses.replace(m, num_layers=2), ParallelConfig())
    assert c.moe_router_score_function == "softmax" and c.moe_router_topk == topk
    assert c.moe_router_pre_softmax is (not norm) and c.moe_router_topk_scaling_factor is None


def test_qwen15_moe_a27b_maps_to_biases_and_a_gated_shared_expert():
    m = model_config_from_hf(QWEN15_MOE_A27B)
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim)
    assert shape == (24, 2048, 16, 16, 128)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (60, 4, 1408)
    assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate) == (5632, True)
    assert m.add_qkv_bias and not m.qk_layernorm and not m.moe_router_renormalize
    hf = hf_config_from_model(m, "bfloat16")
    assert hf["architectures"] == ["Qwen2MoeForCausalLM"] and hf["qkv_bias"] and "attention_bias" not in hf
    assert same_shape(model_config_from_hf(hf), m) == []
    no_bias = {**QWEN15_MOE_A27B, "qkv_bias": False}  # transformers 5.x key
    assert not model_config_from_hf(no_bias).add_qkv_bias
    counts = parameter_counts(m)  # model card: 14.3 B total, 2.7 B activated
    assert 14.2e9 < counts["total"] < 14.4e9 and 2.6e9 < counts["active"] < 2.9e9


@pytest.mark.parametrize(
    "change, key",
    [
        ({"add_qkv_bias": True}, "add_qkv_bias"),
        ({"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size"),
        ({"qk_layernorm": False}, "qk_layernorm"),
        ({"qk_layernorm": False, "num_experts": 0}, "qk_layernorm"),
    ],
)
def test_shapes_without_an_hf_architecture_are_refused(change, key):
    m = dataclasses.replace(model_config_from_hf(QWEN3_30B_A3B), **change)
    with pytest.raises(ConfigError, match=key):
        hf_config_from_model(m)


def test_shared_expert_gate_needs_a_shared_expert():
    from sao_megatron.config import validate_model

    m = dataclasses.replace(model_config_from_hf(QWEN3_30B_A3B), moe_shared_expert_gate=True)
    with pytest.raises(ConfigError, match="moe_shared_expert_gate"):
        validate_model(m)


def test_cli_hf_config_writes_a_loadable_model_yaml(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    out = tmp_path / "models" / "qwen3_30b_a3b.yaml"
    assert main(["convert", "hf-config", str(tmp_path), "--out", str(out), "--name", "qwen3_30b_a3b"]) == 0
    cfg = load_config(None, [f"model={out}"])
    assert cfg.model.name == "qwen3_30b_a3b" and same_shape(cfg.model, model_config_from_hf(QWEN3_30B_A3B)) == []
    assert main(["convert", "hf-config", str(tmp_path / "config.json")]) == 0
    assert "num_experts: 128" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "attention_bias": True}))
    assert main(["convert", "hf-config", str(tmp_path)]) == 2
    assert "attention_bias" in capsys.readouterr().err


# config.json of mistralai/Mixtral-8x7B-v0.1 as published.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
# config.json of zai-org/GLM-4.5 (transformers 4.54 era keys; GLM-4.6 differs in context length).
GLM_45 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0",
    "use_cache": True,
    "use_qk_norm": True,
    "vocab_size": 151552,
}


def test_mixtral_8x7b_maps_to_our_fields_and_parameter_count():
    m = model_config_from_hf(MIXTRAL_8X7B, name="mixtral_8x7b")
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim)
    assert m.family == "mixtral" and shape == (32, 4096, 32, 8, 128)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.dense_layers) == (8, 2, 14336, [])
    assert not (m.qk_layernorm or m.add_qkv_bias or m.moe_shared_expert_intermediate_size)
    assert m.moe_router_renormalize and m.moe_router_score_function == "softmax" and m.rope_theta == 1e6
    counts = parameter_counts(m)  # published: 46.7 B total, 12.9 B active
    assert 46.6e9 < counts["total"] < 46.8e9 and 12.8e9 < counts["active"] < 13.0e9
    assert same_shape(model_config_from_hf(hf_config_from_model(m, "bfloat16")), m) == []
    assert hf_config_from_model(m)["architectures"] == ["MixtralForCausalLM"]
    # transformers 5.x: rope_parameters; rope_theta defaults to Mixtral's 1e6
    hf5 = {k: v for k, v in MIXTRAL_8X7B.items() if k != "rope_theta"}
    assert model_config_from_hf(hf5).rope_theta == 1e6
    c = transformer_config(dataclasses.replace(m, num_layers=2), ParallelConfig())
    assert c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax
    assert not c.qk_layernorm and not c.add_qkv_bias and c.moe_shared_expert_intermediate_size is None


def test_glm_45_maps_to_sigmoid_routing_partial_rope_and_a_shared_expert():
    m = model_config_from_hf(GLM_45, name="glm_4_5")
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim)
    assert m.family == "glm4_moe" and shape == (92, 5120, 96, 8, 128)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (160, 8, 1536, 12288)
    assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate, m.dense_layers) == (1536, False, [0, 1, 2])
    assert m.qk_layernorm and m.add_qkv_bias and m.rotary_percent == 0.5 and m.rope_theta == 1e6
    assert m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias
    assert (m.moe_router_topk_scaling_factor, m.moe_router_num_groups, m.moe_aux_loss_coeff) == (2.5, 1, 0.0)
    hf = hf_config_from_model(m, "bfloat16")
    assert hf["architectures"] == ["Glm4MoeForCausalLM"] and hf["first_k_dense_replace"] == 3
    assert hf["n_shared_experts"] == 1 and hf["num_nextn_predict_layers"] == 0
    assert same_shape(model_config_from_hf(hf), m) == []
    c = transformer_config(dataclasses.replace(m, num_layers=4, dense_layers=[0]), ParallelConfig())
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_topk_scaling_factor == 2.5 and c.moe_router_num_groups is None
    assert c.moe_router_bias_update_rate == 0.0 and c.add_qkv_bias and c.qk_layernorm
    assert c.moe_shared_expert_intermediate_size == 1536 and not c.moe_shared_expert_gate
    trained = transformer_config(dataclasses.replace(m, num_layers=4), ParallelConfig(), router_bias_update_rate=1e-3)
    assert trained.moe_router_bias_update_rate == 1e-3


def test_glm_expert_groups_map_where_megatron_and_hf_rank_groups_alike():
    """HF ranks an expert group by its best 2 scores, Megatron by its best topk // topk_group."""
    grouped = {**GLM_45, "n_group": 8, "topk_group": 4}  # 8 // 4 == 2: DeepSeek-V3's setting
    m = model_config_from_hf(grouped)
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (8, 4)
    c = transformer_config(dataclasses.replace(m, num_layers=4), ParallelConfig())
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (8, 4)
    assert same_shape(model_config_from_hf(hf_config_from_model(m)), m) == []
    with pytest.raises(
        ConfigError, match=r"n_group=8, topk_group=2 with num_experts_per_tok=8.*best 2.*best topk // topk_group = 4"
    ):
        model_config_from_hf({**GLM_45, "n_group": 8, "topk_group": 2})


@pytest.mark.parametrize(
    "change, key",
    [
        ({"sliding_window": 4096}, r"sliding_window=4096 < max_position_embeddings=32768"),
        ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"head_dim": 64, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            r"quantization_config \(quant_method='fp8', fmt='e4m3', weight_block_size=None\)",
        ),
        ({"moe_layer_freq": 2}, r"key 'moe_layer_freq' is not known to the MixtralForCausalLM bridge"),
    ],
)
def test_mixtral_refusals_name_the_key(change, key):
    with pytest.raises(ConfigError, match=key):
        model_config_from_hf({**MIXTRAL_8X7B, **change})


def test_mixtral_window_at_least_the_context_is_full_attention():
    assert model_config_from_hf({**MIXTRAL_8X7B, "sliding_window": 32768}).family == "mixtral"


@pytest.mark.parametrize(
    "change, key",
    [
        ({"n_group": 4, "topk_group": 1}, r"n_group=4, topk_group=1"),
        ({"norm_topk_prob": False}, r"norm_topk_prob=false with num_experts_per_tok=8"),
        ({"num_experts_per_tok": 1}, r"norm_topk_prob=true with num_experts_per_tok=1"),
        ({"n_shared_experts": 0}, "n_shared_experts=0"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, r"rope_parameters\.rope_type='yarn'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"scoring_func": "softmax"}, r"key 'scoring_func' is not known to the Glm4MoeForCausalLM bridge"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_glm_refusals_name_the_key(change, key):
    with pytest.raises(ConfigError, match=key):
        model_config_from_hf({**GLM_45, **change})


def test_glm_without_partial_rotary_factor_rotates_half_as_transformers():
    """transformers 5.19's Glm4MoeConfig defaults ``partial_rotary_factor`` to 0.5; 5.x configs keep it
    in ``rope_parameters``."""
    bare = {k: v for k, v in GLM_45.items() if k != "partial_rotary_factor"}
    assert model_config_from_hf(bare).rotary_percent == 0.5
    v5 = bare | {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.25}}
    assert model_config_from_hf(v5).rotary_percent == 0.25


@pytest.mark.parametrize(
    "change, key",
    [
        (
            {"moe_router_score_function": "sigmoid"},
            "moe_router_score_function='sigmoid' is not expressible in model.family=qwen",
        ),
        ({"rotary_percent": 0.5}, "rotary_percent=0.5 is not expressible"),
        ({"family": "mixtral", "ffn_hidden_size": 768}, "qk_layernorm=True is not expressible in model.family=mixtral"),
        ({"moe_router_enable_expert_bias": True}, "needs model.moe_router_score_function=sigmoid"),
        ({"rotary_percent": 0.3}, r"rotary_percent=0.3 must be in \(0, 1\] and rotate an even number"),
    ],
)
def test_shapes_a_family_cannot_express_are_refused(change, key):
    from sao_megatron.config import validate_model

    m = dataclasses.replace(model_config_from_hf(QWEN3_30B_A3B), **change)
    with pytest.raises(ConfigError, match=key):
        validate_model(m)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"moe_router_renormalize": False}, "moe_router_renormalize=false with sigmoid scores"),
        ({"moe_router_num_groups": 8, "moe_router_group_topk": 2}, r"topk // group_topk = 4"),
        ({"moe_router_num_groups": 3}, "moe_router_num_groups=3 must divide num_experts=160"),
        ({"moe_shared_expert_intermediate_size": 1000}, "positive multiple of moe_ffn_hidden_size=1536"),
        ({"dense_layers": [1, 2]}, "must be the first k layers"),
        ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate=True is not expressible"),
    ],
)
def test_glm_shapes_outside_the_architecture_are_refused(change, key):
    from sao_megatron.config import validate_model

    m = dataclasses.replace(model_config_from_hf(GLM_45), **change)
    with pytest.raises(ConfigError, match=key):
        validate_model(m)
