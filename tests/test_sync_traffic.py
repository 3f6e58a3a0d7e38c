"""``plan.sync_traffic``: bytes and communicators per rank of one weight sync, against hand counts and
against what the real stream moves.

A spawned 4-rank gloo world builds a small MoE model (a dense layer, then 4 experts) at four layouts
(TP 2 with EP 4, EP 2 with two data-parallel replicas, PP 2 with TP 2, TP 2 with expert-TP 2 and EP 2),
runs the sync's stream (``HFWeightStream(senders=n)``) with 1, 2 and 8 senders, and counts every byte
each rank's gathers send and receive, the gathers' groups it belongs to and the bytes each sender
hands on; the analytic figures must equal them.
"""

from __future__ import annotations

from typing import Any

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
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2_ep4": {"tensor_parallel": 2, "expert_parallel": 4},
    "ep2": {"expert_parallel": 2},
    "pp2_tp2": {"pipeline_parallel": 2, "tensor_parallel": 2},
    "tp2_etp2_ep2": {"tensor_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 2},
}
WORLD = 4


SENDERS = (1, 2, 8)
"""``rollout.weight_sync_senders`` measured at each layout (per stage: the largest divisor of EP not above
``senders // pipeline_parallel``)."""


def _measure(layout: dict, senders: int) -> dict:
    """This rank's gather bytes and groups in one fan-out stream, and the bytes it hands on."""
    from sao_megatron.models import hf_stream
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_stream import HFWeightStream
    from tests.models.hf_cases import _setup

    p = _setup(dist.get_world_size(), **layout)
    stream = HFWeightStream(build_gpt(MODEL, p), MODEL, senders=max(1, senders // p.pipeline_parallel))
    moved = {"sent": 0, "received": 0, "groups": set()}
    gather, collect = dist.gather, hf_stream.HFWeightStream._collect

    def counted(tensor, gather_list=None, dst=None, **kw):
        nbytes = tensor.numel() * tensor.element_size()
        if gather_list is None:
            moved["sent"] += nbytes
        else:
            moved["received"] += nbytes * (len(gather_list) - 1)
        return gather(tensor, gather_list, dst=dst, **kw)

    def collecting(self, g):
        moved["groups"].add(g.group)
        return collect(self, g)

    hf_stream.dist.gather = counted  # type: ignore[assignment]
    hf_stream.HFWeightStream._collect = collecting  # type: ignore[method-assign]
    try:
        handed = sum(t.numel() * t.element_size() for bucket in stream.buckets(1 << 12) for _, t in bucket)
    finally:
        hf_stream.dist.gather = gather  # type: ignore[assignment]
        hf_stream.HFWeightStream._collect = collect  # type: ignore[method-assign]
    groups = sorted(list(g) for g in moved["groups"])
    return {**moved, "groups": groups, "handed": handed, "senders": stream.senders, "lane": stream.lane}


def _cases(rank, world) -> dict:
    return {f"{name}/{n}": _measure(layout, n) for name, layout in LAYOUTS.items() for n in SENDERS}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(_cases, WORLD, timeout_s=600)


@pytest.mark.parametrize("senders", SENDERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_analytic_traffic_is_what_the_stream_moves(measured, layout, senders):
    p = ParallelConfig(world_size=WORLD, **LAYOUTS[layout])
    traffic = sync_traffic(MODEL, p, dtype_bytes=4, senders=senders)  # the CPU model is float32
    runs = [r[f"{layout}/{senders}"] for r in measured]
    assert list(traffic.senders) == runs[0]["senders"]
    for rank, got in enumerate(runs):
        want = traffic.ranks[rank]
        lane = got["lane"]
        handed = traffic.lane_bytes[lane] if lane is not None else 0
        assert got["handed"] == handed, (rank, got, traffic)
        assert (got["received"], got["sent"] + handed) == (want.received, want.sent), (rank, got, want)
        assert len(got["groups"]) == want.gather_groups, (rank, got, want)
        assert want.broadcast_groups == int(lane is not None), (rank, got, want)


def test_hand_counts_at_tp2_ep4():
    """One sender (rank 0): it gathers rank 1's half of every TP-split dense tensor over their TP group
    and the experts of ranks 1-3 (EP ranks 1-3, one expert each) over the four; ranks 2-3 hold only
    experts to send. Four senders: each EP rank sends its own expert (nothing gathered), the dense
    tensors split between the two TP groups."""
    h, experts_per_rank = MODEL.hidden_size, MODEL.num_experts // 4
    expert = 3 * MODEL.moe_ffn_hidden_size * h  # fc1 [gate; up] + fc2, elements
    qkv = (MODEL.num_attention_heads + 2 * MODEL.num_query_groups) * MODEL.head_dim * h
    proj = MODEL.num_attention_heads * MODEL.head_dim * h
    dense_mlp = 3 * MODEL.ffn_hidden_size * h
    half_dense = (2 * MODEL.vocab_size * h + 2 * (qkv + proj) + dense_mlp) // 2  # embedding, output layer
    p = ParallelConfig(world_size=4, tensor_parallel=2, expert_parallel=4)
    t = sync_traffic(MODEL, p, dtype_bytes=2, senders=1)
    moved = [(r.received, r.sent, r.gather_groups, r.broadcast_groups) for r in t.ranks]
    rest = 3 * experts_per_rank * expert * 2
    assert (
        moved[1:]
        == [(0, (half_dense + experts_per_rank * expert) * 2, 2, 0)] + [(0, experts_per_rank * expert * 2, 1, 0)] * 2
    )
    assert moved[0] == (half_dense * 2 + rest, t.lane_bytes[0], 2, 1)
    assert t.senders == (0,) and t.busiest == 0 and t.max_communicators == 3
    four = sync_traffic(MODEL, p, dtype_bytes=2, senders=8)
    assert four.senders == (0, 1, 2, 3) and sum(four.lane_bytes) == t.lane_bytes[0]
    assert all(r.received + r.sent < moved[0][0] + moved[0][1] for r in four.ranks)
    assert [r.gather_groups for r in four.ranks] == [1, 1, 1, 1] and four.max_communicators == 2


def test_sao_plan_prints_the_busiest_rank_and_the_communicators(capsys):
    from sao_megatron import cli
    from sao_megatron.config import load_config
    from sao_megatron.plan.sync_traffic import summary

    path = "configs/qwen3_30b_a3b_math.yaml"
    cli.main(["plan", "--analytic", path])
    cfg = load_config(path)
    line = summary(cfg)
    assert line in capsys.readouterr().out
    p = cfg.actor.parallel  # one stage, EP 8: eight senders, each its own EP rank's experts
    assert p.pipeline_parallel == 1 and p.expert_parallel == cfg.rollout.weight_sync_senders == 8
    assert "8 sender(s), 8 per stage" in line and "each engine GPU joins 8." in line
