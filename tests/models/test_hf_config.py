"""HF config.json -> model YAML: real Qwen3 / Qwen2-MoE configs, routing variants, refusals that name
the key, `sao convert hf-config`."""

import dataclasses
import json

import pytest

from sao_megatron.cli import main
from sao_megatron.config import ConfigError, load_config
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
    from sao_megatron.config import ParallelConfig

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
