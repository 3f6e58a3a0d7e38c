"""``plan.sync_traffic``: bytes and communicators per rank of one weight sync, against hand counts and
against what the real stream moves.

A spawned 4-rank gloo world builds a small MoE model (a dense layer, then 4 experts) at three layouts
(TP 2 with EP 4, EP 2 with two data-parallel replicas, PP 2 with TP 2), runs the sync's stream
(``HFWeightStream(per_stage=True)``) and counts every point-to-point byte and peer of each rank (the
acknowledgements apart) and the bytes each sender hands on; the analytic figures must equal them.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from sao_megatron.config import ModelConfig, ParallelConfig
from sao_megatron.plan.sync_traffic import sync_traffic
from tests.distributed import run_distributed

MODEL = ModelConfig(
    name="traffic",
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
LAYOUTS = {
    "tp2_ep4": {"tensor_parallel": 2, "expert_parallel": 4},
    "ep2": {"expert_parallel": 2},
    "pp2_tp2": {"pipeline_parallel": 2, "tensor_parallel": 2},
}
WORLD = 4


def _is_ack(tensor) -> bool:
    return tensor.numel() == 1 and not tensor.is_floating_point()


def _measure(layout: dict) -> dict:
    """This rank's point-to-point bytes and peers in one per-stage stream, and the bytes it hands on."""
    from sao_megatron.models import hf_stream
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_stream import HFWeightStream
    from tests.models.hf_cases import _setup

    p = _setup(dist.get_world_size(), **layout)
    stream = HFWeightStream(build_gpt(MODEL, p), MODEL, per_stage=True)
    moved = {"sent": 0, "received": 0, "peers": set()}
    isend, irecv = dist.isend, dist.irecv

    def count(kind, op):
        def wrapped(tensor, peer, **kw):
            if not _is_ack(tensor):
                moved[kind] += tensor.numel() * tensor.element_size()
                moved["peers"].add(peer)
            return op(tensor, peer, **kw)

        return wrapped

    hf_stream.dist.isend, hf_stream.dist.irecv = count("sent", isend), count("received", irecv)  # type: ignore[assignment]
    try:
        handed = sum(t.numel() * t.element_size() for bucket in stream.buckets(1 << 12) for _, t in bucket)
    finally:
        hf_stream.dist.isend, hf_stream.dist.irecv = isend, irecv  # type: ignore[assignment]
    return {**moved, "peers": sorted(moved["peers"]), "handed": handed, "sender": stream.sender}


def _cases(rank, world) -> dict:
    return {name: _measure(layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(_cases, WORLD, timeout_s=600)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_analytic_traffic_is_what_the_stream_moves(measured, layout):
    p = ParallelConfig(world_size=WORLD, **LAYOUTS[layout])
    traffic = sync_traffic(MODEL, p, dtype_bytes=4)  # the CPU model is float32
    for rank, got in enumerate(r[layout] for r in measured):
        want = traffic.ranks[rank]
        stage = rank // (WORLD // p.pipeline_parallel)
        is_sender = got["sender"] == rank
        handed = traffic.stage_bytes[stage] if is_sender else 0
        assert got["handed"] == handed, (rank, got, traffic)
        assert (got["received"], got["sent"] + handed) == (want.received, want.sent), (rank, got, want)
        assert len(got["peers"]) == want.peers and want.broadcast_groups == int(is_sender), (rank, got, want)


def test_hand_counts_at_tp2_ep4():
    """Rank 0 sends the stage; it receives rank 1's half of every TP-split dense tensor and the experts
    of ranks 1-3 (EP ranks 1-3, one expert each); ranks 2-3 hold only experts to send."""
    h, experts_per_rank = MODEL.hidden_size, MODEL.num_experts // 4
    expert = 3 * MODEL.moe_ffn_hidden_size * h  # fc1 [gate; up] + fc2, elements
    qkv = (MODEL.num_attention_heads + 2 * MODEL.num_query_groups) * MODEL.head_dim * h
    proj = MODEL.num_attention_heads * MODEL.head_dim * h
    dense_mlp = 3 * MODEL.ffn_hidden_size * h
    half_dense = (2 * MODEL.vocab_size * h + 2 * (qkv + proj) + dense_mlp) // 2  # embedding, output layer
    t = sync_traffic(MODEL, ParallelConfig(world_size=4, tensor_parallel=2, expert_parallel=4), dtype_bytes=2)
    moved = [(r.received, r.sent, r.peers, r.broadcast_groups) for r in t.ranks]
    rest = 3 * experts_per_rank * expert * 2
    assert (
        moved[1:]
        == [(0, half_dense * 2 + experts_per_rank * expert * 2, 1, 0)] + [(0, experts_per_rank * expert * 2, 1, 0)] * 2
    )
    assert moved[0] == (half_dense * 2 + rest, t.stage_bytes[0], 3, 1)
    assert t.busiest == 0 and t.max_communicators == 4


def test_sao_plan_prints_the_busiest_rank_and_the_communicators(capsys):
    from sao_megatron import cli
    from sao_megatron.config import load_config
    from sao_megatron.plan.sync_traffic import summary

    path = "configs/qwen3_30b_a3b_math.yaml"
    cli.main(["plan", "--analytic", path])
    cfg = load_config(path)
    line = summary(cfg)
    assert line in capsys.readouterr().out
    p = cfg.actor.parallel  # one stage: rank 0 gathers from TP ranks 1.. and expert ranks 1.. of its stage
    pairs = max(p.tensor_parallel, p.expert_parallel * p.expert_tensor_parallel) - 1
    assert "busiest rank 0 moves" in line and f"({pairs} gather pairs + 1 broadcast group)" in line
