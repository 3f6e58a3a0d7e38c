"""Run a function as one gloo/NCCL world of N local processes and collect per-rank results.

Used for local (non-Ray) role worlds and for distributed tests. The function must be
importable by name (spawn pickles it); it receives ``(rank, world_size, *args)`` with
``torch.distributed`` initialised and returns a JSON-serialisable value. A failure in any
rank raises :class:`WorldFailed` with that rank's traceback; a hang past ``timeout_s`` kills
the processes this call started (by PID) and raises ``TimeoutError``.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path


class WorldFailed(RuntimeError):
    """A rank of a spawned world raised."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, fn, world_size, port, backend, out_dir, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from sao_megatron import parallel

    try:
        parallel.init_distributed(rank, world_size, "127.0.0.1", port, backend=backend, timeout_s=300)
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        parallel.destroy()
    except Exception:
        pass


def run_world(fn, world_size: int, *args, backend: str = "auto", timeout_s: float = 900.0) -> list:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory(prefix="sao-world-") as out_dir:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, free_port(), backend, out_dir, args), nprocs=world_size,
            join=False, start_method="spawn",
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks exceeded {timeout_s:.0f} s")
        except ProcessException as err:
            raise WorldFailed(str(err)) from None
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        results = []
        for rank in range(world_size):
            path = Path(out_dir, f"rank{rank}.json")
            if not path.exists():
                raise WorldFailed(f"rank {rank} of {fn.__name__} exited without a result")
            data = json.loads(path.read_text())
            if not data["ok"]:
                raise WorldFailed(f"rank {rank} of {fn.__name__} failed:\n{data['error']}")
            results.append(data["value"])
        return results
