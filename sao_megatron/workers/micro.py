"""A shard cut into micro-batches on this rank, and per-position outputs put back on its rows.

Every worker method is a collective over its role's world: the driver calls it on all ranks
with each rank's own :class:`~sao_megatron.batch.BatchShard` (its data-parallel replica's rows).
Losses are normalised by the shard's *global* counts, so the optimizer step applies exactly
the full-batch gradient (see ``role.MegatronRole``).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Unpack, cast

import torch
import torch.distributed as dist

from sao_megatron.batch import BatchShard, MicroBatch, MicroBatching, RowExtras, RowOutputs, spread
from sao_megatron.config import ParallelConfig
from sao_megatron.context_parallel import cp_merge, cp_multiple, cp_split
from sao_megatron.parallel import device
from sao_megatron.workers.rank import coordinates, parallel_state


def seq_multiple(parallel: ParallelConfig) -> int:
    """What every micro-batch's sequence length must divide by in this layout: TP when sequence
    parallelism scatters the sequence over TP ranks, times 2 * CP under context parallelism
    (load-balanced chunks)."""
    tp = parallel.tensor_parallel if parallel.effective_sequence_parallel else 1
    return tp * cp_multiple(parallel.context_parallel)


def micro_batching(parallel: ParallelConfig) -> MicroBatching:
    """How a role with layout ``parallel`` cuts its shards into micro-batches."""
    return MicroBatching(
        rows=parallel.micro_batch_size,
        max_tokens=parallel.max_tokens_per_micro_batch,
        multiple=seq_multiple(parallel),
        segment_multiple=cp_multiple(parallel.context_parallel),
        pack=parallel.pack_sequences,
    )


def micro_batches(shard: BatchShard, how: MicroBatching, **extras: Unpack[RowExtras]) -> list[MicroBatch]:
    """The shard's micro-batches (:meth:`~sao_megatron.batch.TrainBatch.micro_batch`), the role's
    ``extras`` (this shard's rows) cut alike. A collective over the data-parallel group: every
    replica runs as many micro-batches as the one with the most (:func:`~sao_megatron.batch.spread`),
    since expert parallelism exchanges tokens within each micro-batch across replicas."""
    plan = how.plan(shard.batch.lengths.tolist())
    ps = parallel_state()
    if ps.get_data_parallel_world_size() > 1:
        count = torch.tensor([len(plan)], device=device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=cast(dist.ProcessGroup, ps.get_data_parallel_group()))
        plan = spread(plan, int(count.item()))
    return [split_context(shard.batch.micro_batch(rows, how, **extras)) for rows in plan]


def split_context(mb: MicroBatch) -> MicroBatch:
    """This context-parallel rank's share of a micro-batch: every ``[b, t, ...]`` tensor cut along the
    sequence (``context_parallel.cp_split``: per padded row, or per packed segment, whose
    ``cu_seqlens`` stay whole as Transformer Engine expects); ``cp_lengths`` records the cut for
    :func:`full_sequence`. Unchanged without context parallelism."""
    ps = parallel_state()
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return mb
    cu = mb.cu_seqlens
    lengths = (cu[1:] - cu[:-1]).tolist() if cu is not None else [mb.tokens.shape[1]]
    rank = ps.get_context_parallel_rank()
    cut = {
        f.name: cp_split(v, lengths, cp, rank)
        for f in fields(mb)
        if isinstance(v := getattr(mb, f.name), torch.Tensor) and v.dim() >= 2  # [b, t, ...]: along t
    }
    return replace(mb, **cut, cp_lengths=lengths)


def full_sequence(x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """A per-position output ``[b, t / cp]`` of this rank's share, gathered from the context-parallel
    ranks into ``[b, t]`` (a collective over the CP group; ``x`` itself without CP)."""
    if mb.cp_lengths is None:
        return x
    ps = parallel_state()
    parts = [torch.empty_like(x) for _ in range(ps.get_context_parallel_world_size())]
    dist.all_gather(parts, x.contiguous(), group=cast(dist.ProcessGroup, ps.get_context_parallel_group()))
    return cp_merge(parts, mb.cp_lengths)


def row_outputs(collected: list[torch.Tensor], micro: list[MicroBatch], shard: BatchShard) -> RowOutputs | None:
    """This rank's per-row outputs when it holds complete ones (see ``rank.RankCoordinates.reports``):
    ``collected[i]`` is micro-batch ``i``'s per-position output, put back on the shard's rows
    (packed segments unpacked; padding past each row dropped)."""
    if not coordinates().reports:
        return None
    width = shard.batch.tokens.shape[1]
    out = torch.zeros(shard.batch.size, width)
    for mb, v in zip(micro, collected, strict=True):
        v = v.detach().float().cpu()
        if mb.spans is not None:
            for row, (offset, n) in zip(mb.rows, mb.spans, strict=True):
                out[row, :n] = v[0, offset : offset + n]
        else:
            w = min(width, v.shape[1])
            for i, row in enumerate(mb.rows):
                out[row, :w] = v[i, :w]
    return RowOutputs(shard.rows, out)


def nonfinite_free(*tensors: torch.Tensor, mask: torch.Tensor) -> bool:
    """Every value at ``mask`` is finite (one host sync for all tensors)."""
    return bool(torch.stack([torch.isfinite(t[mask]).all() for t in tensors]).all())


def nan_loss(output: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """A NaN loss connected to ``output``: its gradients are NaN, so the optimizer step that
    follows is skipped on every rank of the world (``role.MegatronRole.step``) instead of one
    rank raising inside a collective schedule. Metrics: only the token count."""
    return (output.float() * mask).sum() * float("nan"), {"micro_tokens": float(mask.sum())}
