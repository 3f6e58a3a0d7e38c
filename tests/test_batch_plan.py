"""Micro-batch planning on this side of the workers: token-balanced DP shards, padded or packed
micro-batches under a row count or a token budget, equal micro-batch counts across replicas,
and the padding fraction on a long-tail batch."""

import math
import random

import pytest
import torch

from sao_megatron.batch import MicroBatching, balanced_split, build_batch, spread
from tests.workers import ragged_cases


def lognormal_lengths(n: int, seed: int = 0, high: int = 8192) -> list[int]:
    """Agentic long-tail lengths: lognormal (median ~600 tokens), clipped to 1..``high``."""
    rng = random.Random(seed)
    return [min(high, max(1, round(rng.lognormvariate(math.log(600), 1.2)))) for _ in range(n)]


def test_balanced_split_evens_tokens_and_gives_every_replica_a_row():
    lengths = lognormal_lengths(64)
    groups = balanced_split(lengths, 4)
    assert sorted(i for g in groups for i in g) == list(range(64))
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(lengths)  # greedy bound: within one row of each other
    stride = [sum(lengths[d::4]) for d in range(4)]
    assert max(loads) - min(loads) < max(stride) - min(stride)
    assert all(groups) and balanced_split([5, 1, 1], 3) == [[0], [1], [2]]


def test_plan_without_budget_is_consecutive_rows():
    assert MicroBatching(rows=2).plan([7, 12, 5, 9, 3]) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("pack", [False, True])
def test_plan_under_a_token_budget_respects_it(pack):
    how = MicroBatching(max_tokens=4096, multiple=2, pack=pack)
    lengths = lognormal_lengths(128, seed=1)
    plan = how.plan(lengths)
    assert sorted(i for b in plan for i in b) == list(range(128))
    for b in plan:
        assert how.cost([lengths[i] for i in b]) <= 4096 or len(b) == 1  # a longer row alone


def test_spread_halves_then_adds_fillers():
    assert spread([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert spread([[0], [1]], 4) == [[0], [1], [], []]
    batch = build_batch(ragged_cases.ragged_trajectories())
    filler = batch.micro_batch([], MicroBatching(multiple=4), advantages=torch.ones(4, 12))
    assert filler.tokens.shape == (1, 4) and filler.rows == []
    assert not filler.action_mask.any() and (filler.policy_versions == -1).all()
    assert filler.advantages is not None and not filler.advantages.any()
    packed = batch.micro_batch([], MicroBatching(multiple=4, pack=True))
    assert packed.tokens.shape == (1, 4) and packed.spans == [] and packed.cu_seqlens is not None
    assert packed.cu_seqlens.tolist() == [0, 4]


def test_packed_micro_batch_lays_rows_end_to_end_with_exact_segments():
    batch = build_batch(ragged_cases.ragged_trajectories())  # lengths 7, 12, 5, 9
    extra = torch.randn(4, 12)
    how = MicroBatching(multiple=8, segment_multiple=2, pack=True)
    mb = batch.micro_batch([0, 2, 3], how, advantages=extra)
    assert mb.spans is not None and mb.cu_seqlens is not None and mb.segment_ids is not None
    assert mb.advantages is not None and mb.lag is None and mb.returns is None and mb.cp_lengths is None
    # 7 -> 8, 5 -> 6, 9 -> 10: 24 tokens, already a multiple of 8 (no trailing segment)
    assert mb.spans == [(0, 7), (8, 5), (14, 9)] and mb.tokens.shape == (1, 24) and mb.rows == [0, 2, 3]
    assert mb.cu_seqlens.tolist() == [0, 8, 14, 24]
    assert mb.segment_ids[0].tolist() == [0] * 8 + [1] * 6 + [2] * 10
    assert mb.positions[0].tolist() == list(range(8)) + list(range(6)) + list(range(10))
    for row, (offset, n) in zip([0, 2, 3], mb.spans, strict=True):
        for key in ("tokens", "labels", "action_mask", "behavior_logprobs", "policy_versions"):
            assert torch.equal(getattr(mb, key)[0, offset : offset + n], getattr(batch, key)[row, :n]), key
        assert torch.equal(mb.advantages[0, offset : offset + n], extra[row, :n])
    gaps = torch.ones(24, dtype=torch.bool)
    for offset, n in mb.spans:
        gaps[offset : offset + n] = False
    assert not mb.action_mask[0, gaps].any() and (mb.policy_versions[0, gaps] == -1).all()
    odd = batch.micro_batch([1], MicroBatching(multiple=8, pack=True))  # 12 -> 16, tail segment
    assert odd.cu_seqlens is not None and odd.segment_ids is not None
    assert odd.cu_seqlens.tolist() == [0, 12, 16] and odd.segment_ids[0, 12:].tolist() == [1] * 4


def test_packing_under_a_budget_keeps_padding_under_ten_percent_on_a_long_tail():
    """The acceptance figure: lognormal lengths 1..8K, TP2 x CP2 multiples. Before: the old path,
    4 rows per micro-batch padded to their longest, DP by stride; after: token-balanced shards,
    packed micro-batches under an 8K-token budget (benchmarks/bench_padding.py)."""
    lengths = lognormal_lengths(256, seed=3)
    before = max(MicroBatching(rows=4, multiple=8).padding_fraction(lengths[d::4]) for d in range(4))
    after_how = MicroBatching(max_tokens=8192, multiple=8, segment_multiple=4, pack=True)
    after = max(after_how.padding_fraction([lengths[i] for i in g]) for g in balanced_split(lengths, 4))
    assert before > 0.4, before
    assert after <= 0.10, after
