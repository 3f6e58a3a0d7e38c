"""Masked reductions over action tokens, whitening, quantiles and the metrics helper.

``mask`` is a bool (or 0/1) tensor broadcastable to ``x``; only positions where it is true count.
Positions outside the mask may hold any finite value; they never reach the result (``torch.where``
rather than multiplication, so a large sentinel in padding cannot turn into NaN via ``0 * inf``).

All reductions here are *local*: to reduce across data-parallel ranks, all-reduce the sums and the
counts separately (``masked_sum`` and ``mask.sum()``), never the means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x[mask])`` (over ``dim`` if given)."""
    z = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x[mask]) / count(mask)``; an empty selection gives 0 (count is clamped to 1)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x[mask]`` around its masked mean; ``unbiased`` divides by ``n - 1`` (Bessel).

    Fewer than two (unbiased) or one (biased) selected elements give 0.
    """
    m = mask.bool()
    n = m.sum().to(x.dtype)
    mean = masked_sum(x, m) / n.clamp(min=1)
    ss = masked_sum((x - mean) ** 2, m)
    denom = n - 1 if unbiased else n
    return torch.where(denom > 0, ss / denom.clamp(min=1), torch.zeros_like(ss))


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over ``x[mask]`` (unbiased var), zeros outside the mask.

    With ``shift_mean=False`` the mean is added back: ``x_white + mean`` (scale only, as in TRL/verl's
    ``shift_mean`` option). Statistics are local to the tensors given.
    """
    m = mask.bool()
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros_like(out))


def masked_quantiles(x: Tensor, mask: Tensor, qs: Sequence[float]) -> Tensor:
    """Quantiles of ``x[mask]`` with linear interpolation (``torch.quantile``'s default), [len(qs)].

    Sort-based, so it has no size limit; an empty selection gives zeros.
    """
    vals = x[mask.bool()].reshape(-1)
    q = torch.tensor(list(qs), dtype=torch.float64, device=x.device)
    if vals.numel() == 0:
        return torch.zeros(len(qs), dtype=x.dtype, device=x.device)
    s = torch.sort(vals).values
    pos = q * (vals.numel() - 1)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    frac = (pos - lo.to(pos.dtype)).to(x.dtype)
    return s[lo] + (s[hi] - s[lo]) * frac


def metrics_to_floats(metrics: Mapping[str, Tensor | float | int]) -> dict[str, float]:
    """Convert a flat dict of 0-d tensors / numbers to python floats with a single device sync."""
    keys = list(metrics)
    tensors = [v for v in metrics.values() if isinstance(v, Tensor)]
    values = iter([])
    if tensors:
        dev = tensors[0].device
        stacked = torch.stack([t.detach().reshape(()).to(device=dev, dtype=torch.float64) for t in tensors])
        values = iter(stacked.tolist())
    out: dict[str, float] = {}
    for k in keys:
        v = metrics[k]
        out[k] = next(values) if isinstance(v, Tensor) else float(v)
    return out
