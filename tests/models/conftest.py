"""Spawned 2-rank worlds shared by several test modules here (a world's start costs more than most
cases): one for the parallel-layout cases (tests/models/test_parallel.py) and the logprob function's
TP 2 case (test_logprobs_memory.py), one for the HF export tests (test_hf_stream.py, test_hf_weights.py),
whose cases read the same small checkpoint."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.models.hf_cases import write_big_checkpoint


def parallel_cases(rank: int, world: int) -> dict:
    from tests.models import test_logprobs_memory, test_parallel

    return {**test_parallel.all_cases(rank, world), "logprobs": test_logprobs_memory.case(rank, world)}


@pytest.fixture(scope="package")
def parallel_world() -> list[dict]:
    return run_distributed(parallel_cases, 2, timeout_s=600)


def export_cases(rank: int, world: int, root: str) -> dict:
    from tests.models import test_hf_stream, test_hf_weights

    # the weights cases end with a stalled rank that breaks the world's groups: they run last
    return {"stream": test_hf_stream._cases(rank, world, root), "weights": test_hf_weights._cases(rank, world, root)}


@pytest.fixture(scope="package")
def export_world(tmp_path_factory):
    from tests.models.test_hf_stream import MODEL

    root = tmp_path_factory.mktemp("export")
    write_big_checkpoint(root / "hf", MODEL, shard_bytes=64 << 10)
    return root, run_distributed(export_cases, 2, str(root), timeout_s=600)
