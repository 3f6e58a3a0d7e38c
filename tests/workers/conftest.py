"""One spawned 2-rank world shared by several test modules here (a world's start costs more than
most cases): the context-parallel wiring cases (test_context_parallel_wiring.py), the actor/critic
cases at DP=2 and TP=2 (test_workers.py) and the non-finite step (test_nonfinite.py)."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed


def workers_cases(rank: int, world: int, ckpt_root: str) -> dict:
    from megatron.core import parallel_state as ps

    from tests.workers import test_context_parallel_wiring, test_nonfinite, test_workers

    out = {"cp": test_context_parallel_wiring.case_all(rank, world)}
    out["workers"] = test_workers.case_both_layouts(rank, world, ckpt_root)
    out["nonfinite"] = test_nonfinite.case_nan_update(rank, world)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="package")
def workers_world(tmp_path_factory) -> list[dict]:
    """Per rank: {"cp": ..., "workers": ..., "nonfinite": ...}, each module's case results."""
    return run_distributed(workers_cases, 2, str(tmp_path_factory.mktemp("ck")))
