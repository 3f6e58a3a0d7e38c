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
from sao_megatron.batch import TrainBatch


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
    """Weighted mean of each metric over the micro-batches (and DP ranks) that report it."""
    keys = sorted({k for m in per_micro for k in m})
    ps = _ps()
    if ps.get_data_parallel_world_size() > 1:  # ranks may report different keys: use the union
        everyone: list = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(everyone, keys, group=ps.get_data_parallel_group())
        keys = sorted({k for ks in everyone for k in ks})
    if not keys:
        return {}
    sums = torch.zeros(2, len(keys), dtype=torch.float64)  # [weighted sum; weight]
    for m, w in zip(per_micro, weights, strict=True):
        for i, k in enumerate(keys):
            if k in m:
                sums[0, i] += w * float(m[k])
                sums[1, i] += w
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
    return {k: (sums[0, i] / sums[1, i]).item() for i, k in enumerate(keys) if sums[1, i] > 0}


def _assemble_rows(
    collected: list[torch.Tensor], mine: TrainBatch, batch: TrainBatch, ps
) -> torch.Tensor | None:
    """Per-row outputs of every DP replica's last pipeline stage, assembled on global rank 0."""
    local = torch.zeros(mine.size, batch.tokens.shape[1])
    row = 0
    for v in collected:
        local[row : row + v.shape[0], : v.shape[1]] = v
        row += v.shape[0]
    parts: list = [None] * dist.get_world_size()
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


LAG_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, 1 << 30, "3+"))


