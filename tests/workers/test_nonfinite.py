"""A non-finite loss or gradient skips the optimizer step on every rank (weights and optimizer
state untouched; ``updated`` 0); the next finite batch trains normally (2-rank DP world)."""

import torch


def case_nan_update(rank, world):
    from sao_megatron.batch import build_batch
    from sao_megatron.config.rank import ActorRankConfig
    from sao_megatron.models import layout
    from sao_megatron.workers.actor import ActorWorker
    from sao_megatron.workers.rank import coordinates
    from tests.workers.worker_cases import config, trajectories

    actor = ActorWorker(ActorRankConfig.of(config(world)))
    batch = build_batch(trajectories())
    c = coordinates()
    shard = batch.shard(c.dp_size)[c.dp_rank]
    adv = batch.action_mask.clone()
    before = {k: v.clone() for k, v in layout.gather_full(actor.role.module).items()}
    bad = adv.clone()
    if rank == world - 1:  # one rank's loss alone is NaN: every rank must skip
        bad[shard.rows[0], batch.action_mask[shard.rows[0]] > 0] = float("nan")
    skipped = actor.update(shard, shard.take(bad), 0)
    unchanged = all(torch.equal(before[k], v) for k, v in layout.gather_full(actor.role.module).items())
    trained = actor.update(shard, shard.take(adv), 0)
    changed = any(not torch.equal(before[k], v) for k, v in layout.gather_full(actor.role.module).items())
    return {
        "skipped": skipped["updated"],
        "unchanged": unchanged,
        "trained": trained["updated"],
        "changed": changed,
    }


def test_a_nan_on_one_rank_skips_the_step_everywhere_then_training_continues(workers_world):
    """:func:`case_nan_update` runs in the package's spawned world (conftest.py)."""
    for r in (rank["nonfinite"] for rank in workers_world):
        assert r == {"skipped": 0.0, "unchanged": True, "trained": 1.0, "changed": True}, r
