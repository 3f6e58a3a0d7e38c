"""Measured per-rank memory of one real training step, for comparison with :mod:`sao_megatron.plan.memory`.

:func:`measure_role_step` builds a role exactly as a run does (:func:`build_actor_role` /
:func:`build_critic_role`, the configured layout), runs one step (forward, backward over the given
micro-batches, optimizer step) so the optimizer's state exists, then measures a second step. On a GPU
the figure is ``torch.cuda.max_memory_allocated`` over that step less what the process held before the
role was built (``held_before``); elsewhere :class:`PeakTracker`: a
dispatch mode that follows every tensor created inside it by its storage, so the figures are tensor
bytes, not RSS (torch's ``MemTracker`` does the same but its module hooks call ``module.buffers()``,
which Megatron's DDP wrapper replaces by a list). The memory that exists before the step (weights,
the DDP gradient buffers, the optimizer's state) is counted from the tensors themselves and
registered with the tracker first, so in-place updates of it are not new memory.

Used by ``tests/test_plan_measured.py`` (CPU) and the GPU check's ``memory`` section.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sao_megatron.batch import MicroBatch
from sao_megatron.config import SAOConfig


class PeakTracker(TorchDispatchMode):
    """Live bytes of the storages it knows (registered with :meth:`track`, or created by an op inside
    the mode) and their peak; a storage counts once however many views it has, and leaves when freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in self.live:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)

    def live_bytes_of(self, *tensors: torch.Tensor) -> int:
        """Bytes of the (tracked) storages of ``tensors``, each storage once."""
        keys = {t.untyped_storage().data_ptr() for t in tensors}
        return sum(self.live.get(k, 0) for k in keys)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(*(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
        return out


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    out = []
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        for state in torch_opt.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        # Megatron's mixed-precision optimizers keep fp32 main copies beside the model's params
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            out += list(group)
        for group in getattr(opt, "fp32_from_float16_groups", []) or []:
            out += list(group)
    return out


def _grad_buffers(model) -> list[torch.Tensor]:
    from sao_megatron.workers.role import param_and_grad_buffers

    return [buffer.grad_data for buffer in param_and_grad_buffers(model)]


def _micro_batch(vocab: int, rows: int, tokens: int, segments: int, g: torch.Generator) -> MicroBatch:
    """``[rows, tokens]`` random tokens; ``segments`` > 1: one packed row of that many equal sequences."""
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    if segments <= 1:
        return MicroBatch.of_tokens(ids)
    length = tokens // segments
    seg = torch.arange(tokens) // length
    positions = (torch.arange(tokens) % length).unsqueeze(0)
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    return dataclasses.replace(MicroBatch.of_tokens(ids, positions), segment_ids=seg.unsqueeze(0), cu_seqlens=cu)


def measure_role_step(
    rank: int, world: int, cfg: SAOConfig, role: str, micro_shapes: list[tuple[int, int, int]]
) -> dict:
    """This rank's memory (bytes) for one ``role`` (``actor`` or ``critic``) step over micro-batches of
    ``(rows, tokens, segments)`` (``segments`` > 1: one packed row). Collective over the role's world."""
    from megatron.core import parallel_state as ps

    from sao_megatron.models.logprobs import vocab_parallel_logprobs
    from sao_megatron.parallel import initialize_model_parallel, seed_everything
    from sao_megatron.workers.role import build_actor_role, build_critic_role

    rc = getattr(cfg, role)
    # what this process held before the role (another role's leftovers, a caller's tensors): on a GPU
    # the allocator's peak counts it, the CPU tracker never does, so it is reported and left out
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    initialize_model_parallel(rc.parallel)
    seed_everything(cfg.run.seed)
    built = build_actor_role(cfg.model, cfg.actor) if role == "actor" else build_critic_role(cfg.model, cfg.critic)
    g = torch.Generator().manual_seed(rank)
    micro = [_micro_batch(cfg.model.vocab_size, *shape, g) for shape in micro_shapes]

    def actor_loss(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, _ = vocab_parallel_logprobs(logits, mb.labels, ps.get_tensor_model_parallel_group())
        return -logprobs.mean() / len(micro), {}

    def critic_loss(values: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return values.float().square().mean() / len(micro), {}

    loss_fn = actor_loss if role == "actor" else critic_loss
    built.forward_backward(micro, loss_fn)
    built.step()
    module = built.module
    weights = _storage_bytes(p for p in module.parameters())
    grads = _storage_bytes(_grad_buffers(built.model))
    optimizer = _storage_bytes(_optimizer_state(built.optimizer))
    device = next(module.parameters()).device

    def tracked_step() -> int:
        tracker = PeakTracker()
        tracker.track(*module.parameters(), *_grad_buffers(built.model), *_optimizer_state(built.optimizer))
        with tracker:
            built.forward_backward(micro, loss_fn)
            built.step()
        return tracker.peak

    extra = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        built.forward_backward(micro, loss_fn)
        built.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        extra["tensor_bytes"] = tracked_step()  # the CPU's measure on the GPU: allocator overhead apart
    else:
        peak = tracked_step()
    built.close()
    return {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
        "total": peak,
        "beyond_state": peak - weights - grads - optimizer,
        "held_before": before,
        **extra,
    }
