"""Trainer -> engines weight sync, two strategies (``rollout.weight_sync``):

- ``distributed`` (the default): broadcast groups, gloo on CPU, NCCL on GPU. Every trainer rank
  runs :class:`BroadcastSync` (``broadcast.py``) over the transport (``transport.py``: the groups,
  the engines' control plane) and the ranks' store gate (``gate.py``).
- ``disk``: the actor exports the policy as an HF checkpoint and every engine loads it
  (:func:`sync_from_disk`, ``disk.py``, in the driver).

Data plane: one broadcast group per sender. Each pipeline stage has up to
``rollout.weight_sync_senders // pipeline_parallel`` senders (``HFWeightStream(senders=n)``,
``models/hf_fanout.py``): sender j holds the experts of its share of the EP ranks and a share of
the dense tensors whole, gathered from its expert feed group and its TP group by ``dist.gather``
(one collective per tensor or expert slot, over process groups of their own), so no rank receives
the whole model. In each broadcast group the sender is rank 0 and engine ``e`` with TP size t holds
ranks ``1 + e*t .. (e+1)*t``; every engine joins every sender's group. A bucket travels tensor by tensor, or with ``flat`` (when its tensors share
one dtype) as one byte buffer: one broadcast, SGLang's ``flattened_bucket`` (the default under NCCL:
:func:`resolve_flat`). A sender gathers the next bucket in a thread and, on a GPU, on a CUDA stream
of its own while it broadcasts this one (:class:`GatherStreams`, ``streams.py``).

Control plane (:class:`EngineControl`, held by one coordinator, trainer rank 0):

    engines: /pause_generation {mode: rollout.update_policy} -> /begin_weight_update
    per bucket, in one global order: POST /update_weights_from_distributed {names, dtypes,
        shapes, group, flush_cache: false} to every engine || that bucket's sender broadcasts it
    engines: /end_weight_update -> /flush_cache (once per sync) -> /continue_generation

The pause mode (``rollout.update_policy``) decides what happens to the requests in flight:
``retract`` puts them back in the engine's queue (their contexts are prefilled again after the
flush), ``in_place`` keeps them in the batch with their KV cache (the engine refuses the flush while
they are there, so the cache keeps KV of the old weights), ``abort`` returns them with their
partial output and the agent loop resubmits them as continuations.

An engine takes one update request at a time. If two engines took two senders' buckets in
different orders, each could wait inside one group for the other, busy in the other group; so
the coordinator posts bucket j+1 only once every engine has answered bucket j (:func:`sync_order`
interleaves the stages). The senders meanwhile gather and convert their next bucket, each stage
on its own ranks (and a stage's senders on theirs): nothing funnels through one rank or one NIC, and
only the engines' own receive-and-load is serial. The ranks coordinate through keys in the trainer world's store
(:class:`SyncGate`), not collectives: a sender says it holds bucket j (or why it never will)
before the coordinator posts it, and broadcasts it only once the coordinator released it. On an
error the coordinator stops every sender at its next bucket, and the engines end the update and
resume.

Failure semantics (the same code under gloo and NCCL; docs/training.md, "When a weight sync fails"):
a sender enqueues a bucket's broadcasts and waits on each ``Work`` for at most
``rollout.weight_sync_timeout_s``. An engine that dies mid-broadcast or refuses a bucket without
receiving it makes that wait raise (gloo: at once when a peer's connection closes; NCCL: a broadcast
only enqueues, so at the timeout); the sender then aborts its group (:meth:`WeightSync.abort`) and
the sync raises :class:`SyncAborted` on rank 0. The coordinator waits for the engines' answers
to a bucket for at most that timeout plus ``broadcast.ANSWER_MARGIN_S`` (an engine that received a
bucket and never answers fails the sync naming it), and stops at once when a sender says through
the gate that it gave up a released bucket (:meth:`SyncGate.gave_up`). The groups are built with NCCL's async error
handling off (:func:`new_group`), so torch's watchdog never takes a trainer rank down for them.
Engines of an aborted group may still hold its collective, so the driver restarts all of them and
syncs again (``Session.sync_weights``; the run's ``sync/recovered`` counts those recoveries).

In-flight episodes continue under the new version; their later tokens carry it (under
``in_place`` those tokens were sampled on KV of the old weights: the trajectory's ``stale_kv``). When the
engines change (one restarted on a new port, or dropped), the groups are re-formed under new
names: :meth:`WeightSync.close` destroys the old one on the engines still running
(``/destroy_weights_update_group``) and here. The disk strategy is the fallback when no
broadcast group can be formed.
"""

from sao_megatron.weight_sync.broadcast import BroadcastSync
from sao_megatron.weight_sync.disk import sync_from_disk
from sao_megatron.weight_sync.gate import SyncGate
from sao_megatron.weight_sync.streams import GatherStreams
from sao_megatron.weight_sync.transport import (
    BucketSpec,
    EngineControl,
    SyncAborted,
    SyncReport,
    WeightSync,
    new_group,
    prefetched,
    resolve_flat,
    sync_order,
)

__all__ = [
    "BroadcastSync",
    "BucketSpec",
    "EngineControl",
    "GatherStreams",
    "SyncAborted",
    "SyncGate",
    "SyncReport",
    "WeightSync",
    "new_group",
    "prefetched",
    "resolve_flat",
    "sync_from_disk",
    "sync_order",
]
