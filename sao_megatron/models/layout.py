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


def _gather_tp(tensor: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    if not _is_tp_sharded(param):
        return tensor
    group = _tp_group_of(name)
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    dim = partition_dim(param)
    if is_glu_fc1(name) and dim == 0:
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(parts, dim=dim)


def _gather_objects(obj, group) -> list:
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_full(
    model: torch.nn.Module, select: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None
) -> dict[str, torch.Tensor]:
    """Full-layout tensors on every rank: parameters by default, or ``select(param)`` (e.g. grads).

    Collective over the model's whole world; meant for tests, checks and small models. The
    streaming, bucketed export for large models lives with the HF bridge.
    """
    ps = _groups()
    select = select or (lambda p: p.detach())
    local: dict[str, torch.Tensor] = {}
    expert_local: dict[str, torch.Tensor] = {}
    for name, param in unwrap(model).named_parameters():
        tensor = select(param)
        if tensor is None:
            continue
        full = _gather_tp(tensor.detach().cpu(), param, name)
        (expert_local if is_expert_param(name) else local)[global_name(model, name)] = full
    for part in _gather_objects(expert_local, ps.get_expert_model_parallel_group()):
        local.update(part)
    merged: dict[str, torch.Tensor] = {}
    for part in _gather_objects(local, ps.get_pipeline_model_parallel_group()):
        merged.update(part)
    return merged


def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
    """Copy this rank's slices of ``full`` into ``model``'s parameters. Returns the names loaded."""
    loaded = []
    with torch.no_grad():
        for name, param in unwrap(model).named_parameters():
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
