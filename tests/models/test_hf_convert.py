"""``sao convert``: HF -> Megatron torch_dist (2 ranks, EP=2) -> HF (1 rank, resharded) is bit-exact."""

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from sao_megatron.cli import main
from sao_megatron.config import ModelConfig
from sao_megatron.models import hf_io
from sao_megatron.spawn import START_METHOD_ENV
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


def test_a_conversion_past_its_timeout_stops_naming_the_flag(converted, capsys, monkeypatch):
    """``--timeout-s`` bounds the whole world (here far below its start-up): exit 1, one line naming
    the flag, the ranks stopped, nothing left at the target or next to it. Spawned ranks, as in
    production: ranks forked from the suite's preloaded server finish this tiny conversion in 0.5 s."""
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    root, _, _ = converted
    out = root / "timed_out"
    assert main(["convert", "hf-to-mcore", str(root / "hf"), str(out), "--timeout-s", "0.5"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert error: ") and "exceeded" in err and "raise --timeout-s" in err, err
    assert "\n" not in err and not out.exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".timed_out")], "staging left behind"


def test_default_timeout_grows_with_the_bytes():
    """``max(900 s, 3 x bytes / 0.5 GB/s)``: the floor for small checkpoints, 8880 s for 750B-A40B in bf16."""
    from sao_megatron.models.hf_convert import convert_timeout_s

    assert convert_timeout_s(0) == convert_timeout_s(100 << 20) == 900.0
    assert convert_timeout_s(1_480_000_000_000) == pytest.approx(8880.0)


def test_conversion_builds_on_the_cpu_without_initialising(monkeypatch):
    """``for_loading``: CPU parameters whatever CUDA the process sees, allocated but not initialised;
    training builds (``for_loading`` off) still follow CUDA."""
    from sao_megatron.config import ParallelConfig
    from sao_megatron.models.builder import transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    loading = transformer_config(MODEL, ParallelConfig(), for_loading=True)
    assert loading.use_cpu_initialization and not loading.perform_initialization
    training = transformer_config(MODEL, ParallelConfig())
    assert not training.use_cpu_initialization and training.perform_initialization


RSS_MODEL = ModelConfig(
    name="rss",
    num_layers=7,
    hidden_size=1024,
    num_attention_heads=8,
    num_query_groups=2,
    head_dim=128,
    ffn_hidden_size=2048,
    vocab_size=4096,
    num_experts=32,
    moe_router_topk=2,
    moe_ffn_hidden_size=1024,
    rope_theta=10000.0,
)
"""~2.9 GB in float32, ~1.5 GB per rank at EP=2: big enough that the ~0.73 GiB every rank holds before
any weight (torch's CUDA build and Megatron, imported) fits in the bound's half-shard share."""


def _write_random_checkpoint(directory, m: ModelConfig) -> int:
    """Uniform random float32 tensors of every HF tensor of ``m`` in 512 MiB shards; returns bytes."""
    from sao_megatron.config import hf as hf_config
    from sao_megatron.models import hf_bridge

    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    specs = [hf_io.TensorSpec(n, hf_bridge.hf_shape(n, m), torch.float32) for n in hf_bridge.expected_hf_names(m)]
    writer = hf_io.ShardWriter(directory, specs, 512 << 20)
    for spec in specs:
        writer.write(spec.name, torch.empty(spec.shape).uniform_(-0.05, 0.05, generator=g))
    writer.finish()
    (directory / "config.json").write_text(json.dumps(hf_config.hf_config_from_model(m)))
    return writer.bytes_written


@pytest.mark.slow
def test_peak_rss_per_rank_stays_near_its_shard_both_ways(tmp_path):
    """HF -> torch_dist -> HF of a ~2.9 GB checkpoint at EP=2: each rank's peak resident memory over its
    whole process (``VmHWM``, imports included) <= 1.5 x its shard + 256 MiB, both ways; bit-exact."""
    from sao_megatron.models.hf_convert import hf_to_mcore, mcore_to_hf, parallel_config

    nbytes = _write_random_checkpoint(tmp_path / "hf", RSS_MODEL)
    assert nbytes >= 2e9
    p = parallel_config(2, 1, 1, 2)
    there = hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", p)
    back = mcore_to_hf(tmp_path / "mcore", tmp_path / "back", p)
    for summary in (there, back):
        assert len(summary.peak_rss) == len(summary.shard_bytes) == 2
        for peak, shard in zip(summary.peak_rss, summary.shard_bytes, strict=True):
            assert shard < 0.6 * nbytes  # half of the experts each
            assert peak <= 1.5 * shard + (256 << 20), (summary.direction, peak, shard)
    shutil.rmtree(tmp_path / "mcore")
    original, exported = _state(tmp_path / "hf"), _state(tmp_path / "back")
    same = sorted(exported) == sorted(original) and all(torch.equal(exported[k], v) for k, v in original.items())
    del original, exported
    # 8.4 GB of checkpoints, by far the suite's largest footprint: removed here rather than left to
    # pytest's retention of tmp dirs (a CI run of this suite once failed with "No space left on device")
    shutil.rmtree(tmp_path)
    assert same
