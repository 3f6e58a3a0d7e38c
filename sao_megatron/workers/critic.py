"""The value model on one Megatron rank: values V(s) and value-loss updates (frozen attention)."""

from __future__ import annotations

from pathlib import Path

import torch

from sao_megatron import algo
from sao_megatron.batch import BatchShard, MicroBatch, MicroBatching, RowOutputs
from sao_megatron.config.rank import CriticRankConfig
from sao_megatron.workers import checkpoint
from sao_megatron.workers.metrics import reduce_metrics
from sao_megatron.workers.micro import (
    full_sequence,
    micro_batches,
    micro_batching,
    nan_loss,
    nonfinite_free,
    row_outputs,
)
from sao_megatron.workers.rank import init_rank
from sao_megatron.workers.role import build_critic_role


class CriticWorker:
    """The value model on this rank."""

    def __init__(self, cfg: CriticRankConfig, init_from: str | None = None):
        """``init_from``: the trunk's checkpoint (HF or Megatron directory), ``""`` for a random
        trunk; ``None`` means ``cfg.critic.init_from``. Each rank reads only its own slices."""
        self.cfg = cfg
        init_rank(cfg.critic.parallel, cfg.seed)
        source = cfg.critic.init_from if init_from is None else init_from
        self.role = build_critic_role(cfg.model, cfg.critic, source=source)

    @property
    def _micro(self) -> MicroBatching:
        """How this role's layout cuts a shard into micro-batches."""
        return micro_batching(self.cfg.critic.parallel)

    @torch.no_grad()
    def values(self, shard: BatchShard) -> RowOutputs | None:
        """``[b, T]`` values V(s) at the action positions and at each row's last position (the state
        after the sequence's end: a truncated episode's bootstrap), zero elsewhere, on reporting ranks
        (:attr:`TrainBatch.value_mask`)."""
        collected: list[torch.Tensor] = []

        def loss_fn(values: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
            collected.append(full_sequence(values.squeeze(-1).float(), mb))
            return values.sum() * 0.0, {}

        micro = micro_batches(shard, self._micro)
        self.role.forward_backward(micro, loss_fn, forward_only=True)
        out = row_outputs(collected, micro, shard)
        if out is not None:
            out.values.mul_(shard.batch.value_mask)
        return out

    def update(self, shard: BatchShard, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step of the value loss on the whole batch (``returns``, ``old_values``: ``[b, T]``)."""
        a = self.cfg.algo
        micro = micro_batches(shard, self._micro, returns=returns, old_values=old_values)

        def loss_fn(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
            values = output.squeeze(-1)  # [b, t]
            assert mb.returns is not None  # cut in just above
            mask = mb.action_mask > 0
            if not nonfinite_free(values, mb.returns, mask=mask):
                return nan_loss(values, mask)  # the step is skipped on every rank (role.step)
            return algo.value_objective(
                values,
                mb.returns,
                mb.action_mask,
                mb.old_values,
                value_clip=a.value_clip,
                agg=a.loss_agg,
                num_tokens_global=shard.num_tokens_global,
                num_seqs_global=shard.num_seqs_global,
                segment_ids=mb.segment_ids,
            )

        out = self.role.forward_backward(micro, loss_fn)
        step = self.role.step()
        return {
            **reduce_metrics(out),
            **step.group_norms,
            "grad_norm": step.grad_norm,
            "lr": step.lr,
            "updated": float(step.updated),
        }

    def save(self, directory: str) -> None:
        checkpoint.save_role(self.role, Path(directory))

    def load(self, directory: str) -> None:
        checkpoint.load_role(self.role, Path(directory))
