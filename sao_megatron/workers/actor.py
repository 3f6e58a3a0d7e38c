"""The policy on one Megatron rank: DIS (or baseline) updates, logprobs, SFT, export, weight sync."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron import algo
from sao_megatron.batch import BatchShard, MicroBatch, MicroBatching, RowOutputs
from sao_megatron.config.rank import ActorRankConfig
from sao_megatron.models.logprobs import vocab_parallel_logprobs
from sao_megatron.parallel import device
from sao_megatron.weight_sync import BroadcastSync
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
from sao_megatron.workers.rank import init_rank, parallel_state
from sao_megatron.workers.role import build_actor_role


@dataclass(frozen=True)
class ExportReport:
    tensors: int
    bytes: int
    seconds: float


class ActorWorker:
    """The policy on this rank."""

    def __init__(self, cfg: ActorRankConfig):
        self.cfg = cfg
        init_rank(cfg.actor.parallel, cfg.seed)
        replay = cfg.routing_replay != "off"
        self.role = build_actor_role(cfg.model, cfg.actor, routing_replay=replay)
        if replay:
            from sao_megatron.models.replay import RoutingReplay
            from sao_megatron.routing import RouteShape

            self.role.replay = RoutingReplay(
                self.role.module,
                list(RouteShape.of(cfg.model).moe_layers),
                replay=cfg.routing_replay == "on",
            )
        self.broadcast = BroadcastSync(
            self.role.module,
            cfg.model,
            engine_tp=cfg.engine_tp,
            flat=cfg.sync_flat,
            bucket_mb=cfg.sync_bucket_mb,
            inflight_mb=cfg.export_inflight_mb,
            timeout_s=cfg.export_timeout_s,
            gb_per_s=cfg.export_gb_per_s,
            policy=cfg.update_policy,
            bucket_timeout_s=cfg.sync_timeout_s,
            senders=max(1, cfg.sync_senders // cfg.actor.parallel.pipeline_parallel),
        )
        """This rank's part of the broadcast weight sync (:meth:`sync_weights`)."""

    @property
    def _micro(self) -> MicroBatching:
        """How this role's layout cuts a shard into micro-batches."""
        return micro_batching(self.cfg.actor.parallel)

    def _logprobs(self, logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, t]`` logprob of each label under the policy at the sampling temperature, and the
        entropy there (no gradient), from this TP rank's vocabulary slice of ``logits``."""
        return vocab_parallel_logprobs(
            logits,
            mb.labels,
            parallel_state().get_tensor_model_parallel_group(),
            temperature=self.cfg.temperature,
        )

    def update(self, shard: BatchShard, advantages: torch.Tensor, version: int) -> dict[str, float]:
        """One optimizer step of the configured policy loss (DIS by default) on the whole batch.

        ``advantages`` ``[b, T]`` are this shard's rows; ``version`` is the policy version being
        trained (token lag = version - the token's version, reported as ``dis/kept_frac/lag*``)."""
        a = self.cfg.algo
        b = shard.batch
        self.role.config.moe_aux_loss_coeff = self.cfg.actor.moe_aux_loss_coeff  # RL's (Megatron reads it per forward)
        lag = algo.policy_lag(version, b.policy_versions, b.action_mask)
        micro = micro_batches(shard, self._micro, advantages=advantages, lag=lag)

        def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
            logprobs, entropy = self._logprobs(logits, mb)
            assert mb.advantages is not None and mb.lag is not None  # cut in just above
            mask = mb.action_mask > 0
            if not nonfinite_free(logprobs, mb.advantages, mask=mask):
                return nan_loss(logprobs, mask)  # the step is skipped on every rank (role.step)
            mismatch = algo.mismatch_metrics(logprobs, mb.behavior_logprobs, mask & (mb.lag == 0))
            loss, metrics = algo.policy_objective(
                logprobs,
                entropy,
                mb.behavior_logprobs,
                mb.advantages,
                mb.action_mask,
                mb.lag,
                loss=a.policy_loss,
                eps_low=a.eps_low,
                eps_high=a.eps_high,
                detach_ratio=a.detach_ratio,
                agg=a.loss_agg,
                num_tokens_global=shard.num_tokens_global,
                num_seqs_global=shard.num_seqs_global,
                segment_ids=mb.segment_ids,
                stale_lag=a.max_policy_lag if a.over_lag == "mask" else None,
                seq_mask_low=a.seq_mask_low,
                seq_mask_high=a.seq_mask_high,
                tis_cap=a.tis_cap,
            )
            return loss, {**metrics, **mismatch}

        out = self.role.forward_backward(micro, loss_fn)
        routing = self._routing_metrics()
        step = self.role.step()
        return {
            **reduce_metrics(out),
            **routing,
            **step.group_norms,
            "grad_norm": step.grad_norm,
            "lr": step.lr,
            "updated": float(step.updated),
        }

    @torch.no_grad()
    def logprobs(self, shard: BatchShard) -> RowOutputs | None:
        """``[b, T]`` logprobs of each position's label under the current policy (reporting ranks)."""
        out = self._logprob_pass(shard)
        if self.role.replay is not None:
            self.role.replay.take_counts()  # the update's forward reports agreement
        return out

    @torch.no_grad()
    def routed_logprobs(self, shard: BatchShard, replay: bool) -> tuple[RowOutputs | None, dict[str, float]]:
        """:meth:`logprobs` with the routers replaying the batch's routes (``replay``) or routing
        themselves, and their agreement with those routes (``routing/agreement``, a collective over the
        world). For ``sao check --mismatch``; needs ``rollout.routing_replay`` other than ``off``."""
        if self.role.replay is None:
            raise RuntimeError("routed_logprobs needs an actor built with rollout.routing_replay record or on")
        mode = self.cfg.routing_replay == "on"
        self.role.replay.set_replay(replay)
        try:
            rows = self._logprob_pass(shard)
            return rows, self._routing_metrics()
        finally:
            self.role.replay.set_replay(mode)

    def _logprob_pass(self, shard: BatchShard) -> RowOutputs | None:
        collected: list[torch.Tensor] = []

        def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
            logprobs, _ = self._logprobs(logits, mb)
            collected.append(full_sequence(logprobs.float(), mb))
            return logits.sum() * 0.0, {}

        micro = micro_batches(shard, self._micro)
        self.role.forward_backward(micro, loss_fn, forward_only=True)
        return row_outputs(collected, micro, shard)

    def _routing_metrics(self) -> dict[str, float]:
        """Route agreement of the last forward-backward (a collective over the world; {} without replay)."""
        if self.role.replay is None:
            return {}
        from sao_megatron.models.replay import routing_metrics

        counts = self.role.replay.take_counts().to(device())
        dist.all_reduce(counts)
        return routing_metrics(counts.cpu())

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
        self.role.config.moe_aux_loss_coeff = self.cfg.model.moe_aux_loss_coeff  # SFT keeps the model's
        micro = micro_batches(shard, self._micro)

        def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
            logprobs, _ = self._logprobs(logits, mb)
            return algo.sft_nll(logprobs, mb.action_mask, num_tokens_global=shard.num_tokens_global)

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

        c = self.cfg
        stats = save_hf_checkpoint(
            self.role.module,
            c.model,
            out_dir,
            overwrite=True,
            inflight_bytes=c.export_inflight_mb << 20,
            timeout_s=c.export_timeout_s,
            gb_per_s=c.export_gb_per_s,
        )
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
