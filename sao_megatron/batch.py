"""Trajectories -> padded training tensors, aligned on the positions that predict each token.

A sequence is ``prompt_ids + response_ids`` (length L). The model's output at position p
(logits, or the critic's value) is computed from tokens ``0..p`` and predicts token ``p + 1``.
Everything per action token therefore lives at position ``p = len(prompt) + j - 1`` for
response token j: its label, behavior logprob, version, value V(s) and advantage. Rows are
right-padded to the longest sequence in the batch; ``action_mask`` is 0 on prompt,
observation and padding positions.
"""

from __future__ import annotations

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

    def micro_batches(self, micro_batch_size: int) -> list[dict]:
        """Dicts for the engine's schedule, each trimmed to its own longest row."""
        out = []
        for start in range(0, self.size, micro_batch_size):
            part = self.select(slice(start, start + micro_batch_size))
            t = int(part.lengths.max())
            out.append({k: (v[:, :t] if v.dim() == 2 else v) for k, v in part.__dict__.items()})
        return out


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
