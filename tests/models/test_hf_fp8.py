"""FP8 block-scaled checkpoints (DeepSeek-V3 / Kimi-K2's official layout) load dequantised (issue 31).

A tiny Qwen3-MoE and a tiny DeepSeek-V3 (multi-latent attention: q/kv down- and up-projections) are
each saved three ways: bf16 (the reference), FP8 in DeepSeek's layout (every linear
weight ``float8_e4m3fn`` in 128 x 128 blocks beside a float32 ``<name>_scale_inv``, and the
``quantization_config`` that says so), and float32 holding exactly ``fp8 x scale_inv`` computed here
with plain torch (the dequantisation the reader must reproduce). The shapes are not multiples of
the block, and at TP 2 a rank's rows start inside a block, so the reader must cut the scales with
the slice. One spawned 2-rank world loads all six into Megatron at TP 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sao_megatron.models import hf_io
from sao_megatron.models.hf_bridge import Read
from tests.distributed import run_distributed

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
SHAPE = dict(
    vocab_size=128,
    hidden_size=160,  # 1.25 blocks; TP 2 splits q/o rows at 80: inside the first block
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=40,
    intermediate_size=96,
    moe_intermediate_size=144,  # expert rows 72 per TP rank
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)
DEEPSEEK_SHAPE = dict(
    vocab_size=128,
    hidden_size=160,
    num_attention_heads=4,
    num_key_value_heads=4,  # DeepseekV3Config's default is 128 whatever the heads
    q_lora_rank=96,  # 48 rows per TP rank: inside the first block
    kv_lora_rank=60,  # + 4 RoPE dims: 64 rows of kv_a_proj_with_mqa
    qk_nope_head_dim=16,
    qk_rope_head_dim=4,
    v_head_dim=24,
    intermediate_size=96,
    moe_intermediate_size=144,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    num_hidden_layers=2,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)


def _quantised(name: str, t: torch.Tensor) -> bool:
    """DeepSeek quantises the linear layers' weights: not embeddings, head, norms or the router."""
    return t.dim() == 2 and name.endswith("proj.weight")


def _quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale_inv)``: one factor per 128 x 128 block (amax / 448), DeepSeek's rule."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(br * BLOCK, bc * BLOCK)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(br, BLOCK, bc, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (blocks / scale[:, None, :, None]).view(br * BLOCK, bc * BLOCK)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def _dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * expanded


def _model(family: str):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    if family == "deepseek_v3":
        return DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_SHAPE, rope_parameters=rope))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, rope_parameters=rope))


FAMILIES = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("fp8")
    return {family: _save_three_ways(root / family, family) for family in FAMILIES}


