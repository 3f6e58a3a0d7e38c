"""Context-parallel split/merge: hand-computed layouts, a plain per-sequence reference loop (the
rule of TE's ``thd_get_partitioned_indices``), Megatron's own BSHD split, and invariants
(round trip, balance, exact cover)."""

import pytest
import torch

from sao_megatron.context_parallel import (
    cp_indices,
    cp_merge,
    cp_multiple,
    cp_padded_length,
    cp_positions,
    cp_split,
)

CP_SIZES = [1, 2, 3, 4]


def _reference(lengths: list[int], c: int, r: int) -> list[int]:
    """Per sequence: chunks r and 2c-1-r of 2c equal chunks, sequences in order."""
    out, start = [], 0
    for n in lengths:
        k = n // (2 * c)
        for chunk in (r, 2 * c - 1 - r):
            out += range(start + chunk * k, start + (chunk + 1) * k)
        start += n
    return out


def _packed_lengths(c: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2 * c * int(m) for m in torch.randint(0, 5, (4,), generator=g)] + [2 * c]


def test_hand_computed_layouts():
    assert cp_indices([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_indices([8], 2, 1).tolist() == [2, 3, 4, 5]
    # packed [4, 8] over CP 2: sequence 0 has chunks of 1, sequence 1 (offset 4) chunks of 2
    assert cp_indices([4, 8], 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert cp_indices([4, 8], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    assert cp_positions([4, 8], 2, 1).tolist() == [1, 2, 2, 3, 4, 5]
    assert cp_indices([12], 3, 1).tolist() == [2, 3, 8, 9]
    assert cp_padded_length(5, 2) == 8 and cp_padded_length(8, 2) == 8 and cp_padded_length(0, 3) == 0


@pytest.mark.parametrize("c", CP_SIZES)
def test_matches_reference_loop(c):
    for seed in range(3):
        lengths = _packed_lengths(c, seed)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        owner = [i for i, n in enumerate(lengths) for _ in range(n)]
        for r in range(c):
            ref = _reference(lengths, c, r)
            assert cp_indices(lengths, c, r).tolist() == ref
            assert cp_positions(lengths, c, r).tolist() == [p - starts[owner[p]] for p in ref]


@pytest.mark.parametrize("c", CP_SIZES)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("shape", [(3,), (3, 5)])
def test_split_then_merge_is_identity(c, layout, shape):
    g = torch.Generator().manual_seed(c)
    lengths = [cp_padded_length(37, c)] if layout == "padded" else _packed_lengths(c, seed=c)
    b, *h = shape
    x = torch.randn(b, sum(lengths), *h, generator=g)  # [B, T] or [B, T, H]
    parts = [cp_split(x, lengths, c, r) for r in range(c)]
    assert all(p.shape == (b, sum(lengths) // c, *h) for p in parts)
    assert torch.equal(cp_merge(parts, lengths), x)
    if c > 1:  # merging in the wrong rank order must not give x back
        assert not torch.equal(cp_merge(parts[::-1], lengths), x)


def test_other_dims_and_gradients():
    x = torch.randn(8, 2, 3, requires_grad=True)  # [T, B, H]: sequence first, as in Megatron's SBHD
    parts = [cp_split(x, [8], 2, r, dim=0) for r in range(2)]
    assert torch.equal(parts[0], x[[0, 1, 6, 7]])
    merged = cp_merge(parts, [8], dim=0)
    assert torch.equal(merged, x)
    (merged * torch.arange(8.0)[:, None, None]).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.arange(8.0)[:, None, None].expand(8, 2, 3))


@pytest.mark.parametrize("c", CP_SIZES)
def test_matches_megatron_get_batch_on_this_cp_rank(c, monkeypatch):
    utils = pytest.importorskip("megatron.core.utils")
    # megatron-core 0.19 reads the CP size and rank from the cp_group through torch.distributed
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: c)
    t = cp_padded_length(30, c)
    g = torch.Generator().manual_seed(0)
    batch = {
        "tokens": torch.randint(0, 100, (2, t), generator=g),
        "position_ids": torch.arange(t).expand(2, t).clone(),
        "hidden": torch.randn(2, t, 4, generator=g),
    }
    for r in range(c):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=r: r)
        theirs = utils.get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False, cp_group=None)
        for key, val in batch.items():
            assert torch.equal(cp_split(val, [t], c, r), theirs[key]), (c, r, key)
        assert torch.equal(cp_positions([t], c, r).expand(2, -1), theirs["position_ids"])


@pytest.mark.parametrize("c", CP_SIZES)
def test_every_rank_holds_equal_tokens_and_causal_work(c):
    lengths = _packed_lengths(c, seed=7)
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [T]
    for i, n in enumerate(lengths):
        tokens, work = set(), set()
        for r in range(c):
            held = cp_indices(lengths, c, r)
            pos = cp_positions(lengths, c, r)[owner[held] == i]
            tokens.add(len(pos))
            work.add(int((pos + 1).sum()))
        assert tokens == {n // c}, (c, n)
        k = n // (2 * c)
        assert work == {2 * c * k * k + k}, (c, n, work)


def test_naive_contiguous_split_would_be_unbalanced():
    """The balance test can fail: contiguous quarters do different causal work."""
    work = [int((torch.arange(r * 4, r * 4 + 4) + 1).sum()) for r in range(2)]
    assert work[0] != work[1]
    assert len({int((cp_positions([8], 2, r) + 1).sum()) for r in range(2)}) == 1


@pytest.mark.parametrize("c", CP_SIZES)
def test_ranks_cover_every_position_exactly_once(c):
    g = torch.Generator().manual_seed(c)
    lengths = _packed_lengths(c, seed=11)
    work = torch.rand(sum(lengths), generator=g)  # [T] attention work of each position
    held = torch.cat([cp_indices(lengths, c, r) for r in range(c)])
    assert torch.equal(torch.sort(held).values, torch.arange(sum(lengths)))
    split = [cp_split(work, lengths, c, r, dim=0) for r in range(c)]
    # the ranks' pieces are a permutation of the sequence: no position dropped or duplicated
    assert torch.equal(torch.sort(torch.cat(split)).values, torch.sort(work).values)
    assert torch.equal(torch.cat(split)[torch.argsort(held)], work)


def test_cp_size_one_returns_everything_unchanged():
    x = torch.randn(2, 10, 3)
    assert torch.equal(cp_indices([4, 6], 1, 0), torch.arange(10))
    assert torch.equal(cp_positions([4, 6], 1, 0), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5]))
    assert torch.equal(cp_split(x, [4, 6], 1, 0), x)
    assert torch.equal(cp_merge([x], [4, 6]), x)
    # without CP any length goes (Megatron does not split then); a bare int is one sequence
    assert torch.equal(cp_indices(7, 1, 0), torch.arange(7))
    assert torch.equal(cp_positions([3, 2], 1, 0), torch.tensor([0, 1, 2, 0, 1]))
    assert cp_multiple(1) == 1 and cp_multiple(3) == 6 and cp_padded_length(7, 1) == 7


def test_errors_say_how_to_fix():
    with pytest.raises(ValueError, match=r"length 6 .*cp_size=2.*multiple of 2\*cp_size=4.*pad it to 8"):
        cp_indices([8, 6], 2, 0)
    with pytest.raises(ValueError, match=r"length 10 .*cp_size=3.*=6.*pad it to 12"):
        cp_split(torch.zeros(1, 10), [10], 3, 0)
    with pytest.raises(ValueError, match=r"cp_rank=2 is outside"):
        cp_indices([8], 2, 2)
    with pytest.raises(ValueError, match=r"cp_size must be >= 1"):
        cp_indices([8], 0, 0)
    with pytest.raises(ValueError, match=r"x has 12 entries along dim 1 but the lengths sum to 8"):
        cp_split(torch.zeros(1, 12), [8], 2, 0)
    with pytest.raises(ValueError, match=r"each needs 4"):
        cp_merge([torch.zeros(1, 4), torch.zeros(1, 3)], [8])
    with pytest.raises(ValueError, match=r"got none"):
        cp_merge([], [8])
