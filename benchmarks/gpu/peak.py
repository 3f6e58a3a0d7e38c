"""Matrix-product throughput: the bf16 peak the MFU figures divide by.

Measured, not taken from a datasheet: square ``n x n`` products on random data (zeros run
faster on Hopper; random is the honest ceiling), CUDA events around ``reps`` back-to-back
products after ``warmup`` untimed ones. The same function runs on CPU (float32, small ``n``)
so the tests exercise it.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from benchmarks.gpu.workload import matmul_flops


@dataclasses.dataclass(frozen=True)
class MatmulRate:
    tflops: float
    """Mean TFLOP/s over the timed products."""
    n: int
    reps: int
    dtype: str
    seconds: float
    """Wall time of the ``reps`` timed products."""


def matmul_tflops(
    n: int = 8192, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", warmup: int = 3, reps: int = 10
) -> MatmulRate:
    """Mean TFLOP/s of ``reps`` products ``[n, n] @ [n, n]`` (2 n^3 flops each)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            torch.matmul(a, b)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        seconds = time.perf_counter() - t0
    tflops = matmul_flops(n) * reps / seconds / 1e12
    return MatmulRate(tflops, n, reps, str(dtype).removeprefix("torch."), seconds)
