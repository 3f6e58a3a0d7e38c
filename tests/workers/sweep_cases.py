"""Worker body for the loss sweep: every policy loss x advantage estimator, one real actor step each."""

from __future__ import annotations

import dataclasses
import math

import torch

from sao_megatron import algo
from sao_megatron.algo.choices import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS, POLICY_LOSSES
from sao_megatron.batch import assemble_rows, build_batch
from sao_megatron.config.rank import ActorRankConfig, CriticRankConfig
from sao_megatron.driver.estimator import AdvantageEstimator
from sao_megatron.workers.actor import ActorWorker
from sao_megatron.workers.critic import CriticWorker
from tests.workers.worker_cases import config, trajectories


def case_every_loss_and_estimator(rank, world):
    """One 1-rank world: critic values once, then for each (estimator, loss) advantages from
    :class:`AdvantageEstimator` and one :meth:`ActorWorker.update` with ``cfg.algo`` switched in place."""
    from megatron.core import parallel_state as ps

    base = config(world)
    trajs = trajectories()
    for i, t in enumerate(trajs):  # two groups of two with different rewards (grpo/rloo need G > 1)
        t.group_id = f"g{i // 2}"
        t.reward_details = {"group_index": i % 2}
    batch = build_batch(trajs)
    shard = batch.shard(1)[0]
    critic = CriticWorker(CriticRankConfig.of(base), "")  # a random trunk: only the plumbing is under test
    values = assemble_rows([critic.values(shard)], batch.size, batch.tokens.shape[1])
    ps.destroy_model_parallel()
    actor = ActorWorker(ActorRankConfig.of(base))
    out = {}
    for estimator in ADVANTAGE_ESTIMATORS:
        group = 2 if estimator in GROUP_ESTIMATORS else 1
        a = dataclasses.replace(base.algo, advantage=estimator, group_size=group, batch_size=4)
        adv, returns, adv_metrics = AdvantageEstimator(a)(batch, values if algo.uses_critic(estimator) else None, trajs)
        assert (returns is not None) == algo.uses_critic(estimator), estimator
        for loss in POLICY_LOSSES:
            actor.cfg = dataclasses.replace(actor.cfg, algo=dataclasses.replace(a, policy_loss=loss))
            m = actor.update(shard, shard.take(adv), 0)
            out[f"{estimator}/{loss}"] = {
                "updated": m["updated"],
                "loss": m["loss"],
                "grad_norm": m["grad_norm"],
                "adv_finite": bool(torch.isfinite(adv).all()),
                "adv_nonzero": bool(adv.abs().sum() > 0),
                "metrics_finite": all(math.isfinite(v) for v in {**m, **adv_metrics}.values()),
            }
    # algo.over_lag=mask: the tokens (all sampled by version 0) within the bound at version 2, past it at 9
    a = dataclasses.replace(base.algo, advantage="gae", over_lag="mask", max_policy_lag=4)
    adv, _, _ = AdvantageEstimator(a)(batch, values, trajs)
    actor.cfg = dataclasses.replace(actor.cfg, algo=a)
    for version in (2, 9):
        m = actor.update(shard, shard.take(adv), version)
        out[f"mask/v{version}"] = {"stale_masked": m["stale_masked"], "loss": m["loss"], "updated": m["updated"]}
    return out
