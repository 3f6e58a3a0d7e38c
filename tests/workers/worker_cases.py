"""Worker bodies: actor DIS update and critic values/update on real batches; role checkpoints."""

from __future__ import annotations

import dataclasses

import torch

from sao_megatron import algo
from sao_megatron.batch import assemble_rows, build_batch
from sao_megatron.config import load_config
from sao_megatron.config.rank import ActorRankConfig, CriticRankConfig
from sao_megatron.records import Trajectory, Turn
from sao_megatron.workers.actor import ActorWorker
from sao_megatron.workers.critic import CriticWorker
from sao_megatron.workers.rank import coordinates


def trajectories(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(6, 500, (5,), generator=g).tolist()
        a1 = torch.randint(6, 500, (4 + i,), generator=g).tolist()
        obs = torch.randint(6, 500, (3,), generator=g).tolist()
        a2 = torch.randint(6, 500, (3,), generator=g).tolist()
        resp = a1 + obs + a2
        mask = [1] * len(a1) + [0] * len(obs) + [1] * len(a2)
        out.append(
            Trajectory(
                prompt_id=f"p{i}",
                prompt_ids=prompt,
                response_ids=resp,
                action_mask=mask,
                behavior_logprobs=[-6.2 if m else 0.0 for m in mask],
                policy_versions=[0 if m else -1 for m in mask],
                turns=[Turn(0, len(a1)), Turn(len(a1) + 3, len(resp))],
                reward=float(i % 2),
                status="finished",
            )
        )
    return out


def config(world, **overrides):
    overrides = {
        "actor.parallel.world_size": world,
        "critic.parallel.world_size": world,
        "actor.parallel.micro_batch_size": 2,
        "critic.parallel.micro_batch_size": 2,
        **overrides,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=2))


def case_actor_critic(rank, world, ckpt_dir, tp):
    import torch.distributed as dist

    cfg = config(world, **{"actor.parallel.tensor_parallel": tp, "critic.parallel.tensor_parallel": tp})
    batch = build_batch(trajectories())
    actor = ActorWorker(ActorRankConfig.of(cfg))
    hf_dir = ckpt_dir + "/hf"
    actor.export_hf(hf_dir)  # the critic starts from the actor's weights, as ensure_critic does
    c = coordinates()
    shard = batch.shard(c.dp_size)[c.dp_rank]  # what the driver places for this rank's replica
    adv = torch.where(
        batch.action_mask > 0,
        torch.linspace(-1, 1, batch.tokens.shape[1]).expand_as(batch.action_mask),
        torch.zeros(()),
    )
    m1 = actor.update(shard, shard.take(adv), 0)
    actor.save(ckpt_dir + "/actor")
    m2 = actor.update(shard, shard.take(adv), 0)
    actor.load(ckpt_dir + "/actor")
    m3 = actor.update(shard, shard.take(adv), 0)  # after restore, the second step repeats exactly
    fresh = ActorWorker.__new__(ActorWorker)  # a new process's view: fresh role, no optimizer state
    fresh.cfg = ActorRankConfig.of(cfg)
    from sao_megatron.workers.role import build_actor_role

    fresh.role = build_actor_role(cfg.model, cfg.actor)
    fresh.load(ckpt_dir + "/actor")
    m4 = fresh.update(shard, shard.take(adv), 0)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    critic = CriticWorker(CriticRankConfig.of(cfg), hf_dir)
    c = coordinates()
    shard = batch.shard(c.dp_size)[c.dp_rank]
    mine = critic.values(shard)
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)  # the driver's view: every reporting rank's rows
    vals = assemble_rows(parts, batch.size, batch.tokens.shape[1])
    adv2, returns, _ = algo.gae(batch.rewards, vals, batch.action_mask > 0, gamma=1.0, lam=0.95)
    c1 = critic.update(shard, shard.take(returns), shard.take(vals))
    c2 = critic.update(shard, shard.take(returns), shard.take(vals))
    return {
        "actor": [m1, m2, m3, m4],
        "critic": [c1, c2],
        "values_zero": float(vals.abs().max()),
        "reports": mine is not None,
        "rows": mine.rows if mine is not None else None,
    }
