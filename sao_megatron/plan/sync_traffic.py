"""Weight-sync traffic per actor rank, analytically: bytes through each rank and communicators per rank.

The sync as built today (``HFWeightStream(per_stage=True)`` feeding ``BroadcastSync``): each pipeline
stage has one sender, its lowest global rank. The sender receives every tensor of its stage whole:
each TP shard it lacks comes by point-to-point from the lowest rank holding it, which in Megatron's
rank order (``tp-cp-ep-dp-pp`` for the dense grid, ``etp-ep-edp-pp`` for the experts; both put PP
outermost) is ``sender + t`` for TP rank ``t`` and ``sender + r + etp * e`` for expert-TP rank ``r``
of EP rank ``e``. The sender then broadcasts the whole stage to the engines in one group
(an NCCL broadcast's root sends every byte once). Nothing else moves; data-parallel replicas send
nothing.

Communicators per rank counted here are the sync's own: one per (sender, source) pair for the
gathers (the stream's group is created without ``device_id``, so NCCL builds a two-rank
communicator for each pair that exchanges point-to-point traffic) and one per broadcast group a
rank belongs to. Megatron's own groups (TP, DP, EP, PP, ...) are not counted. The acknowledgements
(8 bytes per step and source) and the router's float32 expert bias, replicated and so never
gathered, are counted as broadcast bytes only.

From the model shape and layout alone (:func:`sao_megatron.plan.params.stage_parameters`, local
spec); ``tests/test_sync_traffic.py`` checks it against the bytes and peers the real stream
moves in a spawned gloo world.
"""

from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.config import ModelConfig, ParallelConfig, SAOConfig
from sao_megatron.models.builder import moe_layer_pattern
from sao_megatron.plan.params import stage_parameters


@dataclass(frozen=True)
class RankTraffic:
    """One actor rank's share of one weight sync."""

    received: int
    """Bytes received by point-to-point (a sender's gathers)."""
    sent: int
    """Bytes sent: its shards to its stage's sender, and, on a sender, the broadcast of its stage."""
    peers: int
    """Point-to-point peers in the gathers (one two-rank communicator each)."""
    broadcast_groups: int
    """Broadcast groups with the engines it belongs to (one communicator each)."""

    @property
    def through(self) -> int:
        """Bytes in and out of the rank."""
        return self.received + self.sent

    @property
    def communicators(self) -> int:
        return self.peers + self.broadcast_groups


@dataclass(frozen=True)
class SyncTraffic:
    """Every actor rank's traffic in one weight sync (index: global rank)."""

    ranks: tuple[RankTraffic, ...]
    stage_bytes: tuple[int, ...]
    """Bytes each stage's sender broadcasts: its stage's tensors, whole."""

    @property
    def busiest(self) -> int:
        """The global rank with the most bytes through it (the lowest one on a tie)."""
        return max(range(len(self.ranks)), key=lambda r: (self.ranks[r].through, -r))

    @property
    def max_communicators(self) -> int:
        return max(r.communicators for r in self.ranks)


def _replicated(name: str) -> bool:
    """Held whole by every TP rank: the norms and the router."""
    return "norm" in name or name.endswith("router.weight")


def sync_traffic(m: ModelConfig, p: ParallelConfig, dtype_bytes: int = 2) -> SyncTraffic:
    """Bytes and communicators per rank of one sync of the actor ``m`` at layout ``p``, tensors
    moved in ``dtype_bytes`` per element (the trainer's parameter dtype; bf16: 2)."""
    tp, ep, etp, pp = p.tensor_parallel, p.expert_parallel, p.expert_tensor_parallel, p.pipeline_parallel
    per_stage = p.world_size // pp
    received, sent, peers = [0] * p.world_size, [0] * p.world_size, [set() for _ in range(p.world_size)]
    stage_bytes = []
    pattern = moe_layer_pattern(m)
    for stage in range(pp):
        sender = stage * per_stage
        dense = experts = replicated = 0  # elements on one rank
        for name, (n, _) in stage_parameters(m, p, stage).items():
            if ".local_experts." in name:
                experts += n
            elif _replicated(name):
                replicated += n
            else:
                dense += n
        layers = pattern[stage * (m.num_layers // pp) : (stage + 1) * (m.num_layers // pp)]
        bias = 4 * m.num_experts * sum(layers) if m.moe_router_enable_expert_bias else 0
        stage_bytes.append((replicated + dense * tp + experts * etp * ep) * dtype_bytes + bias)
        shares: dict[int, int] = {}  # source rank -> bytes it sends to the sender
        for t in range(1, tp if dense else 1):
            shares[sender + t] = shares.get(sender + t, 0) + dense * dtype_bytes
        for source in range(1, etp * ep if experts else 1):
            shares[sender + source] = shares.get(sender + source, 0) + experts * dtype_bytes
        for source, nbytes in shares.items():
            sent[source] += nbytes
            received[sender] += nbytes
            peers[source].add(sender)
            peers[sender].add(source)
        sent[sender] += stage_bytes[-1]
    senders = {stage * per_stage for stage in range(pp)}
    ranks = tuple(
        RankTraffic(received[r], sent[r], len(peers[r]), 1 if r in senders else 0) for r in range(p.world_size)
    )
    return SyncTraffic(ranks, tuple(stage_bytes))


def summary(cfg: SAOConfig) -> str:
    """One line for ``sao plan``: the actor's busiest rank per sync and the sync's communicators."""
    p = cfg.actor.parallel
    t = sync_traffic(cfg.model, p, 4 if cfg.rollout.dtype in ("float32", "float") else 2)
    rank = t.ranks[t.busiest]
    return (
        f"weight sync (actor TP{p.tensor_parallel} EP{p.expert_parallel} ETP{p.expert_tensor_parallel} "
        f"PP{p.pipeline_parallel}, {p.world_size} ranks; {p.pipeline_parallel} sender(s), each its stage's "
        f"lowest rank): busiest rank {t.busiest} moves {rank.through / 1e9:,.1f} GB per sync (in "
        f"{rank.received / 1e9:,.1f} by point-to-point gathers, out {rank.sent / 1e9:,.1f}: its broadcast to "
        f"the engines); sync communicators on it {rank.communicators} ({rank.peers} gather pairs + "
        f"{rank.broadcast_groups} broadcast group), at most {t.max_communicators} on any rank."
    )
