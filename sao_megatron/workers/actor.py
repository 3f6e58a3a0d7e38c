"""The policy on one Megatron rank: DIS (or baseline) updates, logprobs, SFT, export, weight sync."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

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
from sao_megatron.workers.role import build_actor_role

if TYPE_CHECKING:
    from sao_megatron.weight_sync import SyncGate

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
        self._sync = None  # this rank's weight-sync group, on a pipeline stage's sender
        self._sync_urls: list[str] | None = None  # the engines the groups were formed with
        self._sync_groups = 0  # weight-sync group formations so far (each has its own names)
        self._sync_calls = 0  # weight syncs so far (each has its own store keys)
        self._gate: SyncGate | None = None  # the coordinator's word to the senders (store connections)
        self._gather_group: dist.ProcessGroup | None = None

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
        """Stream HF-named weights to the engines, tagged ``version`` (every rank calls it).

        Each pipeline stage's sender (the stage's lowest global rank) gathers its own stage's
        buckets from its TP / EP / DP peers, a bucket ahead, and broadcasts them over a group of
        its own; global rank 0 pauses the engines and posts every bucket's request in one order
        (``sao_megatron.weight_sync``), releasing each bucket to its sender through the world's
        store (:class:`~sao_megatron.weight_sync.SyncGate`). ``addresses``: every global rank's
        node address (or one for all), where a sender's group store listens; ``master_port`` 0:
        any free port, else stage ``s``'s sender listens at ``master_port + s``.

        The groups are re-formed (new names; the old ones destroyed on the engines still
        listed) when ``engine_urls`` differ from the last call's (an engine restarted or
        dropped), and after a failed update (an engine died during it), which raises on rank 0.
        Rank 0 returns the timing; the others ``{}``."""
        from sao_megatron.models.hf_weights import HFWeightStream
        from sao_megatron.weight_sync import SyncGate

        if self._gather_group is None:  # the gathers run in a thread of their own, on a group of their own
            self._gather_group = cast(dist.ProcessGroup, dist.new_group())  # every rank is a member
        stream = HFWeightStream(self.role.module, self.cfg.model, per_stage=True, group=self._gather_group)
        rank = dist.get_rank()
        if self._gate is None:
            self._gate = SyncGate.of_world()
        self._sync_calls += 1
        gate = self._gate.next_update(self._sync_calls)
        results: list = [None] * dist.get_world_size()
        formed: list[str | None] = [None] * dist.get_world_size()
        if self._sync_urls != engine_urls:
            dist.all_gather_object(
                formed, self._connect_senders(stream.senders, engine_urls, addresses, master_port, gate)
            )
        t0 = time.perf_counter()
        paused = 0.0
        if any(formed):  # skipped everywhere: an engine would wait for that sender's buckets forever
            results = [(0, 0, error) for error in formed]
        elif rank == 0:
            try:
                nbytes, tensors, error, paused = asyncio.run(self._coordinate(stream, gate, engine_urls, version))
            except Exception as err:  # a bug: the other ranks still get their word below
                nbytes, tensors, error = 0, 0, f"{type(err).__name__}: {err}"
            gate.done()  # the engines were resumed
            dist.all_gather_object(results, (nbytes, tensors, error))
        else:
            mine = self._data_plane(stream, gate)
            gate.wait_done()  # not in the collective: the coordinator may take longer than its timeout
            dist.all_gather_object(results, mine)
        errors = [f"trainer rank {r}: {e}" for r, (_, _, e) in enumerate(results) if e]
        if errors:  # the groups are broken: the next call forms new ones
            self._sync_urls = None
            if self._sync is not None:
                sync, self._sync = self._sync, None
                asyncio.run(sync.close())
            if rank == 0:
                raise RuntimeError(f"weight sync to version {version} failed: {'; '.join(errors)}")
            return {}
        if rank != 0:
            return {}
        seconds = time.perf_counter() - t0
        total = sum(b for b, _, _ in results)
        return {
            "sync_s": seconds,
            "sync_pause_s": paused,
            "sync_gb_per_s": total / max(seconds, 1e-9) / 1e9,
            "sync_tensors": float(sum(t for _, t, _ in results)),
            "sync_senders": float(len(stream.senders)),
        }

    def _connect_senders(
        self, senders: list[int], engine_urls: list[str], addresses: str | list[str], master_port: int, gate: SyncGate
    ) -> str | None:
        """(Re-)form every sender's group, one at a time (an engine joins one group at a time; the
        next sender starts on the previous one's word in the store). Why this rank's group failed to
        form, or None (the update is skipped everywhere on any)."""
        from sao_megatron.weight_sync import WeightSync

        rank = dist.get_rank()
        if self._sync is not None:
            old, self._sync = self._sync, None
            asyncio.run(old.close([u for u in old.engine_urls if u in engine_urls]))
        self._sync_groups += 1
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        error = None
        for stage, sender in enumerate(senders):
            if rank == sender:
                name = self._group_name(stage, len(senders))
                address = addresses if isinstance(addresses, str) else addresses[rank]
                port = master_port + stage if master_port else 0  # two stages' senders may share a node
                where = f"{backend} group {name} at {address}:%s (trainer rank {rank}, stage {stage})"
                sync = WeightSync(
                    list(engine_urls),
                    engine_tp=self.cfg.rollout.tensor_parallel,
                    backend=backend,
                    master_address=address,
                    master_port=port,
                    group_name=name,
                    flat=self.cfg.rollout.weight_sync_flat,
                )
                try:
                    asyncio.run(sync.connect())  # bounded by the engines' HTTP and the group's timeouts
                    self._sync = sync
                    print(
                        f"[sao-weight-sync] {where % sync.master_port} -> engines {' '.join(engine_urls)}",
                        flush=True,
                    )
                except Exception as err:
                    error = f"{where % (sync.master_port or 'any port')} failed to form: {type(err).__name__}: {err}"
                    print(f"[sao-weight-sync] {error}", flush=True)
                gate.formed(stage)
            gate.wait_formed(stage)
        self._sync_urls = list(engine_urls)
        return error

    async def _coordinate(
        self, stream, gate, engine_urls: list[str], version: int
    ) -> tuple[int, int, str | None, float]:
        """Rank 0: pause the engines, start the update, then for every bucket in the global order wait
        until its sender holds it, release and post it (while sending its own stage's); end and
        resume. ``(bytes, tensors, error, paused_s)``. On an error the senders are stopped at their
        next bucket and the engines resumed before this rank's own sending is awaited."""
        from sao_megatron.weight_sync import BucketSpec, EngineControl, sync_order

        control = EngineControl(engine_urls)
        try:
            flat = self.cfg.rollout.weight_sync_flat
            plan = [
                [BucketSpec.planned(b, flat) for b in stage]
                for stage in stream.bucket_plan(self.cfg.rollout.weight_sync_bucket_mb << 20)
            ]
            names = [self._group_name(s, len(plan)) for s in range(len(plan))]
            await control.__aenter__()
        except Exception as err:  # nothing was sent: the other ranks are told to skip the update
            error = f"{type(err).__name__}: {err}"
            gate.start(error)
            return 0, 0, error, control.paused_s
        gate.start()
        sending = asyncio.ensure_future(asyncio.to_thread(self._data_plane, stream, gate))
        released = [0] * len(plan)  # per stage: buckets released so far
        error = None
        try:
            for s, k in sync_order([len(p) for p in plan]):
                if (reason := await asyncio.to_thread(gate.wait_ready, s, k)) is not None:
                    raise RuntimeError(reason)
                gate.release(s, k)
                released[s] = k + 1
                await control.load(names[s], plan[s][k], version)
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
            gate.stop((s, k) for s, k in enumerate(released) if k < len(plan[s]))
            await control.__aexit__(type(err), err, None)  # resumes
            sent = await sending
        else:
            sent = await sending
            if sent[2] is not None:  # a sender failed after its last bucket's request was answered
                error = sent[2]
            try:
                await control.__aexit__(RuntimeError if error else None, None, None)
            except Exception as err:
                error = error or f"{type(err).__name__}: {err}"
        return sent[0], sent[1], error, control.paused_s

    def _group_name(self, stage: int, stages: int) -> str:
        return (
            "sao_weight_sync"
            + (f"_{self._sync_groups}" if self._sync_groups > 1 else "")
            + (f"_pp{stage}" if stages > 1 else "")
        )

    def _data_plane(self, stream, gate) -> tuple[int, int, str | None]:
        """This rank's part of an update: gather its stage's buckets and, on the stage's sender, say
        it holds each and broadcast it once the coordinator releases it, while the next is
        gathered. Ranks other than 0 first wait for the coordinator's start (and skip the update
        if it reports an error). Never raises; a sender's error reaches the coordinator at once
        (its next bucket "failed"), then the stream is drained (the stage's other ranks are inside
        the gathers)."""
        from sao_megatron.weight_sync import BucketSpec, WeightSync, prefetched

        rank = dist.get_rank()
        try:
            if rank != 0 and gate.started() is not None:
                return 0, 0, None  # rank 0 reports it
        except Exception as err:  # the store is gone with rank 0
            return 0, 0, f"waiting for the coordinator's start: {type(err).__name__}: {err}"
        bucket_bytes = self.cfg.rollout.weight_sync_bucket_mb << 20
        flat = self.cfg.rollout.weight_sync_flat
        sender = rank == stream.sender
        plan = stream.bucket_plan(bucket_bytes)[stream.stage] if sender else []
        nbytes = tensors = declared = 0  # declared: buckets this sender said it holds
        error: str | None = None
        stopped = not sender  # a sender sends until an error or the coordinator's stop

        def fail(reason: str) -> None:
            nonlocal error
            error = reason
            if declared < len(plan):  # the coordinator waits for that bucket's word
                try:
                    gate.failed(stream.stage, declared, f"trainer rank {rank} (stage {stream.stage}): {reason}")
                except Exception as err:  # the store is gone with rank 0: the final all-gather fails too
                    error += f"; telling the coordinator failed: {err}"

        if sender and self._sync is None:
            fail("no weight-sync group")
        try:
            buckets = stream.buckets(bucket_bytes)
            for k, bucket in enumerate(prefetched(buckets) if sender else buckets):
                if stopped or error is not None:
                    continue  # drained: the stage's other ranks are inside the gathers
                try:
                    got, planned = BucketSpec.of(bucket, flat), BucketSpec.planned(plan[k], flat)
                    if got != planned:  # a bug: the engines would be told the plan
                        fail(f"bucket {k} holds {got.names[:3]}..., planned {planned.names[:3]}...")
                        continue
                    gate.ready(stream.stage, k)
                    declared = k + 1
                    if not gate.wait(stream.stage, k):
                        stopped = True  # the coordinator reports why
                        continue
                    nbytes += cast(WeightSync, self._sync).send(bucket)
                    tensors += len(bucket)
                except Exception as err:  # a broadcast failed (an engine died) or the store is gone
                    fail(f"{type(err).__name__}: {err}")
        except Exception as err:  # a gather failed: the stream cannot be drained
            if error is None:
                fail(f"{type(err).__name__}: {err}")
        return nbytes, tensors, error

    def save(self, directory: str) -> None:
        checkpoint.save_role(self.role, Path(directory))

    def load(self, directory: str) -> None:
        checkpoint.load_role(self.role, Path(directory))
