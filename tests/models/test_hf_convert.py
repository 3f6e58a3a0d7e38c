"""``sao convert``: HF -> Megatron torch_dist (2 ranks, EP=2) -> HF (1 rank, resharded) is bit-exact."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from sao_megatron.cli import main
from sao_megatron.config import ModelConfig
from sao_megatron.models import hf_io
from tests.models.hf_cases import write_big_checkpoint

MODEL = ModelConfig(
    name="cli",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    ffn_hidden_size=48,
    vocab_size=64,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    dense_layers=[0],
    rope_theta=10000.0,
)


def _state(directory):
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    write_big_checkpoint(root / "hf", MODEL, shard_bytes=16 << 10)
    (root / "hf" / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    (root / "hf" / "tokenizer.json").write_text("{}")
    rc1 = main(["convert", "hf-to-mcore", str(root / "hf"), str(root / "mcore"), "--world", "2", "--ep", "2"])
    rc2 = main(["convert", "mcore-to-hf", str(root / "mcore"), str(root / "back"), "--max-shard-gb", "0.00002"])
    return root, rc1, rc2


def test_round_trip_through_torch_dist_is_bit_exact(converted, capsys):
    root, rc1, rc2 = converted
    assert rc1 == 0 and rc2 == 0
    original, back = _state(root / "hf"), _state(root / "back")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], v) for k, v in original.items())
    assert len(list((root / "back").glob("*.safetensors"))) > 1 and (root / "back" / hf_io.INDEX_FILE).exists()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (root / "back" / name).exists(), name
    assert json.loads((root / "back" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]


def test_megatron_side_holds_model_yaml_and_template(converted):
    root, _, _ = converted
    mcore = root / "mcore"
    assert (mcore / "metadata.json").exists() and (mcore / "hf" / "tokenizer.json").exists()
    shape = yaml.safe_load((mcore / "model.yaml").read_text())
    assert shape["num_experts"] == 4 and shape["dense_layers"] == [0]
    assert json.loads((mcore / "convert.json").read_text())["bf16"] is False
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "staging left behind"


def test_refusals_exit_1_without_writing(converted, capsys):
    root, _, _ = converted
    assert main(["convert", "mcore-to-hf", str(root / "mcore"), str(root / "back")]) == 1
    assert "not empty" in capsys.readouterr().err
    other = root / "other_template"
    other.mkdir()
    config = json.loads((root / "hf" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    assert main(["convert", "mcore-to-hf", str(root / "mcore"), str(root / "x"), "--hf-template", str(other)]) == 1
    assert "disagrees" in capsys.readouterr().err and not (root / "x").exists()
