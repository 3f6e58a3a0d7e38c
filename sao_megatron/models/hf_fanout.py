"""The weight sync's fan-out: several senders per pipeline stage, every gather one collective
(:class:`_FanOut`, planned for ``HFWeightStream(senders=n)``; the stream runs it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from sao_megatron.config import ModelConfig
from sao_megatron.models import layout
from sao_megatron.models.hf_plan import _buckets, _Item, _load_unit, _natural, _order_key


@dataclass(frozen=True)
class _Gather:
    """One collective of the fan-out stream: every member of ``group`` (sorted global ranks, a process
    group of their own) sends ``dst`` one tensor, all of one shape: ``sends`` names it per member
    (member rank, Megatron name, TP rank)."""

    group: tuple[int, ...]
    dst: int
    sends: tuple[tuple[int, str, int], ...]

    def send_of(self, rank: int) -> tuple[str, int]:
        return next((name, tp_rank) for r, name, tp_rank in self.sends if r == rank)


@dataclass(frozen=True)
class _Unit:
    """What a fan-out writer assembles at once: ``items`` whose shards arrive by ``gather`` (None: the
    writer holds every shard itself). An item's ``sources`` name the member that sends each TP shard."""

    items: tuple[_Item, ...]
    gather: _Gather | None

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)


def _unit_buckets(units: list[_Unit], bucket_bytes: int) -> list[list[_Unit]]:
    return _buckets(units, bucket_bytes, name=lambda u: u.items[0].name)


_SLOT_RE = re.compile(r"^(.*\.experts\.(?:local_experts\.|linear_fc[12]\.weight))(\d+)(.*)$")


