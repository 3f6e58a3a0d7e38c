"""``strict_nccl``: a CPU process-group backend with NCCL's contract, for tests.

Gloo and NCCL differ exactly where the trainer -> engine path has broken before, and gloo is all a
CPU suite has: gloo blocks where NCCL only enqueues, gloo builds every group from a store where a
device-bound NCCL world splits communicators, gloo raises at once when a peer dies where NCCL hangs
until its watchdog, and gloo has no watchdog that takes the process down. This backend moves the
data over gloo (a gloo group of the same ranks on the same store) and keeps NCCL's semantics, as
torch 2.14.1's ``ProcessGroupNCCL`` and ``distributed_c10d`` have them:

- **Enqueue, complete later.** Every collective and point-to-point op returns a :class:`StrictWork`
  at once; the ops of one group complete in issue order (NCCL runs them on one stream).
  ``Work.wait()`` without a timeout blocks the host only for an op whose result this rank reads
  (NCCL's ``wait`` only orders the current stream; a CPU test has no stream, and the host reading
  the result is what syncs it on a GPU); an op that only reads this rank's tensors (send, a
  non-root gather or reduce, the root of a broadcast or scatter) returns at once, its inputs
  copied at the call (the stream would have ordered later writes after it).
  ``Work.wait(timeout)`` blocks until done or the timeout (measured from the enqueue), then aborts
  the group and raises ``DistBackendError`` (``WorkNCCL::synchronizeInternal``: a user timeout
  blocks the host); the group's other pending ops then complete without an error, and every later
  op on it raises at its call.
- **A peer that dies hangs the op** (NCCL does not see a closed socket as an error of the op): a
  failure gloo reports is held until the group's timeout, then handled as a timeout.
- **A watchdog per group** (``ProcessGroupNCCL::watchdogHandler``): an op not completed within
  the group's timeout is handled as ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says, read from the
  environment when the group is built (torch reads it per group, in the constructor): 0 logs and
  keeps waiting, 2 aborts the group (later ops raise), 1 and 3 (the default) take the process down
  with ``SIGABRT`` (``std::abort``) after a line naming the group, op, sequence number and
  timeout. ``TORCH_NCCL_BLOCKING_WAIT=1`` makes every ``wait()`` block and raise at the timeout
  instead.
- **Communicators split from a bound world.** A world built by this backend is bound to this
  process's device (``init_process_group(device_id=...)`` does that for NCCL; on CPU the group's
  ``bound_device_id`` is the rank's CUDA device, by name only: tensors stay on the CPU), and torch then hands every later group the world's
  backend as ``split_from`` (``_new_process_group_helper``: ``ncclCommSplit``). A split is a
  collective over the parent: every parent rank must take part in each split, members and
  non-members (``perform_nocolor_split``) alike, in the same order, and the new group's members
  must all be ranks of that parent. Where NCCL would hang, this backend raises
  :class:`NcclWouldHang` at once, naming the group, the parent and the call site.
- **One GPU per rank of a communicator**: two ranks on one device of one host are refused
  (NCCL: ``ncclInvalidUsage`` "Duplicate GPU detected"). A process's device is what
  :func:`set_device` chose, else ``SAO_STRICT_DEVICE`` (``none``: not checked), else device 0 (the
  CUDA default a process that never chooses gets), mapped through ``CUDA_VISIBLE_DEVICES``.

Select it by name wherever the code takes a backend (``actor.backend``, the sync's backend, an
engine's ``/init_weights_update_group``); :func:`register` makes the name known in a process (the
CPU engine shim calls it in engine processes when ``SAO_STRICT_NCCL=1``). Data, reductions and
shapes are gloo's: kernels and memory are not modelled.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import ProcessGroupGloo
from torch.futures import Future

NAME = "strict_nccl"
DEVICE_ENV = "SAO_STRICT_DEVICE"
ENABLE_ENV = "SAO_STRICT_NCCL"
"""``1`` in an engine process's environment: the CPU engine shim registers the backend there."""
SPLIT_WAIT_ENV = "SAO_STRICT_SPLIT_WAIT_S"


