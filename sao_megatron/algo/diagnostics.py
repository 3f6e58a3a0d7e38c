"""Diagnostics of a training batch: per-token policy lag and the critic's explained variance.

Neither feeds a loss; both are logged next to the loss metrics (``docs/training.md``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sao_megatron.algo._checks import check_action_mask, check_shape

EV_MIN_VARIANCE = 1e-12
"""Below this return variance explained variance is undefined (NaN): nothing to explain."""


def policy_lag(version: int, policy_versions: Tensor, action_mask: Tensor) -> Tensor:
    """Per-token policy lag ``version - policy_versions``, clamped at 0, and 0 off the action tokens.

    ``version`` is the policy version being trained; ``policy_versions`` [B, T] the weight version
    that sampled each token (any value, e.g. -1, on prompt/observation/padding tokens);
    ``action_mask`` [B, T] 0/1 or bool. A token sampled by a newer version than ``version`` (only
    possible while weights are being swapped) counts as lag 0. Returns [B, T] in the dtype of
    ``policy_versions``.
    """
    mask = check_action_mask(action_mask)
    check_shape("policy_versions", policy_versions, tuple(mask.shape))
    lag = (version - policy_versions).clamp(min=0)
    return torch.where(mask, lag, torch.zeros_like(lag))


def explained_variance(values: Tensor, returns: Tensor, action_mask: Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over all action tokens of the batch (population variances, float64).

    ``values`` [B, T] are the critic's predictions before its update and ``returns`` [B, T] its
    targets. Over the whole batch on purpose: within one trajectory the returns of a terminal reward
    with gamma = lam_critic = 1 are constant, so a per-micro-batch figure is meaningless. NaN when
    fewer than 2 action tokens are selected or ``Var[R] < 1e-12``. 1 is a perfect critic, 0 one no
    better than the batch mean, negative a worse one.
    """
    mask = action_mask > 0
    r, v = returns[mask].double(), values[mask].double()
    if r.numel() < 2:
        return float("nan")
    var_r = r.var(unbiased=False)
    if var_r < EV_MIN_VARIANCE:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)
