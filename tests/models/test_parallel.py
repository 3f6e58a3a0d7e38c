"""TP=2, EP=2 (allgather and alltoall), PP=2 give the single-rank logits and gradients (float32).

All cases run in one spawned 2-rank gloo world (start-up dominates the cost; shared with
test_logprobs_memory.py through tests/models/conftest.py); each test then asserts on its case's figures. Tolerance: max abs diff <= 1e-5 (:data:`TOL`).
"""

import pytest

from tests.models import parallel_cases

TOL = 1e-5
"""Model-level, not one sum of n terms: the whole float32 forward and backward in another layout, whose
split sums (row-parallel linears, expert dispatch, the vocab-parallel softmax) propagate through every
nonlinear layer, so tests/tolerance.py's bound does not apply. Measured at most 4.8e-7 on the logits and
4.6e-8 on the gradients (x86-64 CPUs); a wrong shard moves the logits by O(1)."""


def all_cases(rank, world):
    return {
        "tp": parallel_cases.case_tp(rank, world),
        "ep_allgather": parallel_cases.case_ep(rank, world, "allgather"),
        "ep_alltoall": parallel_cases.case_ep(rank, world, "alltoall"),
        "pp": parallel_cases.case_pp(rank, world),
    }


@pytest.fixture(scope="module")
def results(parallel_world):
    return parallel_world


def test_tensor_parallel_matches_single_rank(results):
    for r in results:
        tp = r["tp"]
        assert tp["logits"] <= TOL and tp["loss"] <= TOL, tp
        assert tp["grads"] <= TOL, tp


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_parallel_matches_single_rank(results, dispatcher):
    for r in results:
        ep = r[f"ep_{dispatcher}"]
        assert ep["local_experts"] == 4
        assert ep["logits"] <= TOL, ep
        assert ep["expert_grads"] <= TOL and ep["dense_grads"] <= TOL, ep


def test_pipeline_parallel_matches_single_rank(results):
    assert sorted(r["pp"]["stage"] for r in results) == [0, 1]
    for r in results:
        assert r["pp"]["grads"] <= TOL, r["pp"]
    assert [r["pp"]["loss"] <= TOL for r in results if "loss" in r["pp"]] == [True]


def test_gather_to_rank_zero_only_holds_the_full_state_there_and_nothing_elsewhere(results):
    """``gather_full(rank0_only=True)`` (what ``sao check`` saves) at TP=2, EP=2 with DP=2, PP=2."""
    for r in results:
        assert [r[case]["rank0_only"] for case in ("tp", "ep_allgather", "ep_alltoall", "pp")] == [True] * 4
