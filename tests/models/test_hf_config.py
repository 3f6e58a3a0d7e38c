"""HF config.json -> model YAML: real Qwen3 configs, refusals that name the key, `sao convert hf-config`."""

import json

import pytest

from sao_megatron.cli import main
from sao_megatron.config import ConfigError, load_config
from sao_megatron.models.counting import parameter_counts
from sao_megatron.models.hf_config import hf_config_from_model, model_config_from_hf, same_shape

# config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-0.6B as published (transformers 4.51 era keys).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def test_qwen3_30b_a3b_maps_to_our_fields_and_parameter_count():
    m = model_config_from_hf(QWEN3_30B_A3B, name="qwen3_30b_a3b")
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim)
    assert shape == (48, 2048, 32, 4, 128)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (128, 8, 768, 6144)
    assert (m.moe_layer_freq, m.dense_layers, m.moe_shared_expert_intermediate_size) == (1, [], 0)
    rest = (m.vocab_size, m.max_position_embeddings, m.rope_theta, m.norm_epsilon)
    assert rest == (151936, 40960, 1e6, 1e-6)
    assert m.qk_layernorm and not m.tie_word_embeddings and m.moe_aux_loss_coeff == 0.001
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
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention"] * 48}, "layer_types"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_unsupported_features_are_refused_naming_the_key(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        model_config_from_hf({**QWEN3_30B_A3B, **change})


def test_missing_norm_topk_prob_is_refused():
    hf = {k: v for k, v in QWEN3_30B_A3B.items() if k != "norm_topk_prob"}  # HF default: false
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        model_config_from_hf(hf)


def test_cli_hf_config_writes_a_loadable_model_yaml(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    out = tmp_path / "models" / "qwen3_30b_a3b.yaml"
    assert main(["convert", "hf-config", str(tmp_path), "--out", str(out), "--name", "qwen3_30b_a3b"]) == 0
    cfg = load_config(None, [f"model={out}"])
    assert (
        cfg.model.name == "qwen3_30b_a3b" and same_shape(cfg.model, model_config_from_hf(QWEN3_30B_A3B)) == []
    )
    assert main(["convert", "hf-config", str(tmp_path / "config.json")]) == 0
    assert "num_experts: 128" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "attention_bias": True}))
    assert main(["convert", "hf-config", str(tmp_path)]) == 2
    assert "attention_bias" in capsys.readouterr().err
