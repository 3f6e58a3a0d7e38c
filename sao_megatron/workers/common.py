"""What the actor and critic ranks share: micro-batches, metric reduction, row outputs.

Every worker method is a collective over its role's world: the driver calls it on all ranks
with each rank's own :class:`~sao_megatron.batch.BatchShard` (its data-parallel replica's rows).
Losses are normalised by the shard's *global* counts, so the optimizer step applies exactly
the full-batch gradient (see ``engine.MegatronRole``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from sao_megatron.batch import BatchShard, RowOutputs
from sao_megatron.config import ParallelConfig


def parallel_state():
    from megatron.core import parallel_state as ps

    return ps


@dataclass(frozen=True)
class RankCoordinates:
    """Where this rank sits in its role's Megatron world."""

    rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_last: bool
    cp_rank: int

    @property
    def reports(self) -> bool:
        """Holds complete per-row outputs and metrics: last pipeline stage, TP and CP rank 0."""
        return self.pp_last and self.tp_rank == 0 and self.cp_rank == 0


def coordinates() -> RankCoordinates:
    ps = parallel_state()
    return RankCoordinates(rank=dist.get_rank(), dp_rank=ps.get_data_parallel_rank(),
                           dp_size=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                           pp_last=ps.is_pipeline_last_stage(), cp_rank=ps.get_context_parallel_rank())  # fmt: skip


def micro_batches(shard: BatchShard, per_row: dict[str, torch.Tensor], size: int) -> list[dict]:
    """The shard's micro-batches (each trimmed to its longest row) with per-row extras sliced alike."""
    micro = shard.batch.micro_batches(size)
    start = 0
    for mb in micro:
        n, t = mb["tokens"].shape
        for k, v in per_row.items():
            mb[k] = v[start : start + n, :t] if v.dim() == 2 else v[start : start + n]
        start += n
    return micro


def seq_length(shard: BatchShard) -> int:
    return int(shard.batch.lengths.max())


def reduce_metrics(per_micro: list[dict], weight_key: str = "micro_tokens") -> dict[str, float]:
    """Mean of each metric over micro-batches and DP replicas, weighted by ``weight_key``.

    Ranks may report different keys (a lag bucket absent from one replica): the union is used."""
    ps = parallel_state()
    weights = [m.get(weight_key, 1.0) for m in per_micro]
    keys = sorted({k for m in per_micro for k in m} - {weight_key})
    dp_group = cast(dist.ProcessGroup, ps.get_data_parallel_group())
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        everyone: list = [None] * dp
        dist.all_gather_object(everyone, keys, group=dp_group)
        keys = sorted({k for ks in everyone for k in ks})
    if not keys:
        return {}
    sums = torch.zeros(2, len(keys), dtype=torch.float64)  # [weighted sum; weight]
    for m, w in zip(per_micro, weights, strict=True):
        for i, k in enumerate(keys):
            if k in m:
                sums[0, i] += w * float(m[k])
                sums[1, i] += w
    if dp > 1:
        dist.all_reduce(sums, group=dp_group)
    return {k: (sums[0, i] / sums[1, i]).item() for i, k in enumerate(keys) if sums[1, i] > 0}


def row_outputs(collected: list[torch.Tensor], shard: BatchShard) -> RowOutputs | None:
    """This rank's per-row outputs when it holds complete ones (see :attr:`RankCoordinates.reports`)."""
    if not coordinates().reports:
        return None
    width = shard.batch.tokens.shape[1]
    out = torch.zeros(shard.batch.size, width)
    row = 0
    for v in collected:
        out[row : row + v.shape[0], : v.shape[1]] = v
        row += v.shape[0]
    return RowOutputs(shard.rows, out)


def init_rank(parallel: ParallelConfig, seed: int) -> None:
    from sao_megatron.parallel import initialize_model_parallel, seed_everything

    initialize_model_parallel(parallel)
    seed_everything(seed)
