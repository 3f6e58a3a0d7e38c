"""Weight-sync traffic per actor rank, analytically: bytes through each rank and communicators per rank.

The sync as built (``HFWeightStream(senders=n)`` feeding ``BroadcastSync``; ``models/hf_stream.py``,
``_FanOut``): each pipeline stage has k senders, k the largest divisor of the actor's EP not above
``max(1, rollout.weight_sync_senders // pipeline_parallel)``. In Megatron's rank orders
(``tp-cp-ep-dp-pp`` for the dense grid, ``etp-ep-edp-pp`` for the experts; PP outermost) stage s's
rank ``i`` of its ``W`` is EP rank ``(i // etp) % ep``, expert-TP rank ``i % etp``, expert-DP rank
``i // (etp * ep)``, TP rank ``i % tp``. Sender j is EP rank ``j*w`` (``w = ep / k``) at expert-TP and
expert-DP rank 0; it gathers the experts of EP ranks ``j*w .. (j+1)*w - 1`` from their expert-DP-0 ranks
(one collective per local expert slot over that *expert feed group*), and the dense load units (a
tensor, or a set the engine fuses) go in stream order to the least loaded sender (experts counted
first), each one split over TP gathered over the sender's TP group. Each sender broadcasts its own
buckets to the engines over a group of its own.

Counted per rank: bytes received by the gathers (a sender), bytes sent (a member's shards; a
sender's broadcast of its buckets, an NCCL broadcast's root sending every byte once), the gathers'
process groups it belongs to (one communicator each: ``dist.gather`` runs on the group's own) and the
broadcast groups. Megatron's own groups (TP, DP, EP, PP, ...) are not counted.

From the model shape and layout alone (:func:`sao_megatron.plan.params.stage_parameters`, local
spec); ``tests/test_sync_traffic.py`` checks it against the bytes and groups the real stream uses
in spawned gloo worlds.
"""

from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.config import ModelConfig, ParallelConfig, SAOConfig
from sao_megatron.models.builder import moe_layer_pattern
from sao_megatron.models.hf_bridge import is_exported
from sao_megatron.models.hf_stream import _load_unit, _order_key
from sao_megatron.plan.params import stage_parameters


@dataclass(frozen=True)
class RankTraffic:
    """One actor rank's share of one weight sync."""

    received: int
    """Bytes its gathers brought it (a sender's)."""
    sent: int
    """Bytes sent: its shards to senders, and, on a sender, the broadcast of its buckets."""
    gather_groups: int
    """The gathers' process groups it belongs to (one communicator each)."""
    broadcast_groups: int
    """Broadcast groups with the engines it belongs to (one communicator each)."""

    @property
    def through(self) -> int:
        """Bytes in and out of the rank."""
        return self.received + self.sent

    @property
    def communicators(self) -> int:
        return self.gather_groups + self.broadcast_groups


@dataclass(frozen=True)
class SyncTraffic:
    """Every actor rank's traffic in one weight sync (index: global rank)."""

    ranks: tuple[RankTraffic, ...]
    senders: tuple[int, ...]
    """The senders' global ranks, stage by stage."""
    lane_bytes: tuple[int, ...]
    """Bytes each sender broadcasts (its buckets' tensors, whole)."""

    @property
    def busiest(self) -> int:
        """The global rank with the most bytes through it (the lowest one on a tie)."""
        return max(range(len(self.ranks)), key=lambda r: (self.ranks[r].through, -r))

    @property
    def max_communicators(self) -> int:
        return max(r.communicators for r in self.ranks)


def _replicated(name: str) -> bool:
    """Held whole by every TP rank: the norms and the router (its weight and expert bias)."""
    return "norm" in name or ".router." in name


