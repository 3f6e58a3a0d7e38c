"""What one Megatron rank of a role does: actor updates (DIS), critic values and K updates, SFT.

These classes run inside a process whose ``torch.distributed`` world is the role's world (a
Ray actor per rank, or a spawned process). Every method is a collective over that world:
the driver calls it on all ranks and reads the result of global rank 0 (the last pipeline
stage reports metrics; see :func:`_first_result`).

Batches arrive whole; each data-parallel replica takes rows ``dp_rank::dp_size``. Losses are
normalised by the *global* batch (all micro-batches on all DP ranks), so the optimizer step
applies exactly the full-batch gradient (see ``engine.MegatronRole``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron import algo
from sao_megatron.config import SAOConfig
from sao_megatron.models.logprobs import vocab_parallel_logprobs
from sao_megatron.train.batch import TrainBatch


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def _my_rows(batch: TrainBatch, extras: dict[str, torch.Tensor]) -> tuple[TrainBatch, dict]:
    ps = _ps()
    rows = list(range(ps.get_data_parallel_rank(), batch.size, ps.get_data_parallel_world_size()))
    return batch.select(rows), {k: v[rows] for k, v in extras.items()}


def _micro(batch: TrainBatch, extras: dict, size: int) -> list[dict]:
    micro = batch.micro_batches(size)
    start = 0
    for mb in micro:
        n, t = mb["tokens"].shape
        for k, v in extras.items():
            mb[k] = v[start : start + n, :t] if v.dim() == 2 else v[start : start + n]
        start += n
    return micro


def _reduce_metrics(per_micro: list[dict], weights: list[float]) -> dict[str, float]:
    """Weighted mean of per-micro-batch metrics over micro-batches, then over DP ranks."""
    keys = sorted({k for m in per_micro for k in m})
    local = torch.zeros(len(keys) + 1, dtype=torch.float64)
    for m, w in zip(per_micro, weights, strict=True):
        for i, k in enumerate(keys):
            local[i] += w * float(m.get(k, 0.0))
        local[-1] += w
    if not keys:
        return {}
    ps = _ps()
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(local, group=ps.get_data_parallel_group())
    return {k: (local[i] / max(local[-1].item(), 1e-12)).item() for i, k in enumerate(keys)}


def _global_counts(batch: TrainBatch) -> tuple[float, float]:
    """Action tokens and trajectories of the whole batch (every rank sees the whole batch)."""
    return float(batch.action_mask.sum()), float((batch.action_mask.sum(-1) > 0).sum())


def _normaliser(agg: str, batch: TrainBatch) -> dict:
    tokens, seqs = _global_counts(batch)
    return {"num_tokens_global": tokens} if agg == "token_mean" else {"num_seqs_global": seqs}


class ActorWorker:
    """The policy on this rank."""

    def __init__(self, cfg: SAOConfig):
        from sao_megatron.parallel import initialize_model_parallel, seed_everything
        from sao_megatron.train.engine import build_actor_role

        self.cfg = cfg
        initialize_model_parallel(cfg.actor.parallel)
        seed_everything(cfg.run.seed)
        self.role = build_actor_role(cfg.model, cfg.actor)

    def _logprobs(self, logits, mb):
        return vocab_parallel_logprobs(logits, mb["labels"], _ps().get_tensor_model_parallel_group(),
                                       temperature=self.cfg.rollout.temperature)  # fmt: skip

    def update(self, batch: TrainBatch, advantages: torch.Tensor) -> dict[str, float]:
        """One optimizer step of the configured policy loss (DIS by default) on the whole batch."""
        a = self.cfg.algo
        norm = _normaliser(a.loss_agg, batch)
        mine, extras = _my_rows(batch, {"advantages": advantages})
        micro = _micro(mine, extras, self.cfg.actor.parallel.micro_batch_size)
        kwargs = {"agg": a.loss_agg, **norm}
        if a.policy_loss == "dis":
            kwargs.update(eps_low=a.eps_low, eps_high=a.eps_high, detach_ratio=a.detach_ratio)
        elif a.policy_loss == "ppo_clip":
            kwargs.update(clip_low=a.eps_low, clip_high=a.eps_high)

        def loss_fn(logits, mb):
            logprobs, entropy = self._logprobs(logits, mb)
            mask = mb["action_mask"] > 0
            loss, metrics = algo.policy_loss(a.policy_loss, logprobs, mb["behavior_logprobs"], mb["advantages"],
                                             mask, **kwargs)  # fmt: skip
            metrics["entropy"] = algo.masked_mean(entropy, mask.float()).item()
            metrics["micro_tokens"] = float(mask.sum())
            return loss, metrics

        out = self.role.forward_backward(micro, loss_fn, seq_length=int(mine.lengths.max()))
        step = self.role.step()
        metrics = _reduce_metrics(out, [m["micro_tokens"] for m in out])
        metrics.pop("micro_tokens", None)
        return {**metrics, "grad_norm": step.grad_norm, "lr": step.lr, "updated": float(step.updated)}

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """Supervised step: mean negative logprob of the action tokens (demonstrations)."""
        tokens, _ = _global_counts(batch)
        mine, _ = _my_rows(batch, {})
        micro = _micro(mine, {}, self.cfg.actor.parallel.micro_batch_size)

        def loss_fn(logits, mb):
            logprobs, _ = self._logprobs(logits, mb)
            mask = mb["action_mask"]
            loss = -(logprobs * mask).sum() / tokens
            n = float(mask.sum())
            return loss, {"nll": (-(logprobs * mask).sum() / max(n, 1.0)).item(), "micro_tokens": n}

        out = self.role.forward_backward(micro, loss_fn, seq_length=int(mine.lengths.max()))
        step = self.role.step()
        metrics = _reduce_metrics(out, [m["micro_tokens"] for m in out])
        metrics.pop("micro_tokens", None)
        return {**metrics, "grad_norm": step.grad_norm}

    def full_state(self) -> dict[str, torch.Tensor]:
        from sao_megatron.models import layout

        return layout.gather_full(self.role.module)

    def save(self, directory: str) -> None:
        from sao_megatron.train import checkpoint

        checkpoint.save_role(self.role, Path(directory))

    def load(self, directory: str) -> None:
        from sao_megatron.train import checkpoint

        checkpoint.load_role(self.role, Path(directory))


class CriticWorker:
    """The value model on this rank."""

    def __init__(self, cfg: SAOConfig, actor_state: dict | None = None):
        from sao_megatron.parallel import initialize_model_parallel, seed_everything
        from sao_megatron.train.engine import build_critic_role

        self.cfg = cfg
        initialize_model_parallel(cfg.critic.parallel)
        seed_everything(cfg.run.seed)
        self.role = build_critic_role(cfg.model, cfg.critic, actor_state)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor | None:
        """``[B, T]`` values V(s) at each position (zero off actions) on global rank 0, else None."""
        ps = _ps()
        mine, _ = _my_rows(batch, {})
        micro = _micro(mine, {}, self.cfg.critic.parallel.micro_batch_size)
        collected: list[torch.Tensor] = []

        def loss_fn(values, mb):
            collected.append(values.squeeze(-1).float() * mb["action_mask"])
            return values.sum() * 0.0, {}

        self.role.forward_backward(micro, loss_fn, seq_length=int(mine.lengths.max()), forward_only=True)
        local = torch.zeros(mine.size, batch.tokens.shape[1])
        if collected:
            row = 0
            for v in collected:
                local[row : row + v.shape[0], : v.shape[1]] = v
                row += v.shape[0]
        # Last pipeline stage of each DP replica holds its rows; assemble on global rank 0.
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (ps.get_data_parallel_rank(), ps.is_pipeline_last_stage(),
                                       ps.get_tensor_model_parallel_rank(), local))  # fmt: skip
        if dist.get_rank() != 0:
            return None
        out = torch.zeros(batch.size, batch.tokens.shape[1])
        dp = ps.get_data_parallel_world_size()
        for dp_rank, last, tp_rank, values in parts:
            if last and tp_rank == 0:
                out[list(range(dp_rank, batch.size, dp))] = values
        return out

    def update(self, batch: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step of the value loss on the whole batch."""
        a = self.cfg.algo
        norm = _normaliser(a.loss_agg, batch)
        mine, extras = _my_rows(batch, {"returns": returns, "old_values": old_values})
        micro = _micro(mine, extras, self.cfg.critic.parallel.micro_batch_size)
        clip = {"old_values": None, "clip_range": None}

        def loss_fn(values, mb):
            mask = mb["action_mask"] > 0
            if a.value_clip > 0:
                clip.update(old_values=mb["old_values"], clip_range=a.value_clip)
            loss, metrics = algo.value_loss(values.squeeze(-1).float(), mb["returns"], mask, agg=a.loss_agg,
                                            **clip, **norm)  # fmt: skip
            metrics["micro_tokens"] = float(mask.sum())
            return loss, metrics

        out = self.role.forward_backward(micro, loss_fn, seq_length=int(mine.lengths.max()))
        step = self.role.step()
        metrics = _reduce_metrics(out, [m["micro_tokens"] for m in out])
        metrics.pop("micro_tokens", None)
        return {**metrics, "grad_norm": step.grad_norm, "lr": step.lr}

    def save(self, directory: str) -> None:
        from sao_megatron.train import checkpoint

        checkpoint.save_role(self.role, Path(directory))

    def load(self, directory: str) -> None:
        from sao_megatron.train import checkpoint

        checkpoint.load_role(self.role, Path(directory))
