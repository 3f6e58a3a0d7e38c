"""The test tolerance helper: its formula, the figures another machine computed, and sums in other orders."""

import pytest
import torch

from tests.tolerance import sum_atol, sum_rtol

# tests/workers/test_metrics_exact.py, ppo_clip: a float32 loss over 19 action tokens, the first micro-batch's
# terms all negative and the second's all positive (their losses -0.31348 and 0.30153, so sum |x_i| is
# their magnitudes' sum); another x86-64 machine computed the whole batch as -0.0119527354 and the sum of
# the micro-batches as -0.011952757835, which a relative 1e-6 rejected.
N_TOKENS = 19
ABS_SUM = 0.3134783208370209 + 0.3015255630016327
MICRO, WHOLE = -0.011952757835, -0.0119527354


def test_formula():
    u = torch.finfo(torch.float32).eps / 2
    assert sum_rtol(1) == pytest.approx(2 * u, rel=1e-12)
    assert sum_rtol(19) == pytest.approx(2 * 19 * u / (1 - 19 * u), rel=1e-12)
    assert sum_rtol(19, term_ulps=4) == pytest.approx(sum_rtol(19) + 8 * u, rel=1e-12)
    assert sum_rtol(100, torch.float64) < 1e-13 < sum_rtol(100, torch.float32) < sum_rtol(100, torch.bfloat16)
    assert sum_atol(19, torch.float32, 2.0) == 2 * sum_rtol(19)
    for bad in (lambda: sum_rtol(0), lambda: sum_rtol(256, torch.bfloat16), lambda: sum_atol(3, torch.float32, -1)):
        with pytest.raises(ValueError):
            bad()


def test_accepts_the_other_machines_ppo_clip_loss_and_rejects_a_wrong_one():
    atol = sum_atol(N_TOKENS, torch.float32, ABS_SUM, term_ulps=4)
    assert abs(MICRO - WHOLE) <= atol
    assert MICRO == pytest.approx(WHOLE, rel=0, abs=atol)
    assert abs(MICRO - WHOLE) > 1e-6 * abs(WHOLE)  # what failed: relative to the cancelled sum alone
    # one token more in the normaliser (N = 20), or the second micro-batch dropped
    for wrong in (WHOLE * N_TOKENS / (N_TOKENS + 1), -0.3134783208370209, WHOLE * (1 + 1e-3)):
        assert abs(wrong - WHOLE) > atol, wrong


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 19, 200])
def test_sums_in_other_orders_stay_within_the_bound(dtype, n):
    """Sequential, reversed, pairwise and torch's own (SIMD) sums of mixed-sign terms, all rounding in ``dtype``."""
    if dtype == torch.bfloat16 and n * torch.finfo(dtype).eps / 2 >= 1:
        pytest.skip("no worst-case bound")
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, n, dtype=torch.float64)).to(dtype)

    def sequential(t):
        acc = torch.zeros((), dtype=dtype)
        for v in t:
            acc = acc + v
        return acc

    def pairwise(t):
        return t[0] if len(t) == 1 else pairwise(t[: len(t) // 2]) + pairwise(t[len(t) // 2 :])

    sums = [float(f(t)) for f in (sequential, pairwise) for t in (x, x.flip(0), x[torch.randperm(n, generator=g)])]
    sums.append(float(x.sum()))
    exact = float(x.double().sum())
    atol = sum_atol(n, dtype, float(x.double().abs().sum()))
    assert max(abs(a - b) for a in sums for b in sums) <= atol
    assert max(abs(s - exact) for s in sums) <= atol / 2
