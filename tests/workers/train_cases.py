"""Worker bodies for DDP/optimizer, frozen-critic and checkpoint-reshard tests (spawned gloo ranks)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from sao_megatron.batch import MicroBatch
from sao_megatron.config import ActorConfig, CriticConfig, OptimizerConfig, ParallelConfig
from sao_megatron.models import layout
from sao_megatron.models.builder import build_gpt
from sao_megatron.models.logprobs import vocab_parallel_logprobs
from sao_megatron.parallel import initialize_model_parallel, seed_everything
from sao_megatron.workers import checkpoint
from sao_megatron.workers.role import build_actor_role, build_critic_role
from tests.models.parallel_cases import SEQ, batch, gathered_logits, tiny_model_config, tp_group


def _setup(p: ParallelConfig):
    initialize_model_parallel(p)
    seed_everything(1234)


def _micro_batches(seed: int, n: int = 2) -> list[MicroBatch]:
    return [MicroBatch.of_tokens(*batch(seed * 100 + i)) for i in range(n)]


def _nll(output, micro: MicroBatch, n_micro: int, dp: int):
    logprobs, _ = vocab_parallel_logprobs(output, micro.labels, tp_group())
    loss = -logprobs.mean() / (n_micro * dp)  # normalised by the global batch
    return loss, {"nll": loss.detach().item() * n_micro * dp}


def _replica_checksum(model) -> float:
    return sum(p.double().sum().item() for n, p in model.named_parameters() if not layout.is_expert_param(n))


def case_ddp(rank, world, distributed_optimizer: bool):
    """DP=2 actor: the loss falls over steps and both replicas stay identical."""
    p = ParallelConfig(world_size=world, use_distributed_optimizer=distributed_optimizer)
    _setup(p)
    actor = ActorConfig(parallel=p, optim=OptimizerConfig(lr=1e-2, clip_grad=1.0))
    role = build_actor_role(tiny_model_config(), actor)
    micro = _micro_batches(seed=rank)  # different data per DP rank
    losses, norms = [], []
    for _ in range(6):
        metrics = role.forward_backward(micro, lambda o, m: _nll(o, m, len(micro), world))
        result = role.step()
        losses.append(sum(x["nll"] for x in metrics) / len(micro))
        norms.append(result.grad_norm)
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, torch.tensor([_replica_checksum(role.module)], dtype=torch.float64))
    return {
        "losses": losses,
        "grad_norms": norms,
        "checksums": [s.item() for s in sums],
        "optimizer": sorted(
            {type(o).__name__ for o in getattr(role.optimizer, "chained_optimizers", [role.optimizer])}
        ),
    }


def case_frozen_critic(rank, world):
    """Critic (TP=2) from the actor's weights: attention frozen, experts/router/head train."""
    m = tiny_model_config()
    _setup(ParallelConfig(world_size=world))
    actor_state = layout.gather_full(build_gpt(m, ParallelConfig(world_size=world)))
    p = ParallelConfig(world_size=world, tensor_parallel=2)
    _setup(p)
    critic_cfg = CriticConfig(parallel=p, optim=OptimizerConfig(lr=2e-3))
    role = build_critic_role(m, critic_cfg, actor_state)
    before = {n: t.clone() for n, t in layout.gather_full(role.module).items()}
    trunk_equal = max((before[k] - actor_state[k]).abs().max().item() for k in before if not k.startswith("output"))
    micro = _micro_batches(seed=0)
    target = torch.linspace(-1, 1, SEQ).expand(2, SEQ)

    def value_loss(values, mb):
        loss = 0.5 * ((values.squeeze(-1) - target.to(values.device)) ** 2).mean() / len(micro)
        return loss, {"value_loss": loss.item() * len(micro)}

    losses = []
    for _ in range(5):
        metrics = role.forward_backward(micro, value_loss)
        role.step()
        losses.append(sum(x["value_loss"] for x in metrics) / len(micro))
    after = layout.gather_full(role.module)
    changed = {k: not torch.equal(before[k], after[k]) for k in after}
    frozen = [n for n, prm in role.module.named_parameters() if not prm.requires_grad]
    return {
        "trunk_equal": trunk_equal,
        "losses": losses,
        "attention_changed": [k for k, c in changed.items() if ".self_attention." in k and c],
        "experts_unchanged": [k for k, c in changed.items() if ".experts." in k and not c],
        "router_unchanged": [k for k, c in changed.items() if ".router." in k and not c],
        "head_changed": changed["output_layer.weight"],
        "n_frozen": len(frozen),
        "frozen_all_attention": all(".self_attention." in n for n in frozen),
    }


