"""SGLang on CPU: the directory put on the engine subprocess's PYTHONPATH (CPU only).

SGLang's CPU path imports a few ops from ``sgl_kernel``, whose wheels are CUDA-only. The
``sgl_kernel`` package in this directory is a small pure-torch stand-in: it implements the one
op the CPU server actually calls for our models (``assign_req_to_token_pool_cpu``) and raises
``NotImplementedError`` naming any other op, so a new call site fails loudly instead of
silently computing something else. It is guarded by the exact SGLang version it was measured
on (:data:`SUPPORTED_SGLANG`); the launcher refuses other versions on CPU.

:func:`multi_rank_env` is what a CPU engine of more than one rank (``--tp-size`` > 1, or attention
DP) needs from the environment on this version (measured 2026-12-03; issue 30):
``SGLANG_CPU_OMP_THREADS_BIND`` (SGLang asserts ranks <= NUMA nodes unless each rank's cores are
given) and ``SGLANG_NCCL_SO_PATH`` pointing at no library (the CUDA build of torch ships libnccl,
and SGLang's PyNccl then fails with ``Expected a cuda device, but got: cpu``; without the library
it stays off and gloo carries the collectives).
"""

import os
from pathlib import Path

SUPPORTED_SGLANG = "0.5.23"
STANDIN_DIR = Path(__file__).resolve().parent
NO_NCCL = "/nonexistent/sao-cpu-engine/libnccl.so"
"""Where ``SGLANG_NCCL_SO_PATH`` points on a CPU engine: no file, so SGLang's PyNccl stays off."""


def _ranges(cores: list[int]) -> str:
    """``0-3`` for consecutive cores, ``0,2`` otherwise (SGLang's per-rank core list syntax)."""
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))


def multi_rank_env(ranks: int, cores: list[int] | None = None, world: int | None = None) -> dict[str, str]:
    """Environment a CPU engine's process of ``ranks`` ranks (of ``world``, all of the engine's ranks
    over its nodes; default ``ranks``) needs, empty for a one-rank engine: each rank bound to its
    share of ``cores`` (this process's allowed cores by default; with fewer cores than ranks, ranks
    share them round-robin), PyNccl off. A node's one rank of a multi-node engine needs them too
    (SGLang checks the engine's whole world against the NUMA nodes)."""
    if (ranks if world is None else world) <= 1:
        return {}
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if len(cores) >= ranks:
        per, extra = divmod(len(cores), ranks)
        groups, start = [], 0
        for r in range(ranks):
            n = per + (1 if r < extra else 0)
            groups.append(cores[start : start + n])
            start += n
    else:
        groups = [[cores[r % len(cores)]] for r in range(ranks)]
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(_ranges(g) for g in groups), "SGLANG_NCCL_SO_PATH": NO_NCCL}
