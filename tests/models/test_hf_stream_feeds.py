"""The weight sync's fan-out stream under NCCL's watchdog: a rank that only feeds its writer's gathers
survives a sync longer than the feed groups' timeout (``HFWeightStream(feed_window=...)``,
``models/hf_stream.py``).

A spawned 2-rank world on the strict NCCL-contract backend (``runtime/strict_nccl``: a non-root
gather only enqueues; a watchdog per group takes the process down with ``SIGABRT`` when an op is
not done within the group's timeout, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) builds a small dense
model at TP 2 and runs the sync's stream with one sender: rank 0 gathers every bucket and, as the
weight sync's coordinator paces it, consumes each slowly; rank 1 only feeds. Each bucket takes
well under the feed groups' timeout and all of them together well over it. With the window rank 1
posts its gathers as rank 0 takes them and both ranks finish; with every gather posted at once
(the stream before the window) the watchdog kills rank 1.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from sao_megatron.config import ModelConfig
from sao_megatron.spawn import WorldFailed
from tests.distributed import BACKEND_ENV, run_distributed

MODEL = ModelConfig(
    name="feeds",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    ffn_hidden_size=48,
    vocab_size=64,
    rope_theta=10000.0,
)
BUCKET = 1 << 12  # many small buckets
FEED_TIMEOUT_S = 15.0
"""The feed groups' timeout (``run.export_timeout_s``): the strict watchdog's limit for one gather."""
SLOW_S = 2.0
"""The writer's time per bucket (its coordinator waiting for the engines): a few of these fit in
:data:`FEED_TIMEOUT_S` with room for a loaded host; the window keeps two steps of feeds open."""
WORLD_TIMEOUT_S = 240.0


def _slow_writer(rank: int, world: int, feed_window: int) -> dict[str, Any]:
    """The sync's stream with one sender (rank 0), which takes :data:`SLOW_S` per bucket after it
    was gathered (in a thread a bucket ahead, as the weight sync's sender)."""
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_stream import HFWeightStream
    from sao_megatron.weight_sync import prefetched
    from tests.models.hf_cases import _setup

    p = _setup(world, tensor_parallel=2)
    stream = HFWeightStream(
        build_gpt(MODEL, p), MODEL, senders=1, feed_timeout_s=FEED_TIMEOUT_S, feed_window=feed_window
    )
    buckets = stream.buckets(BUCKET)
    if stream.lane is not None:
        buckets = prefetched(buckets)
    taken = 0
    for bucket in buckets:
        if bucket:
            time.sleep(SLOW_S)
            taken += 1
    dist.barrier()
    return {"lane": stream.lane, "taken": taken, "steps": len(stream.steps(BUCKET))}


@pytest.fixture
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The world on the strict backend with NCCL's default error handling (abort on a timeout)."""
    monkeypatch.setenv(BACKEND_ENV, "strict_nccl")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)


def test_a_rank_that_only_feeds_survives_a_sync_longer_than_the_feed_timeout(strict: None) -> None:
    """Rank 0 takes every bucket, :data:`SLOW_S` each, longer than :data:`FEED_TIMEOUT_S` in all;
    rank 1 feeds every step's gather and both finish (the watchdog never fires)."""
    zero, one = run_distributed(_slow_writer, 2, 2, timeout_s=WORLD_TIMEOUT_S)
    assert (zero["lane"], one["lane"]) == (0, None)
    assert zero["taken"] == zero["steps"] == one["steps"] and one["taken"] == 0
    assert zero["taken"] * SLOW_S > 1.5 * FEED_TIMEOUT_S, "the sync must outlast one gather's timeout"


def test_with_every_feed_posted_at_once_the_watchdog_kills_the_feeding_rank(strict: None) -> None:
    """The same world with rank 1's gathers all posted at the start (a window as long as the sync:
    the stream before the window): the strict watchdog times the last ones from the start and takes
    rank 1 down with SIGABRT (its line, naming the gather, goes to the ranks' stderr)."""
    # the feeding rank dies first; the writer's gathers then lose their peer and its watchdog may take
    # it down too before the world reports, so either process may be the one named
    with pytest.raises(WorldFailed, match="process [01] terminated with signal SIGABRT"):
        run_distributed(_slow_writer, 2, 1 << 20, timeout_s=WORLD_TIMEOUT_S)
