"""Foundation check run by ``sao train`` until the asynchronous SAO loop lands.

It is real, not a mock: each role is its own Megatron world (spawned processes with gloo on
CPU, NCCL on GPU) at its configured parallel layout. The actor takes one optimizer step on a
next-token loss over a fixed synthetic batch and saves its full-layout weights; the critic is
built from those weights (frozen attention), takes ``critic.updates_per_step`` steps of value
regression, and both report loss before/after, gradient norm and parameter counts.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sao_megatron.batch import MicroBatch
from sao_megatron.config import SAOConfig

SEQ = 64


def _batch(vocab: int, seed: int, micro_batch_size: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    return [MicroBatch.of_tokens(torch.randint(0, vocab, (micro_batch_size, SEQ), generator=g))]


def _actor_world(rank: int, world: int, cfg: SAOConfig, run_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    from sao_megatron.models import layout
    from sao_megatron.models.builder import count_parameters
    from sao_megatron.models.logprobs import vocab_parallel_logprobs
    from sao_megatron.parallel import initialize_model_parallel, seed_everything
    from sao_megatron.workers.role import build_actor_role

    initialize_model_parallel(cfg.actor.parallel)
    seed_everything(cfg.run.seed)
    role = build_actor_role(cfg.model, cfg.actor)
    micro = _batch(
        cfg.model.vocab_size, cfg.run.seed + ps.get_data_parallel_rank(), cfg.actor.parallel.micro_batch_size
    )
    dp = ps.get_data_parallel_world_size()

    def nll(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, _ = vocab_parallel_logprobs(logits, mb.labels, ps.get_tensor_model_parallel_group())
        loss = -logprobs.mean() / dp
        return loss, {"nll": loss.item() * dp}

    full = layout.gather_full(role.module, rank0_only=True)  # {} on other ranks: only rank 0 writes it
    if rank == 0:
        torch.save(full, Path(run_dir) / "actor_init_full.pt")
    t0 = time.perf_counter()
    before = role.forward_backward(micro, nll)
    step = role.step()
    after = role.forward_backward(micro, nll, forward_only=True)
    return {
        "nll_before": before[0]["nll"] if before else None,
        "nll_after": after[0]["nll"] if after else None,
        "grad_norm": step.grad_norm,
        "step_s": time.perf_counter() - t0,
        "params_on_rank": count_parameters(role.module),
    }


def _critic_world(rank: int, world: int, cfg: SAOConfig, run_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    from sao_megatron.models.builder import count_parameters
    from sao_megatron.parallel import initialize_model_parallel, seed_everything
    from sao_megatron.workers.role import build_critic_role

    initialize_model_parallel(cfg.critic.parallel)
    seed_everything(cfg.run.seed)
    actor_state = None
    if cfg.critic.init_from_actor:
        actor_state = torch.load(Path(run_dir) / "actor_init_full.pt", weights_only=True)
    role = build_critic_role(cfg.model, cfg.critic, actor_state)
    micro = _batch(cfg.model.vocab_size, cfg.run.seed, cfg.critic.parallel.micro_batch_size)
    dp = ps.get_data_parallel_world_size()

    def value_loss(values: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        returns = torch.linspace(0.0, 1.0, SEQ, device=values.device).expand_as(mb.tokens)
        loss = 0.5 * ((values.squeeze(-1).float() - returns) ** 2).mean() / dp
        return loss, {"value_loss": loss.item() * dp}

    losses, norms = [], []
    for _ in range(cfg.critic.updates_per_step):
        out = role.forward_backward(micro, value_loss)
        norms.append(role.step().grad_norm)
        losses.append(out[0]["value_loss"] if out else None)
    final = role.forward_backward(micro, value_loss, forward_only=True)
    return {
        "value_loss_before": losses[0],
        "value_loss_after": final[0]["value_loss"] if final else None,
        "grad_norms": norms,
        "params_on_rank": count_parameters(role.module),
    }


def _last(results: list[dict], key: str):
    """The value from the last pipeline stage (other stages report None)."""
    return next((r[key] for r in reversed(results) if r[key] is not None), None)


def run(cfg: SAOConfig, run_dir: Path) -> dict:
    """Run the actor world, then the critic world; returns rank-0 reports of both."""
    from sao_megatron.spawn import run_world

    backend = cfg.run.backend
    actor = run_world(_actor_world, cfg.actor.parallel.world_size, cfg, str(run_dir), backend=backend)
    critic = run_world(_critic_world, cfg.critic.parallel.world_size, cfg, str(run_dir), backend=backend)
    (run_dir / "actor_init_full.pt").unlink(missing_ok=True)
    return {
        "actor": {**actor[0], "nll_before": _last(actor, "nll_before"), "nll_after": _last(actor, "nll_after")},
        "critic": {
            **critic[0],
            "value_loss_before": _last(critic, "value_loss_before"),
            "value_loss_after": _last(critic, "value_loss_after"),
        },
    }
