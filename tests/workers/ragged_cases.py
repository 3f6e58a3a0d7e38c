"""Worker bodies for the layout matrix: actor and critic at a parallel layout vs one rank.

A ragged batch (sequence lengths 7, 12, 5, 9, optionally a fifth of 23 that makes the DP
shards unequal; one-token actions between observations; micro-batch size 2 unless a layout
sets a token budget) goes through the real workers. The reference layout is TP=PP=EP=1 with
every one of the N ranks holding the *whole* batch as its shard and N-fold global counts:
each rank's gradient is then exactly the single-rank gradient (the engine multiplies by
DP = N, the N-fold normaliser divides it back) and DDP averages N equal copies (see
:data:`COUNT_PARTS` for the metrics). The layout under test then starts from the reference's
weights (``layout.load_full``).

The actor replays a fixed random routing (``rollout.routing_replay: on``; every position but each
trajectory's last, which its routers route themselves, as in a run): the logprob pass and the update
route by it in every layout, and the logprobs are also taken without it (each layout's own routing),
so the replayed ones can be checked against the reference's and shown to differ from its own routing.

The MoE load-balancing loss is off (``moe_aux_loss_coeff`` 0): it counts padding tokens, and
the extra padding a layout needs (9 -> 10 tokens at TP=2) moves it (~4e-5 on the embedding
gradient at the default 0.001), which is not the layout path under test.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from sao_megatron import algo
from sao_megatron.batch import BatchShard, TrainBatch, assemble_rows, build_batch
from sao_megatron.config.rank import ActorRankConfig, CriticRankConfig
from sao_megatron.models import layout
from sao_megatron.records import Trajectory, Turn
from sao_megatron.routing import RouteShape
from sao_megatron.workers.actor import ActorWorker
from sao_megatron.workers.critic import CriticWorker
from sao_megatron.workers.rank import coordinates
from tests.workers.worker_cases import config

COUNT_PARTS = {"tokens", "num_tokens"}
"""Key parts of token counts, which ``reduce_metrics`` sums over DP: the reference's two
replicas of the whole batch count every token twice. Losses are summed too, but each replica
holds half the loss (doubled normaliser), so their sum is the whole-batch loss."""


def ragged_trajectories(long_row: bool = False) -> list[Trajectory]:
    """Lengths 7, 12, 5, 9 (and 23 with ``long_row``): (prompt, [(action tokens, observation
    tokens after it), ...])."""
    shapes = [(3, [(1, 2), (1, 0)]), (4, [(1, 2), (1, 2), (2, 0)]), (4, [(1, 0)]), (4, [(1, 2), (2, 0)])]
    if long_row:
        shapes.append((2, [(1, 3)] * 4 + [(3, 2)] * 1))
    g = torch.Generator().manual_seed(7)
    layers = len(SHAPE.moe_layers)
    out = []
    for i, (n_prompt, turns) in enumerate(shapes):
        prompt = torch.randint(6, 500, (n_prompt,), generator=g).tolist()
        resp, mask, spans = [], [], []
        for n_act, n_obs in turns:
            spans.append(Turn(len(resp), len(resp) + n_act))
            resp += torch.randint(6, 500, (n_act + n_obs,), generator=g).tolist()
            mask += [1] * n_act + [0] * n_obs
        behavior = (-3.0 - torch.rand(len(resp), generator=g) * 4).tolist()
        n = n_prompt + len(resp)
        routes = torch.stack([torch.randperm(SHAPE.num_experts, generator=g)[: SHAPE.topk] for _ in range(n * layers)])
        out.append(
            Trajectory(
                prompt_id=f"p{i}",
                prompt_ids=prompt,
                response_ids=resp,
                action_mask=mask,
                behavior_logprobs=[b if m else 0.0 for b, m in zip(behavior, mask, strict=True)],
                policy_versions=[0 if m else -1 for m in mask],
                turns=spans,
                reward=float(i % 2),
                status="finished",
                routes=routes.reshape(n, layers, SHAPE.topk).numpy().astype(SHAPE.dtype),
                routes_missing=[Turn(n - 1, n)],
            )
        )
    return out


SHAPE = RouteShape.of(config(1).model)
"""The tiny MoE's routes (every layer MoE)."""


def _shard(batch: TrainBatch, reference: bool) -> BatchShard:
    if not reference:
        c = coordinates()
        return batch.shard(c.dp_size)[c.dp_rank]
    whole, n = batch.shard(1)[0], dist.get_world_size()
    return BatchShard(batch, whole.rows, n * whole.num_tokens_global, n * whole.num_seqs_global)


def _metrics(m: dict[str, float], reference: bool) -> dict[str, float]:
    n = dist.get_world_size()
    return {k: v / n if reference and COUNT_PARTS & set(k.split("/")) else v for k, v in m.items()}


def _grads(role) -> dict[str, torch.Tensor]:
    """The reduced gradients of the last step (DDP's buffers; clipping is off in these configs)."""
    return _copy(layout.gather_full(role.module, select=lambda p: getattr(p, "main_grad", None)))


