"""The policy on one Megatron rank: DIS (or baseline) updates, logprobs, SFT, export, weight sync."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron import algo
from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX
from sao_megatron.batch import BatchShard, MicroBatching, RowOutputs
from sao_megatron.config import SAOConfig
from sao_megatron.models.logprobs import vocab_parallel_logprobs
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
from sao_megatron.workers.engine import build_actor_role

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
        self._sync = None
        self._sync_groups = 0  # weight-sync groups formed so far (each has its own name)

    @property
    def _micro(self) -> MicroBatching:
        """How this role's layout cuts a shard into micro-batches."""
        return micro_batching(self.cfg.actor.parallel)

    def _logprobs(self, logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_logprobs(logits, mb["labels"], parallel_state().get_tensor_model_parallel_group(),
                                       temperature=self.cfg.rollout.loop.temperature)  # fmt: skip

    def update(self, shard: BatchShard, advantages: torch.Tensor, version: int) -> dict[str, float]:
        """One optimizer step of the configured policy loss (DIS by default) on the whole batch.

        ``advantages`` ``[b, T]`` are this shard's rows; ``version`` is the policy version being
        trained (token lag = version - the token's version, reported as ``dis/kept_frac/lag*``)."""
        a = self.cfg.algo
        b = shard.batch
        lag = algo.policy_lag(version, b.policy_versions, b.action_mask)
        micro = micro_batches(shard, {"advantages": advantages, "lag": lag}, self._micro)
        token_mean = a.loss_agg == "token_mean"  # the global normaliser of the aggregation
        norm = {"num_tokens_global": shard.num_tokens_global if token_mean else None,
                "num_seqs_global": None if token_mean else shard.num_seqs_global}  # fmt: skip
        bounds = {"eps_low": a.eps_low, "eps_high": a.eps_high} if a.policy_loss != "vanilla" else {}
        extra = {"detach_ratio": a.detach_ratio} if a.policy_loss == "dis" else {}

        def loss_fn(logits, mb):
            logprobs, entropy = self._logprobs(logits, mb)
            mask = mb["action_mask"] > 0
            if not nonfinite_free(logprobs, mb["advantages"], mask=mask):
                return nan_loss(logprobs, mask)  # the step is skipped on every rank (engine.step)
            loss, metrics = algo.policy_loss(a.policy_loss, logprobs, mb["behavior_logprobs"], mb["advantages"], mask,
                                             agg=a.loss_agg, segment_ids=mb.get("segment_ids"),
                                             **bounds, **extra, **norm)  # fmt: skip
            metrics["entropy"] = algo.masked_mean(entropy, mask.float()).item()
            metrics["micro_tokens"] = float(mask.sum())
            kept = algo.dis_band(logprobs.detach(), mb["behavior_logprobs"], a.eps_low, a.eps_high)
            metrics.update(kept_by_lag(kept, mb["lag"], mb["advantages"], mask))
            return loss, metrics

        out = self.role.forward_backward(micro, loss_fn)
        step = self.role.step()
        return {**reduce_metrics(out), **step.group_norms, "grad_norm": step.grad_norm, "lr": step.lr,
                "updated": float(step.updated)}  # fmt: skip

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
        self, engine_urls: list[str], version: int, master_address: str, master_port: int = 0
    ) -> dict[str, float]:
        """Stream HF-named weights to the engines (rank 0 broadcasts), tagged ``version``.

        The broadcast group is re-formed (a new name; the old one destroyed on the engines still
        listed) when ``engine_urls`` differ from the last call's (an engine restarted or dropped),
        and after a failed update (an engine died during it), which raises here."""
        from sao_megatron.models.hf_weights import iter_hf_weights
        from sao_megatron.weight_sync import WeightSync

        r = self.cfg.rollout
        buckets = iter_hf_weights(
            self.role.module, self.cfg.model, bucket_bytes=r.weight_sync_bucket_mb << 20
        )
        if dist.get_rank() != 0:
            for _ in buckets:  # the gather inside is a collective
                pass
            return {}
        if self._sync is not None and self._sync.engine_urls != engine_urls:
            old = self._sync
            self._sync = None
            asyncio.run(old.close([u for u in old.engine_urls if u in engine_urls]))
        try:
            if self._sync is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
                self._sync_groups += 1
                name = "sao_weight_sync" + (f"_{self._sync_groups}" if self._sync_groups > 1 else "")
                self._sync = WeightSync(list(engine_urls), engine_tp=r.tensor_parallel, backend=backend,
                                        master_address=master_address, master_port=master_port, group_name=name)  # fmt: skip
                asyncio.run(self._sync.connect())
                print(f"[sao-weight-sync] {backend} group {name} at {master_address}:{self._sync.master_port} "
                      f"(trainer rank 0) -> engines {' '.join(engine_urls)}", flush=True)  # fmt: skip
            report = asyncio.run(self._sync.update(buckets, version))
        except BaseException:
            for _ in buckets:  # the other ranks still gather every bucket: finish the collectives
                pass
            if self._sync is not None:  # broken by the failure: the next call forms a new group
                sync, self._sync = self._sync, None
                asyncio.run(sync.close())
            raise
        return {
            "sync_s": report.seconds,
            "sync_pause_s": report.paused_s,
            "sync_gb_per_s": report.gb_per_s,
            "sync_tensors": float(report.tensors),
        }

    def save(self, directory: str) -> None:
        checkpoint.save_role(self.role, Path(directory))

    def load(self, directory: str) -> None:
        checkpoint.load_role(self.role, Path(directory))
