"""Worker bodies for the parallel-equivalence tests (run inside spawned gloo ranks).

Each case builds a single-rank reference model (TP=PP=EP=1) in the same world, copies its
weights into the parallel layout under test with ``layout.load_full`` and compares logits and
gradients (gathered back with ``layout.gather_full``) in float32.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from sao_megatron.config import ParallelConfig, load_config
from sao_megatron.models import layout
from sao_megatron.models.builder import build_gpt
from sao_megatron.models.logprobs import vocab_parallel_logprobs
from sao_megatron.parallel import initialize_model_parallel, seed_everything

SEQ = 32


def tiny_model_config(num_layers: int = 2):
    cfg = load_config()
    return dataclasses.replace(cfg.model, num_layers=num_layers)


def batch(seed: int, b: int = 2, s: int = SEQ, vocab: int = 512):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    positions = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    return tokens, positions


def setup(world: int, **layout_kw) -> ParallelConfig:
    p = ParallelConfig(world_size=world, use_distributed_optimizer=False, **layout_kw)
    initialize_model_parallel(p)
    seed_everything(1234)
    return p


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def lm_loss(model, tokens, positions):
    """Mean negative logprob of the next token; logits stay vocab-parallel."""
    logits = model(tokens, positions, attention_mask=None)  # [B, T, V/tp]
    labels = torch.roll(tokens, -1, dims=1)
    logprobs, _ = vocab_parallel_logprobs(logits, labels, tp_group())
    return -logprobs.mean(), logits


def gathered_logits(logits):
    group = tp_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def reference(m, world: int, tokens, positions):
    """Single-rank model: (full weights, logits, loss, full grads)."""
    p = setup(world)
    model = build_gpt(m, p)
    loss, logits = lm_loss(model, tokens, positions)
    loss.backward()
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    return layout.gather_full(model), logits.detach(), loss.item(), grads


def reduce_partial_grads(model):
    """Sum the partial gradients Megatron DDP would reduce when every rank sees one replica's data.

    With SP, replicated params (norms, router) hold the grad of their sequence shard; with
    TP > 1 and expert-TP = 1, each TP rank runs the experts on its own tokens only, so expert
    grads are partial over the expert-data-parallel group (DDP sums them and divides by DP).
    """
    from megatron.core import parallel_state as ps

    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if layout.is_expert_param(name):
            dist.all_reduce(param.grad, group=ps.get_expert_data_parallel_group())
            param.grad /= ps.get_data_parallel_world_size()
        elif getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=tp_group())


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k in a:
        d = (a[k] - b[k]).abs().max().item()
        if d > worst:
            worst, where = d, k
    return worst, where


def rank0_only_agrees(model, everywhere: dict, select=None) -> bool:
    """``gather_full(rank0_only=True)`` holds on rank 0 exactly what every rank gathers without it
    (``everywhere``), and nothing elsewhere."""
    only = layout.gather_full(model, select=select, rank0_only=True)
    if dist.get_rank() != 0:
        return only == {}
    return set(only) == set(everywhere) and all(torch.equal(only[k], everywhere[k]) for k in everywhere)


def case_tp(rank, world):
    m = tiny_model_config()
    tokens, positions = batch(0)
    full, ref_logits, ref_loss, ref_grads = reference(m, world, tokens, positions)
    setup(world, tensor_parallel=2)
    model = build_gpt(m, ParallelConfig(world_size=world, tensor_parallel=2))
    layout.load_full(model, full)
    loss, logits = lm_loss(model, tokens, positions)
    loss.backward()
    reduce_partial_grads(model)
    grads = layout.gather_full(model, select=lambda p: p.grad)
    grad_diff, where = max_diff(grads, ref_grads)
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    return {
        "logits": (gathered_logits(logits.detach()) - ref_logits).abs().max().item(),
        "loss": abs(loss.item() - ref_loss),
        "grads": grad_diff,
        "worst_grad": where,
        "n_params": len(grads),
        "rank0_only": rank0_only_agrees(model, grads, select=lambda p: p.grad),
    }


def case_ep(rank, world, dispatcher):
    m = tiny_model_config()
    tokens, positions = batch(10 + rank)  # each EP rank is also a DP rank: its own data
    full, ref_logits, ref_loss, ref_grads = reference(m, world, tokens, positions)
    p = ParallelConfig(world_size=world, expert_parallel=2, moe_token_dispatcher=dispatcher)
    setup(world, expert_parallel=2)
    model = build_gpt(m, p)
    n_local = len(model.decoder.layers[0].mlp.experts.local_experts)
    layout.load_full(model, full)
    loss, logits = lm_loss(model, tokens, positions)
    loss.backward()
    grads = layout.gather_full(model, select=lambda p: p.grad)
    # An expert's gradient collects tokens from both ranks' batches: compare with the sum.
    expert_ref = {k: v.clone() for k, v in ref_grads.items() if layout.is_expert_param(k)}
    for v in expert_ref.values():
        dist.all_reduce(v)
    expert_diff, _ = max_diff({k: grads[k] for k in expert_ref}, expert_ref)
    dense_diff, _ = max_diff({k: grads[k] for k in ref_grads if k not in expert_ref}, ref_grads)
    return {
        "local_experts": n_local,
        "logits": (logits.detach() - ref_logits).abs().max().item(),
        "expert_grads": expert_diff,
        "dense_grads": dense_diff,
        "rank0_only": rank0_only_agrees(model, grads, select=lambda p: p.grad),
    }


def case_pp(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    m = tiny_model_config()
    n_micro, mbs = 2, 2
    tokens, positions = batch(0, b=n_micro * mbs)
    p1 = setup(world)
    ref = build_gpt(m, p1)
    full = layout.gather_full(ref)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n_micro))
    ref_loss = 0.0
    for i in range(n_micro):
        sl = slice(i * mbs, (i + 1) * mbs)
        loss, _ = lm_loss(ref, tokens[sl], positions[sl])
        (loss / n_micro).backward()
        ref_loss += loss.item() / n_micro
    ref_grads = {k: v.grad.clone() for k, v in ref.named_parameters()}
    MoEAuxLossAutoScaler.main_loss_backward_scale = None

    setup(world, pipeline_parallel=2)
    model = build_gpt(m, ParallelConfig(world_size=world, pipeline_parallel=2))
    layout.load_full(model, full)
    micro = iter([(tokens[i * mbs : (i + 1) * mbs], positions[i * mbs : (i + 1) * mbs]) for i in range(n_micro)])

    def forward_step(data_iterator, model):
        t, pos = next(data_iterator)
        output = model(t, pos, attention_mask=None)

        def loss_func(logits):
            logprobs, _ = vocab_parallel_logprobs(logits, torch.roll(t, -1, dims=1), tp_group())
            loss = -logprobs.mean()
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=micro,
        model=[model],
        num_microbatches=n_micro,
        seq_length=SEQ,
        micro_batch_size=mbs,
        forward_only=False,
    )
    grads = layout.gather_full(model, select=lambda p: p.grad)
    grad_diff, where = max_diff(grads, ref_grads)
    out = {
        "grads": grad_diff,
        "worst_grad": where,
        "stage": ps.get_pipeline_model_parallel_rank(),
        "n_params": len(grads),
        "rank0_only": rank0_only_agrees(model, grads, select=lambda p: p.grad),
    }
    if ps.is_pipeline_last_stage():
        out["loss"] = abs(sum(x["loss"].item() for x in losses) / n_micro - ref_loss)
    return out
