"""Safetensors I/O: streamed shards, sliced reads, and damaged checkpoints that fail naming tensor and file."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sao_megatron.config import ConfigError, ModelConfig, ParallelConfig
from sao_megatron.models import hf_bridge, hf_io
from sao_megatron.models.hf_bridge import Read
from sao_megatron.models.hf_convert import check_hf_checkpoint, hf_to_mcore
from sao_megatron.models.hf_io import CheckpointError, HFCheckpoint, ShardWriter, TensorSpec
from tests.models.hf_cases import write_big_checkpoint

TINY = ModelConfig(
    name="tiny",
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=4,
    ffn_hidden_size=24,
    vocab_size=32,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=8,
)
LAYOUT = ParallelConfig(world_size=1)


@pytest.fixture
def ckpt(tmp_path):
    write_big_checkpoint(tmp_path / "hf", TINY, shard_bytes=4096)
    return tmp_path / "hf"


def _index(directory):
    return json.loads((directory / hf_io.INDEX_FILE).read_text())["weight_map"]


def test_streamed_shards_read_back_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randn(5, 7 + i, generator=g).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(6)
    }
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    writer = ShardWriter(tmp_path, specs, max_shard_bytes=200)
    for k, v in tensors.items():
        writer.write(k, v)
    writer.finish()
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {k: v for f in files for k, v in load_file(tmp_path / f).items()}
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())
    with HFCheckpoint(tmp_path, reopen_bytes=1) as reader:  # re-opens the file after every read
        part = reader.read(Read("t3", 1, 4, (2, 5)))
        assert torch.equal(part, tensors["t3"][1:4, 2:5])
        assert reader.check("t0", (5, 7), "F32").file.name == _index(tmp_path)["t0"]


def test_single_file_and_fused_expert_slab(tmp_path):
    stacked = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    save_file({"model.layers.0.mlp.experts.gate_up_proj": stacked}, tmp_path / hf_io.SINGLE_FILE)
    with HFCheckpoint(tmp_path) as reader:
        got = reader.read(Read("model.layers.0.mlp.experts.gate_up_proj", 3, 6, None, expert=1))
    assert torch.equal(got, stacked[1, 3:6])


def test_writer_refuses_out_of_plan_tensors(tmp_path):
    writer = ShardWriter(tmp_path, [TensorSpec("a", (2,), torch.float32), TensorSpec("b", (2,), torch.float32)], 64)
    with pytest.raises(ValueError, match="'b' \\[3\\] torch.float32 arrived where 'a' \\[2\\]"):
        writer.write("b", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="next missing: 'b'"):
        writer.finish()
    writer.abort()


def test_valid_checkpoint_passes(ckpt):
    tensors, nbytes = check_hf_checkpoint(ckpt, TINY)
    assert tensors == len(hf_bridge.expected_hf_names(TINY)) and nbytes > 0


def _rewrite(ckpt, name, fn):
    """Replace tensor ``name`` in its shard by ``fn(tensor)`` (or drop it when fn returns None)."""
    file = ckpt / _index(ckpt)[name]
    state = load_file(file)
    new = fn(state.pop(name))
    if new is not None:
        state[name] = new
    save_file(state, file, metadata={"format": "pt"})
    return file


NAME = "model.layers.1.mlp.experts.2.up_proj.weight"


def test_missing_tensor_names_tensor_and_index(ckpt):
    weight_map = _index(ckpt)
    del weight_map[NAME]
    (ckpt / hf_io.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"{hf_io.INDEX_FILE} has no tensor '{NAME}'"):
        check_hf_checkpoint(ckpt, TINY)


def test_tensor_absent_from_its_file(ckpt):
    file = _rewrite(ckpt, NAME, lambda t: None)
    with pytest.raises(CheckpointError, match=rf"'{NAME}' is mapped to {file}.* but is not in that file"):
        check_hf_checkpoint(ckpt, TINY)


def test_wrong_shape_names_tensor_file_and_shapes(ckpt):
    file = _rewrite(ckpt, NAME, lambda t: t[:-1])
    with pytest.raises(CheckpointError, match=rf"'{NAME}' in {file} has shape \[7, 16\], .* expects \[8, 16\]"):
        check_hf_checkpoint(ckpt, TINY)


def test_wrong_dtype_names_tensor_and_file(ckpt):
    file = _rewrite(ckpt, NAME, lambda t: t.half())
    with pytest.raises(CheckpointError, match=rf"'{NAME}' in {file} has dtype F16, config.json says F32"):
        check_hf_checkpoint(ckpt, TINY)


def test_truncated_file_names_file_and_tensor(ckpt):
    file = ckpt / _index(ckpt)[NAME]
    os.truncate(file, file.stat().st_size - 16)
    with pytest.raises(CheckpointError, match=rf"cannot read tensor '[^']+': {file} is truncated"):
        check_hf_checkpoint(ckpt, TINY)


def test_extra_tensor_means_another_config(ckpt):
    extra = "model.layers.0.mlp.shared_expert.gate_proj.weight"
    _rewrite(ckpt, NAME, lambda t: t)
    save_file({extra: torch.zeros(8, 16)}, ckpt / "extra.safetensors")
    (ckpt / hf_io.INDEX_FILE).write_text(json.dumps({"weight_map": {**_index(ckpt), extra: "extra.safetensors"}}))
    with pytest.raises(CheckpointError, match=rf"does not describe, e.g. '{extra}' in {ckpt / 'extra.safetensors'}"):
        check_hf_checkpoint(ckpt, TINY)


def test_conversion_refuses_before_writing_anything(ckpt, tmp_path):
    out = tmp_path / "mcore"
    _rewrite(ckpt, NAME, lambda t: t[:-1])
    with pytest.raises(CheckpointError, match=NAME):
        hf_to_mcore(ckpt, out, LAYOUT)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ConfigError, match="MixtralForCausalLM"):
        hf_to_mcore(ckpt, out, LAYOUT)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_staging_dir_is_all_or_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), hf_io.staging_dir(target) as stage:
        (stage / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    with hf_io.staging_dir(target) as stage:
        (stage / "config.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(FileExistsError, match="not empty"), hf_io.staging_dir(target):
        pass
    with hf_io.staging_dir(target, overwrite=True) as stage:
        (stage / "new.json").write_text("{}")
    assert [p.name for p in target.iterdir()] == ["new.json"]
