"""Worker body for the exact metric reductions: ActorWorker.update's metrics vs algo on the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sao_megatron import algo
from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX
from sao_megatron.batch import assemble_rows, build_batch
from sao_megatron.workers.actor import ActorWorker, kept_by_lag
from sao_megatron.workers.common import coordinates
from tests.workers.worker_cases import config, trajectories

VERSION = 2


def case_update_metrics_match_whole_batch(rank, world):
    """Rows 0-1 (the first micro-batch at one rank) have A > 0, rows 2-3 A < 0; token lags 0..2."""
    cfg = config(world)
    trajs = trajectories()
    for i, t in enumerate(trajs):
        t.policy_versions = [i % 3 if m else -1 for m in t.action_mask]
    batch = build_batch(trajs)
    actor = ActorWorker(cfg)
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
    _, want = algo.policy_loss(
        a.policy_loss,
        logprobs,
        batch.behavior_logprobs,
        adv,
        mask,
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        num_tokens_global=float(mask.sum()),
    )
    lag = algo.policy_lag(VERSION, batch.policy_versions, batch.action_mask)
    kept = algo.dis_band(logprobs, batch.behavior_logprobs, a.eps_low, a.eps_high)
    want |= kept_by_lag(kept, lag, adv, mask)
    want = {k: v for k, v in want.items() if not k.endswith(WEIGHT_SUFFIX)}
    return {"got": got, "want": want}
