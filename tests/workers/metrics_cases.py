"""Worker body for the exact metric reductions: ActorWorker.update's metrics vs algo on the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sao_megatron import algo
from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX
from sao_megatron.batch import assemble_rows, build_batch
from sao_megatron.config.rank import ActorRankConfig
from sao_megatron.workers.actor import ActorWorker
from sao_megatron.workers.rank import coordinates
from tests.workers.worker_cases import config, trajectories

VERSION = 2


def case_update_metrics_match_whole_batch(rank, world):
    """Rows 0-1 (the first micro-batch at one rank) have A > 0, rows 2-3 A < 0; token lags 0..2."""
    cfg = config(world)
    trajs = trajectories()
    for i, t in enumerate(trajs):
        t.policy_versions = [i % 3 if m else -1 for m in t.action_mask]
    batch = build_batch(trajs)
    actor = ActorWorker(ActorRankConfig.of(cfg))
    c = coordinates()
    shard = batch.shard(c.dp_size)[c.dp_rank]
    mask = batch.action_mask > 0
    sign = torch.tensor([1.0, 1.0, -1.0, -1.0])[:, None]
    ramp = torch.linspace(0.5, 1.5, batch.tokens.shape[1])[None, :]
    adv = torch.where(mask, sign * ramp, torch.zeros(()))
    parts: list = [None] * world
    dist.all_gather_object(parts, actor.logprobs(shard))  # the weights the update starts from
    logprobs = assemble_rows(parts, batch.size, batch.tokens.shape[1])
    got = actor.update(shard, shard.take(adv), VERSION)

    a = cfg.algo

    def whole_batch_loss(rows):
        return algo.policy_loss(
            a.policy_loss,
            logprobs[rows],
            batch.behavior_logprobs[rows],
            adv[rows],
            mask[rows],
            eps_low=a.eps_low,
            eps_high=a.eps_high,
            num_tokens_global=float(mask.sum()),
        )

    _, want = whole_batch_loss(slice(None))
    lag = algo.policy_lag(VERSION, batch.policy_versions, batch.action_mask)
    kept = algo.dis_band(logprobs, batch.behavior_logprobs, a.eps_low, a.eps_high)
    want |= algo.kept_by_lag(kept, lag, adv, mask)
    want = {k: v for k, v in want.items() if not k.endswith(WEIGHT_SUFFIX)}
    # For the tolerances (test_metrics_exact.exact_atol): each half holds one sign of A, and so one sign
    # of loss terms, so the halves' |loss| add up to the loss's sum |terms|; the metrics' operands per token.
    loss_abs_sum = sum(abs(whole_batch_loss(rows)[1]["loss"]) for rows in (slice(0, 2), slice(2, 4)))
    bound = operand_bound(logprobs, batch.behavior_logprobs, mask)
    return {"got": got, "want": want, "n": int(mask.sum()), "loss_abs_sum": loss_abs_sum, "bound": bound}


def operand_bound(logprobs, behavior_logprobs, mask) -> float:
    """Largest per-token ``rho (1 + |log rho|) + 1 + |log rho|``: the magnitudes of the operands of every
    policy metric's per-token term add up to at most this (``kl_k3_rev = rho log rho - rho + 1``)."""
    lr = (logprobs - behavior_logprobs).double()[mask]
    return float((lr.exp() * (1 + lr.abs()) + 1 + lr.abs()).max())
