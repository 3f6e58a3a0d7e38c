"""``HFWeightStream``: who writes what (``spread``), and the bound on a sender's unacknowledged bytes.

One spawned 2-rank gloo world loads a small Qwen3-MoE checkpoint at TP=2 and at EP=2 and runs the
stream: with many writers (``spread``, the HF export) every HF tensor reaches exactly one writer
with the checkpoint's values, both ranks write, and at EP=2 (TP=1) no tensor moves between ranks
at all; with one writer (rank 0, consuming slowly) rank 1 never has more than ``inflight_bytes``
sent and unacknowledged (one step always goes), and without the bound it has everything.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sao_megatron.config import ModelConfig

MODEL = ModelConfig(
    name="stream",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=96,
    vocab_size=128,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    dense_layers=[0],
    rope_theta=10000.0,
)
BUCKET = 16 << 10  # several steps per writer
SLOW_S = 0.05  # the single writer's time per bucket


def _model(layout: dict, hf_dir: str):
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_weights import load_hf_weights
    from tests.models.hf_cases import _setup

    p = _setup(dist.get_world_size(), **layout)
    model = build_gpt(MODEL, p, for_loading=True)
    load_hf_weights(model, MODEL, hf_dir)
    return model


def _spread(layout: dict, hf_dir: str, out: Path) -> dict:
    """Every rank's received tensors saved to ``out``; its writers, bytes received and sends posted."""
    from sao_megatron.models import hf_stream
    from sao_megatron.models.hf_stream import HFWeightStream

    model = _model(layout, hf_dir)
    sends = []
    isend = dist.isend
    hf_stream.dist.isend = lambda tensor, dst, **kw: sends.append(dst) or isend(tensor, dst, **kw)  # type: ignore[assignment]
    try:
        stream = HFWeightStream(model, MODEL, spread=True)
        got = [(n, t.clone()) for bucket in stream.buckets(BUCKET) for n, t in bucket]
    finally:
        hf_stream.dist.isend = isend  # type: ignore[assignment]
    torch.save(dict(got), out)
    return {
        "writers": stream.writers,
        "planned": [s.name for s in stream.writer_specs(dist.get_rank())],
        "got": [n for n, _ in got],
        "bytes": sum(t.numel() * t.element_size() for _, t in got),
        "sends": len(sends),
    }


def _window(hf_dir: str, inflight_bytes: int) -> dict:
    """One writer (rank 0) that takes ``SLOW_S`` per bucket; every post of rank 1: its step's index,
    seconds since the start, bytes, and the unacknowledged bytes after it."""
    from sao_megatron.models import hf_stream
    from sao_megatron.models.hf_stream import HFWeightStream

    model = _model({"tensor_parallel": 2}, hf_dir)
    stream = HFWeightStream(model, MODEL, dst=0, inflight_bytes=inflight_bytes)
    posts: list[tuple[int, float, int, int]] = []
    add = hf_stream._SendWindow.add

    def record(window, index, nbytes, *rest):
        add(window, index, nbytes, *rest)
        posts.append((index, time.perf_counter() - t0, nbytes, window.bytes))

    hf_stream._SendWindow.add = record  # type: ignore[method-assign]
    dist.barrier()
    t0 = time.perf_counter()
    try:
        for bucket in stream.buckets(BUCKET):
            if bucket:
                time.sleep(SLOW_S)
    finally:
        hf_stream._SendWindow.add = add  # type: ignore[method-assign]
    return {"posts": posts, "steps": len(stream.steps(BUCKET))}


def _cases(rank, world, root: str) -> dict:
    hf_dir = str(Path(root) / "hf")
    return {
        "tp2": _spread({"tensor_parallel": 2}, hf_dir, Path(root) / f"tp2-rank{rank}.pt"),
        "ep2": _spread({"expert_parallel": 2}, hf_dir, Path(root) / f"ep2-rank{rank}.pt"),
        "bounded": _window(hf_dir, BUCKET),
        "unbounded": _window(hf_dir, 1 << 40),
    }


@pytest.fixture(scope="module")
def world(export_world):
    """This module's cases, run in the package's export world (tests/models/conftest.py)."""
    root, results = export_world
    return root, [r["stream"] for r in results]


def _stored(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted((root / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_every_tensor_reaches_one_writer_with_its_values_and_both_ranks_write(world, layout):
    root, results = world
    stored = _stored(root)
    ranks = [r[layout] for r in results]
    assert ranks[0]["writers"] == ranks[1]["writers"] == [0, 1]
    names = ranks[0]["got"] + ranks[1]["got"]
    assert sorted(names) == sorted(stored) and len(set(names)) == len(names)
    for rank, r in enumerate(ranks):
        assert r["got"] == r["planned"] and r["bytes"] > 0
        for name, tensor in torch.load(root / f"{layout}-rank{rank}.pt").items():
            assert torch.equal(tensor, stored[name]), name
    small, big = sorted(r["bytes"] for r in ranks)
    assert big <= 2 * small, (small, big)  # the least-loaded holder writes each tensor


def test_with_tp1_every_rank_writes_what_it_holds_and_nothing_moves(world):
    _, results = world
    assert [r["ep2"]["sends"] for r in results] == [0, 0]
    assert all(r["tp2"]["sends"] > 0 for r in results)  # TP=2: the writer's TP peer sends its shards


def test_a_sender_waits_for_acknowledgements_beyond_inflight_bytes(world):
    """Rank 1 posts a step only while its unacknowledged bytes stay within the bound (one step always
    goes), so at most ``m = BUCKET // smallest step`` of its steps are open: when it posts its k-th step
    the writer has acknowledged its (k - m)-th, which it receives only after sleeping once per earlier
    step. Without the bound everything is posted at once."""
    _, results = world
    assert results[0]["bounded"]["posts"] == []  # rank 0 is the writer
    posts = results[1]["bounded"]["posts"]
    assert len(posts) > 4
    largest = max(nbytes for _, _, nbytes, _ in posts)
    assert all(open_bytes <= max(BUCKET, largest) for _, _, _, open_bytes in posts), posts
    m = max(1, BUCKET // min(nbytes for _, _, nbytes, _ in posts))
    for k in range(m, len(posts)):
        index, seconds = posts[k][:2]
        acknowledged = posts[k - m][0]  # received by the writer after `acknowledged` sleeps
        assert seconds >= acknowledged * SLOW_S - 0.02, (k, index, seconds, acknowledged)
    unbounded = results[1]["unbounded"]["posts"]
    total = sum(nbytes for _, _, nbytes, _ in unbounded)
    assert total > 2 * BUCKET and unbounded[-1][3] == total  # it waited for no acknowledgement
