"""Worker body: the policy-loss corrections and the MoE router settings in real actor steps (1 rank)."""

from __future__ import annotations

import dataclasses

import torch

from sao_megatron import algo
from sao_megatron.algo.corrections import sequence_mask, truncated_is
from sao_megatron.batch import assemble_rows, build_batch
from sao_megatron.config.rank import ActorRankConfig
from sao_megatron.models import layout
from sao_megatron.workers.actor import ActorWorker
from tests.workers.worker_cases import config, trajectories

ROUTER = ".mlp.router.weight"


def _with(actor: ActorWorker, algo_keys: dict | None = None, actor_keys: dict | None = None) -> None:
    """Switch ``actor.cfg.algo`` / ``actor.cfg.actor`` fields in place (as the loss sweep does)."""
    c = actor.cfg
    actor.cfg = dataclasses.replace(
        c,
        algo=dataclasses.replace(c.algo, **(algo_keys or {})),
        actor=dataclasses.replace(c.actor, **(actor_keys or {})),
    )


def _step(actor, shard, adv, algo_keys=None, actor_keys=None) -> dict[str, float]:
    base = actor.cfg
    _with(actor, algo_keys, actor_keys)
    try:
        return actor.update(shard, shard.take(adv), 0)
    finally:
        actor.cfg = base


def _whole_batch(loss, logprobs, batch, adv, mask, **corrections) -> dict[str, float]:
    """``algo.policy_objective`` on the whole batch at the weights the steps start from."""
    ent = torch.zeros_like(logprobs)
    lag = torch.zeros_like(mask, dtype=torch.long)
    n = float(mask.sum())
    _, m = algo.policy_objective(
        logprobs, ent, batch.behavior_logprobs, adv, mask, lag, loss=loss, eps_low=0.3, eps_high=5.0,
        detach_ratio=True, agg="token_mean", num_tokens_global=n, num_seqs_global=float(batch.size), **corrections,
    )  # fmt: skip
    return m


def case_corrections(rank, world):
    """lr 0 (weights fixed) so every step starts from the same policy: rows 2 and 3 get behavior logprobs
    one nat below / above the policy's (geometric-mean ratio e and 1/e), rows 0-1 within 0.05."""
    cfg = config(world)
    batch = build_batch(trajectories())
    actor = ActorWorker(ActorRankConfig.of(cfg))
    actor.set_lr(0.0)
    shard = batch.shard(1)[0]
    t = batch.tokens.shape[1]
    logprobs = assemble_rows([actor.logprobs(shard)], batch.size, t)
    mask = batch.action_mask > 0
    noise = torch.linspace(-0.05, 0.05, t)[None, :]
    offset = torch.tensor([0.0, 0.0, -1.0, 1.0])[:, None]
    batch.behavior_logprobs = torch.where(mask, logprobs + noise + offset, torch.zeros(()))
    shard = batch.shard(1)[0]
    adv = torch.where(mask, torch.linspace(-1, 1, t).expand(batch.size, t), torch.zeros(()))
    drop = torch.tensor([1.0, 1.0, 0.0, 0.0])[:, None]
    band = {"seq_mask_low": 0.5, "seq_mask_high": 2.0}
    out = {
        "plain": _step(actor, shard, adv),
        "seq_mask": _step(actor, shard, adv, band),
        "rows_zeroed": _step(actor, shard, adv * drop),  # plain DIS without rows 2-3's advantages
        "want_seq_mask": _whole_batch("dis", logprobs, batch, adv, mask, **band),
        "keep": sequence_mask(logprobs, batch.behavior_logprobs, mask, low=0.5, high=2.0)[0].tolist(),
    }
    # truncated IS on vanilla: the step with weights min(rho, C) folded into the advantages by hand
    cap = 1.5
    w, _ = truncated_is(logprobs, batch.behavior_logprobs, mask, cap=cap, loss_has_ratio=False)
    out["vanilla"] = _step(actor, shard, adv, {"policy_loss": "vanilla"})
    out["tis"] = _step(actor, shard, adv, {"policy_loss": "vanilla", "tis_cap": cap})
    out["weighted"] = _step(actor, shard, (adv * w).float(), {"policy_loss": "vanilla"})
    out["want_tis"] = _whole_batch("vanilla", logprobs, batch, adv, mask, tis_cap=cap)
    # sum_t |loss term| of each (the tests' tolerance): |weight * A * logprob| / N, weight <= 1 + eps_high
    rho = torch.exp(logprobs - batch.behavior_logprobs).double().clamp(max=6.0)
    terms = (adv * logprobs).abs().double() * mask / float(mask.sum())
    out["abs_seq"], out["abs_tis"] = float((rho * terms * drop).sum()), float((w * terms).sum())
    # the load-balancing loss: with A = 0 the policy loss has no gradient, so what is left is the aux loss's
    zero = torch.zeros_like(adv)
    out["aux_default"] = _step(actor, shard, zero)
    out["aux_on"] = _step(actor, shard, zero, actor_keys={"moe_aux_loss_coeff": 0.01})
    actor.sft_step(shard)
    out["coeff_after_sft"] = float(actor.role.config.moe_aux_loss_coeff)  # pyright: ignore[reportArgumentType]
    _step(actor, shard, zero)
    out["coeff_after_rl"] = float(actor.role.config.moe_aux_loss_coeff)  # pyright: ignore[reportArgumentType]
    return out


def case_all(rank, world):
    from megatron.core import parallel_state as ps

    out = {"corrections": case_corrections(rank, world)}
    ps.destroy_model_parallel()
    out["freeze_router"] = case_freeze_router(rank, world)
    return out


def case_freeze_router(rank, world):
    """One step at lr 1e-3 with the routers trainable, then a fresh actor with ``actor.freeze_router``."""
    from megatron.core import parallel_state as ps

    batch = build_batch(trajectories())
    shard = batch.shard(1)[0]
    mask = batch.action_mask > 0
    adv = torch.where(mask, torch.linspace(-1, 1, batch.tokens.shape[1]).expand_as(mask), torch.zeros(()))
    out = {}
    for frozen in (False, True):
        cfg = config(world, **{"actor.freeze_router": str(frozen).lower()})
        actor = ActorWorker(ActorRankConfig.of(cfg))
        actor.set_lr(1e-3)
        before = {k: v.clone() for k, v in layout.gather_full(actor.role.module).items()}
        m = actor.update(shard, shard.take(adv), 0)
        after = layout.gather_full(actor.role.module)
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        routers = {k for k in before if k.endswith(ROUTER)}
        out["frozen" if frozen else "trainable"] = {
            "updated": m["updated"],
            "routers": len(routers),
            "routers_changed": len(routers & changed),
            "others_changed": len(changed - routers),
            "others": len(set(before) - routers),
        }
        ps.destroy_model_parallel()
    return out
