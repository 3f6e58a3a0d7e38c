"""The HF weight stream of a sharded Megatron model: full HF tensors gathered to their writers.

:class:`HFWeightStream` plans, once per model, which rank receives every tensor whole (its
*writer*) and from which ranks its TP shards come, then moves them bucket by bucket:

- one writer (``dst``): every tensor goes to global rank ``dst`` (``iter_hf_weights``);
- one writer per pipeline stage (``per_stage``, the parallel weight sync): the stage's lowest
  global rank; stages run independently of each other;
- many writers (``spread``, the HF export): every tensor is written by one of the ranks that
  hold a shard of it, the least loaded so far; its other TP shards come from that rank's own
  TP group. With TP = 1 (PP / EP / DP layouts) nothing moves between ranks at all.

The schedule is a list of *steps*, one per bucket of a writer (a writer's k-th bucket of at most
``bucket_bytes``; tensors an engine fuses on load, :data:`_ENGINE_FUSED`, share one), ordered
``(k, writer)``; every rank of the stream walks the same steps in the same order and posts its
point-to-point operations of a step only there, so the operations of every pair of ranks are posted
in the same order at both ends (NCCL runs a pair's operations on one stream, in order; gloo matches
them in order). At its step a writer receives its bucket's shards, then acknowledges the step to
every rank that sent to it. A sender posts a step's sends and the receive of that step's
acknowledgement together, and before posting more waits for its oldest acknowledgements while its
unacknowledged bytes would exceed ``inflight_bytes`` (one step's bytes always go out): a sender
never runs ahead of the writers by more than that. On NCCL an acknowledgement is waited for by
reading it on the host (``.item()``), which waits for the transfer itself, not only for its launch.

Deadlock-free: a rank waits only for (a) acknowledgements of earlier steps, whose writers have
passed them, since every rank passed them; (b) the shards of its own current step, whose senders
reach that step by (a). Collectives of the stream's group are the caller's (none inside).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sao_megatron.config import ModelConfig
from sao_megatron.models import hf_bridge as bridge
from sao_megatron.models import hf_io, layout
from sao_megatron.models.hf_io import TensorSpec

DEFAULT_BUCKET_BYTES = 512 << 20
DEFAULT_INFLIGHT_BYTES = 2 * DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class _TP:
    size: int
    rank: int
    dim: int | None
    glu: bool


def _tp(param: torch.Tensor, local_name: str) -> tuple[_TP, tuple[int, ...]]:
    """How ``param`` is split over TP, and the global ranks of its TP group in group-rank order."""
    if not layout._is_tp_sharded(param):
        return _TP(1, 0, None, False), (dist.get_rank(),)
    group = layout._tp_group_of(local_name)
    size, rank, dim = dist.get_world_size(group), dist.get_rank(group), layout.partition_dim(param)
    ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
    return _TP(size, rank, dim if size > 1 else None, layout.is_glu_fc1(local_name) and dim == 0), ranks


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


@dataclass(frozen=True)
class _Step:
    """One bucket of one writer: the unit of the schedule and of acknowledgements."""

    writer: int
    items: tuple[_Item, ...]


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


def _buckets(items: list[_Item], bucket_bytes: int) -> list[list[_Item]]:
    """Consecutive groups of at most ``bucket_bytes``, never splitting a run of one load unit
    (:func:`_load_unit`); a larger unit goes alone."""
    units: list[list[_Item]] = []
    for item in items:
        if units and _load_unit(item.name) == _load_unit(units[-1][-1].name):
            units[-1].append(item)
        else:
            units.append([item])
    groups: list[list[_Item]] = []
    size = 0
    for unit in units:
        nbytes = sum(item.nbytes for item in unit)
        if not groups or (groups[-1] and size + nbytes > bucket_bytes):
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += nbytes
    return groups


class _SendWindow:
    """A sender's unacknowledged steps: their bytes, tensors (kept alive) and acknowledgement receives."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bytes = 0
        self._open: deque = deque()  # (step index, bytes, ack tensor, ack work, send works, tensors)

    def make_room(self, nbytes: int) -> None:
        while self._open and self.bytes + nbytes > self.limit:
            self._close_oldest()

    def add(self, index: int, nbytes: int, ack: torch.Tensor, ack_work, works: list, tensors: list) -> None:
        self._open.append((index, nbytes, ack, ack_work, works, tensors))
        self.bytes += nbytes

    def drain(self) -> None:
        while self._open:
            self._close_oldest()

    def _close_oldest(self) -> None:
        index, nbytes, ack, ack_work, works, _ = self._open.popleft()
        ack_work.wait()
        for work in works:
            work.wait()
        got = int(ack.item())  # on the host: on NCCL this waits for the transfer itself
        if got != index + 1:
            raise RuntimeError(f"HF weight stream: step {index} acknowledged as step {got - 1}; the plans differ")
        self.bytes -= nbytes