def split_wait_s() -> float:
    """How long a split waits for every parent rank before it reports where NCCL would hang
    (``SAO_STRICT_SPLIT_WAIT_S``, default 60). NCCL itself would wait on; the bound is where a test
    says so instead. Ranks of one world reach a split within seconds of each other (each split
    waits for the whole parent, so they move in step), and 60 s leaves room for a loaded machine;
    a new group's members are waited for up to its timeout, as ``ncclCommInitRank`` waits."""
    return float(os.environ.get(SPLIT_WAIT_ENV, "60"))


class NcclWouldHang(RuntimeError):
    """A communicator set-up that NCCL would not finish: a split some parent rank never joins, in a
    different order on different ranks, or with members outside the parent."""


class DuplicateDevice(RuntimeError):
    """Two ranks of one communicator on one device (NCCL: ``Duplicate GPU detected``)."""


_device: int | None = None


def set_device(index: int) -> None:
    """This process's device, as ``torch.cuda.set_device`` chooses it for NCCL."""
    global _device
    _device = index


def device_count() -> int:
    """Devices of a node as this backend counts them (``SAO_STRICT_DEVICES``, default 8)."""
    return int(os.environ.get("SAO_STRICT_DEVICES", "8"))


def device_identity() -> str | None:
    """``host:physical index`` of this process's device, None where not checked."""
    if _device is not None:
        index = str(_device)
    else:
        index = os.environ.get(DEVICE_ENV, "0")
        if index.lower() == "none":
            return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    physical = visible[int(index)] if visible and int(index) < len(visible) else index
    return f"{socket.gethostname()}:{physical}"


def _call_site() -> str:
    """The first frame outside torch and this module: where the group was asked for."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename.replace(os.sep, "/")
        if "/torch/" not in name and not name.endswith("runtime/strict_nccl.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "unknown"


class StrictWork(dist.Work):
    """One enqueued op: completed by its group's worker, in issue order."""

    def __init__(self, backend: StrictBackend, seq: int, op: str, reads_result: bool):
        super().__init__()
        self.backend = backend
        self.seq = seq
        self.op = op
        self.reads_result = reads_result
        self.started = time.monotonic()
        self.inner: Any = None
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.future: Future = Future()
        self.result_tensors: list[torch.Tensor] = []
        self.held: BaseException | None = None  # gloo's failure, not shown before the timeout

    def describe(self) -> str:
        return (
            f"WorkNCCL(SeqNum={self.seq}, OpType={self.op}, Timeout(ms)="
            f"{int(self.backend.timeout.total_seconds() * 1000)}) of group {self.backend.group_name}"
        )

    def _finish(self, error: BaseException | None) -> None:
        if self.done.is_set():
            return
        self.error = error
        self.done.set()
        if error is None:
            self.future.set_result(self.result_tensors)
        else:
            self.future.set_exception(error)

    def is_completed(self) -> bool:
        return self.done.is_set()

    def is_success(self) -> bool:
        return self.done.is_set() and self.error is None

    def exception(self):
        return self.error

    def get_future(self) -> Future:
        return self.future

    def result(self) -> list[torch.Tensor]:
        return self.result_tensors

    def wait(self, timeout: timedelta | None = None) -> bool:
        user_timeout = timeout is not None and timeout.total_seconds() > 0
        if not user_timeout and not self.backend.blocking_wait and not self.reads_result:
            return True  # NCCL orders the stream only; nothing of this rank waits for the op
        if user_timeout or self.backend.blocking_wait:
            # WorkNCCL::checkTimeout measures from the op's enqueue (workStartTime_), not from the wait
            limit = timeout.total_seconds() if user_timeout else self.backend.timeout.total_seconds()  # type: ignore[union-attr]
            if not self.done.wait(max(0.0, limit - (time.monotonic() - self.started))):
                ran = int((time.monotonic() - self.started) * 1000)
                message = (
                    f"Watchdog caught collective operation timeout: {self.describe()} ran for {ran} milliseconds "
                    "before timing out."
                )
                self.backend.abort(reason=message)
                raise dist.DistBackendError(message)
        else:
            self.done.wait()
        if self.error is not None:
            raise dist.DistBackendError(str(self.error))
        return True


