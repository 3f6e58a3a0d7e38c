"""Corrections beside the policy loss for training-inference mismatch and staleness: a sequence-level
mask on the geometric mean of a trajectory's ratios, and token-level truncated importance sampling.

Notation as :mod:`~sao_megatron.algo.policy_loss`: ``rho_t = exp(logprobs_t - behavior_logprobs_t)``
on action tokens, ``sg`` = stop-gradient. A trajectory is a row, or a segment of a packed row
(``segment_ids``, :mod:`~sao_megatron.algo._segments`); it must be whole in the tensors given (a
micro-batch never splits a row; under context parallelism a row is split, so the sequence mask is
refused there at config load, ``config/load.py``).

* **Sequence mask** (:func:`sequence_mask`): ``g_s = exp(mean_{t in s} log rho_t)``, the geometric
  mean of the ratios over trajectory ``s``'s action tokens; every action token of ``s`` keeps its
  policy gradient iff ``low <= g_s <= high``. One far-off token moves ``g_s`` by ``log rho_t / n_s``
  only, so the mask reacts to a trajectory that drifted as a whole (a different expert path, a
  stale policy), which the per-token DIS band cannot see (GSPO / "geometric-mean" masking in the
  MoE RL literature).
* **Truncated IS** (:func:`truncated_is`): the importance weight of each action token's gradient is
  ``min(rho_t, C)``, ``C`` the cap; nothing is masked (Ionides 2008; Yao et al. 2025 apply it to
  the trainer/engine mismatch). For a loss without a weight (``vanilla``) the token's loss is
  multiplied by ``sg(min(rho_t, C))``; for a loss that already carries ``rho_t`` (``dis``,
  ``ppo_clip``) it is multiplied by ``sg(min(rho_t, C) / rho_t) = sg(min(1, C / rho_t))``, so its
  weight ``rho_t`` becomes ``min(rho_t, C)`` and not ``rho_t min(rho_t, C)``.

Both give a per-token factor ``c_t >= 0`` (no gradient) that multiplies the token's advantage in
:func:`~sao_megatron.algo.objectives.policy_objective`: every policy loss here is positively
homogeneous in ``A_t`` per token (``l_t(c A) = c l_t(A)`` for ``c >= 0``; PPO's ``min`` included),
so this multiplies each token's loss, and its gradient, by ``c_t``. Masked or down-weighted tokens
still count in the loss normalisers, as DIS's masked tokens do. Value targets never see them.

Metrics (python floats, local to the call; each with ``K#n``, its count, the weight of the
``K#n``-weighted mean that ``workers.metrics.reduce_metrics`` takes over micro-batches and data-parallel
ranks, exact since a trajectory lies in one micro-batch; ``*/max`` and ``*/min`` reduce by max / min):

* ``seq_mask/dropped_seq_frac`` (``#n``: trajectories), ``seq_mask/dropped_low_seq_frac`` (``g_s <
  low``), ``seq_mask/dropped_high_seq_frac`` (``g_s > high``); ``seq_mask/dropped_token_frac``
  (``#n``: action tokens), the share of action tokens in dropped trajectories;
  ``seq_mask/geo_ratio/mean`` (``#n``: trajectories), ``seq_mask/geo_ratio/max``, ``seq_mask/geo_ratio/min``
  of ``g_s``.
* ``tis/clipped_frac`` (``#n``: action tokens), the share with ``rho_t > C``; ``tis/weight/mean``, the
  mean of ``min(rho_t, C)`` over action tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sao_megatron.algo._checks import check_action_mask, check_positive, check_segment_ids, check_shape
from sao_megatron.algo._segments import trajectory_index
from sao_megatron.algo.masked import masked_mean, metrics_to_floats
from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX as _W


def _log_ratio(logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` float64 ``log rho`` (no gradient), taken in the dtype of ``logprobs`` as
    :func:`~sao_megatron.algo.policy_loss.dis_band` does; 0 off the action mask."""
    check_shape("logprobs", logprobs, tuple(mask.shape))
    check_shape("behavior_logprobs", behavior_logprobs, tuple(mask.shape))
    lr = (logprobs.detach() - behavior_logprobs.detach().to(logprobs.dtype)).to(torch.float64)
    return torch.where(mask, lr, torch.zeros_like(lr))


