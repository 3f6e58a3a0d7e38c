"""The HF weight stream of a sharded Megatron model: full HF tensors gathered to their writers.

:class:`HFWeightStream` plans, once per model, which rank receives every tensor whole (its
*writer*) and from which ranks its TP shards come, then moves them bucket by bucket:

- one writer (``dst``): every tensor goes to global rank ``dst`` (``iter_hf_weights``);
- one writer per pipeline stage (``per_stage``): the stage's lowest global rank; stages run
  independently of each other;
- many writers (``spread``, the HF export): every tensor is written by one of the ranks that
  hold a shard of it, the least loaded so far; its other TP shards come from that rank's own
  TP group. With TP = 1 (PP / EP / DP layouts) nothing moves between ranks at all.
- several senders per pipeline stage, gathering by collectives (``senders=n``, the weight sync):
  see :class:`_FanOut`. No point-to-point operation and no acknowledgement: each gather is one
  ``dist.gather`` over a small process group of its own (one communicator each, reused).

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

The fan-out walks its stage's steps the same way, ``(k, writer)``, each rank joining the gathers of
the groups it belongs to: the members of a group post its collectives in one order, and each gather
waits only for members that passed every earlier step. A consumer that holds a writer's bucket back
(the weight sync until its coordinator releases it) must release the buckets in the steps' order:
``weight_sync.sync_order`` interleaves the senders of a stage exactly so.

A rank posts a gather it does not receive (a *feed*) no earlier than its writer can consume it: it
keeps the feeds of at most ``feed_window`` of its steps outstanding, and before posting more waits
on the host (``Work.wait(timeout)``) until the oldest of those steps' feeds completed, that is until
their writer took part. Under NCCL a non-root ``dist.gather`` only enqueues, so without the window a
rank that only feeds would post every gather of the sync at once, and NCCL's watchdog times each
from its post: the last ones from the sync's start, while the writer reaches them only as its
consumer (the weight sync's coordinator, paced by the engines) releases its buckets. A sync longer
than the feed groups' timeout would then take those ranks down (``SIGABRT`` under
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) though every bucket was on time. With the window a feed's
clock starts at most ``feed_window`` of its rank's steps before its writer joins it, so the feed
groups' timeout bounds the writer's stall over those steps, not the whole sync. (Giving the feed
groups a timeout that covers the whole sync was the alternative; it would leave a rank waiting that
long for a writer that died.) Gloo blocks in every gather anyway: there the window changes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from sao_megatron.config import ModelConfig
from sao_megatron.models import hf_bridge as bridge
from sao_megatron.models import hf_io, layout
from sao_megatron.models.hf_fanout import _FanOut, _Gather, _Unit, _unit_buckets
from sao_megatron.models.hf_io import TensorSpec
from sao_megatron.models.hf_plan import (  # noqa: F401  (_buckets, _Item: the planners' names, read by tests)
    _TP,
    _buckets,
    _Item,
    _load_unit,
    _local_shape,
    _order_key,
)

DEFAULT_BUCKET_BYTES = 512 << 20
DEFAULT_INFLIGHT_BYTES = 2 * DEFAULT_BUCKET_BYTES
FEED_WINDOW = 2
"""A fan-out rank's steps whose feeds may be outstanding at once (module docstring): one more than
gloo's lock step, so that the next step's feeds are posted while the writer takes this one."""


def _tp(param: torch.Tensor, local_name: str) -> tuple[_TP, tuple[int, ...]]:
    """How ``param`` is split over TP, and the global ranks of its TP group in group-rank order."""
    if not layout._is_tp_sharded(param):
        return _TP(1, 0, None, False), (dist.get_rank(),)
    group = layout._tp_group_of(local_name)
    size, rank, dim = dist.get_world_size(group), dist.get_rank(group), layout.partition_dim(param)
    ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
    return _TP(size, rank, dim if size > 1 else None, layout.is_glu_fc1(local_name) and dim == 0), ranks


@dataclass(frozen=True)
class _Step:
    """One bucket of one writer: the unit of the schedule and of acknowledgements."""

    writer: int
    items: tuple[_Item, ...]
    units: tuple[_Unit, ...] = ()
    """Fan-out streams: the bucket's units (their items, in order, are ``items``)."""


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

    ``senders``: per stage at most that many senders gathering by collectives (:class:`_FanOut`; the
    weight sync); :attr:`senders` then lists every stage's, stage by stage, ascending, and
    :meth:`bucket_plan` has one entry per sender (a *lane*). ``feed_groups``: the process groups of
    earlier streams by member ranks, reused and filled (created with ``feed_timeout_s``);
    ``feed_window``: how many of its steps' feeds a rank may have outstanding (module docstring).
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
        senders: int = 0,
        feed_groups: dict[tuple[int, ...], dist.ProcessGroup] | None = None,
        feed_timeout_s: float = 600.0,
        feed_window: int = FEED_WINDOW,
    ):
        if feed_window < 1:
            raise ValueError(f"HFWeightStream: feed_window={feed_window}; use 1 or more")
        if sum((per_stage, spread, senders > 0)) > 1:
            raise ValueError("HFWeightStream: per_stage, spread and senders exclude each other")
        per_stage = per_stage or senders > 0
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
        dist.all_gather_object(everyone, (stage, meta, _FanOut.coordinates() if senders else None), group=group)
        stages = [s for s, _, _ in everyone]
        self.stage = stage
        self.fanout = _FanOut(everyone, senders) if senders else None
        self.senders = (
            self.fanout.senders
            if self.fanout
            else [min(r for r, s in enumerate(stages) if s == k) if per_stage else dst for k in range(max(stages) + 1)]
        )
        self.items = self._plan(everyone)
        if self.fanout:
            self.items = self.fanout.assign(self.items, self.m)
        self.dtype = dtype
        self.specs = self._specs(self.items)
        self._bucket_plans: dict[int, list[list[list[TensorSpec]]]] = {}
        self._steps: dict[int, list[_Step]] = {}
        self._feed_groups = feed_groups if feed_groups is not None else {}
        self._feed_timeout = timedelta(seconds=feed_timeout_s)
        self._feed_window = feed_window
        self._feeds: list[dist.Work] = []  # the feeds of the step being posted (_collect)
        if self.fanout:
            for members in self.fanout.groups():  # every rank creates every group, in one order
                if members not in self._feed_groups:
                    made = dist.new_group(list(members), timeout=timedelta(seconds=feed_timeout_s))
                    self._feed_groups[members] = cast(dist.ProcessGroup, made)

    @property
    def sender(self) -> int:
        """The global rank that receives this rank's stage's tensors (``dst`` unless ``per_stage``);
        with several senders per stage, the stage's first."""
        return next(r for r, s in zip(self.senders, self.lane_stages, strict=True) if s == self.stage)

    @property
    def lane_stages(self) -> list[int]:
        """The pipeline stage of each sender of :attr:`senders`."""
        return self.fanout.stages if self.fanout else list(range(len(self.senders)))

    @property
    def lane(self) -> int | None:
        """The index in :attr:`senders` of this rank's lane, if it is a sender (else None)."""
        lanes = [k for k, (r, s) in enumerate(zip(self.senders, self.lane_stages, strict=True)) if r == self.rank]
        return next((k for k in lanes if self.lane_stages[k] == self.stage), None)

    def lane_label(self, lane: int) -> str:
        """A lane's name: ``pp{stage}`` with several stages, ``s{j}`` for its stage's j-th sender with
        several per stage (both joined by ``_``), else empty."""
        stages = self.lane_stages
        stage = stages[lane]
        per_stage = stages.count(stage)
        parts = [f"pp{stage}"] if len(set(stages)) > 1 else []
        parts += [f"s{stages[:lane].count(stage)}"] if per_stage > 1 else []
        return "_".join(parts)

    @property
    def writers(self) -> list[int]:
        """The global ranks that receive tensors, ascending."""
        return sorted({item.dst for item in self.items})

    def _plan(self, everyone: list) -> list[_Item]:
        found: dict[str, dict] = {}
        for rank, (stage, meta, _) in enumerate(everyone):
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
            elif self.fanout:
                dst, sources = -1, tuple((r, holders[r][1]) for r in sorted(holders))[: tp.size]  # assign() places it
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
        """Per lane (sender of :attr:`senders`), its buckets' HF tensors (name, shape, dtype) in the
        order :meth:`buckets` yields them on that sender; the same on every rank."""
        if bucket_bytes not in self._bucket_plans:  # the coordinator and its own sending both ask
            if self.fanout:
                lanes = [self._lane_buckets(r, bucket_bytes) for r in self.senders]
                plan = [[self._specs([i for u in b for i in u.items]) for b in lane] for lane in lanes]
            else:
                plan = [
                    [self._specs(group) for group in _buckets([i for i in self.items if i.stage == s], bucket_bytes)]
                    for s in range(len(self.senders))
                ]
            self._bucket_plans[bucket_bytes] = plan
        return self._bucket_plans[bucket_bytes]

    def _lane_buckets(self, writer: int, bucket_bytes: int) -> list[list[_Unit]]:
        assert self.fanout is not None
        return _unit_buckets(self.fanout.units[writer], bucket_bytes)

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
        if bucket_bytes not in self._steps and self.fanout:
            writers = [r for r, s in zip(self.senders, self.fanout.stages, strict=True) if s == self.stage]
            lanes = {w: self._lane_buckets(w, bucket_bytes) for w in writers}
            rounds = max((len(b) for b in lanes.values()), default=0)
            self._steps[bucket_bytes] = [
                _Step(w, tuple(i for u in b[k] for i in u.items), tuple(b[k]))
                for k in range(rounds)
                for w, b in lanes.items()
                if k < len(b)
            ]
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
        if self.fanout:
            open_steps: deque[list[dist.Work]] = deque()  # this rank's steps with feeds outstanding
            for step in self.steps(bucket_bytes):
                if len(open_steps) >= self._feed_window:
                    self._await_feeds(open_steps.popleft())
                self._feeds = []
                bucket = self._fan_step(step)
                if self._feeds:
                    open_steps.append(self._feeds)
                yield bucket
            while open_steps:
                self._await_feeds(open_steps.popleft())
            return
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
            out.extend(self._hf_of(item, [received[(item.name, r)] for r in range(item.tp.size)]))
        return out

    def _hf_of(self, item: _Item, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of ``item`` from its TP shards, in the stream's dtype."""
        full = _concat_tp(shards, item.tp)
        return [
            (hf, tensor.to(self._dtype_of(hf, tensor.dtype))) for hf, tensor in bridge.to_hf(item.name, full, self.m)
        ]

    def _fan_step(self, step: _Step) -> list[tuple[str, torch.Tensor]]:
        """A fan-out step: this rank's part in each unit's gather; on the writer, the bucket."""
        out = []
        for unit in step.units:
            got = self._collect(unit.gather) if unit.gather and self.rank in unit.gather.group else {}
            if self.rank != step.writer:
                continue
            for item in unit.items:
                shards = [
                    got[src] if unit.gather else self._params[(item.name, t)].detach()
                    for t, (src, _) in enumerate(item.sources)
                ]
                out.extend(self._hf_of(item, shards))
        return out

    def _collect(self, gather: _Gather) -> dict[int, torch.Tensor]:
        """Send this rank's tensor of ``gather`` to its writer; on the writer, every member's, by rank."""
        name, tp_rank = gather.send_of(self.rank)
        tensor = self._params[(name, tp_rank)].detach().contiguous()
        group = self._feed_groups[gather.group]
        if self.rank != gather.dst:  # a feed: posted here, awaited in buckets() (module docstring)
            self._feeds.append(cast(dist.Work, dist.gather(tensor, None, dst=gather.dst, group=group, async_op=True)))
            return {}
        received = [torch.empty_like(tensor) for _ in gather.group]
        dist.gather(tensor, received, dst=gather.dst, group=group)
        return dict(zip(gather.group, received, strict=True))

    def _await_feeds(self, feeds: list[dist.Work]) -> None:
        """Block the host until ``feeds`` completed (NCCL: a ``wait`` with a timeout blocks the host;
        without one it would only order the stream). Their group's watchdog, whose clock started
        at the post, fires first on a writer that never comes."""
        for work in feeds:
            work.wait(timeout=self._feed_timeout)


def _concat_tp(shards: list[torch.Tensor], tp: _TP) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    if tp.glu:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    assert tp.dim is not None, "several TP shards of a parameter that is not TP-sharded"
    return torch.cat(shards, dim=tp.dim)
