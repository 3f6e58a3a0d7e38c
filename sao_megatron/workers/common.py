"""What the actor and critic ranks share: micro-batches, metric reduction, row outputs.

Every worker method is a collective over its role's world: the driver calls it on all ranks
with each rank's own :class:`~sao_megatron.batch.BatchShard` (its data-parallel replica's rows).
Losses are normalised by the shard's *global* counts, so the optimizer step applies exactly
the full-batch gradient (see ``engine.MegatronRole``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX
from sao_megatron.batch import BatchShard, MicroBatching, RowOutputs, spread
from sao_megatron.config import ParallelConfig
from sao_megatron.context_parallel import cp_merge, cp_multiple, cp_split
from sao_megatron.parallel import device


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
    return RankCoordinates(
        rank=dist.get_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_last=ps.is_pipeline_last_stage(),
        cp_rank=ps.get_context_parallel_rank(),
    )


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


def micro_batches(shard: BatchShard, per_row: dict[str, torch.Tensor], how: MicroBatching) -> list[dict]:
    """The shard's micro-batches (:meth:`~sao_megatron.batch.TrainBatch.micro_batch`), per-row
    extras cut alike. A collective over the data-parallel group: every replica runs as many
    micro-batches as the one with the most (:func:`~sao_megatron.batch.spread`), since expert
    parallelism exchanges tokens within each micro-batch across replicas."""
    plan = how.plan(shard.batch.lengths.tolist())
    ps = parallel_state()
    if ps.get_data_parallel_world_size() > 1:
        count = torch.tensor([len(plan)], device=device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=cast(dist.ProcessGroup, ps.get_data_parallel_group()))
        plan = spread(plan, int(count.item()))
    return [split_context(shard.batch.micro_batch(rows, how, per_row)) for rows in plan]


def split_context(mb: dict) -> dict:
    """This context-parallel rank's share of a micro-batch: every ``[b, t]`` tensor cut along the
    sequence (``context_parallel.cp_split``: per padded row, or per packed segment, whose
    ``cu_seqlens`` stay whole as Transformer Engine expects); ``cp_lengths`` records the cut for
    :func:`full_sequence`. Unchanged without context parallelism."""
    ps = parallel_state()
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return mb
    cu = mb.get("cu_seqlens")
    lengths = (cu[1:] - cu[:-1]).tolist() if cu is not None else [mb["tokens"].shape[1]]
    rank = ps.get_context_parallel_rank()
    out = {
        k: cp_split(v, lengths, cp, rank) if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in mb.items()
    }
    return {**out, "cp_lengths": lengths}


def full_sequence(x: torch.Tensor, mb: dict) -> torch.Tensor:
    """A per-position output ``[b, t / cp]`` of this rank's share, gathered from the context-parallel
    ranks into ``[b, t]`` (a collective over the CP group; ``x`` itself without CP)."""
    if "cp_lengths" not in mb:
        return x
    ps = parallel_state()
    parts = [torch.empty_like(x) for _ in range(ps.get_context_parallel_world_size())]
    dist.all_gather(parts, x.contiguous(), group=cast(dist.ProcessGroup, ps.get_context_parallel_group()))
    return cp_merge(parts, mb["cp_lengths"])


def seq_length(micro: list[dict]) -> int:
    """The longest micro-batch (the bound Megatron's pipeline schedule is given)."""
    return max(mb["tokens"].shape[1] for mb in micro)


SUM_PARTS = frozenset({"loss", "num_tokens", "tokens"})
"""Path components that mark a metric as a total (summed over micro-batches and ranks)."""


def metric_rule(key: str) -> str:
    """How :func:`reduce_metrics` combines ``key``: ``"sum"``, ``"max"``, ``"min"``, ``"std"`` or ``"mean"``."""
    parts = key.split("/")
    if set(parts) & SUM_PARTS:
        return "sum"
    if "max" in parts:
        return "max"
    if "min" in parts:
        return "min"
    if parts[-1] == "std":
        return "std"
    return "mean"


def _std_mean(key: str) -> str:
    """The mean that goes with a ``.../std`` key (``values/std`` -> ``values/mean``)."""
    return key[: -len("std")] + "mean"


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
            if rule == "std":  # pooled: the weighted mean of the second moments std^2 + mean^2
                out[0, i] += w * (v * v + float(m.get(_std_mean(k), 0.0)) ** 2)
            else:
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
    for k in keys:  # second moment -> std, with the reduced mean of the same subset
        if metric_rule(k) == "std":
            out[k] = max(out[k] - out.get(_std_mean(k), 0.0) ** 2, 0.0) ** 0.5
    return out


def _metric_keys(per_micro: list[dict], weight_key: str) -> list[str]:
    return sorted({k for m in per_micro for k in m if k != weight_key and not k.endswith(WEIGHT_SUFFIX)})


def reduce_metrics(per_micro: list[dict], weight_key: str = "micro_tokens", *, dp: bool = True) -> dict[str, float]:
    """Combine per-micro-batch metrics over the micro-batches and (``dp``) the data-parallel
    replicas and context-parallel ranks (each holding a share of every sequence).

    This is the one place the reduction rule lives (:func:`metric_rule` on the key's ``/`` parts):

    * ``sum`` (a part is ``loss``, ``num_tokens`` or ``tokens``): totals, summed. Losses are
      already normalised by the batch's global counts, so their sum is the whole-batch loss.
    * ``max`` / ``min`` (a part is ``max`` / ``min``, e.g. ``ratio/max``, ``ratio/max/adv_pos``):
      the max / min over the micro-batches whose weight is > 0 (an empty subset's placeholder 0
      never wins); 0 when none has weight.
    * ``std`` (the last part is ``std``, e.g. ``values/std``): the pooled standard deviation
      of the micro-batches' subsets, exact for population (biased) deviations reported next to
      their ``.../mean`` with the same weight.
    * ``mean`` (everything else): the mean weighted by the metric's own count ``key#n``
      (:data:`WEIGHT_SUFFIX`) when the producer reports one, else by ``weight_key`` (the
      micro-batch's action tokens, 1 when absent). Exact for means and fractions over a token
      subset when the producer reports that subset's size (``*/adv_pos``, ``dis/kept_frac/lag*``);
      0 when the total weight is 0. Quantiles (``ratio/p1``, ``p50``, ``p99``), ``ess`` and the critic's
      ``explained_var`` are per-micro-batch statistics, so their weighted mean is an
      approximation (the driver logs the whole batch's ``critic/explained_var``).

    ``weight_key`` and ``*#n`` entries are consumed, not returned. Ranks and micro-batches may
    report different keys (a lag bucket absent from one replica): the union is used, and a
    micro-batch without a key does not count toward it.
    """
    keys = _metric_keys(per_micro, weight_key)
    if dp:
        ps = parallel_state()
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        dp_group = cast(dist.ProcessGroup, ps.get_data_parallel_group(with_context_parallel=True))
        if dp_size > 1:
            everyone: list = [None] * dp_size
            dist.all_gather_object(everyone, keys, group=dp_group)
            keys = sorted({k for ks in everyone for k in ks})
            if not keys:
                return {}
            partials = _metric_partials(per_micro, keys, weight_key).to(device())
            totals = partials[:2].contiguous()
            dist.all_reduce(totals, group=dp_group)
            extremes = partials[2:].contiguous()
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=dp_group)
            return _finish_metrics(keys, torch.cat([totals, extremes]).cpu())
    if not keys:
        return {}
    return _finish_metrics(keys, _metric_partials(per_micro, keys, weight_key))