def sequence_log_ratio(log_ratio: Tensor, action_mask: Tensor, segment_ids: Tensor | None = None) -> Tensor:
    """``[B, T]``: at each action token, ``log g_s``, the mean of ``log_ratio`` over the action tokens of
    its trajectory ``s`` (row, or packed segment with ``segment_ids``); 0 elsewhere. Same dtype."""
    mask = check_action_mask(action_mask)
    check_shape("log_ratio", log_ratio, tuple(mask.shape))
    check_segment_ids(segment_ids, tuple(mask.shape))
    idx = trajectory_index(mask, segment_ids)
    flat = log_ratio.reshape(-1)
    sums = torch.zeros(idx.num_traj, dtype=log_ratio.dtype, device=log_ratio.device)
    sums.index_add_(0, idx.traj, flat[idx.positions])
    means = sums / idx.lengths.to(log_ratio.dtype)  # [S]
    out = torch.zeros_like(flat)
    out[idx.positions] = means[idx.traj]
    return out.view_as(log_ratio)


def sequence_mask(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    action_mask: Tensor,
    *,
    low: float | None,
    high: float | None,
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The action tokens whose trajectory's geometric-mean ratio ``g_s`` is inside ``[low, high]``
    (inclusive; ``None`` leaves that side open), as a bool ``[B, T]`` (False off the action mask), and
    the ``seq_mask/*`` metrics (module docstring). Compared in log space: ``log low <= log g_s <= log
    high``, so no ratio overflows. ``low`` > 0 and ``high`` > ``low`` when given."""
    mask = check_action_mask(action_mask)
    if low is not None:
        check_positive("low", low)
    if high is not None and low is not None and not high > low:
        raise ValueError(f"`high`={high} must be > `low`={low}.")
    lr = _log_ratio(logprobs, behavior_logprobs, mask)
    log_g = sequence_log_ratio(lr, mask, segment_ids)  # [B, T]
    below = mask & (log_g < math.log(low)) if low is not None else torch.zeros_like(mask)
    above = mask & (log_g > math.log(high)) if high is not None else torch.zeros_like(mask)
    keep = mask & ~below & ~above
    idx = trajectory_index(mask, segment_ids)
    first = idx.positions[idx.first]  # [S] flat position of each trajectory's first action token
    n_seq = torch.tensor(float(idx.num_traj), dtype=torch.float64)
    n_tok = mask.sum().to(torch.float64)
    g = log_g.reshape(-1)[first].exp()  # [S]
    seq_below, seq_above = below.reshape(-1)[first], above.reshape(-1)[first]
    per_seq = n_seq.clamp(min=1)
    m: dict[str, Tensor | float] = {
        "seq_mask/dropped_seq_frac": (seq_below | seq_above).sum() / per_seq,
        "seq_mask/dropped_low_seq_frac": seq_below.sum() / per_seq,
        "seq_mask/dropped_high_seq_frac": seq_above.sum() / per_seq,
        "seq_mask/geo_ratio/mean": g.sum() / per_seq,
        "seq_mask/geo_ratio/max": g.max() if idx.num_traj else 0.0,
        "seq_mask/geo_ratio/min": g.min() if idx.num_traj else 0.0,
        "seq_mask/dropped_token_frac": (mask & ~keep).sum() / n_tok.clamp(min=1),
    }
    weights = {k + _W: n_tok if k.endswith("token_frac") else n_seq for k in m}
    return keep, metrics_to_floats({**m, **weights})


def truncated_is(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    action_mask: Tensor,
    *,
    cap: float,
    loss_has_ratio: bool,
) -> tuple[Tensor, dict[str, float]]:
    """The truncated-IS factor ``c_t`` ``[B, T]`` float64 (no gradient; 0 off the action mask) that
    multiplies each action token's loss, and the ``tis/*`` metrics (module docstring).

    ``loss_has_ratio=False`` (``vanilla``): ``c_t = min(rho_t, C)``; True (``dis``, ``ppo_clip``):
    ``c_t = min(rho_t, C) / rho_t``. Computed as ``exp(min(log rho_t, log C))`` and ``exp(min(log
    rho_t, log C) - log rho_t)``: no overflow, and ``c_t`` is exactly 1 for the second where ``rho_t
    <= C``. ``cap`` = ``C`` > 0."""
    check_positive("cap", cap)
    mask = check_action_mask(action_mask)
    lr = _log_ratio(logprobs, behavior_logprobs, mask)
    log_w = lr.clamp(max=math.log(cap))  # log min(rho, C)
    factor = torch.exp(log_w - lr) if loss_has_ratio else torch.exp(log_w)
    factor = torch.where(mask, factor, torch.zeros_like(factor))
    n_tok = mask.sum().to(torch.float64)
    m = {
        "tis/clipped_frac": (mask & (lr > math.log(cap))).sum() / n_tok.clamp(min=1),
        "tis/weight/mean": masked_mean(log_w.exp(), mask),
    }
    return factor, metrics_to_floats({**m, **{k + _W: n_tok for k in m}})
