"""The policy on one Megatron rank: DIS (or baseline) updates, logprobs, SFT, export, weight sync."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron import algo
from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX
from sao_megatron.batch import BatchShard, MicroBatching, RowOutputs
from sao_megatron.config import SAOConfig
from sao_megatron.models.logprobs import vocab_parallel_logprobs
from sao_megatron.weight_sync import BroadcastSync
from sao_megatron.workers import checkpoint
from sao_megatron.workers.common import (
    full_sequence,
    init_rank,
    micro_batches,
    micro_batching,
    nan_loss,
    nonfinite_free,
    parallel_state,
    reduce_metrics,
    row_outputs,
)
from sao_megatron.workers.role import build_actor_role

LAG_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, 1 << 30, "3+"))


@dataclass(frozen=True)
class ExportReport:
    tensors: int
    bytes: int
    seconds: float


def kept_by_lag(
    kept: torch.Tensor, lag: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Fraction of action tokens inside the DIS band, per token-lag bucket and advantage sign.

    Each fraction ``K`` comes with its token count ``K#n`` (``WEIGHT_SUFFIX``, the weight of its
    reduction in :func:`~sao_megatron.workers.common.reduce_metrics`); ``dis/tokens/lag{b}`` is the
    bucket's token count (summed). Empty buckets and signs report nothing."""
    out = {}
    for lo, hi, name in LAG_BUCKETS:
        sel = mask & (lag >= lo) & (lag <= hi)
        n = int(sel.sum())
        out[f"dis/tokens/lag{name}"] = float(n)
        if n:
            out[f"dis/kept_frac/lag{name}"] = float((kept & sel).sum()) / n
            out[f"dis/kept_frac/lag{name}{WEIGHT_SUFFIX}"] = float(n)
        for sign, sel_sign in (("pos", advantages > 0), ("neg", advantages < 0)):
            both = sel & sel_sign
            if nb := int(both.sum()):
                out[f"dis/kept_frac/lag{name}/adv_{sign}"] = float((kept & both).sum()) / nb
                out[f"dis/kept_frac/lag{name}/adv_{sign}{WEIGHT_SUFFIX}"] = float(nb)
    return out