class StrictBackend(_C10dBackend):
    """One communicator: a gloo group of the same ranks carries the data; this object keeps NCCL's
    completion, watchdog and set-up rules (module docstring)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        group_name: str,
        parent: StrictBackend | None,
        ranks_in_parent: list[int] | None = None,
    ):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.store = store
        self.timeout = timeout
        self.group_name = group_name
        self.parent = parent
        if rank == 0:  # one id for the communicator on every rank (NCCL: its unique id, from rank 0)
            store.set("strict/uid", uuid.uuid4().hex)
        # NCCL's ncclCommInitRank waits for every member (slow starters included): here up to the
        # group's timeout, and never less than the split bound (a group with a short op timeout is
        # still made among processes that start seconds apart)
        self.join_timeout = max(timeout, timedelta(seconds=split_wait_s()))
        try:
            store.wait(["strict/uid"], self.join_timeout)
        except Exception:
            raise NcclWouldHang(
                f"group {group_name}: its rank 0 never joined within {self.join_timeout.total_seconds():g} s "
                f"(NCCL would hang here, in ncclCommInitRank); created at {_call_site()}"
            ) from None
        self.uid = store.get("strict/uid").decode()
        self.error_handling = int(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"))
        self.blocking_wait = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") in ("1", "true", "True")
        self.splits = 0  # splits of this communicator joined so far (this rank)
        self.aborted: str | None = None
        self.closed = False
        self.seq = 0
        self._lock = threading.Condition()
        self._pending: deque[StrictWork] = deque()
        self._check_members()
        if parent is not None:
            parent.join_split(group_name, size, ranks_in_parent)
        # gloo carries the data; its own timeout is far past the group's, so the watchdog decides
        # typed Any: torch's stubs do not declare the collectives the binding has
        self.gloo: Any = ProcessGroupGloo(store, rank, size, timeout * 4 + timedelta(seconds=60))
        self._worker = threading.Thread(target=self._run, name=f"strict-nccl-{group_name}", daemon=True)
        self._worker.start()
        _watched.add(self)
        _start_watchdog()

    # --- set-up rules -------------------------------------------------------------------------
    def _check_members(self) -> None:
        """Every member's parent and device, read from this group's store: members outside the
        split's parent, or two on one device, fail here on every member."""
        me = {
            "parent": self.parent.uid if self.parent else None,
            "parent_name": self.parent.group_name if self.parent else None,
            "device": device_identity(),
            "pid": os.getpid(),
        }
        self.store.set(f"strict/member/{self._rank}", json.dumps(me))
        keys = [f"strict/member/{r}" for r in range(self._size)]
        try:
            self.store.wait(keys, self.join_timeout)
        except Exception:
            missing = [r for r in range(self._size) if not self.store.check([f"strict/member/{r}"])]
            raise NcclWouldHang(
                f"group {self.group_name}: ranks {missing} of {self._size} never joined within "
                f"{self.join_timeout.total_seconds():g} s (NCCL would hang here, in ncclCommInitRank); created at "
                f"{_call_site()}"
            ) from None
        members = [json.loads(self.store.get(k)) for k in keys]
        parents = {m["parent"] for m in members}
        if len(parents) > 1:
            inside = [r for r, m in enumerate(members) if m["parent"] == me["parent"]]
            outside = [r for r, m in enumerate(members) if m["parent"] != me["parent"]]
            source = next((m["parent_name"] for m in members if m["parent"]), None)
            raise NcclWouldHang(
                f"group {self.group_name} is made by splitting the bound world {source!r} on some ranks "
                f"but its ranks {outside if me['parent'] else inside} are not ranks of that world "
                f"(ranks {inside if me['parent'] else outside} split it): ncclCommSplit needs every member "
                f"in the parent communicator, so NCCL would hang here. Created at {_call_site()}. Build a "
                "group with members outside the world without splitting (the default group unbound while "
                "it is made)"
            )
        seen: dict[str, int] = {}
        for r, m in enumerate(members):
            if m["device"] is None:
                continue
            if m["device"] in seen:
                raise DuplicateDevice(
                    f"group {self.group_name}: ranks {seen[m['device']]} and {r} are both on device "
                    f"{m['device']} (pids {members[seen[m['device']]]['pid']}, {m['pid']}); NCCL refuses a "
                    f"duplicate GPU in one communicator. Created at {_call_site()}: give each rank its own "
                    "device (torch.cuda.set_device(local rank) before the world is made)"
                )
            seen[m["device"]] = r

    def join_split(self, group_name: str | None, size: int | None, ranks: list[int] | None = None) -> None:
        """This rank's part of split number ``self.splits``: every parent rank must take part, with
        the same group (name and global ranks) at the same number, and the members must be the new
        group's whole size."""
        seq = self.splits
        self.splits += 1
        entry = {"group": group_name, "ranks": ranks or [], "at": _call_site()}
        self.store.set(f"strict/split/{seq}/{self._rank}", json.dumps(entry))
        keys = [f"strict/split/{seq}/{r}" for r in range(self._size)]
        # ncclCommSplit is a collective of the whole parent, blocking for members and non-members
        # (NCCL_SPLIT_NOCOLOR, performNocolorSplit) alike
        try:
            self.store.wait(keys, timedelta(seconds=split_wait_s()))
        except Exception:
            missing = [r for r in range(self._size) if not self.store.check([keys[r]])]
            made = "this rank is not a member of the new group" if group_name is None else f"making group {group_name}"
            raise NcclWouldHang(
                f"split #{seq} of {self.group_name} ({made}): parent ranks {missing} of {self._size} never took "
                f"part within {split_wait_s():g} s: ncclCommSplit is a collective of the whole parent, so NCCL "
                f"would hang here. At {_call_site()}"
            ) from None
        if group_name is None:
            return
        entries = [json.loads(self.store.get(k)) for k in keys]
        mine = (group_name, entry["ranks"])
        other = [(r, e) for r, e in enumerate(entries) if e["group"] is not None and (e["group"], e["ranks"]) != mine]
        if other:
            r, e = other[0]
            raise NcclWouldHang(
                f"split #{seq} of {self.group_name}: this rank makes group {group_name} (ranks {entry['ranks']}) "
                f"but parent rank {r} makes {e['group']} (ranks {e['ranks']}, at {e['at']}): ranks split in "
                f"different orders, so NCCL would hang or mismatch communicators here. Created at {_call_site()}"
            )
        joined = sum(e["group"] == group_name for e in entries)
        if size is not None and joined != size:
            raise NcclWouldHang(
                f"group {group_name} of {size} ranks is split from {self.group_name}, but {joined} parent ranks "
                f"joined it (split #{seq}): its other members are not ranks of the parent, so NCCL would hang "
                f"here. Created at {_call_site()}"
            )

    # the name torch calls on a parent rank that is not a member of the new group
    def perform_nocolor_split(self, device: torch.device | None = None) -> None:
        self.join_split(None, None)

    @property
    def supports_splitting(self) -> bool:
        return True

    @property
    def supports_coalescing(self) -> bool:
        return False

    def getBackendName(self) -> str:
        return NAME

    def name(self) -> str:
        return NAME

    # --- completion and watchdog ---------------------------------------------------------------
    def _run(self) -> None:
        """The group's worker: completes its ops in issue order (gloo's ``wait``; gloo's p2p works
        say they are complete only once waited). A failure gloo reports is held: the op stays
        pending, as an NCCL op with a dead peer does, until the watchdog's timeout."""
        while True:
            with self._lock:
                while not self._pending and not self.closed:
                    self._lock.wait()
                if not self._pending:  # shut down (destroy_process_group): the thread ends with the group
                    return
                work = self._pending[0]
            try:
                work.inner.wait()
            except Exception as err:  # a peer died or gloo failed: NCCL would just not complete
                work.held = err
                work.done.wait()  # ended by the watchdog or an abort
            else:
                work._finish(None)
            with self._lock:
                self._pending.popleft()

    def _watch(self) -> None:
        """One pass of the watchdog (``ProcessGroupNCCL::watchdogHandler``): the oldest pending op."""
        with self._lock:
            work = next((w for w in self._pending if not w.done.is_set()), None)
        if work is None:
            return
        if self.aborted is not None:
            work._finish(None)  # see abort()
        elif time.monotonic() - work.started > self.timeout.total_seconds():
            self._timed_out(work, work.held)

    def _timed_out(self, work: StrictWork, failed: BaseException | None) -> None:
        cause = f" (gloo underneath: {type(failed).__name__}: {str(failed)[:200]})" if failed else ""
        message = (
            f"[PG {self.group_name} Rank {self._rank}] Watchdog caught collective operation timeout: "
            f"{work.describe()} ran for {time.monotonic() - work.started:.1f} s{cause}"
        )
        if self.blocking_wait:
            return  # the waiter raises at its timeout; the watchdog does not act
        if self.error_handling in (1, 3):
            print(
                message + f"; TORCH_NCCL_ASYNC_ERROR_HANDLING={self.error_handling}: abort", file=sys.stderr, flush=True
            )
            os.abort()
        if self.error_handling == 2:
            self.abort(reason=message)
        elif not getattr(work, "_logged", False):
            print(message + "; TORCH_NCCL_ASYNC_ERROR_HANDLING=0: still waiting", file=sys.stderr, flush=True)
            work._logged = True  # type: ignore[attr-defined]

    def abort(self, reason: str = "abort requested") -> None:
        """NCCL's ``ncclCommAbort``: the group's pending ops end now, and every later op on it raises
        at its call. An op pending at the abort completes without an error and its output is left as
        it was (``WorkNCCL::isCompleted`` skips the error check on an aborted communicator; its end
        event fires when the kernels exit): only the waiter whose timeout aborted it raises."""
        if self.aborted is None:
            self.aborted = reason
        with self._lock:
            pending = list(self._pending)
        for work in pending:
            work._finish(None)

    def shutdown(self) -> None:
        """``destroy_process_group``: pending ops end (an abort) and the worker thread exits."""
        self.abort("shut down")
        with self._lock:
            self.closed = True
            self._lock.notify_all()
        _watched.discard(self)

    # --- ops ------------------------------------------------------------------------------------
    def _enqueue(self, op: str, reads_result: bool, issue: Callable[[], Any], results=()) -> StrictWork:
        if self.aborted is not None:
            raise dist.DistBackendError(
                f"{op} on group {self.group_name}: the communicator was aborted ({self.aborted})"
            )
        self.seq += 1
        work = StrictWork(self, self.seq, op, reads_result)
        work.result_tensors = list(results)
        work.inner = issue()
        with self._lock:
            self._pending.append(work)
            self._lock.notify()
        return work

    @staticmethod
    def _snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in tensors]

    def broadcast(self, tensors, opts):
        root = opts.rootRank == self._rank
        sent = self._snapshot(tensors) if root else tensors
        return self._enqueue("BROADCAST", not root, lambda: self.gloo.broadcast(sent, opts), tensors)

    def allreduce(self, tensors, opts):
        return self._enqueue("ALLREDUCE", True, lambda: self.gloo.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors, opts):
        return self._enqueue("ALLREDUCE_COALESCED", True, lambda: self.gloo.allreduce_coalesced(tensors, opts), tensors)

    def reduce(self, tensors, opts):
        root = opts.rootRank == self._rank
        sent = tensors if root else self._snapshot(tensors)
        return self._enqueue("REDUCE", root, lambda: self.gloo.reduce(sent, opts), tensors)

    def allgather(self, outputs, inputs, opts):
        flat = [t for group in outputs for t in group]
        return self._enqueue("ALLGATHER", True, lambda: self.gloo.allgather(outputs, inputs, opts), flat)

    def _allgather_base(self, output, input, opts):
        return self._enqueue("_ALLGATHER_BASE", True, lambda: self.gloo._allgather_base(output, input, opts), [output])

    def allgather_coalesced(self, outputs, inputs, opts):
        flat = [t for group in outputs for t in group]
        return self._enqueue(
            "ALLGATHER_COALESCED", True, lambda: self.gloo.allgather_coalesced(outputs, inputs, opts), flat
        )

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        return self._enqueue(
            "ALLGATHER_INTO_TENSOR_COALESCED",
            True,
            lambda: self.gloo.all_gather_single_coalesced(outputs, inputs, opts),
            outputs,
        )

    def gather(self, outputs, inputs, opts):
        root = opts.rootRank == self._rank
        sent = inputs if root else self._snapshot(inputs)
        flat = [t for group in outputs for t in group]
        return self._enqueue("GATHER", root, lambda: self.gloo.gather(outputs, sent, opts), flat)

    def gather_single(self, output, input, opts):
        root = opts.rootRank == self._rank
        sent = input if root else input.clone()
        return self._enqueue("GATHER", root, lambda: self.gloo.gather_single(output, sent, opts), [output])

    def scatter(self, outputs, inputs, opts):
        return self._enqueue("SCATTER", True, lambda: self.gloo.scatter(outputs, inputs, opts), outputs)

    def reduce_scatter(self, outputs, inputs, opts):
        return self._enqueue("REDUCE_SCATTER", True, lambda: self.gloo.reduce_scatter(outputs, inputs, opts), outputs)

    def _reduce_scatter_base(self, output, input, opts):
        return self._enqueue(
            "_REDUCE_SCATTER_BASE", True, lambda: self.gloo._reduce_scatter_base(output, input, opts), [output]
        )

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return self._enqueue(
            "REDUCE_SCATTER_TENSOR_COALESCED",
            True,
            lambda: self.gloo.reduce_scatter_single_coalesced(outputs, inputs, opts),
            outputs,
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._enqueue(
            "ALLTOALL_BASE",
            True,
            lambda: self.gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
            [output],
        )

    def alltoall(self, outputs, inputs, opts):
        return self._enqueue("ALLTOALL", True, lambda: self.gloo.alltoall(outputs, inputs, opts), outputs)

    def send(self, tensors, dst, tag):
        sent = self._snapshot(tensors)
        return self._enqueue("SEND", False, lambda: self.gloo.send(sent, dst, tag))

    def recv(self, tensors, src, tag):
        return self._enqueue("RECV", True, lambda: self.gloo.recv(tensors, src, tag), tensors)

    def recv_anysource(self, tensors, tag):
        return self._enqueue("RECV", True, lambda: self.gloo.recv_anysource(tensors, tag), tensors)

    def barrier(self, opts):
        return self._enqueue("BARRIER", True, lambda: self.gloo.barrier(opts))


_watched: weakref.WeakSet[StrictBackend] = weakref.WeakSet()
_watchdog_lock = threading.Lock()
_watchdog: threading.Thread | None = None
_WATCH_S = 0.05


def _start_watchdog() -> None:
    """One thread of this process watches every group (NCCL: a watchdog thread per group)."""
    global _watchdog
    with _watchdog_lock:
        if _watchdog is not None:
            return

        def loop() -> None:
            while True:
                for backend in list(_watched):
                    backend._watch()
                time.sleep(_WATCH_S)

        _watchdog = threading.Thread(target=loop, name="strict-nccl-watchdog", daemon=True)
        _watchdog.start()


class StrictGroup(dist.ProcessGroup):
    """The process group torch hands the caller: every op goes to its :class:`StrictBackend`.

    A Python process group (as torch's own ``multi_threaded_pg`` is) rather than a backend inside
    torch's: its ``barrier`` is this backend's (torch's C++ barrier allocates on the bound device,
    which a CPU machine has none of), and ``_get_backend`` hands torch the backend to split from."""

    def __init__(self, backend: StrictBackend):
        super().__init__(backend._rank, backend._size)  # pyright: ignore[reportCallIssue]  # (rank, size) at runtime
        self.backend = backend

    def _get_backend(self, device=None) -> StrictBackend:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.backend

    def getBackendName(self) -> str:
        return NAME

    def name(self) -> str:
        return NAME

    @property
    def group_name(self) -> str:  # pyright: ignore[reportIncompatibleMethodOverride]
        """torch's C++ group keeps its name on its backends, which a Python group has none of."""
        return self.backend.group_name

    @property
    def group_desc(self) -> str:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.backend.group_name

    def abort(self) -> None:
        self.backend.abort()

    def shutdown(self) -> None:
        self.backend.shutdown()

    def barrier(self, opts=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.backend.barrier(opts if opts is not None else dist.BarrierOptions())


def _delegate(op: str):
    def call(self, *args):
        return getattr(self.backend, op)(*args)

    call.__name__ = op
    return call


for _op in (
    "broadcast allreduce allreduce_coalesced reduce allgather _allgather_base allgather_coalesced "
    "allgather_into_tensor_coalesced gather scatter reduce_scatter _reduce_scatter_base "
    "reduce_scatter_tensor_coalesced alltoall_base alltoall send recv"
).split():
    setattr(StrictGroup, _op, _delegate(_op))
for _api, _op in {  # the names torch 2.14's distributed_c10d calls on a group, and the backend's op
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "recv_anysource": "recv_anysource",
    "gather_single": "gather_single",
}.items():
    setattr(StrictGroup, _api, _delegate(_op))


def _create(opts, backend_options=None) -> StrictGroup:
    """torch's extended-API creator: ``opts.split_from`` is the bound world's backend when torch
    would split (``_new_process_group_helper``), None otherwise."""
    parent = opts.split_from if isinstance(opts.split_from, StrictBackend) else None
    default_group = not opts.global_ranks_in_group and not dist.is_initialized()
    name = str(opts.group_id)
    backend = StrictBackend(
        opts.store, opts.group_rank, opts.group_size, opts.timeout, name, parent, list(opts.global_ranks_in_group)
    )
    group = StrictGroup(backend)
    if default_group or parent is not None:
        # NCCL binds the world to the rank's device when init_process_group gets device_id, and torch
        # then splits every later group from it (and binds each new group to the same device).
        # init_process_group refuses a CUDA device on a machine without one, so the binding is set
        # here: the rank's CUDA device as a name only (tensors stay on the CPU; this group's barrier
        # is its own, so nothing is allocated there). Gloo groups made beside it (Megatron's) are
        # registered for CUDA as well, as torch needs of a group bound to a device
        group.bound_device_id = torch.device("cuda", _device or 0)
    return group


_registered = threading.Lock()


def register() -> None:
    """Make :data:`NAME` a backend of this process (idempotent)."""
    with _registered:
        if NAME.upper() in dist.Backend._plugins:  # pyright: ignore[reportAttributeAccessIssue]
            return
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def is_nccl_like(backend: str) -> bool:
    """Whether the code should take its NCCL branches for ``backend``."""
    return backend in ("nccl", NAME)
