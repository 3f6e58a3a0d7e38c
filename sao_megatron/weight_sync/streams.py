"""The streams of a sender's gather and broadcast (:class:`GatherStreams`).

The gathers that build bucket k+1 run in a thread of their own (:func:`~sao_megatron.weight_sync.prefetched`)
while bucket k is broadcast. On a GPU that overlap also needs two CUDA streams: kernels queued on one
stream run in order, so gathers queued on the broadcasting thread's stream would wait for the
broadcast. Here the gathers go on a side stream; after each bucket the side stream records an event,
and the broadcasting stream waits on that event (on the device, not the host) before the bucket is
sent. A bucket's tensors were allocated on the side stream: they are marked as used by the
broadcasting stream (``record_stream``), so the allocator reuses their memory only once the
broadcast queued there has run, not as soon as Python drops them.

On the host the same object runs the same calls on :class:`_HostStream`: host work is in order
already, so its events are complete when recorded and waiting on one returns at once. Only the
constructor looks at the device.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, cast

import torch

Bucket = list[tuple[str, torch.Tensor]]


class _HostEvent:
    """A host "event": the work before it has run by the time it is recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _HostStream:
    """The host stand-in for ``torch.cuda.Stream`` (the calls :class:`GatherStreams` makes)."""

    def __init__(self) -> None:
        self._inside = threading.local()  # per thread, like CUDA's current stream

    def record_event(self) -> _HostEvent:
        return _HostEvent()

    def wait_event(self, event: _HostEvent) -> None:
        assert event.query(), "a host event is complete when recorded"

    def use(self) -> AbstractContextManager[None]:
        """Make this the calling thread's current stream for the ``with`` block."""
        stream = self

        class _Use:
            def __enter__(self) -> None:
                stream._inside.depth = getattr(stream._inside, "depth", 0) + 1

            def __exit__(self, *exc: object) -> None:
                stream._inside.depth -= 1

        return _Use()

    def is_current(self) -> bool:
        return getattr(self._inside, "depth", 0) > 0

    def keep(self, tensor: torch.Tensor) -> None:
        """Host memory is freed when the last reference goes: nothing to record."""


class _CudaStream:
    """A ``torch.cuda.Stream`` behind :class:`_HostStream`'s calls."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def record_event(self) -> torch.cuda.Event:
        return cast(torch.cuda.Event, self.stream.record_event())  # a CUDA stream records CUDA events

    def wait_event(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def use(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def is_current(self) -> bool:
        return torch.cuda.current_stream(self.stream.device) == self.stream

    def keep(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            tensor.record_stream(self.stream)


@dataclass
class Gathered:
    """One bucket as the gather stream left it: its tensors may still be being written until ``event``."""

    bucket: Bucket
    event: Any  # torch.cuda.Event or _HostEvent


class GatherStreams:
    """A sender's gather stream and the stream its broadcasts are queued on, for ``device``.

    Use: ``for g in prefetched(streams.gathered(buckets)): send(streams.ready(g))``.
    :meth:`gathered` runs in the producer's thread and queues each bucket's gathers on the side
    stream; :meth:`ready` runs in the sending thread, on the stream current there (NCCL queues a
    collective after the work on the calling thread's current stream).

    Built in the thread that sends, after the training step has been queued: the side stream
    first waits for the work queued so far on the sending thread's stream (the optimizer's last
    update of the parameters the gathers read).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.gather: _CudaStream | _HostStream
        self.send: _CudaStream | _HostStream
        if device.type == "cuda":
            side, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
            side.wait_stream(current)
            self.gather, self.send = _CudaStream(side), _CudaStream(current)
        else:
            self.gather, self.send = _HostStream(), _HostStream()

    def gathered(self, buckets: Iterator[Bucket]) -> Iterator[Gathered]:
        """``buckets`` produced with the gather stream current (each ``next`` runs their gathers),
        each with the event recorded on it once its gathers are queued."""
        while True:
            with self.gather.use():
                bucket = next(buckets, None)
                if bucket is None:
                    return
                event = self.gather.record_event()
            yield Gathered(bucket, event)

    def ready(self, gathered: Gathered) -> Bucket:
        """The bucket, safe to send on the sending stream: that stream waits for the bucket's
        event, and its tensors' memory stays reserved until the work queued on it so far has run."""
        self.send.wait_event(gathered.event)
        for _, tensor in gathered.bucket:
            self.send.keep(tensor)
        return gathered.bucket

    def on_gather_stream(self) -> bool:
        """Whether the calling thread's current stream is the gather stream."""
        return self.gather.is_current()