def _kept_by_lag(logprobs, mb, mask, eps_low: float, eps_high: float) -> dict[str, float]:
    """Fraction of action tokens inside the DIS band, per token-lag bucket and advantage sign.

    Each value is a count-weighted fraction over this micro-batch; counts are reported too
    (``dis/tokens/lag{b}``) so that reductions can weight them."""
    rho = torch.exp(logprobs - mb["behavior_logprobs"])
    kept = (rho > 1 - eps_low) & (rho < 1 + eps_high)
    out = {}
    for lo, hi, name in LAG_BUCKETS:
        sel = mask & (mb["lag"] >= lo) & (mb["lag"] <= hi)
        n = int(sel.sum())
        out[f"dis/tokens/lag{name}"] = float(n)
        if n:
            out[f"dis/kept_frac/lag{name}"] = float((kept & sel).sum()) / n
        for sign, sel_sign in (("pos", mb["advantages"] > 0), ("neg", mb["advantages"] < 0)):
            both = sel & sel_sign
            if int(both.sum()):
                out[f"dis/kept_frac/lag{name}/adv_{sign}"] = float((kept & both).sum()) / int(both.sum())
    return out


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
        from sao_megatron.workers.engine import build_actor_role

        self.cfg = cfg
        initialize_model_parallel(cfg.actor.parallel)
        seed_everything(cfg.run.seed)
        self.role = build_actor_role(cfg.model, cfg.actor)

    def _logprobs(self, logits, mb):
        return vocab_parallel_logprobs(logits, mb["labels"], _ps().get_tensor_model_parallel_group(),
                                       temperature=self.cfg.rollout.temperature)  # fmt: skip

    def update(self, batch: TrainBatch, advantages: torch.Tensor, version: int = 0) -> dict[str, float]:
        """One optimizer step of the configured policy loss (DIS by default) on the whole batch.

        ``version`` is the policy version being trained; token lag = version - token's version,
        reported as ``dis/kept_frac/lag{0,1,2,3+}`` next to the algo metrics."""
        a = self.cfg.algo
        norm = _normaliser(a.loss_agg, batch)
        lag = (version - batch.policy_versions).clamp(min=0).float()
        mine, extras = _my_rows(batch, {"advantages": advantages, "lag": lag})
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
            metrics.update(_kept_by_lag(logprobs.detach(), mb, mask, a.eps_low, a.eps_high))
            return loss, metrics

        out = self.role.forward_backward(micro, loss_fn, seq_length=int(mine.lengths.max()))
        step = self.role.step()
        metrics = _reduce_metrics(out, [m["micro_tokens"] for m in out])
        metrics.pop("micro_tokens", None)
        return {**metrics, **step.group_norms, "grad_norm": step.grad_norm, "lr": step.lr,
                "updated": float(step.updated)}  # fmt: skip

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """``[B, T]`` logprobs of each position's label under the current policy, on global rank 0."""
        ps = _ps()
        mine, _ = _my_rows(batch, {})
        collected: list[torch.Tensor] = []

        def loss_fn(logits, mb):
            logprobs, _ = self._logprobs(logits, mb)
            collected.append(logprobs.float())
            return logits.sum() * 0.0, {}

        micro = _micro(mine, {}, self.cfg.actor.parallel.micro_batch_size)
        self.role.forward_backward(micro, loss_fn, seq_length=int(mine.lengths.max()), forward_only=True)
        return _assemble_rows(collected, mine, batch, ps)

    def set_lr(self, lr: float) -> None:
        """Switch the constant learning rate (SFT uses ``train.sft_lr``, RL ``actor.optim.lr``)."""
        sched = self.role.scheduler
        sched.init_lr = sched.max_lr = lr
        sched.min_lr = min(sched.min_lr, lr)
        for group in self.role.optimizer.param_groups:  # Megatron groups carry their own max/min lr
            group["lr"] = group["max_lr"] = lr
            group["min_lr"] = min(group.get("min_lr", lr), lr)

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

    def export_hf(self, out_dir: str, overwrite: bool = True) -> dict:
        """Collective: write the policy as an HF checkpoint (weights, config, tokenizer) for engines."""
        import shutil

        from sao_megatron.models.hf_weights import save_hf_checkpoint
        from sao_megatron.tokenizer import TOKENIZER_DIR

        stats = save_hf_checkpoint(self.role.module, self.cfg.model, out_dir, overwrite=overwrite)
        if dist.get_rank() == 0:
            for path in TOKENIZER_DIR.iterdir():
                shutil.copy(path, Path(out_dir) / path.name)
        return {"tensors": stats.tensors, "bytes": stats.bytes, "seconds": stats.seconds}

    def sync_weights(self, engine_urls: list[str], version: int, master_port: int,
                     master_address: str = "127.0.0.1") -> dict:  # fmt: skip
        """Collective: stream HF-named weights to the engines (rank 0 broadcasts), tagged ``version``."""
        import asyncio

        from sao_megatron.models.hf_weights import iter_hf_weights
        from sao_megatron.weight_sync import WeightSync

        r = self.cfg.rollout
        buckets = iter_hf_weights(
            self.role.module, self.cfg.model, bucket_bytes=r.weight_sync_bucket_mb << 20
        )
        if dist.get_rank() != 0:
            for _ in buckets:
                pass
            return {}
        if getattr(self, "_sync", None) is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            self._sync = WeightSync(engine_urls, engine_tp=r.tensor_parallel, backend=backend,
                                    master_address=master_address, master_port=master_port)  # fmt: skip
            asyncio.run(self._sync.connect())
        report = asyncio.run(self._sync.update(buckets, version))
        return {
            "sync_s": report.seconds,
            "sync_gb_per_s": report.gb_per_s,
            "sync_tensors": float(report.tensors),
        }

    def full_state(self) -> dict[str, torch.Tensor]:
        from sao_megatron.models import layout

        return layout.gather_full(self.role.module)

    def save(self, directory: str) -> None:
        from sao_megatron.workers import checkpoint

        checkpoint.save_role(self.role, Path(directory))

    def load(self, directory: str) -> None:
        from sao_megatron.workers import checkpoint

        checkpoint.load_role(self.role, Path(directory))


class CriticWorker:
    """The value model on this rank."""

    def __init__(self, cfg: SAOConfig, actor_state: dict | None = None):
        from sao_megatron.parallel import initialize_model_parallel, seed_everything
        from sao_megatron.workers.engine import build_critic_role

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
        return _assemble_rows(collected, mine, batch, ps)

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
        return {**metrics, **step.group_norms, "grad_norm": step.grad_norm, "lr": step.lr}

    def save(self, directory: str) -> None:
        from sao_megatron.workers import checkpoint

        checkpoint.save_role(self.role, Path(directory))

    def load(self, directory: str) -> None:
        from sao_megatron.workers import checkpoint

        checkpoint.load_role(self.role, Path(directory))
