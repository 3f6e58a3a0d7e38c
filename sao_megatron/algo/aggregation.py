"""How per-token losses become one scalar, so that micro-batches and ranks add up exactly.

Two modes (``agg``):

* ``"token_mean"`` (default): ``loss = sum_t m_t * l_t / N`` with ``N`` the number of action tokens in
  the *global* batch (all micro-batches of all data-parallel ranks of one optimizer step). Every action
  token weighs the same; long trajectories weigh more.
* ``"seq_mean"``: ``loss = sum_s (sum_{t in s} l_t / n_s) / S`` with ``n_s`` the action tokens of
  trajectory ``s`` and ``S`` the number of trajectories (with >= 1 action token) in the global batch.
  Every trajectory weighs the same. A trajectory is a row, or a segment of a packed row when
  ``segment_ids`` is given; it must not straddle micro-batches.

The normaliser is passed explicitly (``num_tokens_global`` / ``num_seqs_global``, typically the
all-reduced ``action_mask.sum()`` / ``count_sequences(...)`` over the step). Then the plain *sum* of
the losses returned for every micro-batch on every rank equals the full-batch loss, and so does the
gradient. If your data-parallel all-reduce *averages* gradients, multiply each local loss by the DP
world size (or all-reduce with SUM). Without a normaliser the local batch is used (``N`` or ``S`` of
the tensors given).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sao_megatron.algo._checks import check_choice, row_counts
from sao_megatron.algo._segments import trajectory_index
from sao_megatron.algo.choices import AGG_MODES, LossAgg


def count_sequences(action_mask: Tensor, segment_ids: Tensor | None = None) -> int:
    """Number of trajectories with at least one action token (the local ``num_seqs`` of ``seq_mean``)."""
    return trajectory_index(action_mask.bool(), segment_ids).num_traj


def _check_normaliser(name: str, value: float | int | Tensor | None, local: int) -> float:
    if value is None:
        if local == 0:
            raise ValueError(
                "`action_mask` has no action tokens in the whole batch and no global normaliser was "
                f"given; drop empty batches or pass `{name}` (the count over the full step)."
            )
        return float(local)
    v = float(value)
    if not v > 0 or v != v:
        raise ValueError(f"`{name}` must be > 0 (the count over the full step), got {value!r}.")
    if v < local:
        raise ValueError(
            f"`{name}`={v:g} is smaller than this micro-batch's own count {local}; pass the count summed "
            "over all micro-batches and data-parallel ranks of the step."
        )
    return v


def loss_weights(
    action_mask: Tensor,
    agg: LossAgg = "token_mean",
    *,
    num_tokens_global: float | int | Tensor | None = None,
    num_seqs_global: float | int | Tensor | None = None,
    segment_ids: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-token weights ``w`` [B, T] with ``loss = sum(w * l)``; zero off the action tokens.

    ``action_mask`` must already be a validated bool tensor. Passing the normaliser of the other mode
    is an error (it would be silently ignored otherwise).
    """
    check_choice("aggregation `agg`", agg, AGG_MODES)
    mask = action_mask
    if agg == "token_mean":
        if num_seqs_global is not None:
            raise ValueError("`num_seqs_global` is for agg='seq_mean'; with 'token_mean' pass `num_tokens_global`.")
        n = _check_normaliser("num_tokens_global", num_tokens_global, int(row_counts(mask).sum()))
        return mask.to(dtype) / n
    if num_tokens_global is not None:
        raise ValueError("`num_tokens_global` is for agg='token_mean'; with 'seq_mean' pass `num_seqs_global`.")
    idx = trajectory_index(mask, segment_ids)
    s = _check_normaliser("num_seqs_global", num_seqs_global, idx.num_traj)
    w_k = 1.0 / (idx.lengths[idx.traj].to(torch.float64) * s)  # [K]
    w = torch.zeros(mask.numel(), dtype=torch.float64, device=mask.device)
    w[idx.positions] = w_k
    return w.view(mask.shape).to(dtype)


def aggregate(per_token: Tensor, weights: Tensor, action_mask: Tensor) -> Tensor:
    """``sum(w * l)`` over action tokens; non-action entries of ``per_token`` never reach the result."""
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    return torch.where(action_mask, per_token * weights.to(per_token.dtype), zero).sum()
