"""The plan's vocabulary shared by the HF weight stream (:mod:`sao_megatron.models.hf_stream`) and its
fan-out (:mod:`sao_megatron.models.hf_fanout`): a tensor's TP split, a planned tensor, which tensors
an engine fuses on load, the stream's order and its buckets."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from sao_megatron.models import hf_io


@dataclass(frozen=True)
class _TP:
    size: int
    rank: int
    dim: int | None
    glu: bool


def _local_shape(full: tuple[int, ...], tp: _TP) -> tuple[int, ...]:
    if tp.dim is None:
        return full
    return tuple(s // tp.size if d == tp.dim else s for d, s in enumerate(full))


@dataclass(frozen=True)
class _Item:
    """One Megatron full-layout tensor and where its TP shards live (global ranks)."""

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    tp: _TP  # size, dim and glu; rank unused
    sources: tuple[tuple[int, tuple[int, ...]], ...]  # per TP rank: (global rank, local shape)
    dst: int  # the global rank that receives it whole (its writer)
    stage: int  # the pipeline stage that holds it (0 when not gathered per stage)

    @property
    def nbytes(self) -> int:
        return hf_io._numel(self.full_shape) * self.dtype.itemsize


_ENGINE_FUSED = {"self_attention.linear_kv_down_proj.weight": "self_attention.linear_q_down_proj.weight"}
"""Megatron per-layer tensors an engine fuses on load, each to the set's lead tensor: they travel
next to each other and in one bucket (:func:`_load_unit`). Each bucket of a weight sync is one
``/update_weights_from_distributed``, i.e. one ``load_weights`` call of SGLang's model class, and a
loader that holds a tensor until its partner arrives in the same call drops it otherwise, leaving
the engine's previous (at start, ``--load-format dummy``: random) weights. SGLang's loaders, read
for every family we sync (sglang 0.5.x as installed):

- DeepSeek-V3 / Kimi-K2 (``deepseek_common/deepseek_weight_loader.py``): ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` (Megatron ``linear_q_down_proj``, ``linear_kv_down_proj``) are cached in a
  dict of the call (``cached_a_proj``) and written as ``fused_qkv_a_proj_with_mqa`` only once both
  are there (whenever ``q_lora_rank`` is set). The set listed here. (Its other per-call cache,
  ``pending_indexer_wk``, is DeepSeek-V3.2's indexer, a model we do not map.)
- Qwen3-MoE (``qwen3_moe.py``), Mixtral (``mixtral.py``), GLM-4.5 (``glm4_moe.py``): none. Their
  fused parameters (``qkv_proj``, ``gate_up_proj``, the experts' ``w13_weight`` / ``w2_weight``) are
  written shard by shard as each HF tensor arrives (``weight_loader(param, w, shard_id)``), in any
  call. DeepSeek's experts and shared experts load the same way; its ``post_load_weights`` splits
  ``kv_b_proj`` into ``w_kc`` / ``w_vc`` for the layers whose ``kv_b_proj`` came in that call, one
  tensor.
"""


def _load_unit(name: str) -> str:
    """The Megatron tensor whose place and bucket ``name`` shares: its fused set's lead, else itself."""
    for member, lead in _ENGINE_FUSED.items():
        if name.endswith("." + member):
            return name.removesuffix(member) + lead
    return name


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _order_key(name: str):
    """Embedding, layers in order, final norm, output layer; a fused set's members next to its lead."""
    unit = _load_unit(name)
    group = (
        0
        if unit.startswith("embedding.")
        else 2
        if unit.startswith("decoder.final")
        else 3
        if unit.startswith("output_layer")
        else 1
    )
    return group, _natural(unit), _natural(name)


def _buckets[T](parts: list[T], bucket_bytes: int, name=lambda p: p.name, nbytes=lambda p: p.nbytes) -> list[list[T]]:
    """Consecutive groups of at most ``bucket_bytes`` of ``parts`` (items, or a fan-out writer's units,
    named by their first item), never splitting a run of one load unit (:func:`_load_unit`); a larger
    unit goes alone."""
    units: list[list[T]] = []
    for part in parts:
        if units and _load_unit(name(part)) == _load_unit(name(units[-1][-1])):
            units[-1].append(part)
        else:
            units.append([part])
    groups: list[list[T]] = []
    size = 0
    for unit in units:
        unit_bytes = sum(nbytes(part) for part in unit)
        if not groups or (groups[-1] and size + unit_bytes > bucket_bytes):
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += unit_bytes
    return groups
