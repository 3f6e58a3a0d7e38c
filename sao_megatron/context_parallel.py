"""Context-parallel sequence split and merge: Megatron's load-balanced ("zigzag") layout.

With context-parallel size ``c`` every sequence of length L (a multiple of ``2c``) is cut into
``2c`` equal chunks of ``L / 2c`` tokens, and CP rank ``r`` holds chunks ``r`` and
``2c - 1 - r``, in that order. Under a causal mask the token at position p attends to p + 1
tokens, so a rank holding an early chunk also holds the mirrored late one and every rank does
the same attention work: with chunk size k, rank r's work on a sequence is
``sum_{p held} (p + 1) = (r k^2 + k(k+1)/2) + ((2c-1-r) k^2 + k(k+1)/2) = 2c k^2 + k``,
independent of r.

Two layouts, one rule:

* one padded row per sequence (BSHD, Megatron's ``get_batch_on_this_cp_rank`` without
  ``cu_seqlens``): pass the single row length, ``lengths=[T]``;
* a packed row (THD, Transformer Engine's ``thd_get_partitioned_indices`` used for
  ``cu_seqlens``): pass every packed sequence's (padded) length; the rule applies to each
  sequence separately and a rank's pieces follow in sequence order.

Positions index the concatenation of the sequences. :func:`cp_positions` gives the position ids
of the held tokens within their own sequence, which rotary embeddings need on each rank.
Everything here is pure tensor index arithmetic: no process group is touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Lengths = int | Sequence[int] | torch.Tensor


def cp_multiple(cp_size: int) -> int:
    """What each sequence length must divide by: ``2 * cp_size``, or 1 without CP (``cp_size``
    1 splits nothing, as Megatron skips the split then)."""
    return 2 * cp_size if cp_size > 1 else 1


def cp_padded_length(length: int, cp_size: int) -> int:
    """``length`` rounded up to a multiple of :func:`cp_multiple`."""
    multiple = cp_multiple(cp_size)
    return -(-length // multiple) * multiple


def cp_indices(lengths: Lengths, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions held by ``cp_rank``, ascending: ``[sum(lengths) // cp_size]`` int64.

    For each sequence (starting at offset s, chunk size k = L / 2c) these are
    ``s + r*k .. s + (r+1)*k - 1`` then ``s + (2c-1-r)*k .. s + (2c-r)*k - 1``. Raises
    ``ValueError`` when a length is not a multiple of ``2 * cp_size`` (any length for CP 1)."""
    starts, within = _held(lengths, cp_size, cp_rank)
    return starts + within


def cp_positions(lengths: Lengths, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Position ids of the tokens :func:`cp_indices` selects, restarting at 0 for each sequence:
    ``[sum(lengths) // cp_size]`` int64. Equal to :func:`cp_indices` for a single row."""
    return _held(lengths, cp_size, cp_rank)[1]


def cp_split(x: torch.Tensor, lengths: Lengths, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """The part of ``x`` that ``cp_rank`` holds: ``x.index_select(dim, cp_indices(...))``.

    ``x.shape[dim]`` must equal ``sum(lengths)``; the result has ``sum(lengths) // cp_size``
    entries along ``dim``. Differentiable (gradients scatter back to the held positions)."""
    total = int(_lengths(lengths, cp_size).sum())
    if x.shape[dim] != total:
        raise ValueError(
            f"cp_split: x has {x.shape[dim]} entries along dim {dim} but the lengths sum "
            f"to {total}; pass the lengths of the sequences laid out along that dim"
        )
    return x.index_select(dim, cp_indices(lengths, cp_size, cp_rank).to(x.device))


def cp_merge(parts: Sequence[torch.Tensor], lengths: Lengths, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`cp_split`: every rank's part in rank order (what an ``all_gather`` over
    the CP group returns) back to the original order along ``dim``. CP size is ``len(parts)``."""
    cp_size = len(parts)
    if cp_size == 0:
        raise ValueError("cp_merge needs one part per context-parallel rank, got none")
    total = int(_lengths(lengths, cp_size).sum())
    sizes = [p.shape[dim] for p in parts]
    if any(n * cp_size != total for n in sizes):
        raise ValueError(
            f"cp_merge: parts have {sizes} entries along dim {dim}; with lengths summing "
            f"to {total} and {cp_size} ranks each needs {total // cp_size}"
        )
    held = torch.cat([cp_indices(lengths, cp_size, r) for r in range(cp_size)])  # [total]
    return torch.cat(list(parts), dim).index_select(dim, torch.argsort(held).to(parts[0].device))


def _lengths(lengths: Lengths, cp_size: int) -> torch.Tensor:
    """``lengths`` as a 1-D int64 tensor, checked against :func:`cp_multiple`."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    out = torch.as_tensor([lengths] if isinstance(lengths, int) else lengths, dtype=torch.int64)
    if out.dim() != 1:
        raise ValueError(f"lengths must be one number per sequence (1-D), got shape {tuple(out.shape)}")
    multiple = cp_multiple(cp_size)
    bad = [int(n) for n in out if n < 0 or n % multiple]
    if bad:
        raise ValueError(
            f"sequence length {bad[0]} cannot be split over cp_size={cp_size}: each length "
            f"must be a multiple of 2*cp_size={multiple}; pad it to "
            f"{cp_padded_length(max(bad[0], 0), cp_size)} (cp_padded_length)"
        )
    return out


def _held(lengths: Lengths, cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start offset of the owning sequence, position within it) for each token ``cp_rank`` holds."""
    n = _lengths(lengths, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
    chunk = n // (2 * cp_size) if cp_size > 1 else n  # [S]; without CP one chunk, whole sequences
    starts = torch.cumsum(n, 0) - n  # [S]
    per_rank = n // cp_size  # tokens each rank holds of each sequence
    seq = torch.repeat_interleave(torch.arange(len(n)), per_rank)  # [sum(n) // c] owning sequence
    j = torch.arange(len(seq)) - (torch.cumsum(per_rank, 0) - per_rank)[seq]  # index among held
    k = chunk[seq]
    first = j < k
    within = torch.where(first, cp_rank * k + j, (2 * cp_size - 1 - cp_rank) * k + (j - k))
    return starts[seq], within