class _FanOut:
    """The weight sync's plan: several senders per pipeline stage, every gather one collective over a
    small process group of its own (``HFWeightStream(senders=n)``).

    Senders: a stage's ranks of expert-data-parallel replica 0 at expert-TP rank 0 and EP ranks 0, w,
    2w, ... (w = EP / k, k the largest divisor of EP not above ``n``); without experts (EP 1), one.
    Sender j gathers the experts of EP ranks ``j*w .. (j+1)*w - 1``: one ``dist.gather`` per local slot
    (layer, local expert i, weight) over its *expert feed group* (those EP ranks' ranks of replica 0,
    every expert-TP rank), in which every member sends its tensor of that slot (global expert
    ``e*L + i`` on EP rank e): one collective brings the slice's w experts and their expert-TP shards.
    Dense tensors go, a load unit (:func:`_load_unit`) at a time, to the stage's least loaded sender so
    far (bytes, its experts counted); one split over TP comes by one ``dist.gather`` over the sender's
    own TP group. What the sender holds whole (replicated or TP 1) does not move.
    """

    def __init__(self, everyone: list, cap: int):
        coords = {r: c for r, (_, _, c) in enumerate(everyone)}  # (ep rank, ep size, etp rank, edp rank)
        stage_of = {r: s for r, (s, _, _) in enumerate(everyone)}
        self.meta = {r: m for r, (_, m, _) in enumerate(everyone)}
        self.coords, self._stage_of = coords, stage_of
        self.width: dict[int, int] = {}  # per stage: EP ranks per sender
        self.slice_sender: dict[tuple[int, int], int] = {}  # (stage, slice): its sender
        self.feed: dict[tuple[int, int], tuple[int, ...]] = {}  # (stage, slice): its expert feed group
        lanes = []
        for stage in sorted(set(stage_of.values())):
            ranks = sorted(r for r in stage_of if stage_of[r] == stage)
            ep_size = coords[ranks[0]][1]
            n = max(d for d in range(1, ep_size + 1) if ep_size % d == 0 and d <= max(cap, 1))
            w = self.width[stage] = ep_size // n
            replica = [r for r in ranks if coords[r][3] == 0]
            for j in range(n):
                sender = min(r for r in replica if coords[r][0] == j * w and coords[r][2] == 0)
                self.slice_sender[(stage, j)] = sender
                self.feed[(stage, j)] = tuple(sorted(r for r in replica if coords[r][0] // w == j))
                lanes.append((stage, sender))
        lanes.sort()
        self.stages = [s for s, _ in lanes]
        self.senders = [r for _, r in lanes]
        self.units: dict[int, list[_Unit]] = {}

    @staticmethod
    def coordinates() -> tuple[int, int, int, int]:
        """This rank's (EP rank, EP size, expert-TP rank, expert-DP rank)."""
        ps = layout._groups()
        return (
            int(ps.get_expert_model_parallel_rank()),
            int(ps.get_expert_model_parallel_world_size()),
            int(ps.get_expert_tensor_parallel_rank() or 0),
            int(ps.get_expert_data_parallel_rank()),
        )

    def groups(self) -> list[tuple[int, ...]]:
        """Every gather's process group (member ranks), each once, in one order on every rank."""
        seen = {u.gather.group for units in self.units.values() for u in units if u.gather is not None}
        return sorted(seen)

    def assign(self, items: list[_Item], m: ModelConfig) -> list[_Item]:
        """``items`` with their writers and sources; fills :attr:`units` (per sender, in stream order).
        The experts first (each slice's sender is fixed), then the dense load units in stream order,
        each to its stage's least loaded sender."""
        stage_of = {item.name: item.stage for item in items}  # a tensor two stages hold: the first's
        holders: dict[str, dict[int, tuple]] = {}  # name -> rank -> (tp rank, local shape, TP group)
        for r, meta in self.meta.items():
            for name, _, tp_rank, _, _, shape, _, tp_ranks in meta:
                if self._stage_of[r] == stage_of.get(name):
                    holders.setdefault(name, {})[r] = (tp_rank, tuple(shape), tuple(tp_ranks))
        self.units = {r: [] for r in self.senders}
        load = dict.fromkeys(self.senders, 0)
        placed = self._assign_experts([i for i in items if layout.is_expert_param(i.name)], holders, load, m)
        placed += self._assign_dense([i for i in items if not layout.is_expert_param(i.name)], holders, load)
        for units in self.units.values():
            units.sort(key=lambda u: _order_key(u.items[0].name))
        order = {item.name: k for k, item in enumerate(items)}
        return sorted(placed, key=lambda i: order[i.name])

    def _assign_experts(self, items: list[_Item], holders: dict, load: dict[int, int], m: ModelConfig) -> list[_Item]:
        slots: dict[tuple[int, int, str], list[_Item]] = {}
        for item in items:
            owners = {h[0]: r for r, h in holders[item.name].items() if self.coords[r][3] == 0}  # etp rank -> rank
            j = self.coords[owners[0]][0] // self.width[item.stage]
            dst = self.slice_sender[(item.stage, j)]
            sources = tuple((owners[t], holders[item.name][owners[t]][1]) for t in range(item.tp.size))
            per_rank = m.num_experts // self.coords[dst][1]  # local experts of one EP rank
            local = _SLOT_RE.sub(lambda x, n=per_rank: f"{x[1]}{int(x[2]) % n}{x[3]}", item.name)
            slots.setdefault((item.stage, j, local), []).append(replace(item, dst=dst, sources=sources))
            load[dst] += item.nbytes
        placed = []
        for (stage, j, _), members in slots.items():
            members.sort(key=lambda i: _natural(i.name))
            group, dst = self.feed[(stage, j)], members[0].dst
            gather = None
            if len(group) > 1:
                by_rank = {src: (i.name, t) for i in members for t, (src, _) in enumerate(i.sources)}
                gather = _Gather(group, dst, tuple((r, *by_rank[r]) for r in group))
            self.units[dst].append(_Unit(tuple(members), gather))
            placed.extend(members)
        return placed

    def _assign_dense(self, items: list[_Item], holders: dict, load: dict[int, int]) -> list[_Item]:
        placed = []
        writer_of: dict[tuple[int, str], int] = {}  # (stage, load unit): its writer
        for item in items:
            held = holders[item.name]
            key = (item.stage, _load_unit(item.name))
            if key not in writer_of:
                stage_senders = [r for r, s in zip(self.senders, self.stages, strict=True) if s == item.stage]
                writer_of[key] = min(stage_senders, key=lambda r: (load[r], r))
            dst = writer_of[key]
            if dst not in held:
                raise ValueError(f"'{item.name}': its stage's sender {dst} does not hold it")
            load[dst] += item.nbytes
            tp_group = tuple(sorted(held[dst][2])) if item.tp.size > 1 else (dst,)
            sources = tuple((r, held[r][1]) for r in held[dst][2]) if item.tp.size > 1 else ((dst, held[dst][1]),)
            done = replace(item, dst=dst, sources=sources)
            gather = _Gather(tp_group, dst, tuple((r, item.name, held[r][0]) for r in tp_group))
            self.units[dst].append(_Unit((done,), gather if item.tp.size > 1 else None))
            placed.append(done)
        return placed