def nonfinite_free(*tensors: torch.Tensor, mask: torch.Tensor) -> bool:
    """Every value at ``mask`` is finite (one host sync for all tensors)."""
    return bool(torch.stack([torch.isfinite(t[mask]).all() for t in tensors]).all())


def nan_loss(output: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """A NaN loss connected to ``output``: its gradients are NaN, so the optimizer step that
    follows is skipped on every rank of the world (``engine.MegatronRole.step``) instead of one
    rank raising inside a collective schedule. Metrics: only the token count."""
    return (output.float() * mask).sum() * float("nan"), {"micro_tokens": float(mask.sum())}


def row_outputs(collected: list[torch.Tensor], micro: list[dict], shard: BatchShard) -> RowOutputs | None:
    """This rank's per-row outputs when it holds complete ones (see :attr:`RankCoordinates.reports`):
    ``collected[i]`` is micro-batch ``i``'s per-position output, put back on the shard's rows
    (packed segments unpacked; padding past each row dropped)."""
    if not coordinates().reports:
        return None
    width = shard.batch.tokens.shape[1]
    out = torch.zeros(shard.batch.size, width)
    for mb, v in zip(micro, collected, strict=True):
        v = v.detach().float().cpu()
        if "spans" in mb:
            for row, (offset, n) in zip(mb["rows"], mb["spans"], strict=True):
                out[row, :n] = v[0, offset : offset + n]
        else:
            w = min(width, v.shape[1])
            for i, row in enumerate(mb["rows"]):
                out[row, :w] = v[i, :w]
    return RowOutputs(shard.rows, out)


def init_rank(parallel: ParallelConfig, seed: int) -> None:
    from sao_megatron.parallel import initialize_model_parallel, seed_everything

    initialize_model_parallel(parallel)
    seed_everything(seed)
    # Where this rank runs, for anyone reading its log (tests/launch/test_slurm_multinode.py).
    print(
        f"[sao-rank] rank {dist.get_rank()} of {dist.get_world_size()} on host {socket.gethostname()} "
        f"addresses {','.join(node_addresses()) or '-'}",
        flush=True,
    )


def node_addresses() -> list[str]:
    """This node's IPv4 addresses other than loopback."""
    import psutil

    return sorted(
        {
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")
        }
    )
