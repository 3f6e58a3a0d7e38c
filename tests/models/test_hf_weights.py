"""``save_hf_checkpoint`` with many writers: each rank writes its own shards, all or nothing, in time.

One spawned 2-rank gloo world exports a small Qwen3-MoE loaded from an HF checkpoint:

* at TP=2 and at EP=2 both ranks write shards; the file names are unique across writers
  (``model-0000i-of-0000N``, N over all writers), the index merges both writers' tensors and the
  checkpoint reads back bit for bit (``transformers`` loads such exports: tests/models/test_hf_models.py);
* a writer whose disk fails makes every rank raise naming it, and nothing appears at the target;
* a rank that stalls past ``timeout_s`` makes the other fail with a ``TimeoutError`` naming
  ``run.export_timeout_s``; again nothing appears at the target.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sao_megatron.models import hf_io
from tests.models.test_hf_stream import MODEL, _model

STALL_S = 8.0
TIMEOUT_S = 2.0


def _export(layout: dict, hf_dir: str, out: Path, **kw) -> dict:
    """This rank's part of an export: its stats, or the error it raised and after how long."""
    from sao_megatron.models.hf_weights import save_hf_checkpoint

    model = _model(layout, hf_dir)
    dist.barrier()
    t0 = time.perf_counter()
    try:
        stats = save_hf_checkpoint(model, MODEL, out, max_shard_bytes=40 << 10, **kw)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
    return {"error": None, **stats.as_dict()}


def _failing_disk(hf_dir: str, out: Path) -> dict:
    """Rank 1's shard writes fail (no space left) after its first tensor."""
    if dist.get_rank() == 1:
        write = hf_io.ShardWriter.write

        def full(writer, name, tensor):
            if writer._pos > 0:
                raise OSError(28, "No space left on device")
            write(writer, name, tensor)

        hf_io.ShardWriter.write = full  # type: ignore[method-assign]
    return _export({"tensor_parallel": 2}, hf_dir, out)


def _stalled(hf_dir: str, out: Path) -> dict:
    """Rank 1 stalls ``STALL_S`` before its first transfer; the export's timeout is ``TIMEOUT_S``."""
    from sao_megatron.models.hf_stream import HFWeightStream

    if dist.get_rank() == 1:
        buckets = HFWeightStream.buckets

        def late(stream, bucket_bytes):
            time.sleep(STALL_S)
            yield from buckets(stream, bucket_bytes)

        HFWeightStream.buckets = late  # type: ignore[method-assign]
    return _export({"expert_parallel": 2}, hf_dir, out, timeout_s=TIMEOUT_S)


def _cases(rank, world, root: str) -> dict:
    hf_dir = str(Path(root) / "hf")
    out = Path(root) / "out"
    return {
        "tp2": _export({"tensor_parallel": 2}, hf_dir, out / "tp2"),
        "ep2": _export({"expert_parallel": 2}, hf_dir, out / "ep2"),
        "disk": _failing_disk(hf_dir, out / "disk"),
        "stall": _stalled(hf_dir, out / "stall"),  # last: the world's groups are broken after it
    }


@pytest.fixture(scope="module")
def world(export_world):
    """This module's cases, run in the package's export world (tests/models/conftest.py)."""
    root, results = export_world
    return root, [r["weights"] for r in results]


def _state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_every_rank_writes_its_own_shards_under_unique_names_and_the_index_merges_them(world, layout):
    root, results = world
    ranks = [r[layout] for r in results]
    assert [r["error"] for r in ranks] == [None, None]
    assert all(r["writers"] == 2 and r["written_bytes"] > 0 for r in ranks)
    out = root / "out" / layout
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = ranks[0]["shards"]
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] and n > 2
    weight_map = json.loads((out / hf_io.INDEX_FILE).read_text())["weight_map"]
    original, exported = _state(root / "hf"), _state(out)
    assert set(weight_map) == set(original) and set(weight_map.values()) == set(files)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    assert ranks[0]["bytes"] == ranks[1]["bytes"] == sum(r["written_bytes"] for r in ranks)
    assert (out / "config.json").exists()


def test_a_writer_that_fails_fails_every_rank_and_nothing_is_published(world):
    root, results = world
    for r in results:
        assert r["disk"]["error"].startswith("RuntimeError: HF export to "), r["disk"]
        assert "nothing was written: rank 1: OSError: [Errno 28] No space left on device" in r["disk"]["error"]
    assert not (root / "out" / "disk").exists()
    assert not [p.name for p in (root / "out").iterdir() if p.name.startswith(".")], "staging left behind"


def test_a_stalled_rank_times_out_its_peer_naming_the_key(world):
    root, results = world
    waiting = results[0]["stall"]
    assert waiting["error"].startswith("TimeoutError: HF export to "), waiting
    assert (
        f"run.export_timeout_s={TIMEOUT_S:g} s" in waiting["error"] and "raise run.export_timeout_s" in waiting["error"]
    )
    assert TIMEOUT_S <= waiting["seconds"] < STALL_S, waiting  # it did not wait for the stalled rank
    assert results[1]["stall"]["error"] is not None  # its peer left the export: it fails too
    assert not (root / "out" / "stall").exists()
    assert not [p.name for p in (root / "out").iterdir() if p.name.startswith(".")], "staging left behind"
