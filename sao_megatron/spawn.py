"""Run a function as one gloo/NCCL world of N local processes and collect per-rank results.

Used for local (non-Ray) role worlds and for distributed tests. The function must be
importable by name (spawn pickles it); it receives ``(rank, world_size, *args)`` with
``torch.distributed`` initialised and returns a JSON-serialisable value. A failure in any
rank raises :class:`WorldFailed` with that rank's traceback; a hang past ``timeout_s`` kills
the processes this call started (by PID) and raises ``TimeoutError`` (naming ``timeout_key``,
the setting that chose the limit, when given): a :class:`WorldTimeout`, whose one-line message
names a file holding every live rank's Python stacks at that moment (``faulthandler`` on
``SIGUSR1``; also in its ``stacks``), so a hang says where it hung. ``timeout_s`` is also the
world's collective timeout.

Ranks start as fresh interpreters (``spawn``) unless ``SAO_WORLD_START_METHOD=forkserver``: then
they fork from one server process per caller, which imports the modules named by
``multiprocessing.set_forkserver_preload`` once (the test suite preloads torch and Megatron:
tests/world_preload.py). A forked rank takes the caller's current environment, working directory
and stdout/stderr, as a spawned one does.

Each rank calls :func:`sao_megatron.logs.quiet_third_party` before it unpickles ``fn`` and its
arguments (which imports Megatron), so import-time notices are filtered too. With ``log_to``
(a path with ``{rank}``, e.g. ``run_dir / "logs" / "convert_rank{rank}.log"``) each rank's
stdout and stderr go to its own file instead of the console.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path


class WorldFailed(RuntimeError):
    """A rank of a spawned world raised."""


class WorldTimeout(TimeoutError):
    """A spawned world ran past its timeout; ``stacks``: its live ranks' Python stacks then."""

    def __init__(self, message: str, stacks: str):
        super().__init__(message)
        self.stacks = stacks


_HANDED_OUT: set[int] = set()

START_METHOD_ENV = "SAO_WORLD_START_METHOD"
START_METHODS = ("spawn", "forkserver")


def start_method() -> str:
    """How :func:`run_world` starts ranks: ``$SAO_WORLD_START_METHOD``, default ``spawn``."""
    method = os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use one of {', '.join(START_METHODS)}")
    return method


def free_port() -> int:
    """A port that was free a moment ago, never one this process handed out before.

    Probe-and-release: another process may still take it before the caller binds it. Servers
    started on such a port retry on a clash (``rollout.engine``); rendezvous stores avoid it by
    binding port 0 themselves (``parallel.open_store``)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _stacks_path(out_dir: str, rank: int) -> Path:
    return Path(out_dir, f"rank{rank}.stacks")


def _take_callers_context(env: dict[str, str], cwd: str, caller: int) -> None:
    """What a spawned rank inherits and a forked one does not: the caller's environment and working
    directory now, and where its stdout and stderr point now (opened through /proc, appending)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{caller}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # e.g. a socket: keep the server's
        os.dup2(target, fd)
        os.close(target)


def _entry(rank, payload, world_size, port, backend, out_dir, log_to, timeout_s, caller=None):
    if caller is not None:
        _take_callers_context(*caller)
    # One compute thread per rank unless the caller says otherwise: the ranks share the node's
    # cores. torch is imported already (it started this process), so its OpenMP pool has read the
    # environment: set the count on torch itself; the variable is for what the rank starts.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stacks = _stacks_path(out_dir, rank).open("w")  # open for the process's life: run_world reads it on a hang
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    from sao_megatron.logs import quiet_third_party, redirect_process_output

    if log_to is not None:
        redirect_process_output(log_to.format(rank=rank))
    quiet_third_party()
    from sao_megatron import parallel

    try:
        fn, args = pickle.loads(payload)  # only now: unpickling imports fn's module (and Megatron)
        # run_world's own store (it holds the port; loopback only): every rank is its client.
        store = parallel.join_store("127.0.0.1", port, world_size, timeout_s=300)
        parallel.init_distributed(
            rank, world_size, "127.0.0.1", port, backend=backend, timeout_s=timeout_s, store=store
        )
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        parallel.destroy()
    except Exception:
        pass


def run_world(
    fn,
    world_size: int,
    *args,
    backend: str = "auto",
    timeout_s: float = 900.0,
    log_to: str | os.PathLike | None = None,
    timeout_key: str = "",
) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; their return values in rank order.

    ``log_to``: a path containing ``{rank}``; each rank appends its stdout and stderr there
    (parent directories are created). None keeps them on this process's stdout/stderr.
    """
    from torch.multiprocessing.spawn import ProcessException, start_processes

    log = None if log_to is None else str(log_to)
    if log is not None and "{rank}" not in log:
        raise ValueError(f"log_to={log!r} must contain '{{rank}}' (one file per rank)")
    from sao_megatron.parallel import open_store

    payload = pickle.dumps((fn, args))
    method = start_method()
    caller = (dict(os.environ), os.getcwd(), os.getpid()) if method == "forkserver" else None
    # The rendezvous store lives here, on a port the OS picks while the store holds it: a port
    # chosen for rank 0 to bind later could be taken first by another process's world, whose
    # store the other ranks would then join (a hang until the timeout, seen under pytest-xdist).
    store = open_store("127.0.0.1", world_size, 0, timeout_s=300)
    with tempfile.TemporaryDirectory(prefix="sao-world-") as out_dir:
        ctx = start_processes(
            _entry,
            args=(payload, world_size, store.port, backend, out_dir, log, timeout_s, caller),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        assert ctx is not None  # join=False returns the process context
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    fix = f" ({timeout_key}={timeout_s:g}); raise {timeout_key}" if timeout_key else ""
                    stacks = _live_stacks(ctx.processes, out_dir)
                    where = ""
                    if stacks:  # kept past the world's temporary directory, named in the one-line error
                        with tempfile.NamedTemporaryFile(
                            "w", prefix="sao-world-stacks-", suffix=".txt", delete=False
                        ) as f:
                            f.write(stacks)
                        where = f"; the ranks' Python stacks then: {f.name}"
                    raise WorldTimeout(
                        f"{fn.__name__} on {world_size} ranks exceeded {timeout_s:.0f} s{fix}{where}", stacks
                    )
        except ProcessException as err:
            raise WorldFailed(str(err)) from None
        finally:
            for proc in ctx.processes:  # torch builds it from [None] * nprocs, hence the None check
                if proc is not None and proc.is_alive():
                    proc.kill()
        results = []
        for rank in range(world_size):
            path = Path(out_dir, f"rank{rank}.json")
            if not path.exists():
                raise WorldFailed(f"rank {rank} of {fn.__name__} exited without a result")
            data = json.loads(path.read_text())
            if not data["ok"]:
                where = "" if log is None else f" (its output: {log.format(rank=rank)})"
                raise WorldFailed(f"rank {rank} of {fn.__name__} failed{where}:\n{data['error']}")
            results.append(data["value"])
        return results


def _live_stacks(processes: list, out_dir: str, wait_s: float = 2.0) -> str:
    """Every live rank's Python stacks, each dumped by the rank itself on ``SIGUSR1``."""
    live = [(rank, p) for rank, p in enumerate(processes) if p is not None and p.is_alive()]
    for _, proc in live:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(wait_s)  # the dumps are written by the ranks' signal handlers
    parts = []
    for rank, _ in live:
        path = _stacks_path(out_dir, rank)
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        parts.append(f"--- rank {rank} stacks ---\n{text or '(none written: the rank had not started Python yet)'}\n")
    return "".join(parts)
