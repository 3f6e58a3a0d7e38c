"""Critic loss: squared error to the GAE returns on action tokens, optional PPO-style value clipping.

``l_t = 0.5 * (V_t - R_t)^2`` (the 0.5 makes ``d l / d V = V - R``); with ``old_values`` and
``clip_range`` (PPO2 / OpenAI baselines value clipping):
``V^clip_t = old_t + clamp(V_t - old_t, -clip_range, clip_range)`` and
``l_t = 0.5 * max((V_t - R_t)^2, (V^clip_t - R_t)^2)``.
Units: squared reward units. Aggregation and normalisers as in ``sao_megatron.algo.aggregation``.

Metrics (python floats, local): ``loss``; ``value_loss`` = mean of ``l_t`` over action tokens (the
token mean whatever ``agg``, for logging); ``explained_var = 1 - Var[R - V] / Var[R]`` (masked,
biased variances, ``Var[R]`` clamped to >= 1e-8); ``values/mean``, ``values/std``, ``returns/mean``,
``returns/std``; ``clip_frac`` (share of tokens where the clipped term is the larger); ``num_tokens``.
Reduce across ranks with a ``num_tokens``-weighted mean (explained variance then is approximate; for the
exact value all-reduce the sums of R, R^2, R-V, (R-V)^2 and the count).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sao_megatron.algo._checks import (
    check_action_mask,
    check_finite,
    check_positive,
    check_segment_ids,
    check_shape,
)
from sao_megatron.algo.aggregation import aggregate, loss_weights
from sao_megatron.algo.choices import LossAgg
from sao_megatron.algo.masked import masked_mean, masked_var, metrics_to_floats


def value_loss(
    values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    *,
    old_values: Tensor | None = None,
    clip_range: float | None = None,
    agg: LossAgg = "token_mean",
    num_tokens_global: float | int | Tensor | None = None,
    num_seqs_global: float | int | Tensor | None = None,
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Critic loss ``(loss, metrics)``; ``values`` [B, T] with grad, ``returns``/``old_values`` constants."""
    mask = check_action_mask(action_mask)
    shape = tuple(mask.shape)
    tensors = {"values": values, "returns": returns}
    if (old_values is None) != (clip_range is None):
        raise ValueError("Value clipping needs both `old_values` and `clip_range`; pass both or neither.")
    if old_values is not None:
        tensors["old_values"] = old_values
        check_positive("clip_range", clip_range)  # type: ignore[arg-type]
    for name, x in tensors.items():
        check_shape(name, x, shape)
        check_finite(name, x)
    check_segment_ids(segment_ids, shape)
    w = loss_weights(
        mask,
        agg,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        segment_ids=segment_ids,
        dtype=torch.float64,
    )
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    ret = torch.where(mask, returns.detach().to(values.dtype), zero)
    per_token = 0.5 * (v - ret) ** 2
    clipped = torch.zeros_like(mask)
    if old_values is not None:
        old = torch.where(mask, old_values.detach().to(values.dtype), zero)
        v_clip = old + (v - old).clamp(-clip_range, clip_range)  # type: ignore[operator]
        per_token_clip = 0.5 * (v_clip - ret) ** 2
        clipped = mask & (per_token_clip > per_token)
        per_token = torch.maximum(per_token, per_token_clip)
    loss = aggregate(per_token, w, mask)
    vd, rd = v.detach().to(torch.float64), ret.to(torch.float64)
    var_r = masked_var(rd, mask, unbiased=False)
    n = mask.sum().to(torch.float64)
    metrics = metrics_to_floats(
        {
            "loss": loss.detach(),
            "value_loss": masked_mean(per_token.detach().to(torch.float64), mask),
            "explained_var": torch.where(
                n > 0, 1.0 - masked_var(rd - vd, mask, unbiased=False) / var_r.clamp(min=1e-8), 0.0
            ),
            "values/mean": masked_mean(vd, mask),
            "values/std": masked_var(vd, mask, unbiased=False).sqrt(),
            "returns/mean": masked_mean(rd, mask),
            "returns/std": var_r.sqrt(),
            "clip_frac": clipped.sum() / n.clamp(min=1),
            "num_tokens": n,
        }
    )
    return loss, metrics
