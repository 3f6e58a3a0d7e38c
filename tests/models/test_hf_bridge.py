"""The pure HF <-> Megatron mapping: hand-computed QKV layout, round trips, TP slices, spec names."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sao_megatron.config import ModelConfig
from sao_megatron.models import hf_bridge as bridge
from sao_megatron.models import layout

MOE = ModelConfig(
    name="t",
    num_layers=3,
    hidden_size=8,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=4,
    ffn_hidden_size=12,
    vocab_size=16,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=6,
    dense_layers=[1],
    moe_shared_expert_intermediate_size=10,
)
DENSE_TIED = dataclasses.replace(MOE, num_experts=0, moe_shared_expert_intermediate_size=0, tie_word_embeddings=True)
# Qwen2-MoE: q/k/v biases, no q/k norm, gated shared expert.
QWEN2_MOE = dataclasses.replace(MOE, qk_layernorm=False, add_qkv_bias=True, moe_shared_expert_gate=True)
MIXTRAL = dataclasses.replace(
    MOE,
    family="mixtral",
    qk_layernorm=False,
    dense_layers=[],
    moe_shared_expert_intermediate_size=0,
    ffn_hidden_size=6,
)
# GLM-4.5: first layer dense, ungated shared expert (2 x expert width), sigmoid router with expert bias.
GLM = dataclasses.replace(
    MOE,
    family="glm4_moe",
    dense_layers=[0],
    moe_shared_expert_intermediate_size=12,
    add_qkv_bias=True,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.5,
    rotary_percent=0.5,
)

# DeepSeek-V3: GLM's MoE layers, multi-latent attention (q LoRA 8, kv latent 6 + 2 RoPE dims).
DEEPSEEK = dataclasses.replace(
    GLM,
    family="deepseek_v3",
    num_query_groups=4,
    add_qkv_bias=False,
    rotary_percent=1.0,
    q_lora_rank=8,
    kv_lora_rank=6,
    qk_rope_head_dim=2,
    v_head_dim=3,
)


def random_hf_state(m: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(bridge.hf_shape(n, m), generator=g) for n in bridge.expected_hf_names(m)}


def test_qkv_is_interleaved_per_query_group_hand_computed():
    m = dataclasses.replace(MOE, hidden_size=1, head_dim=1)
    pre = "model.layers.0.self_attn."
    hf = {
        pre + "q_proj.weight": torch.tensor([[0.0], [1], [2], [3]]),
        pre + "k_proj.weight": torch.tensor([[10.0], [11]]),
        pre + "v_proj.weight": torch.tensor([[20.0], [21]]),
    }
    qkv = bridge.from_hf("decoder.layers.0.self_attention.linear_qkv.weight", m, hf.__getitem__)
    # [ng=2, (np/ng=2 q heads + k + v), head_dim=1, hidden=1]
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = dict(bridge.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", qkv, m))
    assert list(back) == [pre + "q_proj.weight", pre + "k_proj.weight", pre + "v_proj.weight"]
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_bias_is_interleaved_like_the_weight():
    m = dataclasses.replace(QWEN2_MOE, head_dim=1)
    pre = "model.layers.0.self_attn."
    hf = {
        pre + "q_proj.bias": torch.tensor([0.0, 1, 2, 3]),
        pre + "k_proj.bias": torch.tensor([10.0, 11]),
        pre + "v_proj.bias": torch.tensor([20.0, 21]),
    }
    bias = bridge.from_hf("decoder.layers.0.self_attention.linear_qkv.bias", m, hf.__getitem__)
    assert bias.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = dict(bridge.to_hf("decoder.layers.0.self_attention.linear_qkv.bias", bias, m))
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    assert bridge.hf_shape("model.layers.2.mlp.shared_expert_gate.weight", m) == (1, 8)
    names = bridge.mcore_names(m)
    assert "decoder.layers.2.mlp.shared_experts.gate_weight" in names
    assert "decoder.layers.0.self_attention.q_layernorm.weight" not in names
    with pytest.raises(bridge.MappingError, match="add_qkv_bias"):
        bridge.hf_pieces("decoder.layers.0.self_attention.linear_qkv.bias", MOE)


def test_glu_and_expert_layouts():
    hf = random_hf_state(MOE)
    fc1 = bridge.from_hf("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", MOE, hf.__getitem__)
    gate, up = (
        hf["model.layers.0.mlp.experts.3.gate_proj.weight"],
        hf["model.layers.0.mlp.experts.3.up_proj.weight"],
    )
    assert torch.equal(fc1, torch.cat([gate, up]))
    shared = bridge.from_hf("decoder.layers.2.mlp.shared_experts.linear_fc1.weight", MOE, hf.__getitem__)
    assert torch.equal(shared[:10], hf["model.layers.2.mlp.shared_expert.gate_proj.weight"])
    assert bridge.hf_names("decoder.layers.1.mlp.linear_fc2.weight", MOE) == ["model.layers.1.mlp.down_proj.weight"]
    assert bridge.hf_names("decoder.layers.0.mlp.router.weight", MOE) == ["model.layers.0.mlp.gate.weight"]


@pytest.mark.parametrize(
    "m",
    [MOE, DENSE_TIED, QWEN2_MOE, MIXTRAL, GLM, DEEPSEEK],
    ids=["moe_shared_dense_layer", "dense_tied", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"],
)
@pytest.mark.parametrize("spec", ["local", "te", "te_grouped"])
def test_round_trip_is_bit_exact_for_every_spec(m, spec):
    hf = random_hf_state(m)
    full = bridge.hf_to_mcore(hf, m, bridge.mcore_names(m, spec))
    for name, tensor in full.items():
        assert tuple(tensor.shape) == bridge.full_shape(name, m), name
    back = bridge.mcore_to_hf(full, m)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_te_names_map_to_the_same_hf_tensors():
    names = dict(zip(bridge.mcore_names(MOE, "local"), bridge.mcore_names(MOE, "te"), strict=True))
    assert (
        names["decoder.layers.0.input_layernorm.weight"]
        == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )
    assert names["decoder.layers.1.pre_mlp_layernorm.weight"] == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    for local, te in names.items():
        assert bridge.hf_names(local, MOE) == bridge.hf_names(te, MOE)
    assert bridge.hf_names("decoder.layers.2.mlp.experts.linear_fc1.weight3", MOE) == [
        "model.layers.2.mlp.experts.3.gate_proj.weight",
        "model.layers.2.mlp.experts.3.up_proj.weight",
    ]


def test_tied_head_reads_the_embedding_and_is_not_exported():
    assert bridge.hf_pieces("output_layer.weight", DENSE_TIED)[0].hf_name == "model.embed_tokens.weight"
    assert bridge.to_hf("output_layer.weight", torch.zeros(16, 8), DENSE_TIED) == []
    assert "lm_head.weight" not in bridge.expected_hf_names(DENSE_TIED)
    assert "lm_head.weight" in bridge.expected_hf_names(MOE)


def test_fused_transformers_experts_read_like_per_expert_files():
    hf = random_hf_state(MOE)
    fused = {k: v for k, v in hf.items() if ".experts." not in k}
    for layer in (0, 2):
        pre = f"model.layers.{layer}.mlp.experts."
        fused[pre + "gate_up_proj"] = torch.stack(
            [torch.cat([hf[f"{pre}{e}.gate_proj.weight"], hf[f"{pre}{e}.up_proj.weight"]]) for e in range(4)]
        )  # [E, 2I, H] as transformers 5.19 holds it in memory
        fused[pre + "down_proj"] = torch.stack([hf[f"{pre}{e}.down_proj.weight"] for e in range(4)])
        assert tuple(fused[pre + "gate_up_proj"].shape) == bridge.hf_shape(pre + "gate_up_proj", MOE)
    a, b = bridge.hf_to_mcore(hf, MOE), bridge.hf_to_mcore(fused, MOE)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mixtral_names_are_block_sparse_moe_w1_w3_w2():
    hf = random_hf_state(MIXTRAL)
    pre = "model.layers.1.block_sparse_moe."
    assert bridge.hf_names("decoder.layers.1.mlp.router.weight", MIXTRAL) == [pre + "gate.weight"]
    fc1 = bridge.from_hf("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", MIXTRAL, hf.__getitem__)
    assert torch.equal(fc1, torch.cat([hf[pre + "experts.2.w1.weight"], hf[pre + "experts.2.w3.weight"]]))
    assert bridge.hf_names("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight", MIXTRAL) == [
        pre + "experts.2.w2.weight"
    ]
    assert not [n for n in bridge.expected_hf_names(MIXTRAL) if ".mlp." in n or "shared" in n or "_norm." in n]
    with pytest.raises(bridge.MappingError, match="not a Mixtral tensor"):
        bridge.hf_shape("model.layers.0.mlp.experts.0.gate_proj.weight", MIXTRAL)


def test_mixtral_reads_transformers_in_memory_names():
    """transformers 5.19 renames ``block_sparse_moe`` to ``mlp`` in memory and fuses the experts."""
    hf = random_hf_state(MIXTRAL)
    fused = {k: v for k, v in hf.items() if "block_sparse_moe" not in k}
    for layer in range(3):
        pre = f"model.layers.{layer}.block_sparse_moe."
        fused[f"model.layers.{layer}.mlp.gate.weight"] = hf[pre + "gate.weight"]
        fused[f"model.layers.{layer}.{bridge.FUSED_GATE_UP}"] = torch.stack(
            [torch.cat([hf[f"{pre}experts.{e}.w1.weight"], hf[f"{pre}experts.{e}.w3.weight"]]) for e in range(4)]
        )
        fused[f"model.layers.{layer}.{bridge.FUSED_DOWN}"] = torch.stack(
            [hf[f"{pre}experts.{e}.w2.weight"] for e in range(4)]
        )
    a, b = bridge.hf_to_mcore(hf, MIXTRAL), bridge.hf_to_mcore(fused, MIXTRAL)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_glm_shared_experts_and_expert_bias():
    hf = random_hf_state(GLM)
    pre = "model.layers.2.mlp."
    shared = bridge.from_hf("decoder.layers.2.mlp.shared_experts.linear_fc1.weight", GLM, hf.__getitem__)
    assert torch.equal(
        shared, torch.cat([hf[pre + "shared_experts.gate_proj.weight"], hf[pre + "shared_experts.up_proj.weight"]])
    )
    bias = "decoder.layers.2.mlp.router.expert_bias"
    assert bridge.is_buffer(bias) and not bridge.is_buffer("decoder.layers.2.mlp.router.weight")
    assert bridge.hf_names(bias, GLM) == [pre + "gate.e_score_correction_bias"]
    assert bridge.full_shape(bias, GLM) == (4,)
    names = bridge.mcore_names(GLM)
    assert bias in names and "decoder.layers.0.mlp.router.expert_bias" not in names  # layer 0 is dense
    assert "decoder.layers.1.mlp.shared_experts.gate_weight" not in names
    assert pre + "shared_experts.down_proj.weight" in bridge.expected_hf_names(GLM)
    with pytest.raises(bridge.MappingError, match="moe_router_enable_expert_bias=false"):
        bridge.hf_pieces(bias, MOE)
    with pytest.raises(bridge.MappingError, match="not a Qwen3"):
        bridge.hf_shape(pre + "gate.e_score_correction_bias", MOE)


def test_mla_names_map_whole_and_te_fuses_the_latent_norms():
    """Every MLA tensor maps to one HF tensor whole; TE's spec names the q/kv latent norms after the
    up-projections they are fused into, and keeps the input norm apart."""
    pre, hf = "decoder.layers.1.self_attention.", "model.layers.1.self_attn."
    pairs = {
        "linear_q_down_proj.weight": ("q_a_proj.weight", (8, 8)),
        "q_layernorm.weight": ("q_a_layernorm.weight", (8,)),
        "linear_q_up_proj.weight": ("q_b_proj.weight", (4 * (4 + 2), 8)),
        "linear_kv_down_proj.weight": ("kv_a_proj_with_mqa.weight", (6 + 2, 8)),
        "kv_layernorm.weight": ("kv_a_layernorm.weight", (6,)),
        "linear_kv_up_proj.weight": ("kv_b_proj.weight", (4 * (4 + 3), 6)),
        "linear_proj.weight": ("o_proj.weight", (8, 4 * 3)),
    }
    for mcore, (name, shape) in pairs.items():
        assert bridge.hf_names(pre + mcore, DEEPSEEK) == [hf + name]
        assert bridge.full_shape(pre + mcore, DEEPSEEK) == bridge.hf_shape(hf + name, DEEPSEEK) == shape
    names = dict(zip(bridge.mcore_names(DEEPSEEK, "local"), bridge.mcore_names(DEEPSEEK, "te"), strict=True))
    assert names[pre + "q_layernorm.weight"] == pre + "linear_q_up_proj.layer_norm_weight"
    assert names[pre + "kv_layernorm.weight"] == pre + "linear_kv_up_proj.layer_norm_weight"
    assert names["decoder.layers.1.input_layernorm.weight"] == "decoder.layers.1.input_layernorm.weight"
    for local, te in names.items():
        assert bridge.hf_names(local, DEEPSEEK) == bridge.hf_names(te, DEEPSEEK)
    assert not [n for n in bridge.expected_hf_names(DEEPSEEK) if ".q_proj." in n or "q_norm" in n]
    with pytest.raises(bridge.MappingError, match="not a DeepSeek-V3 tensor"):
        bridge.hf_shape(hf + "q_proj.weight", DEEPSEEK)
    assert bridge.is_mtp("model.layers.3.eh_proj.weight", DEEPSEEK) and bridge.is_ignored(
        "model.layers.3.self_attn.q_a_proj.weight", DEEPSEEK
    )
    assert not bridge.is_mtp("model.layers.2.self_attn.q_a_proj.weight", DEEPSEEK)


def test_canonical_names_of_te_mla_norms():
    from sao_megatron.models.builder import canonical_name

    pre = "decoder.layers.0.self_attention."
    assert canonical_name(pre + "linear_q_up_proj.layer_norm_weight") == pre + "q_layernorm.weight"
    assert canonical_name(pre + "linear_kv_up_proj.layer_norm_weight") == pre + "kv_layernorm.weight"


def test_unknown_names_are_refused():
    with pytest.raises(bridge.MappingError, match="no HF counterpart"):
        bridge.hf_pieces("decoder.layers.0.mlp.value_head.weight", MOE)
    with pytest.raises(bridge.MappingError, match="expert 4"):
        bridge.hf_pieces("decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight", MOE)
    with pytest.raises(bridge.MappingError, match="not a Qwen3"):
        bridge.hf_shape("model.layers.0.mlp.experts.0.w1.weight", MOE)


def _fake_tp(monkeypatch, size: int, rank: int) -> None:
    monkeypatch.setattr(layout, "_tp_group_of", lambda name: None)
    monkeypatch.setattr(layout.dist, "get_world_size", lambda group=None: size)
    monkeypatch.setattr(layout.dist, "get_rank", lambda group=None: rank)


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("base", [QWEN2_MOE, GLM, DEEPSEEK], ids=["qwen2_moe", "glm4_moe", "deepseek_v3"])
def test_local_reads_equal_layout_shard(monkeypatch, tp_size, base):
    """Reading a rank's HF slices gives exactly ``layout.shard`` of the full tensor."""
    m = dataclasses.replace(
        base,
        num_attention_heads=8,
        num_query_groups=8 if bridge.is_mla(base) else 4,
        ffn_hidden_size=16,
        moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=8,
    )
    hf = random_hf_state(m)
    partition = {
        "linear_qkv.weight": 0,
        "linear_qkv.bias": 0,
        "linear_proj.weight": 1,
        "_down_proj.weight": 0,  # MLA: column-parallel on the local spec (rows 8 and 6 + 2: TP 2 and 4 divide)
        "_up_proj.weight": 0,
        "linear_fc1.weight": 0,
        "linear_fc2.weight": 1,
        "word_embeddings.weight": 0,
        "output_layer.weight": 0,
    }
    for name in bridge.mcore_names(m):
        full = bridge.from_hf(name, m, hf.__getitem__)
        dim = next((d for k, d in partition.items() if name.endswith(k)), None)
        for rank in range(tp_size):
            _fake_tp(monkeypatch, tp_size, rank)
            param = torch.empty(0)
            param.tensor_model_parallel, param.partition_dim = dim is not None, dim
            expected = layout.shard(full, param, name)
            glu = layout.is_glu_fc1(name) and dim == 0
            reads = bridge.local_reads(bridge.hf_pieces(name, m), tuple(full.shape), dim, tp_size, rank, glu)
            parts = [hf[r.hf_name][r.start : r.stop] for r in reads]
            parts = [p[:, r.cols[0] : r.cols[1]] if r.cols else p for p, r in zip(parts, reads, strict=True)]
            assert torch.equal(torch.cat(parts), expected), (name, rank)


def test_global_name_of_te_grouped_gemm_experts(monkeypatch):
    """layout.global_name renumbers TE grouped-GEMM experts (``linear_fc1.weight{e}``) by EP rank."""
    experts = SimpleNamespace(num_local_experts=2)
    layers = [SimpleNamespace(layer_number=3, mlp=SimpleNamespace(experts=experts))]
    model = SimpleNamespace(decoder=SimpleNamespace(layers=layers))
    monkeypatch.setattr(layout, "_groups", lambda: SimpleNamespace(get_expert_model_parallel_rank=lambda: 1))
    assert layout.global_name(model, "decoder.layers.0.mlp.experts.linear_fc2.weight1") == (
        "decoder.layers.2.mlp.experts.linear_fc2.weight3"
    )
    assert layout.global_name(model, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight") == (
        "decoder.layers.2.mlp.experts.local_experts.2.linear_fc1.weight"
    )