class ActorWorker:
    """The policy on this rank."""

    def __init__(self, cfg: SAOConfig):
        self.cfg = cfg
        init_rank(cfg.actor.parallel, cfg.run.seed)
        self.role = build_actor_role(cfg.model, cfg.actor)
        r = cfg.rollout
        self.broadcast = BroadcastSync(
            self.role.module,
            cfg.model,
            engine_tp=r.tensor_parallel,
            flat=r.weight_sync_flat,
            bucket_mb=r.weight_sync_bucket_mb,
        )
        """This rank's part of the broadcast weight sync (:meth:`sync_weights`)."""

    @property
    def _micro(self) -> MicroBatching:
        """How this role's layout cuts a shard into micro-batches."""
        return micro_batching(self.cfg.actor.parallel)

    def _logprobs(self, logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_logprobs(
            logits,
            mb["labels"],
            parallel_state().get_tensor_model_parallel_group(),
            temperature=self.cfg.rollout.loop.temperature,
        )

    def update(self, shard: BatchShard, advantages: torch.Tensor, version: int) -> dict[str, float]:
        """One optimizer step of the configured policy loss (DIS by default) on the whole batch.

        ``advantages`` ``[b, T]`` are this shard's rows; ``version`` is the policy version being
        trained (token lag = version - the token's version, reported as ``dis/kept_frac/lag*``)."""
        a = self.cfg.algo
        b = shard.batch
        lag = algo.policy_lag(version, b.policy_versions, b.action_mask)
        micro = micro_batches(shard, {"advantages": advantages, "lag": lag}, self._micro)
        token_mean = a.loss_agg == "token_mean"  # the global normaliser of the aggregation
        norm = {
            "num_tokens_global": shard.num_tokens_global if token_mean else None,
            "num_seqs_global": None if token_mean else shard.num_seqs_global,
        }
        bounds = {"eps_low": a.eps_low, "eps_high": a.eps_high} if a.policy_loss != "vanilla" else {}
        extra = {"detach_ratio": a.detach_ratio} if a.policy_loss == "dis" else {}

        def loss_fn(logits, mb):
            logprobs, entropy = self._logprobs(logits, mb)
            mask = mb["action_mask"] > 0
            if not nonfinite_free(logprobs, mb["advantages"], mask=mask):
                return nan_loss(logprobs, mask)  # the step is skipped on every rank (engine.step)
            loss, metrics = algo.policy_loss(
                a.policy_loss,
                logprobs,
                mb["behavior_logprobs"],
                mb["advantages"],
                mask,
                agg=a.loss_agg,
                segment_ids=mb.get("segment_ids"),
                **bounds,
                **extra,
                **norm,
            )
            metrics["entropy"] = algo.masked_mean(entropy, mask.float()).item()
            metrics["micro_tokens"] = float(mask.sum())
            kept = algo.dis_band(logprobs.detach(), mb["behavior_logprobs"], a.eps_low, a.eps_high)
            metrics.update(kept_by_lag(kept, mb["lag"], mb["advantages"], mask))
            return loss, metrics

        out = self.role.forward_backward(micro, loss_fn)
        step = self.role.step()
        return {
            **reduce_metrics(out),
            **step.group_norms,
            "grad_norm": step.grad_norm,
            "lr": step.lr,
            "updated": float(step.updated),
        }

    @torch.no_grad()
    def logprobs(self, shard: BatchShard) -> RowOutputs | None:
        """``[b, T]`` logprobs of each position's label under the current policy (reporting ranks)."""
        collected: list[torch.Tensor] = []

        def loss_fn(logits, mb):
            logprobs, _ = self._logprobs(logits, mb)
            collected.append(full_sequence(logprobs.float(), mb))
            return logits.sum() * 0.0, {}

        micro = micro_batches(shard, {}, self._micro)
        self.role.forward_backward(micro, loss_fn, forward_only=True)
        return row_outputs(collected, micro, shard)

    def set_lr(self, lr: float) -> None:
        """Switch the constant learning rate (SFT uses ``train.sft_lr``, RL ``actor.optim.lr``)."""
        sched = self.role.scheduler
        sched.init_lr = sched.max_lr = lr
        sched.min_lr = min(sched.min_lr, lr)
        for group in self.role.optimizer.param_groups:  # Megatron groups carry their own max/min lr
            group["lr"] = group["max_lr"] = lr
            group["min_lr"] = min(group.get("min_lr", lr), lr)

    def sft_step(self, shard: BatchShard) -> dict[str, float]:
        """Supervised step: mean negative logprob of the action tokens (demonstrations)."""
        tokens = shard.num_tokens_global
        micro = micro_batches(shard, {}, self._micro)

        def loss_fn(logits, mb):
            logprobs, _ = self._logprobs(logits, mb)
            mask = mb["action_mask"]
            n = float(mask.sum())
            nll = -(logprobs * mask).sum()
            return nll / tokens, {"nll": (nll / max(n, 1.0)).item(), "micro_tokens": n}

        out = self.role.forward_backward(micro, loss_fn)
        step = self.role.step()
        return {**reduce_metrics(out), "grad_norm": step.grad_norm}

    def export_hf(self, out_dir: str) -> ExportReport:
        """Write the policy as an HF checkpoint (weights, config, tokenizer) for the engines.

        The tokenizer files are the run's tokenizer source (``actor.init_from`` when it is an HF
        directory, else the in-repo tiny tokenizer), copied unchanged so engines serve it as is.
        """
        from sao_megatron.models.hf_weights import save_hf_checkpoint
        from sao_megatron.tokenizer import copy_tokenizer_files

        stats = save_hf_checkpoint(self.role.module, self.cfg.model, out_dir, overwrite=True)
        if dist.get_rank() == 0:
            copy_tokenizer_files(getattr(self.cfg.actor, "init_from", ""), out_dir)
        return ExportReport(stats.tensors, stats.bytes, stats.seconds)

    def sync_weights(
        self, engine_urls: list[str], version: int, addresses: str | list[str], master_port: int = 0
    ) -> dict[str, float]:
        """Stream the policy's HF weights to the engines, tagged ``version`` (every rank calls it;
        :meth:`BroadcastSync.sync <sao_megatron.weight_sync.BroadcastSync.sync>`). Rank 0 returns
        the timing; the others ``{}``."""
        return self.broadcast.sync(engine_urls, version, addresses, master_port)

    def save(self, directory: str) -> None:
        checkpoint.save_role(self.role, Path(directory))

    def load(self, directory: str) -> None:
        checkpoint.load_role(self.role, Path(directory))