def case_checkpoint_reshard(rank, world, directory: str):
    """Save at TP=1 (DP=2), load into TP=2: same logits."""
    m = tiny_model_config()
    tokens, positions = batch(3)
    _setup(ParallelConfig(world_size=world))
    model = build_gpt(m, ParallelConfig(world_size=world))
    model.eval()
    reference = model(tokens, positions, attention_mask=None).detach()
    checkpoint.save_model(model, directory)
    p = ParallelConfig(world_size=world, tensor_parallel=2)
    _setup(p)
    seed_everything(999)  # a different initialisation that the load must overwrite
    resharded = build_gpt(m, p)
    resharded.eval()
    before = (gathered_logits(resharded(tokens, positions, attention_mask=None).detach()) - reference).abs().max()
    checkpoint.load_model(resharded, directory)
    after = (gathered_logits(resharded(tokens, positions, attention_mask=None).detach()) - reference).abs().max()
    return {"before": before.item(), "after": after.item()}


def case_never_stepped_role(rank, world, directory: str):
    """A critic saved before its optimizer's first step (an SFT-only run) and loaded into a fresh
    role: same weights, and the next step of both gives the same weights (the optimizer starts
    fresh in both, its main copies from the loaded weights)."""
    m = tiny_model_config()
    p = ParallelConfig(world_size=world, use_distributed_optimizer=True)
    _setup(p)
    critic_cfg = CriticConfig(parallel=p, optim=OptimizerConfig(lr=2e-3))
    original = build_critic_role(m, critic_cfg, layout.gather_full(build_gpt(m, p)))
    checkpoint.save_role(original, directory)
    seed_everything(999)
    loaded = build_critic_role(m, critic_cfg, layout.gather_full(build_gpt(m, p)))  # other weights
    pairs = list(zip(original.module.parameters(), loaded.module.parameters(), strict=True))
    differ_before = any(not torch.equal(a, b) for a, b in pairs)
    checkpoint.load_role(loaded, directory)
    equal_loaded = all(torch.equal(a, b) for a, b in pairs)
    micro = _micro_batches(seed=rank)
    target = torch.linspace(-1, 1, SEQ).expand(2, SEQ)

    def value_loss(values, mb):
        return 0.5 * ((values.squeeze(-1) - target.to(values.device)) ** 2).mean() / len(micro), {}

    before_step = [a.detach().clone() for a, _ in pairs]
    for role in (original, loaded):
        role.forward_backward(micro, value_loss)
        role.step()
    return {
        "differ_before": differ_before,
        "equal_loaded": equal_loaded,
        "step_diff": max((a - b).abs().max().item() for a, b in pairs),
        "moved": any(not torch.equal(a, b) for (a, _), b in zip(pairs, before_step, strict=True)),
    }


def _adam_steps(role) -> list[float]:
    """Every parameter's Adam step count (torch's Adam keeps one per parameter)."""
    inner = [o.optimizer for o in getattr(role.optimizer, "chained_optimizers", [role.optimizer])]
    return sorted({float(s["step"]) for o in inner for s in o.state.values() if "step" in s})


def case_resume_continues_the_optimizer(rank, world, directory: str, distributed_optimizer: bool):
    """A critic stepped 3 times, saved, loaded into a fresh role (other weights): the loaded Adam
    keeps the step count (its bias correction), so the next step of both gives the same weights."""
    m = tiny_model_config()
    p = ParallelConfig(world_size=world, use_distributed_optimizer=distributed_optimizer)
    _setup(p)
    critic_cfg = CriticConfig(parallel=p, optim=OptimizerConfig(lr=2e-3))
    original = build_critic_role(m, critic_cfg, layout.gather_full(build_gpt(m, p)))
    micro = _micro_batches(seed=rank)
    target = torch.linspace(-1, 1, SEQ).expand(2, SEQ)

    def value_loss(values, mb):
        return 0.5 * ((values.squeeze(-1) - target.to(values.device)) ** 2).mean() / len(micro), {}

    for _ in range(3):
        original.forward_backward(micro, value_loss)
        original.step()
    checkpoint.save_role(original, directory)
    seed_everything(999)
    loaded = build_critic_role(m, critic_cfg, layout.gather_full(build_gpt(m, p)))
    checkpoint.load_role(loaded, directory)
    steps = {"saved": _adam_steps(original), "loaded": _adam_steps(loaded)}
    for role in (original, loaded):
        role.forward_backward(micro, value_loss)
        role.step()
    pairs = zip(original.module.parameters(), loaded.module.parameters(), strict=True)
    return steps | {"step_diff": max((a - b).abs().max().item() for a, b in pairs)}


def case_all(rank, world, directory):
    return {
        "ddp_distopt": case_ddp(rank, world, True),
        "ddp_plain": case_ddp(rank, world, False),
        "critic": case_frozen_critic(rank, world),
        "ckpt": case_checkpoint_reshard(rank, world, directory),
        "never_stepped": case_never_stepped_role(rank, world, directory + "_never_stepped"),
        "resume_distopt": case_resume_continues_the_optimizer(rank, world, directory + "_resume_distopt", True),
        "resume_plain": case_resume_continues_the_optimizer(rank, world, directory + "_resume_plain", False),
    }


__all__ = ["case_all", "dataclasses"]
