"""Exact metric reductions over micro-batches and data-parallel ranks (``reduce_metrics``).

Subset metrics (``*/adv_pos``, ``*/adv_neg``, ``dis/kept_frac/lag*``) are weighted by their own
token counts, ``*/max`` reduce by max, totals by sum: micro-batches that each hold one advantage sign
give the whole-batch values. Quantiles and ESS are approximate by design (docs/training.md)."""

import pytest
import torch

from sao_megatron import algo
from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX
from sao_megatron.workers.metrics import metric_rule, reduce_metrics
from tests.distributed import run_distributed
from tests.tolerance import sum_atol
from tests.workers import metrics_cases

APPROXIMATE = ("ratio/p1", "ratio/p50", "ratio/p99", "ess")


def exact_keys(metrics):
    return [k for k in metrics if not k.endswith(WEIGHT_SUFFIX) and not k.startswith(APPROXIMATE)]


def exact_atol(key: str, n: int, loss_abs_sum: float, operand_bound: float) -> float:
    """Bound on ``|got - want|`` for an exact key whose two sides differ only in summation order
    (micro-batches and ranks vs the whole batch; tests/tolerance.py), over ``n`` action tokens.

    ``loss``: a float32 sum of ``n`` terms whose magnitudes add up to ``loss_abs_sum``. A term may differ
    by a few ulps: exp runs in the SIMD body or the scalar tail of the elementwise loop depending on the
    tensor's length (up to 2 ulps apart), then the products by A and the weight round once each.
    Every other key: a float64 mean over tokens of at most 3 operands each (``kl_k3 = rho - 1 - log rho``)
    whose magnitudes add up to at most ``operand_bound`` per token; ``reduce_metrics`` re-weights by the
    micro-batch counts and divides by the total (3 more roundings per term).
    """
    if key == "loss":
        return sum_atol(n, torch.float32, loss_abs_sum, term_ulps=4)
    return sum_atol(3 * n + 3, torch.float64, operand_bound, term_ulps=4)


def test_rules():
    assert [
        metric_rule(k)
        for k in (
            "ratio/max",
            "ratio/max/adv_neg",
            "x/min",
            "loss",
            "num_tokens/adv_pos",
            "dis/tokens/lag0",
            "ratio/mean/adv_pos",
            "ratio/p99",
        )
    ] == ["max", "max", "min", "sum", "sum", "sum", "mean", "mean"]


@pytest.mark.parametrize("name", ["dis", "ppo_clip", "vanilla"])
def test_one_sign_per_micro_batch_reduces_to_the_whole_batch(name):
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g) * 3
    beh = lp + torch.randn(4, 6, generator=g) * 0.4
    mask = torch.rand(4, 6, generator=g) > 0.2
    adv = torch.rand(4, 6, generator=g) + 0.1
    adv[2:] *= -1  # micro-batch 1 (rows 0-1) all positive, micro-batch 2 (rows 2-3) all negative
    eps = {} if name == "vanilla" else {"eps_low": 0.2, "eps_high": 0.3}
    n = float(mask.sum())
    _, whole = algo.policy_loss(name, lp, beh, adv, mask, num_tokens_global=n, **eps)
    per_micro = []
    for rows in (slice(0, 2), slice(2, 4)):
        _, m = algo.policy_loss(name, lp[rows], beh[rows], adv[rows], mask[rows], num_tokens_global=n, **eps)
        m["micro_tokens"] = float(mask[rows].sum())
        per_micro.append(m)
    got = reduce_metrics(per_micro, dp=False)
    assert not any(k.endswith(WEIGHT_SUFFIX) or k == "micro_tokens" for k in got)
    # each micro-batch holds one sign of A, and so of the loss's terms: their |loss| add up to sum |terms|
    loss_abs_sum = sum(abs(m["loss"]) for m in per_micro)
    bound = metrics_cases.operand_bound(lp, beh, mask)
    if name == "ppo_clip":  # what another x86-64 machine computed (micro-batches, whole batch)
        assert abs(-0.011952757835 - -0.0119527354) <= exact_atol("loss", int(n), loss_abs_sum, bound)
    for key in exact_keys(whole):
        atol = exact_atol(key, int(n), loss_abs_sum, bound)
        assert got[key] == pytest.approx(whole[key], rel=0, abs=atol), key
    rho = torch.exp(lp - beh)[mask]  # float32 here, float64 in the metric: a max, no sum; default rel 1e-6
    assert got["ratio/max"] == pytest.approx(float(rho.max()))
    assert got["ratio/max/adv_neg"] == pytest.approx(float(torch.exp(lp - beh)[2:][mask[2:]].max()))
    # each sign lives in one micro-batch: weighting by the micro-batch's tokens would mix in the other's 0
    assert per_micro[1]["ratio/mean/adv_pos"] == 0.0 and got["ratio/mean/adv_pos"] > 0
    assert got["num_tokens/adv_pos"] + got["num_tokens/adv_neg"] == n


def test_min_and_empty_subsets():
    per_micro = [
        {"x/min": 0.0, "x/min#n": 0.0, "f": 1.0, "f#n": 0.0, "micro_tokens": 3.0},
        {"x/min": 2.0, "x/min#n": 1.0, "f": 0.25, "f#n": 4.0, "micro_tokens": 1.0},
        {"x/min": 5.0, "x/min#n": 2.0, "g": 2.0, "micro_tokens": 1.0},
    ]
    assert reduce_metrics(per_micro, dp=False) == {"x/min": 2.0, "f": 0.25, "g": 2.0}
    assert reduce_metrics([{"f": 0.0, "f#n": 0.0}], dp=False) == {"f": 0.0}


@pytest.mark.parametrize("world", [1, 2], ids=["1rank", "dp2"])
def test_actor_update_metrics_equal_the_whole_batch_computation(world):
    results = run_distributed(metrics_cases.case_update_metrics_match_whole_batch, world)
    for r in results:  # every rank reports the same reduced metrics
        got, want = r["got"], r["want"]
        assert got["updated"] == 1.0
        assert {
            "ratio/max/adv_pos",
            "dis/kept_frac/lag0/adv_neg",
            "dis/kept_frac/lag2/adv_pos",
            "dis/kept_frac/lag2/adv_neg",
        } <= set(want)
        for key in exact_keys(want):  # the same logprobs: only the summation order differs
            atol = exact_atol(key, r["n"], r["loss_abs_sum"], r["bound"])
            assert got[key] == pytest.approx(want[key], rel=0, abs=atol), key
