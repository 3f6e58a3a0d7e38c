"""The weight stream loaded into SGLang's own model classes bucket by bucket, as a weight sync does.

Each bucket of a sync is one ``/update_weights_from_distributed``, i.e. one ``load_weights`` call of
the engine's model class; a loader that pairs tensors within a call (DeepSeek-V3's
``q_a_proj`` + ``kv_a_proj_with_mqa`` -> ``fused_qkv_a_proj_with_mqa``) silently drops a tensor
whose partner came in another call, and the engine keeps its random (``--load-format dummy``)
weights there. Tiny checkpoints of the four synced families (Qwen3-MoE, Mixtral, GLM-4.5,
DeepSeek-V3 with YaRN, which SGLang's CPU rotary embedding for DeepSeek requires) are streamed in
the stream's own order and bucketing (``hf_stream._order_key``, ``hf_stream._buckets``; the plan of
a one-rank stream, every tensor whole at its writer) for each Megatron spec's names, at 1 byte
per bucket (every tensor or fused set alone: every layer split wherever it can be) and at a few KB
(mixed packing). One subprocess (``tests/models/sglang_load.py``) calls ``load_weights`` once per
bucket and compares every parameter with ``transformers``'. CPU only, one SGLang import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sao_megatron.config.hf import model_config_from_hf, read_hf_config
from sao_megatron.config.schema import REPO_ROOT
from sao_megatron.models import hf_bridge, hf_stream
from sao_megatron.rollout.sglang_cpu import STANDIN_DIR
from tests.models import hf_cases
from tests.models.test_hf_models import _state

FAMILIES = {"moe_gqa2": "qwen3_moe", "mixtral": "mixtral", "glm4_moe": "glm4_moe", "deepseek_v3_yarn": "deepseek_v2"}
SPECS = ("local", "te", "te_grouped")
BUCKET_BYTES = (1, 3000)
CASES = [(shape, spec, size) for shape in FAMILIES for spec in SPECS for size in BUCKET_BYTES]


def stream_buckets(hf_dir, spec: str, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The HF buckets a one-rank stream of ``hf_dir``'s checkpoint yields, Megatron names of ``spec``."""
    m = model_config_from_hf(read_hf_config(hf_dir))
    full = hf_bridge.hf_to_mcore(_state(hf_dir), m, hf_bridge.mcore_names(m, spec))
    one_rank = hf_stream._TP(1, 0, None, False)
    items = [
        hf_stream._Item(name, tuple(t.shape), t.dtype, one_rank, ((0, tuple(t.shape)),), 0, 0)
        for name, t in full.items()
    ]
    items.sort(key=lambda item: hf_stream._order_key(item.name))
    return [
        [pair for item in bucket for pair in hf_bridge.to_hf(item.name, full[item.name], m)]
        for bucket in hf_stream._buckets(items, bucket_bytes)
    ]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sglang_buckets")
    every = {**hf_cases.SHAPES, **hf_cases.FAMILY_SHAPES}
    dirs = hf_cases.make_checkpoints(root, {shape: every[shape] for shape in FAMILIES})
    argv, layers = [], {}
    for shape, spec, size in CASES:
        path = root / f"{shape}-{spec}-{size}.pt"
        buckets = stream_buckets(dirs[shape], spec, size)
        torch.save(buckets, path)
        argv += [str(dirs[shape]), str(path)]
        layers[(shape, spec, size)] = _split_layers(buckets)
    out = root / "sglang.json"
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join([str(STANDIN_DIR), str(REPO_ROOT)]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.models.sglang_load", str(out), *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    return {case: (results[argv[2 * i + 1]], layers[case]) for i, case in enumerate(CASES)}


def _split_layers(buckets: list[list[tuple[str, torch.Tensor]]]) -> int:
    """How many decoder layers have their tensors in more than one bucket."""
    seen: dict[str, set[int]] = {}
    for index, bucket in enumerate(buckets):
        for name, _ in bucket:
            if name.startswith("model.layers."):
                seen.setdefault(name.split(".")[2], set()).add(index)
    return sum(1 for where in seen.values() if len(where) > 1)


@pytest.mark.parametrize("shape, spec, bucket_bytes", CASES)
def test_sglang_loads_the_stream_bucket_by_bucket(loaded, shape, spec, bucket_bytes):
    """Every parameter of SGLang's class is written (none left NaN) and equals transformers' tensor for
    it, with the layers split over buckets; DeepSeek's per-head ``w_kc`` / ``w_vc`` too."""
    r, split = loaded[(shape, spec, bucket_bytes)]
    assert r["class"] == f"sglang.srt.models.{FAMILIES[shape]}"
    assert split > 0 and r["buckets"] > 1, (split, r["buckets"])
    assert r["unloaded"] == [] and r["mismatched"] == [] and r["compared"] > 10, r
    if shape.startswith("deepseek"):
        assert r["mla_absorbed"] == {"layers": 2, "equal": 2}, r["mla_absorbed"]
