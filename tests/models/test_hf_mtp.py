"""Multi-token-prediction tensors carried beside the model (``models/hf_mtp.py``, issue 31), file I/O only.

A DeepSeek-V3 checkpoint in its official layout (bf16 config, FP8 block-scaled linear weights with
``weight_scale_inv``, bf16 norms, the float32 expert bias) holds one decoder layer and one MTP layer.
``copy_to_template`` must keep only the MTP tensors: FP8 ones as ``fp8 x scale_inv`` (computed here
with plain torch) rounded to bf16, the others bit for bit; the export side must find them in a
converted checkpoint, its template or the HF directory itself, and write them in the export's dtype
across several shards. The end-to-end chain (convert, train, export, transformers) is
test_hf_families_cli's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sao_megatron.config import hf as hf_config
from sao_megatron.models import hf_io, hf_mtp
from sao_megatron.models.hf_bridge import Read
from tests.models.test_hf_fp8 import DEEPSEEK_SHAPE, QUANT, _dequantise, _quantise

LAYERS = DEEPSEEK_SHAPE["num_hidden_layers"]
H = DEEPSEEK_SHAPE["hidden_size"]
EXPERTS = DEEPSEEK_SHAPE["n_routed_experts"]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint and what each MTP tensor must read as (FP8 dequantised to float32)."""
    root = tmp_path_factory.mktemp("mtp") / "hf"
    root.mkdir()
    config = {
        **DEEPSEEK_SHAPE,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dtype": "bfloat16",
        "quantization_config": QUANT,
        "num_nextn_predict_layers": 1,
    }
    (root / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    tensors, expected = {}, {}
    for layer in (0, LAYERS):  # a decoder layer (not MTP) and the MTP layer
        eh_proj = 0.08 * torch.randn(H, 2 * H)  # 160 x 320: blocks cut at both edges
        q, scale = _quantise(eh_proj)
        norm = (1.0 + 0.2 * torch.randn(H)).to(torch.bfloat16)
        bias = torch.randn(EXPERTS)
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "eh_proj.weight": q,
            prefix + "eh_proj.weight_scale_inv": scale,
            prefix + "enorm.weight": norm,
            prefix + "mlp.gate.e_score_correction_bias": bias,
        }
        if layer == LAYERS:
            expected = {
                prefix + "eh_proj.weight": _dequantise(q, scale),
                prefix + "enorm.weight": norm,
                prefix + "mlp.gate.e_score_correction_bias": bias,
            }
    save_file(tensors, str(root / hf_io.SINGLE_FILE))
    return root, expected


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    with hf_io.HFCheckpoint(directory) as ckpt:
        return {n: ckpt.read(Read(n, 0, ckpt.info(n).shape[0])) for n in ckpt.names()}


def test_conversion_keeps_mtp_tensors_fp8_dequantised_to_the_checkpoint_dtype(fp8_checkpoint, tmp_path):
    hf, expected = fp8_checkpoint
    m = hf_config.model_config_from_hf(hf_config.read_hf_config(hf))
    template = tmp_path / "mcore" / "hf"
    template.mkdir(parents=True)
    assert hf_mtp.copy_to_template(hf, m, template, max_shard_bytes=5 << 30) == len(expected)
    kept = _read_all(template / hf_mtp.TEMPLATE_SUBDIR)
    assert kept.keys() == expected.keys()  # the MTP layer only, without scales
    eh_proj = f"model.layers.{LAYERS}.eh_proj.weight"
    assert kept[eh_proj].dtype == torch.bfloat16  # config.json's dtype
    assert torch.equal(kept[eh_proj], expected[eh_proj].to(torch.bfloat16))  # the loader's dequantisation, rounded once
    for name in expected.keys() - {eh_proj}:  # stored as they were: bf16 norm, float32 bias
        assert kept[name].dtype == expected[name].dtype and torch.equal(kept[name], expected[name]), name
    for where in (tmp_path / "mcore", template, hf):  # a converted checkpoint, its template, the HF directory
        source = hf_mtp.find(where, m)
        assert source is not None and sorted(source.names) == sorted(expected) and source.layers == 1, where
    assert hf_mtp.find(tmp_path / "nowhere", m) is None


def test_export_writes_mtp_tensors_in_its_dtype_across_shards(fp8_checkpoint, tmp_path):
    hf, expected = fp8_checkpoint
    m = hf_config.model_config_from_hf(hf_config.read_hf_config(hf))
    source = hf_mtp.find(hf, m)
    assert source is not None
    specs = source.specs(torch.float32)
    bias = f"model.layers.{LAYERS}.mlp.gate.e_score_correction_bias"
    assert {s.name: s.dtype for s in specs} == dict.fromkeys(expected, torch.float32)
    bf16 = {s.name: s.dtype for s in source.specs(torch.bfloat16)}
    assert bf16[bias] == torch.float32 and set(bf16.values()) == {torch.float32, torch.bfloat16}  # bias stays float32
    max_shard = H * 2 * H * 4  # the projection fills one shard alone
    files = hf_mtp.export_files(len(hf_io.plan_shards(specs, max_shard)))
    out = tmp_path / "export"
    out.mkdir()
    weight_map = source.write_shards(out, specs, max_shard, files)
    assert sorted(set(weight_map.values())) == files and len(files) == 2
    hf_io.write_index(out, weight_map, sum(s.nbytes for s in specs))
    written = _read_all(out)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[n], expected[n].float()) for n in expected)  # float32 holds each exactly


def test_the_summary_says_what_became_of_the_mtp_layers(fp8_checkpoint, tmp_path):
    from sao_megatron.models.hf_convert import _mtp_note

    m = hf_config.model_config_from_hf(hf_config.read_hf_config(fp8_checkpoint[0]))
    assert m.mtp_layers == 1
    assert _mtp_note(m, "SRC", [{"mtp_tensors": 3}]).startswith("carried 3 multi-token-prediction tensors from SRC")
    gone = _mtp_note(m, tmp_path / "moved", [{"mtp_tensors": 0}])
    assert (
        gone
        == f"no multi-token-prediction layer written ({tmp_path / 'moved'} holds none); config.json says num_nextn_predict_layers: 0"
    )
    assert _mtp_note(dataclasses.replace(m, mtp_layers=0), None, [{"mtp_tensors": 0}]) == ""  # nothing to say