def senders_per_stage(p: ParallelConfig, senders: int) -> int:
    """The largest divisor of EP not above ``max(1, senders // pipeline_parallel)``."""
    cap = max(1, senders // p.pipeline_parallel)
    return max(d for d in range(1, p.expert_parallel + 1) if p.expert_parallel % d == 0 and d <= cap)


def _stage_tensors(m: ModelConfig, p: ParallelConfig, stage: int) -> dict[str, tuple[int, int]]:
    """Every exported tensor a rank of ``stage`` holds: ``(elements on one rank, bytes per element)``;
    the router's expert bias is float32 (``dtype_bytes`` applies to the rest)."""
    out = {name: (n, 0) for name, (n, _) in stage_parameters(m, p, stage).items() if is_exported(name, m)}
    if m.moe_router_enable_expert_bias:
        per_stage = m.num_layers // p.pipeline_parallel
        for i, moe in enumerate(moe_layer_pattern(m)[stage * per_stage : (stage + 1) * per_stage]):
            if moe:
                out[f"decoder.layers.{i}.mlp.router.expert_bias"] = (m.num_experts, 4)
    return out


def sync_traffic(m: ModelConfig, p: ParallelConfig, dtype_bytes: int = 2, senders: int = 8) -> SyncTraffic:
    """Bytes and communicators per rank of one sync of the actor ``m`` at layout ``p``, tensors
    moved in ``dtype_bytes`` per element (the trainer's parameter dtype; bf16: 2), with
    ``rollout.weight_sync_senders`` = ``senders``."""
    tp, ep, etp, pp = p.tensor_parallel, p.expert_parallel, p.expert_tensor_parallel, p.pipeline_parallel
    size = p.world_size // pp
    k = senders_per_stage(p, senders)
    w = ep // k
    received, sent = [0] * p.world_size, [0] * p.world_size
    groups: list[set[tuple[int, ...]]] = [set() for _ in range(p.world_size)]
    lanes: list[tuple[int, int]] = []  # (sender, bytes)

    def gather(members: tuple[int, ...], dst: int, nbytes: int) -> None:
        for r in members:
            groups[r].add(members)
            if r != dst:
                sent[r] += nbytes
                received[dst] += nbytes

    for stage in range(pp):
        base = stage * size
        tensors = _stage_tensors(m, p, stage)
        experts = [n * dtype_bytes for name, (n, _) in tensors.items() if ".local_experts." in name]
        load = {base + j * w * etp: 0 for j in range(k)}
        for j, sender in enumerate(load):
            feed = tuple(base + e * etp + t for e in range(j * w, (j + 1) * w) for t in range(etp))
            load[sender] += sum(experts) * len(feed)
            if len(feed) > 1:
                for nbytes in experts:
                    gather(feed, sender, nbytes)
        dense = sorted((name for name in tensors if ".local_experts." not in name), key=_order_key)
        writer: dict[str, int] = {}
        for name in dense:
            n, itemsize = tensors[name]
            shard = n * (itemsize or dtype_bytes)
            split = tp > 1 and not _replicated(name)
            unit = _load_unit(name)
            if unit not in writer:
                writer[unit] = min(load, key=lambda r: (load[r], r))
            sender = writer[unit]
            load[sender] += shard * (tp if split else 1)
            if split:
                first = base + (sender - base) // tp * tp
                gather(tuple(range(first, first + tp)), sender, shard)
        for sender, nbytes in load.items():
            sent[sender] += nbytes
            lanes.append((sender, nbytes))
    senders_ = {r for r, _ in lanes}
    ranks = tuple(RankTraffic(received[r], sent[r], len(groups[r]), int(r in senders_)) for r in range(p.world_size))
    return SyncTraffic(ranks, tuple(r for r, _ in lanes), tuple(b for _, b in lanes))


def summary(cfg: SAOConfig) -> str:
    """One line for ``sao plan``: the actor's busiest rank per sync and the sync's communicators."""
    p = cfg.actor.parallel
    n = cfg.rollout.weight_sync_senders
    t = sync_traffic(cfg.model, p, 4 if cfg.rollout.dtype in ("float32", "float") else 2, n)
    rank = t.ranks[t.busiest]
    return (
        f"weight sync (actor TP{p.tensor_parallel} EP{p.expert_parallel} ETP{p.expert_tensor_parallel} "
        f"PP{p.pipeline_parallel}, {p.world_size} ranks; rollout.weight_sync_senders={n}: "
        f"{len(t.senders)} sender(s), {senders_per_stage(p, n)} per stage): busiest rank {t.busiest} moves "
        f"{rank.through / 1e9:,.1f} GB per sync (in {rank.received / 1e9:,.1f} by gathers, out "
        f"{rank.sent / 1e9:,.1f}{': its broadcast to the engines' if rank.broadcast_groups else ''}); sync "
        f"communicators on it {rank.communicators} ({rank.gather_groups} gather groups + "
        f"{rank.broadcast_groups} broadcast group), at most {t.max_communicators} on any rank; each engine "
        f"GPU joins {len(t.senders)}."
    )
