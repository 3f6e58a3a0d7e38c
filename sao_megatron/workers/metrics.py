"""Per-micro-batch metrics reduced over the micro-batches and the data- and context-parallel ranks.

One rule per key (:func:`metric_rule`), read from the key's ``/`` parts; see :func:`reduce_metrics`.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX
from sao_megatron.parallel import device
from sao_megatron.workers.rank import parallel_state

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
