"""A stage's stream of training batches: the rollout manager feeding the ready buffer.

The learner awaits :meth:`RolloutSource.next_batch`; it returns as soon as the buffer holds a
batch (no polling) and raises if the manager died. In synchronous mode (``algo.synchronous``)
exactly one batch of prompts is submitted at a time, after the previous weight update.
"""

from __future__ import annotations

import asyncio

from sao_megatron.buffer import ReadyBuffer
from sao_megatron.records import Trajectory
from sao_megatron.rollout.manager import RolloutManager


class RolloutSource:
    def __init__(self, manager: RolloutManager, buffer: ReadyBuffer, prompts_per_batch: int | None = None):
        """``prompts_per_batch`` set: synchronous (one batch of prompts submitted per request)."""
        self.manager = manager
        self.buffer = buffer
        self.prompts_per_batch = prompts_per_batch
        self._stop = asyncio.Event()
        self._runner: asyncio.Task | None = None

    def start(self) -> None:
        """Start (or, in synchronous mode, restart) submitting episodes. Synchronous with a batch
        already waiting (a resumed run's buffer), nothing goes out yet: the next batch of prompts is
        submitted after that one is trained, as in an uninterrupted run (submitted now, it would be
        one version stale by then and dropped). A resumed run stopped mid-batch completes that batch
        first: its prompts waiting in the buffer and those the manager resubmits count toward it."""
        if self.prompts_per_batch is not None and self.buffer.ready():
            self._runner = None
            return
        prompts = self.prompts_per_batch
        if prompts is not None and self._runner is None:  # the stage's first submission
            prompts -= len({(t.split, t.sample_index) for t in self.buffer.waiting()})
        self._runner = asyncio.create_task(self.manager.run(self._stop, max_prompts=prompts))

    async def next_batch(self) -> list[Trajectory]:
        """The next batch of finished trajectories, in the order they became ready."""
        if self._runner is None:
            self.start()  # synchronous, after the batch a resumed run found waiting
        get = asyncio.ensure_future(self.buffer.get())
        try:
            while True:
                await asyncio.wait(
                    [get, *([self._runner] if self._runner else [])], return_when=asyncio.FIRST_COMPLETED
                )
                if get.done():
                    return get.result()
                assert self._runner is not None  # only get was awaited otherwise
                self._runner.result()  # surfaces a manager crash
                if self.prompts_per_batch is None:
                    raise RuntimeError("the rollout manager stopped before a batch was ready")
                self.start()  # synchronous: the submitted prompts were not enough (failed, stale): more
        except asyncio.CancelledError:
            if get.done() and not get.cancelled() and get.exception() is None:
                self.buffer.put_back(get.result())  # taken but never returned: it waits for the resumed run
            raise
        finally:
            get.cancel()

    def stop(self) -> None:
        """Stop submitting; episodes in flight keep running (and count as unfinished in a checkpoint)."""
        self._stop.set()
        self.manager.pause()

    async def close(self) -> None:
        """Stop and cancel the episodes in flight (a resumed run resubmits them)."""
        self.stop()
        await self.manager.drain(cancel=True)
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()
