"""The trainer ranks' word to each other during a broadcast weight sync (:class:`SyncGate`)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from torch.distributed import Store  # pyright: ignore[reportPrivateImportUsage]  # public API


class SyncGate:
    """The trainer ranks' word to each other during an update, through the trainer world's store.
    Nobody waits inside a collective for a peer that may take long or give up: a rank waits here
    (:attr:`WAIT_S`, longer than any sync or failure path) and enters a collective only once the
    peers it needs are there.

    - Formation: stage ``s``'s sender forms its group and says :meth:`formed`; every rank waits
      for it (:meth:`wait_formed`) before stage ``s + 1``'s sender starts (an engine joins one
      group at a time).
    - The coordinator :meth:`start` s the update, or tells every rank to skip it with the reason.
    - Per bucket, two phases: its sender says it holds the bucket (:meth:`ready`) or why it never
      will (:meth:`failed`); the coordinator waits for that word (:meth:`wait_ready`), then
      :meth:`release` s the bucket and posts its request. A sender broadcasts only a released
      bucket, and the coordinator posts only a bucket whose sender holds it, so neither the
      engines nor a sender wait in a broadcast the other side never joins (short of an engine
      dying or refusing mid-broadcast: the sender's wait ends at ``rollout.weight_sync_timeout_s``
      and it aborts its group). A sender whose broadcast of a released bucket failed says so at
      once (:meth:`gave_up`): the engines' requests for that bucket will never be answered, and
      the coordinator, which watches for that word while it waits for them (:meth:`given_up`),
      stops there. On an error the coordinator :meth:`stop` s every sender at its next bucket.
    - The coordinator says :meth:`done` after the engines resumed; the others wait for it
      (:meth:`wait_done`) before the final all-gather of every rank's result.

    Keys live under one prefix per update (:meth:`next_update`). A blocking get holds its store
    connection until the key is set, so the calls that never block, the sender's waits (a thread
    of its own on rank 0), the coordinator's waits and its watch for :meth:`given_up` use four
    connections."""

    WAIT_S = 3600.0

    def __init__(self, store: Store):
        self._calls, self._waits, self._coordinator = store.clone(), store.clone(), store.clone()
        self._watch = store.clone()
        for connection in (self._waits, self._coordinator):
            connection.set_timeout(timedelta(seconds=self.WAIT_S))
        self._prefix = "sao_weight_sync/0/"

    @classmethod
    def of_world(cls) -> SyncGate:
        """On the default process group's store (torch exposes it only privately)."""
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(_get_default_store())

    def next_update(self, n: int) -> SyncGate:
        """Use update ``n``'s keys (every rank counts its updates alike)."""
        self._prefix = f"sao_weight_sync/{n}/"
        return self

    def formed(self, stage: int) -> None:
        self._calls.set(f"{self._prefix}formed/{stage}", "")

    def wait_formed(self, stage: int) -> None:
        self._waits.get(f"{self._prefix}formed/{stage}")

    def start(self, error: str | None = None) -> None:
        self._calls.set(self._prefix + "start", error or "")

    def started(self) -> str | None:
        """Blocks until :meth:`start`; None to go, else why the update is skipped."""
        return self._waits.get(self._prefix + "start").decode() or None

    def ready(self, sender: int, bucket: int) -> None:
        self._calls.set(f"{self._prefix}ready/{sender}/{bucket}", "")

    def failed(self, sender: int, bucket: int, reason: str) -> None:
        """The sender will never hold ``bucket`` (nor any later one)."""
        self._calls.set(f"{self._prefix}ready/{sender}/{bucket}", reason or "failed")

    def wait_ready(self, sender: int, bucket: int) -> str | None:
        """Blocks until the sender holds the bucket (None) or failed (why)."""
        key = f"{self._prefix}ready/{sender}/{bucket}"
        word = self._coordinator.get(key).decode()
        self._coordinator.delete_key(key)
        return word or None

    def gave_up(self, sender: int, bucket: int, reason: str) -> None:
        """The sender will not complete the broadcast of ``bucket``, which was released (it aborted
        its group, or the send raised); the first sender's word stays."""
        self._calls.compare_set(self._prefix + "gave_up", "", f"sender {sender}, bucket {bucket}: {reason}")

    def given_up(self) -> str | None:
        """Never blocks: a sender's :meth:`gave_up` word in this update, or None."""
        key = self._prefix + "gave_up"
        return self._watch.get(key).decode() if self._watch.check([key]) else None

    def release(self, sender: int, bucket: int) -> None:
        self._calls.set(f"{self._prefix}go/{sender}/{bucket}", "go")

    def stop(self, next_buckets: Iterable[tuple[int, int]]) -> None:
        """``(sender, bucket)``: each sender's first bucket not released."""
        for sender, bucket in next_buckets:
            self._calls.set(f"{self._prefix}go/{sender}/{bucket}", "stop")

    def wait(self, sender: int, bucket: int) -> bool:
        """Blocks until the bucket is released (True) or the update stopped (False)."""
        key = f"{self._prefix}go/{sender}/{bucket}"
        word = self._waits.get(key)
        self._waits.delete_key(key)
        return word == b"go"

    def done(self) -> None:
        self._calls.set(self._prefix + "done", "")

    def wait_done(self) -> None:
        self._waits.get(self._prefix + "done")
