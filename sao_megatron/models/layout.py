"""Move tensors between a sharded Megatron model and its single-rank ("full") layout.

The full layout is what a TP=PP=EP=1 model of the same config holds: parameter names with
global layer indices and global expert indices, and unsplit tensors. It is the pivot between
layouts: checkpoints converted from HF are full tensors sliced per rank (:func:`shard`), and
weight export / parity checks gather shards back (:func:`gather_full`).

Sharding rules (Megatron-Core local and TE specs):

- TP: parameters with ``tensor_model_parallel=True`` are split along ``partition_dim`` over the
  TP group (the expert-TP group for expert parameters). SwiGLU ``linear_fc1`` holds
  ``[gate_r; up_r]`` on rank r, so the full tensor is ``[gate; up]``, not the plain concat.
- EP: ``...experts.local_experts.{i}`` on expert-parallel rank e is global expert
  ``e * num_local_experts + i``.
- PP: ``decoder.layers.{i}`` on a stage is global layer ``layer.layer_number - 1``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

_LAYER_RE = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_EXPERT_RE = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT_RE = re.compile(r"^(.*\.experts\.linear_fc[12]\.weight)(\d+)()$")  # TE grouped GEMM


def _groups():
    from megatron.core import parallel_state as ps

    return ps


def pipeline_rank() -> int:
    """This rank's pipeline stage."""
    return _groups().get_pipeline_model_parallel_rank()


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def is_glu_fc1(name: str) -> bool:
    return "linear_fc1.weight" in name


def global_name(model: torch.nn.Module, local_name: str) -> str:
    """Local parameter name on this rank -> name in the full (single-rank) layout."""
    ps = _groups()
    name = local_name
    match = _LAYER_RE.match(name)
    if match:
        layers = unwrap(model).decoder.layers
        layer_number = layers[int(match.group(2))].layer_number
        name = f"{match.group(1)}{layer_number - 1}{match.group(3)}"
    match = _EXPERT_RE.match(name) or _GROUPED_EXPERT_RE.match(name)
    if match:
        num_local = _num_local_experts(model, local_name)
        expert = ps.get_expert_model_parallel_rank() * num_local + int(match.group(2))
        name = f"{match.group(1)}{expert}{match.group(3)}"
    return name


def unwrap(model: torch.nn.Module) -> Any:
    """The model inside its wrappers (DDP, ``Float16Module``): a Megatron ``GPTModel`` whose
    submodules (``decoder.layers``, ``mlp.experts``...) are only known at run time, hence ``Any``."""
    inner: Any = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def named_weights(module: torch.nn.Module):
    """``named_parameters()`` plus the buffers that are model weights: the MoE routers' expert
    bias (``...mlp.router.expert_bias``, aux-loss-free balancing), which Megatron keeps as a
    buffer and moves itself during training. Loading, export, weight sync and checks walk this,
    so the bias travels wherever the router's weight does."""
    yield from module.named_parameters()
    for name, buffer in module.named_buffers():
        if name.endswith(".router.expert_bias"):
            yield name, buffer


def _num_local_experts(model: torch.nn.Module, local_name: str) -> int:
    match = _LAYER_RE.match(local_name)
    assert match is not None, f"expert parameter '{local_name}' is not inside a decoder layer"
    layer = unwrap(model).decoder.layers[int(match.group(2))]
    return layer.mlp.experts.num_local_experts  # SequentialMLP and TEGroupedMLP alike


def _tp_group_of(name: str) -> dist.ProcessGroup:
    ps = _groups()
    if is_expert_param(name):
        group = ps.get_expert_tensor_parallel_group()
    else:
        group = ps.get_tensor_model_parallel_group()
    # parallel_state's getters are unannotated: pyright infers new_group's non-member sentinel and
    # None, but an initialised parallel_state only keeps groups this rank belongs to.
    return cast(dist.ProcessGroup, group)


def _is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


_EXPERT_WEIGHT_RE = re.compile(r"\.experts\..*linear_fc[12]\.weight\d*$")


def check_expert_tp_attributes(model: torch.nn.Module, expert_tensor_parallel: int) -> None:
    """With expert TP > 1 every expert weight is split over the expert-TP group, and what reads
    shards (:func:`shard`, :func:`gather_full`, the HF export and weight sync) learns that from
    Megatron's ``tensor_model_parallel`` and ``partition_dim`` attributes on the tensor. A weight
    without them (layer implementations that do not set them, e.g. possibly Transformer Engine's
    grouped GEMM) would pass as replicated: export and sync would write one rank's slice as the
    whole tensor. Raise, naming it, instead."""
    if expert_tensor_parallel <= 1:
        return
    for name, param in unwrap(model).named_parameters():
        if _EXPERT_WEIGHT_RE.search(name) and not (_is_tp_sharded(param) and hasattr(param, "partition_dim")):
            raise RuntimeError(
                f"expert weight {name!r} lacks Megatron's tensor_model_parallel/partition_dim attributes, but "
                f"parallel.expert_tensor_parallel={expert_tensor_parallel} splits it; export and weight sync "
                "would take one rank's slice for the whole tensor. Set expert_tensor_parallel=1 for this "
                "layer implementation"
            )


