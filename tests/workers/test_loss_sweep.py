"""Every ``algo.policy_loss`` x ``algo.advantage`` choice runs one real actor step (one spawned world)."""

import math

import pytest

from sao_megatron.algo.choices import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from tests.distributed import run_distributed
from tests.workers import sweep_cases


@pytest.fixture(scope="module")
def sweep():
    return run_distributed(sweep_cases.case_every_loss_and_estimator, 1)[0]


@pytest.mark.parametrize("loss", POLICY_LOSSES)
@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_one_real_step(sweep, estimator, loss):
    r = sweep[f"{estimator}/{loss}"]
    assert r["updated"] == 1.0 and r["adv_finite"] and r["metrics_finite"], r
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
    if estimator != "running_mean_global":  # a fresh global baseline may equal the batch mean only by chance
        assert r["adv_nonzero"] and r["grad_norm"] > 0, r


def test_over_lag_mask_gives_tokens_past_the_bound_no_gradient_in_a_real_step(sweep):
    fresh, stale = sweep["mask/v2"], sweep["mask/v9"]  # the policy loss (the MoE's aux loss aside)
    assert fresh["stale_masked"] == 0.0 and fresh["loss"] != 0.0 and fresh["updated"] == 1.0, fresh
    assert stale["stale_masked"] == 1.0 and stale["loss"] == 0.0 and stale["updated"] == 1.0, stale
