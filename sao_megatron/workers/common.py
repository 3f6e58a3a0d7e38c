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

from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX
from sao_megatron.batch import BatchShard, RowOutputs, pad_columns, padded_length
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


def seq_multiple(parallel: ParallelConfig) -> int:
    """What every micro-batch's sequence length must divide by in this layout: TP when sequence
    parallelism scatters the sequence over TP ranks, times 2 * CP under context parallelism
    (load-balanced chunks)."""
    tp = parallel.tensor_parallel if parallel.effective_sequence_parallel else 1
    cp = parallel.context_parallel
    return tp * (2 * cp if cp > 1 else 1)


def micro_batches(
    shard: BatchShard, per_row: dict[str, torch.Tensor], size: int, multiple: int = 1
) -> list[dict]:
    """The shard's micro-batches (each trimmed to its longest row, padded up to a multiple of
    ``multiple``, see :func:`seq_multiple`) with per-row extras sliced and zero-padded alike."""
    micro = shard.batch.micro_batches(size, multiple)
    start = 0
    for mb in micro:
        n, t = mb["tokens"].shape
        for k, v in per_row.items():
            mb[k] = pad_columns(v[start : start + n], t) if v.dim() == 2 else v[start : start + n]
        start += n
    return micro


def seq_length(shard: BatchShard, multiple: int = 1) -> int:
    """The longest micro-batch length of the shard (see :func:`micro_batches`)."""
    return padded_length(int(shard.batch.lengths.max()), multiple)


SUM_PARTS = frozenset({"loss", "num_tokens", "tokens"})
"""Path components that mark a metric as a total (summed over micro-batches and ranks)."""


def metric_rule(key: str) -> str:
    """How :func:`reduce_metrics` combines ``key``: ``"sum"``, ``"max"``, ``"min"`` or ``"mean"``."""
    parts = set(key.split("/"))
    if parts & SUM_PARTS:
        return "sum"
    if "max" in parts:
        return "max"
    if "min" in parts:
        return "min"
    return "mean"


def _metric_partials(per_micro: list[dict], keys: list[str], weight_key: str) -> torch.Tensor:
    """``[4, K]`` float64: sum of w * v (sums: of v), sum of w, max of v, max of -v (over w > 0)."""
    out = torch.zeros(4, len(keys), dtype=torch.float64)
    out[2:] = float("-inf")
    for m in per_micro:
        default = float(m.get(weight_key, 1.0))
        for i, k in enumerate(keys):
            if k not in m:
                continue
            v, w = float(m[k]), float(m.get(k + WEIGHT_SUFFIX, default))
            rule = metric_rule(k)
            out[0, i] += v if rule == "sum" else w * v
            out[1, i] += w
            if w > 0:
                out[2, i] = max(out[2, i].item(), v)
                out[3, i] = max(out[3, i].item(), -v)
    return out


def _finish_metrics(keys: list[str], partials: torch.Tensor) -> dict[str, float]:
    out = {}
    for i, k in enumerate(keys):
        rule, total, weight = metric_rule(k), partials[0, i].item(), partials[1, i].item()
        if rule == "sum":
            out[k] = total
        elif rule in ("max", "min"):
            best = partials[2 if rule == "max" else 3, i].item()
            out[k] = 0.0 if best == float("-inf") else (best if rule == "max" else -best)
        else:
            out[k] = total / weight if weight > 0 else 0.0
    return out


def _metric_keys(per_micro: list[dict], weight_key: str) -> list[str]:
    return sorted({k for m in per_micro for k in m if k != weight_key and not k.endswith(WEIGHT_SUFFIX)})


def reduce_metrics(
    per_micro: list[dict], weight_key: str = "micro_tokens", *, dp: bool = True
) -> dict[str, float]:
    """Combine per-micro-batch metrics over the micro-batches and (``dp``) the data-parallel replicas.

    This is the one place the reduction rule lives (:func:`metric_rule` on the key's ``/`` parts):

    * ``sum`` (a part is ``loss``, ``num_tokens`` or ``tokens``): totals, summed. Losses are
      already normalised by the batch's global counts, so their sum is the whole-batch loss.
    * ``max`` / ``min`` (a part is ``max`` / ``min``, e.g. ``ratio/max``, ``ratio/max/adv_pos``):
      the max / min over the micro-batches whose weight is > 0 (an empty subset's placeholder 0
      never wins); 0 when none has weight.
    * ``mean`` (everything else): the mean weighted by the metric's own count ``key#n``
      (:data:`WEIGHT_SUFFIX`) when the producer reports one, else by ``weight_key`` (the
      micro-batch's action tokens, 1 when absent). Exact for means and fractions over a token
      subset when the producer reports that subset's size (``*/adv_pos``, ``dis/kept_frac/lag*``);
      0 when the total weight is 0. Quantiles (``ratio/p1``, ``p50``, ``p99``) and ``ess`` are
      per-micro-batch statistics, so their weighted mean is an approximation (documented as such).

    ``weight_key`` and ``*#n`` entries are consumed, not returned. Ranks and micro-batches may
    report different keys (a lag bucket absent from one replica): the union is used, and a
    micro-batch without a key does not count toward it.
    """
    keys = _metric_keys(per_micro, weight_key)
    if dp:
        ps = parallel_state()
        dp_size = ps.get_data_parallel_world_size()
        dp_group = cast(dist.ProcessGroup, ps.get_data_parallel_group())
        if dp_size > 1:
            everyone: list = [None] * dp_size
            dist.all_gather_object(everyone, keys, group=dp_group)
            keys = sorted({k for ks in everyone for k in ks})
            if not keys:
                return {}
            partials = _metric_partials(per_micro, keys, weight_key)
            totals = partials[:2].contiguous()
            dist.all_reduce(totals, group=dp_group)
            extremes = partials[2:].contiguous()
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=dp_group)
            return _finish_metrics(keys, torch.cat([totals, extremes]))
    if not keys:
        return {}
    return _finish_metrics(keys, _metric_partials(per_micro, keys, weight_key))


def row_outputs(collected: list[torch.Tensor], shard: BatchShard) -> RowOutputs | None:
    """This rank's per-row outputs when it holds complete ones (see :attr:`RankCoordinates.reports`)."""
    if not coordinates().reports:
        return None
    width = shard.batch.tokens.shape[1]
    out = torch.zeros(shard.batch.size, width)
    row = 0
    for v in collected:
        v = v[:, :width]  # padding columns past the batch width (see micro_batches) are dropped
        out[row : row + v.shape[0], : v.shape[1]] = v
        row += v.shape[0]
    return RowOutputs(shard.rows, out)


def init_rank(parallel: ParallelConfig, seed: int) -> None:
    from sao_megatron.parallel import initialize_model_parallel, seed_everything

    initialize_model_parallel(parallel)
    seed_everything(seed)