def _copy(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies (at TP=1 ``gather_full`` returns the live tensors themselves)."""
    return {k: v.clone() for k, v in full.items()}


def _gathered_rows(mine, batch: TrainBatch) -> torch.Tensor:
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return assemble_rows(parts, batch.size, batch.tokens.shape[1])


def _run(overrides: dict, batch: TrainBatch, reference: bool, start: dict | None) -> dict:
    from megatron.core import parallel_state as ps

    cfg = config(dist.get_world_size(), **overrides)
    adv = torch.where(
        batch.action_mask > 0,
        torch.linspace(-1, 1, batch.tokens.shape[1]).expand_as(batch.action_mask),
        torch.zeros(()),
    )
    actor = ActorWorker(ActorRankConfig.of(cfg))
    start = start or {}
    if "actor" in start:
        layout.load_full(actor.role.module, start["actor"])
    weights = {"actor": _copy(layout.gather_full(actor.role.module))}
    shard = _shard(batch, reference)
    logprobs = _gathered_rows(actor.logprobs(shard), batch)
    unrouted = replace(shard, batch=replace(shard.batch, routes=None, route_mask=None))
    own_logprobs = _gathered_rows(actor.logprobs(unrouted), batch)  # the routers' own routing
    m = actor.update(shard, shard.take(adv), 2)
    out = {
        "actor_metrics": _metrics(m, reference),
        "actor_grads": _grads(actor.role),
        "logprobs": logprobs,
        "own_logprobs": own_logprobs,
        "actor_reports": coordinates().reports,
    }
    ps.destroy_model_parallel()

    critic = CriticWorker(CriticRankConfig.of(cfg), "")
    if "critic" in start:
        layout.load_full(critic.role.module, start["critic"])
    weights["critic"] = _copy(layout.gather_full(critic.role.module))
    shard = _shard(batch, reference)
    values = _gathered_rows(critic.values(shard), batch)
    ref_values = start.get("values", values)  # the update's inputs: the reference's, in every layout
    _, returns, _ = algo.gae(batch.rewards, ref_values, batch.action_mask > 0, gamma=1.0, lam=0.95)
    c = critic.update(shard, shard.take(returns), shard.take(ref_values))
    out.update(
        critic_metrics=_metrics(c, reference),
        critic_grads=_grads(critic.role),
        values=values,
        critic_reports=coordinates().reports,
        weights=weights,
    )
    ps.destroy_model_parallel()
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference and the tensor that holds it."""
    assert set(a) == set(b), set(a) ^ set(b)
    return max(((a[k] - b[k]).abs().max().item(), k) for k in a)


COMMON = {
    "actor.optim.clip_grad": 1e6,
    "critic.optim.clip_grad": 1e6,
    "actor.parallel.use_distributed_optimizer": False,
    "critic.parallel.use_distributed_optimizer": False,
    "critic.value_head_init": "normal",
    "model.moe_aux_loss_coeff": 0.0,
    "rollout.routing_replay": "on",
}


def case_ragged(rank, world, layout_overrides: dict, long_row: bool = False, ref: dict | None = None):
    """One layout against the reference (``ref``: the reference's outputs on this batch, computed
    here when not given)."""
    common = COMMON
    batch = build_batch(ragged_trajectories(long_row))
    ref = ref or _run(common, batch, reference=True, start=None)
    start = {**ref["weights"], "values": ref["values"]}
    got = _run({**common, **layout_overrides}, batch, reference=False, start=start)
    result = {
        "lengths": batch.lengths.tolist(),
        "logprobs": ((got["logprobs"] - ref["logprobs"]) * batch.action_mask).abs().max().item(),
        "own_logprobs": ((got["own_logprobs"] - ref["own_logprobs"]) * batch.action_mask).abs().max().item(),
        "replay_effect": ((ref["logprobs"] - ref["own_logprobs"]) * batch.action_mask).abs().max().item(),
        "actor_grads": _max_diff(got["actor_grads"], ref["actor_grads"]),
        "actor_grad_scale": max(v.abs().max().item() for v in ref["actor_grads"].values()),
        "values": (got["values"] - ref["values"]).abs().max().item(),
        "values_scale": ref["values"].abs().max().item(),
        "critic_grads": _max_diff(got["critic_grads"], ref["critic_grads"]),
        "critic_grad_scale": max(v.abs().max().item() for v in ref["critic_grads"].values()),
        "actor_reports": got["actor_reports"],
        "critic_reports": got["critic_reports"],
    }
    for role in ("actor", "critic"):
        if got[f"{role}_reports"]:  # metrics live on the reporting rank (last stage, TP rank 0)
            mine, theirs = got[f"{role}_metrics"], ref[f"{role}_metrics"]
            result[f"{role}_metrics"] = {k: [mine[k], theirs.get(k)] for k in mine}
    return result


def case_layouts(rank, world, layouts: dict[str, tuple[dict, bool]]) -> dict[str, dict]:
    """:func:`case_ragged` for several layouts of one world size in one spawned world (one start
    instead of one per layout); ``layouts``: name -> (overrides, long_row). The reference run
    depends only on the batch, so it runs once per batch (with and without the 23-token row)."""
    refs = {
        long_row: _run(COMMON, build_batch(ragged_trajectories(long_row)), reference=True, start=None)
        for long_row in sorted({long_row for _, long_row in layouts.values()})
    }
    return {
        name: case_ragged(rank, world, overrides, long_row, refs[long_row])
        for name, (overrides, long_row) in layouts.items()
    }


def spoiled_routes(batch: TrainBatch) -> tuple[TrainBatch, TrainBatch]:
    """``batch`` with two known positions' routes unfit to replay in both MoE layers (row 1, position 3
    and row 2, position 1: one layer names an expert twice, the other expert ``num_experts``, outside
    the model), as routes stored before the rollout checked them would hold; and ``batch`` with those
    two positions masked instead (what the rollout records now). The router falls back per layer, so
    spoiling every layer of a position makes the two equal."""
    assert batch.routes is not None and batch.route_mask is not None
    routes, mask = batch.routes.clone(), batch.route_mask.clone()
    assert mask[1, 3] and mask[2, 1]
    assert len(SHAPE.moe_layers) == 2
    routes[1, 3, 0, 1], routes[1, 3, 1, 0] = routes[1, 3, 0, 0], SHAPE.num_experts
    routes[2, 1, 0, 0], routes[2, 1, 1, 1] = SHAPE.num_experts, routes[2, 1, 1, 0]
    mask[1, 3] = mask[2, 1] = False
    return replace(batch, routes=routes), replace(batch, route_mask=mask)


def case_replay_guards(rank, world) -> dict:
    """The replaying actor at EP2 (DP2), each run from the same weights: on :func:`spoiled_routes`'
    rows given as known (a repeat crashed Megatron's dispatcher here), and on the same rows masked;
    then the masked batch with selective recompute of the whole MoE layer (``recompute_modules``
    ``moe``, as ``builder.recompute_kwargs`` could choose), whose backward runs the routers again."""
    import contextlib
    from unittest import mock

    from megatron.core import parallel_state as ps

    from sao_megatron.models import builder

    batch = build_batch(ragged_trajectories())
    spoiled, masked = spoiled_routes(batch)
    adv = torch.where(
        batch.action_mask > 0,
        torch.linspace(-1, 1, batch.tokens.shape[1]).expand_as(batch.action_mask),
        torch.zeros(()),
    )
    cfg = config(world, **COMMON, **{"actor.parallel.expert_parallel": 2})

    def run(b: TrainBatch, start: dict | None, recompute_moe: bool = False) -> dict:
        moe = dict(recompute_granularity="selective", recompute_modules=["moe"])
        with (
            mock.patch.object(builder, "recompute_kwargs", lambda *_, **__: moe)
            if recompute_moe
            else contextlib.nullcontext()
        ):
            actor = ActorWorker(ActorRankConfig.of(cfg))
        if start is not None:
            layout.load_full(actor.role.module, start)
        weights = _copy(layout.gather_full(actor.role.module))
        shard = _shard(b, reference=False)
        rows, routing = actor.routed_logprobs(shard, replay=True)
        own, _ = actor.routed_logprobs(shard, replay=False)
        m = actor.update(shard, shard.take(adv), 2)
        out = {
            "weights": weights,
            "recompute": actor.role.module.config.recompute_granularity,
            "logprobs": _gathered_rows(rows, b),
            "own_logprobs": _gathered_rows(own, b),
            "routing": routing,
            "metrics": m,
            "grads": _grads(actor.role),
        }
        ps.destroy_model_parallel()
        return out

    plain = run(masked, None)
    bad = run(spoiled, plain["weights"])
    recomputed = run(masked, plain["weights"], recompute_moe=True)

    def logprob_diff(a: dict, b: dict, key: str = "logprobs") -> float:
        return ((a[key] - b[key]) * batch.action_mask).abs().max().item()

    return {
        "unfit_logprobs": logprob_diff(bad, plain),
        "unfit_grads": _max_diff(bad["grads"], plain["grads"]),
        "unfit_routing": [bad["routing"].get("routing/invalid"), plain["routing"].get("routing/invalid")],
        "unfit_update": [bad["metrics"].get("routing/invalid"), bad["metrics"]["loss"], bad["metrics"]["grad_norm"]],
        "known_tokens": int(batch.route_mask.sum()),
        "recompute": recomputed["recompute"],
        "recompute_logprobs": logprob_diff(recomputed, plain),
        "recompute_grads": _max_diff(recomputed["grads"], plain["grads"]),
        "replay_effect": logprob_diff(plain, plain | {"logprobs": plain["own_logprobs"]}),
        "grad_scale": max(v.abs().max().item() for v in plain["grads"].values()),
    }
