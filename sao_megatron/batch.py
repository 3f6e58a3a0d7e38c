"""Trajectories -> padded training tensors, aligned on the positions that predict each token.

A sequence is ``prompt_ids + response_ids`` (length L). The model's output at position p
(logits, or the critic's value) is computed from tokens ``0..p`` and predicts token ``p + 1``.
Everything per action token therefore lives at position ``p = len(prompt) + j - 1`` for
response token j: its label, behavior logprob, version, value V(s) and advantage. Rows are
right-padded to the longest sequence in the batch; ``action_mask`` is 0 on prompt,
observation and padding positions.

The driver builds one :class:`TrainBatch` per learner step and splits it into one
:class:`BatchShard` per data-parallel replica of a role (rows ``dp_rank::dp_size``, which
spreads long and short trajectories evenly). A shard carries the whole batch's token and
sequence counts, so every replica normalises its loss by the *global* batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sao_megatron.records import Trajectory


@dataclass
class TrainBatch:
    """``[B, T]`` tensors for B trajectories (T = longest sequence)."""

    tokens: torch.Tensor  # [B, T] int64 input ids (0-padded)
    positions: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T] token predicted at each position (tokens shifted left)
    action_mask: torch.Tensor  # [B, T] float 1 where the label is a model-generated token
    behavior_logprobs: torch.Tensor  # [B, T]
    policy_versions: torch.Tensor  # [B, T] int64, -1 off actions
    rewards: torch.Tensor  # [B] scalar episode reward
    lengths: torch.Tensor  # [B] sequence length L

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def select(self, rows: slice | list[int]) -> TrainBatch:
        return TrainBatch(**{k: v[rows] for k, v in self.__dict__.items()})

    def shard(self, dp_size: int) -> list[BatchShard]:
        """One shard per data-parallel replica: replica ``d`` gets rows ``d::dp_size``."""
        if not 1 <= dp_size <= self.size:
            raise ValueError(f"cannot split a batch of {self.size} trajectories over {dp_size} DP replicas; "
                             f"make algo.batch_size a multiple of the data-parallel size")  # fmt: skip
        tokens, seqs = float(self.action_mask.sum()), float((self.action_mask.sum(-1) > 0).sum())
        out = []
        for d in range(dp_size):
            rows = list(range(d, self.size, dp_size))
            out.append(BatchShard(self.select(rows), rows, tokens, seqs))
        return out

    def micro_batches(self, micro_batch_size: int, multiple: int = 1) -> list[dict]:
        """Dicts for the engine's schedule, each trimmed to its own longest row, then right-padded
        up to a multiple of ``multiple`` (the sequence divisor a layout needs: TP with sequence
        parallelism, 2 * CP with context parallelism).

        Padding positions are exact no-ops for the loss: ``action_mask`` 0, labels and tokens 0,
        ``policy_versions`` -1, positions continuing the row's ``arange``. The model is causal,
        so positions past a row's length never change the outputs at earlier positions."""
        out = []
        for start in range(0, self.size, micro_batch_size):
            part = self.select(slice(start, start + micro_batch_size))
            t = padded_length(int(part.lengths.max()), multiple)
            mb = {
                k: (pad_columns(v, t, _PAD.get(k, 0)) if v.dim() == 2 else v)
                for k, v in part.__dict__.items()
            }
            width = min(t, part.positions.shape[1])  # positions past the batch width continue each row
            extra = torch.arange(1, t - width + 1, dtype=part.positions.dtype)
            mb["positions"] = torch.cat(
                [part.positions[:, :width], part.positions[:, width - 1 : width] + extra], 1
            )
            out.append(mb)
        return out


_PAD = {"policy_versions": -1}
"""Fill of padding positions per ``[B, T]`` field (0 otherwise)."""


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def pad_columns(v: torch.Tensor, t: int, fill: float = 0) -> torch.Tensor:
    """``v`` ``[B, T']`` trimmed or right-padded with ``fill`` to ``[B, t]``."""
    if v.shape[1] >= t:
        return v[:, :t]
    pad = torch.full((v.shape[0], t - v.shape[1]), fill, dtype=v.dtype, device=v.device)
    return torch.cat([v, pad], dim=1)


def build_batch(trajectories: list[Trajectory]) -> TrainBatch:
    if not trajectories:
        raise ValueError("build_batch needs at least one trajectory")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    b, width = len(trajectories), max(lengths)
    tokens = torch.zeros(b, width, dtype=torch.long)
    labels = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width)
    behavior = torch.zeros(b, width)
    versions = torch.full((b, width), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        if not t.prompt_ids:
            raise ValueError(f"trajectory {t.prompt_id} has an empty prompt")
        seq = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        n, p = len(seq), len(t.prompt_ids) - 1  # first response token is predicted at position p
        tokens[i, :n] = seq
        labels[i, : n - 1] = seq[1:]
        r = len(t.response_ids)
        mask[i, p : p + r] = torch.tensor(t.action_mask, dtype=torch.float32)
        behavior[i, p : p + r] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
        versions[i, p : p + r] = torch.tensor(t.policy_versions, dtype=torch.long)
    positions = torch.arange(width).unsqueeze(0).expand(b, width).contiguous()
    return TrainBatch(tokens, positions, labels, mask, behavior, versions,
                      torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
                      torch.tensor(lengths, dtype=torch.long))  # fmt: skip


@dataclass
class BatchShard:
    """The rows of a :class:`TrainBatch` that one data-parallel replica trains on."""

    batch: TrainBatch
    """This replica's rows, ``[b, T]`` (T of the whole batch)."""
    rows: list[int]
    """Their indices in the whole batch (to put per-row outputs back in place)."""
    num_tokens_global: float
    """Action tokens of the whole batch (all replicas): the ``token_mean`` normaliser."""
    num_seqs_global: float
    """Trajectories with at least one action token in the whole batch: the ``seq_mean`` normaliser."""

    def take(self, per_row: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a whole-batch ``[B, ...]`` tensor (advantages, returns, values)."""
        return per_row[self.rows]


@dataclass
class RowOutputs:
    """Per-position outputs (logprobs, values) of some rows, returned by one rank."""

    rows: list[int]
    values: torch.Tensor  # [len(rows), t] with t <= T


def assemble_rows(parts: Sequence[RowOutputs | None], size: int, width: int) -> torch.Tensor:
    """``[size, width]`` from the row outputs of the ranks that hold them (others give None)."""
    out = torch.zeros(size, width)
    seen: set[int] = set()
    for part in parts:
        if part is None:
            continue
        out[part.rows, : part.values.shape[1]] = part.values.float()
        seen.update(part.rows)
    if len(seen) != size:
        raise RuntimeError(
            f"row outputs cover {len(seen)} of {size} rows; a data-parallel replica reported nothing"
        )
    return out