class HFWeightStream:
    """Collective plan of the HF weight stream of ``model`` (see the module docstring).

    ``specs`` lists every HF tensor (name, shape, dtype) in plan order, on every rank, before any
    tensor moves. Build the stream once (one ``all_gather_object`` of names over the default
    group) and call :meth:`buckets` at every transfer: it sends the parameters' current values.

    ``per_stage``: every pipeline stage gathers its own tensors to its own sender
    (:attr:`senders`, the stage's lowest global rank), without waiting for the other stages;
    :meth:`buckets` then yields this rank's stage only, and :meth:`bucket_plan` tells every rank
    every stage's buckets. ``spread``: many writers (:meth:`writer_specs`). ``group``: the
    process group the point-to-point transfers use (all ranks, global ranks; default the default
    group), so that they can run in a thread of their own while the caller uses the default group.
    ``inflight_bytes``: a sender's unacknowledged bytes before it waits (one step always goes).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        m: ModelConfig,
        dst: int = 0,
        dtype: torch.dtype | None = None,
        per_stage: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        spread: bool = False,
        inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
    ):
        if per_stage and spread:
            raise ValueError("HFWeightStream: per_stage and spread exclude each other")
        self.model, self.m, self.dst, self.rank = model, m, dst, dist.get_rank()
        self.group, self.spread, self.inflight_bytes = group, spread, inflight_bytes
        self._params: dict[tuple[str, int], torch.Tensor] = {}
        meta = []
        for local, param in layout.named_weights(layout.unwrap(model)):  # parameters and expert biases
            name = layout.global_name(model, local)
            if not bridge.is_exported(name, m):
                continue
            tp, tp_ranks = _tp(param, local)
            self._params[(name, tp.rank)] = param
            meta.append((name, tp.size, tp.rank, tp.dim, tp.glu, tuple(param.shape), str(param.dtype), tp_ranks))
        params = list(self._params.values())
        self.device = params[0].device if params else torch.device("cpu")  # NCCL moves GPU tensors
        stage = layout.pipeline_rank() if per_stage else 0
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (stage, meta), group=group)
        stages = [s for s, _ in everyone]
        self.stage = stage
        self.senders = [
            min(r for r, s in enumerate(stages) if s == k) if per_stage else dst for k in range(max(stages) + 1)
        ]
        self.items = self._plan(everyone)
        self.dtype = dtype
        self.specs = self._specs(self.items)
        self._bucket_plans: dict[int, list[list[list[TensorSpec]]]] = {}
        self._steps: dict[int, list[_Step]] = {}

    @property
    def sender(self) -> int:
        """The global rank that receives this rank's stage's tensors (``dst`` unless ``per_stage``)."""
        return self.senders[self.stage]

    @property
    def writers(self) -> list[int]:
        """The global ranks that receive tensors, ascending."""
        return sorted({item.dst for item in self.items})

    def _plan(self, everyone: list) -> list[_Item]:
        found: dict[str, dict] = {}
        for rank, (stage, meta) in enumerate(everyone):
            for name, size, tp_rank, dim, glu, shape, dtype, tp_ranks in meta:
                entry = found.setdefault(
                    name, {"tp": _TP(size, 0, dim, glu), "dtype": dtype, "holders": {}, "stage": stage}
                )
                if stage != entry["stage"]:  # held by two stages: the first one sends it
                    if stage > entry["stage"]:
                        continue
                    entry.update(stage=stage, holders={})
                entry["holders"][rank] = (tp_rank, tuple(shape), tuple(tp_ranks))
        produced = {hf for name in found for hf in bridge.hf_names(name, self.m)}
        missing = [n for n in bridge.expected_hf_names(self.m) if n not in produced]
        if missing:
            raise ValueError(
                f"no rank holds the source of HF tensors {missing[:3]}; is the model built from this config?"
            )
        load: dict[int, int] = {}  # spread: bytes each writer got so far
        items = []
        for name in sorted(found, key=_order_key):
            entry = found[name]
            tp: _TP = entry["tp"]
            holders: dict[int, tuple] = entry["holders"]
            held = sorted({tp_rank for tp_rank, _, _ in holders.values()})
            if held != list(range(tp.size)):
                raise ValueError(f"'{name}': TP shards {held} of {tp.size} found")
            dtype = getattr(torch, entry["dtype"].split(".")[-1])
            full = bridge.full_shape(name, self.m)
            nbytes = hf_io._numel(full) * dtype.itemsize
            if self.spread:
                dst = min(holders, key=lambda r: (load.get(r, 0), r))
                load[dst] = load.get(dst, 0) + nbytes
                group = holders[dst][2]  # the writer's TP group holds every other shard
                if any(r not in holders or holders[r][0] != t for t, r in enumerate(group)):
                    raise ValueError(f"'{name}': rank {dst}'s TP group {list(group)} does not hold its shards")
                sources = tuple((r, holders[r][1]) for r in group)
            else:
                dst = self.senders[entry["stage"]]
                best: dict[int, int] = {}  # per TP rank: the receiver itself, else the lowest rank
                for rank, (tp_rank, _, _) in holders.items():
                    if tp_rank not in best or rank == dst or (best[tp_rank] != dst and rank < best[tp_rank]):
                        best[tp_rank] = rank
                sources = tuple((best[t], holders[best[t]][1]) for t in range(tp.size))
            if _local_shape(full, tp) != tuple(sources[0][1]):
                raise ValueError(
                    f"'{name}': shard shape {list(sources[0][1])} does not fit the config's "
                    f"full shape {list(full)} over TP={tp.size}"
                )
            items.append(_Item(name, full, dtype, tp, sources, dst, entry["stage"]))
        return items

    def bucket_plan(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[list[TensorSpec]]]:
        """Per stage, its buckets' HF tensors (name, shape, dtype) in the order :meth:`buckets`
        yields them on that stage's sender; the same on every rank (one writer per stage)."""
        if bucket_bytes not in self._bucket_plans:  # the coordinator and its own sending both ask
            self._bucket_plans[bucket_bytes] = [
                [self._specs(group) for group in _buckets([i for i in self.items if i.stage == s], bucket_bytes)]
                for s in range(len(self.senders))
            ]
        return self._bucket_plans[bucket_bytes]

    def writer_specs(self, writer: int) -> list[TensorSpec]:
        """The HF tensors ``writer`` receives, in the order its buckets bring them; the same on every rank."""
        return self._specs([item for item in self.items if item.dst == writer])

    def _specs(self, items: list[_Item]) -> list[TensorSpec]:
        """The HF tensors (name, shape, dtype) of ``items``, in order."""
        return [
            TensorSpec(hf, bridge.hf_shape(hf, self.m), self._dtype_of(hf, item.dtype))
            for item in items
            for hf in bridge.hf_names(item.name, self.m)
        ]

    def _dtype_of(self, hf_name: str, source: torch.dtype) -> torch.dtype:
        """``dtype`` when given, else the source's; float32 for what HF keeps in float32 (the expert bias)."""
        return torch.float32 if bridge.keeps_float32(hf_name) else self.dtype or source

    def steps(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[_Step]:
        """This rank's schedule: every writer's buckets (this stage's with ``per_stage``), ``(k, writer)`` order."""
        if bucket_bytes not in self._steps:
            mine = [i for i in self.items if len(self.senders) == 1 or i.stage == self.stage]
            per_writer = {
                w: _buckets([i for i in mine if i.dst == w], bucket_bytes) for w in sorted({i.dst for i in mine})
            }
            rounds = max((len(b) for b in per_writer.values()), default=0)
            self._steps[bucket_bytes] = [
                _Step(w, tuple(b[k])) for k in range(rounds) for w, b in per_writer.items() if k < len(b)
            ]
        return self._steps[bucket_bytes]

    def buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """One entry per step of :meth:`steps`: on the step's writer the list of ``(hf_name,
        full_tensor)`` of its bucket (at most ``bucket_bytes`` of Megatron tensors, one larger tensor
        or fused set alone; a set the engine fuses on load is never split, :data:`_ENGINE_FUSED`), on
        every other rank an empty list. Every rank of the stream must exhaust it."""
        window = _SendWindow(self.inflight_bytes)
        acks: list[tuple[object, torch.Tensor]] = []  # this rank's acknowledgements being sent
        for index, step in enumerate(self.steps(bucket_bytes)):
            if self.rank == step.writer:
                yield self._receive(step, index, acks)
            else:
                self._send(step, index, window)
                yield []
        window.drain()
        for work, _ in acks:
            work.wait()  # pyright: ignore[reportAttributeAccessIssue]

    def _send(self, step: _Step, index: int, window: _SendWindow) -> None:
        mine = [
            (item, tp_rank) for item in step.items for tp_rank, (src, _) in enumerate(item.sources) if src == self.rank
        ]
        if not mine:
            return
        window.make_room(sum(hf_io._numel(item.sources[tp_rank][1]) * item.dtype.itemsize for item, tp_rank in mine))
        tensors = [self._params[(item.name, tp_rank)].detach().contiguous() for item, tp_rank in mine]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        works = [dist.isend(t, step.writer, group=self.group) for t in tensors]
        ack = torch.zeros(1, dtype=torch.int64, device=self.device)
        window.add(index, nbytes, ack, dist.irecv(ack, step.writer, group=self.group), works, tensors)

    def _receive(self, step: _Step, index: int, acks: list) -> list[tuple[str, torch.Tensor]]:
        works, received, senders = [], {}, set()
        for item in step.items:
            for tp_rank, (src, shape) in enumerate(item.sources):
                if src == self.rank:
                    received[(item.name, tp_rank)] = self._params[(item.name, tp_rank)].detach()
                else:
                    buf = torch.empty(shape, dtype=item.dtype, device=self.device)
                    works.append(dist.irecv(buf, src, group=self.group))
                    received[(item.name, tp_rank)] = buf
                    senders.add(src)
        for work in works:
            work.wait()
        for work, _ in acks:  # the previous step's: long done, their tensors can go
            work.wait()
        acks.clear()
        if senders:
            ack = torch.full((1,), index + 1, dtype=torch.int64, device=self.device)
            acks.extend((dist.isend(ack, src, group=self.group), ack) for src in sorted(senders))
        out = []
        for item in step.items:
            shards = [received[(item.name, r)] for r in range(item.tp.size)]
            full = _concat_tp(shards, item.tp)
            for hf, tensor in bridge.to_hf(item.name, full, self.m):
                out.append((hf, tensor.to(self._dtype_of(hf, tensor.dtype))))
        return out


def _concat_tp(shards: list[torch.Tensor], tp: _TP) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    if tp.glu:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    assert tp.dim is not None, "several TP shards of a parameter that is not TP-sharded"
    return torch.cat(shards, dim=tp.dim)