def _save_three_ways(root: Path, family: str) -> dict[str, Path]:
    torch.manual_seed(0)
    model = _model(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.08 * torch.randn_like(p))
    dirs = {k: root / k for k in ("bf16", "fp8", "dequantised")}
    model.to(torch.bfloat16).save_pretrained(dirs["bf16"])
    config = json.loads((dirs["bf16"] / "config.json").read_text())
    with safe_open(str(dirs["bf16"] / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    fp8, deq = {}, {}
    for name, t in state.items():
        if _quantised(name, t):
            q, scale = _quantise(t)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            deq[name] = _dequantise(q, scale)
        else:
            fp8[name], deq[name] = t, t.float()
    for key, tensors, extra in (
        ("fp8", fp8, {"quantization_config": QUANT}),
        ("dequantised", deq, {"dtype": "float32"}),
    ):
        dirs[key].mkdir()
        save_file(tensors, str(dirs[key] / "model.safetensors"))
        (dirs[key] / "config.json").write_text(json.dumps({**config, **extra}))
    return dirs


def _load(rank: int, world: int, families: dict[str, dict[str, str]]) -> dict:
    return {family: _load_family(world, dirs) for family, dirs in families.items()}


def _load_family(world: int, dirs: dict[str, str]) -> dict:
    from megatron.core import parallel_state as ps

    from sao_megatron.config import ParallelConfig
    from sao_megatron.config import hf as hf_config
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_weights import load_hf_weights
    from sao_megatron.parallel import initialize_model_parallel

    p = ParallelConfig(world_size=world, tensor_parallel=2, use_distributed_optimizer=False)
    if not ps.model_parallel_is_initialized():
        initialize_model_parallel(p)
    m = hf_config.model_config_from_hf(hf_config.read_hf_config(dirs["bf16"]))
    params = {}
    for key, path in dirs.items():
        model = build_gpt(m, p)
        load_hf_weights(model, m, path)
        params[key] = {n: t.detach().float().clone() for n, t in model.named_parameters()}
    out: dict = {"params": len(params["fp8"]), "differ_from_dequantised": [], "beyond_fp8_rounding": []}
    for name, got in params["fp8"].items():
        if not torch.equal(got, params["dequantised"][name]):
            out["differ_from_dequantised"].append(name)
        ref = params["bf16"][name]
        # e4m3 keeps 3 mantissa bits: |x - fp8(x)| <= |x| 2^-4 for normals, half the subnormal spacing
        # (2^-10 of the block's scale) below; the bf16 reference adds its own 2^-9 relative rounding
        scale = ref.abs().max().item() / FP8_MAX  # no block's scale exceeds the tensor's
        bound = ref.abs() * (2**-4 + 2**-8) + scale * 2**-10
        if not bool(((got - ref).abs() <= bound + 1e-30).all()):
            out["beyond_fp8_rounding"].append(name)
        if not torch.equal(got, ref):
            out.setdefault("quantised", []).append(name)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    families = {f: {k: str(v) for k, v in dirs.items()} for f, dirs in checkpoints.items()}
    return run_distributed(_load, 2, families, timeout_s=600)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_weights_load_as_their_dequantised_values_at_tp2(loaded, family):
    for r in (ranks[family] for ranks in loaded):
        assert r["params"] > 0 and r["differ_from_dequantised"] == [], r
        # every linear layer was quantised (so the FP8 path ran), and only those
        assert r["quantised"] and all("linear" in n or "experts" in n for n in r["quantised"]), r["quantised"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_weights_are_within_fp8_rounding_of_the_bf16_checkpoint(loaded, family):
    for r in (ranks[family] for ranks in loaded):
        assert r["beyond_fp8_rounding"] == [], r


def test_the_reader_hides_scales_and_cuts_them_with_the_slice(checkpoints):
    checkpoints = checkpoints["qwen3_moe"]
    with hf_io.HFCheckpoint(checkpoints["fp8"]) as ckpt:
        assert ckpt.fp8_block == (BLOCK, BLOCK)
        assert not [n for n in ckpt.names() if n.endswith("_scale_inv")]
        name = "model.layers.0.self_attn.q_proj.weight"
        with safe_open(str(checkpoints["dequantised"] / "model.safetensors"), "pt") as f:
            full = f.get_tensor(name)
        for start, stop, cols in ((0, 160, None), (80, 160, None), (100, 140, (70, 150)), (127, 129, (127, 129))):
            got = ckpt.read(Read(name, start, stop, cols))
            want = full[start:stop] if cols is None else full[start:stop, cols[0] : cols[1]]
            assert got.dtype == torch.float32 and torch.equal(got, want), (start, stop, cols)


def test_unreadable_quantisation_is_refused_naming_it(checkpoints, tmp_path):
    checkpoints = checkpoints["qwen3_moe"]
    bad = tmp_path / "int4"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((checkpoints["fp8"] / "model.safetensors").read_bytes())
    config = json.loads((checkpoints["fp8"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf_io.CheckpointError, match=r"quantization_config .*gptq.* is not supported: only DeepSeek"):
        hf_io.HFCheckpoint(bad)
    del config["quantization_config"]  # FP8 tensors, but nothing says how to scale them
    (bad / "config.json").write_text(json.dumps(config))
    with hf_io.HFCheckpoint(bad) as ckpt, pytest.raises(hf_io.CheckpointError, match="has no quantization_config"):
        ckpt.check("model.layers.0.self_attn.q_proj.weight", (160, 160), "BF16")


@pytest.mark.parametrize("family", FAMILIES)
def test_config_json_of_an_fp8_checkpoint_maps_to_the_same_model(checkpoints, family):
    """DeepSeek's FP8 block config is accepted (the reader dequantises); the model is the bf16 one's."""
    from sao_megatron.config import hf as hf_config

    checkpoints = checkpoints[family]
    fp8 = hf_config.read_hf_config(checkpoints["fp8"])
    assert hf_config.fp8_block(fp8) == (BLOCK, BLOCK)
    assert hf_config.model_config_from_hf(fp8) == hf_config.model_config_from_hf(
        hf_config.read_hf_config(checkpoints["bf16"])
    )