def partition_dim(param: torch.Tensor) -> int:
    """The dimension a TP-sharded parameter is split along (set by Megatron on the tensor)."""
    return int(param.partition_dim)  # pyright: ignore[reportAttributeAccessIssue]  # Megatron's runtime attribute


def shard(full: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's slice of a full tensor, shaped like ``param``."""
    if not _is_tp_sharded(param):
        return full
    group = _tp_group_of(name)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = partition_dim(param)
    if is_glu_fc1(name) and dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def _gather_tp(tensor: torch.Tensor, param: torch.Tensor, name: str, to_first: bool = False) -> torch.Tensor | None:
    """The full tensor of ``param`` from this rank's shard ``tensor``, gathered over its TP group on
    ``tensor``'s own device (NCCL gathers only GPU tensors). ``to_first``: only the group's first
    rank receives it; the others get None."""
    if not _is_tp_sharded(param):
        return tensor
    group = _tp_group_of(name)
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    if to_first:
        first = dist.get_global_rank(group, 0)
        parts = [torch.empty_like(tensor) for _ in range(size)] if dist.get_rank() == first else None
        dist.gather(tensor, parts, dst=first, group=group)
        if parts is None:
            return None
    else:
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor, group=group)
    dim = partition_dim(param)
    if is_glu_fc1(name) and dim == 0:
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(parts, dim=dim)


def _gather_objects(obj, group, to_first: bool = False) -> list:
    """``obj`` of every rank of ``group``; ``to_first``: on the group's first rank only (empty elsewhere)."""
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    if to_first:
        first = dist.get_global_rank(group, 0)
        out: list | None = [None] * size if dist.get_rank() == first else None
        dist.gather_object(obj, out, dst=first, group=group)
        return out or []
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_full(
    model: torch.nn.Module,
    select: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    rank0_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Full-layout CPU tensors on every rank: parameters and expert biases (:func:`named_weights`)
    by default, or ``select(param)`` (e.g. grads; None skips the tensor, e.g. a buffer's).

    Collective over the model's whole world; meant for tests, checks and small models. The
    streaming, bucketed export for large models lives with the HF bridge. Shards are gathered on
    their own device, then copied to CPU one tensor at a time.

    ``rank0_only``: only global rank 0 receives the full copy (the others return ``{}``), and only
    the ranks holding the parts it needs take part: data- and context-parallel replica 0 (expert
    data-parallel replica 0 for experts) gathers over TP to TP rank 0, experts over EP and stages
    over PP to rank 0. Megatron orders ranks TP first, so a stage's first rank is TP, CP, DP,
    expert-TP, EP and expert-DP rank 0 alike: it receives its stage's experts and sends the stage.
    """
    ps = _groups()
    select = select or (lambda p: p.detach())
    dense_copy = experts_copy = stage_sender = True
    if rank0_only:
        dense_copy = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        experts_copy = ps.get_expert_data_parallel_rank() == 0
        stage_sender = dense_copy and ps.get_tensor_model_parallel_rank() == 0
    local: dict[str, torch.Tensor] = {}
    expert_local: dict[str, torch.Tensor] = {}
    for name, param in named_weights(unwrap(model)):
        expert = is_expert_param(name)
        if not (experts_copy if expert else dense_copy):
            continue  # another replica's copy of what replica 0 sends
        tensor = select(param)
        if tensor is None:
            continue
        full = _gather_tp(tensor.detach(), param, name, rank0_only)
        if full is not None:
            (expert_local if expert else local)[global_name(model, name)] = full.cpu()
    if experts_copy and (not rank0_only or ps.get_expert_tensor_parallel_rank() == 0):
        for part in _gather_objects(expert_local, ps.get_expert_model_parallel_group(), rank0_only):
            local.update(part)
    merged: dict[str, torch.Tensor] = {}
    if stage_sender:
        for part in _gather_objects(local, ps.get_pipeline_model_parallel_group(), rank0_only):
            merged.update(part)
    return merged if not rank0_only or dist.get_rank() == 0 else {}


def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
    """Copy this rank's slices of ``full`` into ``model``'s parameters. Returns the names loaded."""
    loaded = []
    with torch.no_grad():
        for name, param in named_weights(unwrap(model)):
            key = global_name(model, name)
            if key not in full:
                if strict:
                    raise KeyError(f"full state has no tensor '{key}' (local '{name}')")
                continue
            piece = shard(full[key], param, name)
            if piece.shape != param.shape:
                raise ValueError(f"'{key}': slice {tuple(piece.shape)} does not fit parameter {tuple(param.shape)}")
            param.copy_(piece)
            loaded.append(name)
    return loaded
