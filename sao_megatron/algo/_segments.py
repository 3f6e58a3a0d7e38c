"""Trajectory bookkeeping over action tokens: padding, packing and compaction.

A *trajectory* is the set of action tokens of one row (``segment_ids is None``) or of one segment of
a packed row (``segment_ids`` [B, T]: a new trajectory starts wherever the id changes between two
consecutive action tokens of the row, so neighbouring trajectories of a row need different ids, as
``segment_ids_from_cu_seqlens`` or any 0, 1, 2, ... packer gives). Observation and padding tokens
(``action_mask == 0``) belong to no trajectory and their ids are not read. A segment without action
tokens is not a trajectory.

``TrajectoryIndex.flat(width)`` places each trajectory's action tokens at the left of its own row of
an [S, width] buffer (S trajectories, width >= longest trajectory), so observation gaps, padding and
packing disappear and a per-trajectory recurrence becomes a per-row recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True)
class TrajectoryIndex:
    """Where each action token sits. K = number of action tokens, S = number of trajectories.

    Trajectories are numbered in row-major order of their tokens, so the K action tokens (also in
    row-major order) are grouped by trajectory: trajectory ``s`` owns ``first[s] : first[s] + lengths[s]``.
    """

    shape: tuple[int, int]  # (B, T) of the token layout
    positions: Tensor  # [K] flat row-major positions of action tokens, ascending
    first: Tensor  # [S] index into K of each trajectory's first action token
    lengths: Tensor  # [S] number of action tokens per trajectory (>= 1)
    rows: Tensor  # [S] batch row of each trajectory
    num_traj: int
    max_len: int

    def last(self) -> Tensor:
        """[S] index into K of each trajectory's last action token."""
        return self.first + self.lengths - 1

    @cached_property
    def traj(self) -> Tensor:
        """[K] trajectory of each action token (0..S-1, non-decreasing)."""
        return torch.arange(self.num_traj, device=self.first.device).repeat_interleave(self.lengths)

    @cached_property
    def rank(self) -> Tensor:
        """[K] index of each action token within its trajectory (0-based)."""
        return torch.arange(self.positions.numel(), device=self.first.device) - self.first.repeat_interleave(
            self.lengths
        )

    def flat(self, width: int) -> Tensor:
        """[K] position of each action token in a row-major [S, width] buffer: ``traj * width + rank``.

        Built as a cumulative sum of steps (1 inside a trajectory, ``width - len_prev + 1`` at each
        trajectory start) so that only one K-sized tensor is allocated.
        """
        steps = torch.ones(self.positions.numel(), dtype=torch.long, device=self.first.device)
        if steps.numel():
            steps[self.first[1:]] = width - self.lengths[:-1] + 1
            steps[0] = 0
        return steps.cumsum_(0)


def trajectory_index(action_mask: Tensor, segment_ids: Tensor | None = None) -> TrajectoryIndex:
    """Index the action tokens of a validated bool ``action_mask`` [B, T] by trajectory.

    A new trajectory starts at the first action token of each row and, with ``segment_ids``, wherever
    the id differs between two consecutive action tokens of a row (ids of observation tokens are not
    read). Cost: one ``nonzero`` over [B, T] plus O(B log K) (and one pass over K when packed).
    """
    b, t = action_mask.shape
    dev = action_mask.device
    positions = action_mask.reshape(-1).nonzero().flatten()  # [K]
    k = positions.numel()
    row_first = torch.searchsorted(positions, torch.arange(b, device=dev) * t)  # [B] first index into K
    row_len = torch.diff(row_first, append=row_first.new_tensor([k]))  # [B]
    nonempty = row_len > 0
    if segment_ids is None:
        first, lengths = row_first[nonempty], row_len[nonempty]
        rows = torch.arange(b, device=dev)[nonempty]
    else:
        new = torch.zeros(k, dtype=torch.bool, device=dev)
        new[row_first[nonempty]] = True
        seg_k = segment_ids.reshape(-1)[positions]
        new[1:] |= seg_k[1:] != seg_k[:-1]
        first = new.nonzero().flatten()
        lengths = torch.diff(first, append=first.new_tensor([k]))
        rows = torch.div(positions[first], t, rounding_mode="floor")
    return TrajectoryIndex(
        shape=(b, t),
        positions=positions,
        first=first,
        lengths=lengths,
        rows=rows,
        num_traj=first.numel(),
        max_len=int(lengths.max()) if k else 0,
    )


def segment_ids_from_cu_seqlens(cu_seqlens: Tensor, total_len: int) -> Tensor:
    """``cu_seqlens`` [S+1] (flash-attention style offsets into one packed row) -> segment ids [1, T].

    Tokens at or beyond ``cu_seqlens[-1]`` (padding) get id S.
    """
    pos = torch.arange(total_len, device=cu_seqlens.device)
    ids = torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True)
    return ids.view(1, total_len)
