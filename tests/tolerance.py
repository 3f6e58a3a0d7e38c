"""Float tolerances derived from the dtype and the number of terms, for figures summed in different orders.

Two evaluations ``a`` and ``b`` of the same sum ``s = x_1 + ... + x_n`` in floating point differ when the
terms are added in another order: another layout, another micro-batching, another data-parallel rank
count, another BLAS or SIMD kernel (8 vs 16 lanes, blocked vs pairwise). Every such order is a binary
tree of ``n - 1`` additions, and each addition rounds once with relative error at most the unit
roundoff ``u = eps / 2`` (``eps = torch.finfo(dtype).eps``). The worst-case bound (Higham, *Accuracy
and Stability of Numerical Algorithms*, 2nd ed., 2002, section 4.2; ``gamma_k`` from Lemma 3.1)::

    |fl(s) - s| <= gamma_{n-1} * sum_i |x_i|,    gamma_k = k u / (1 - k u)

holds for any order. We use ``gamma_n`` instead of ``gamma_{n-1}``: the extra ``u`` per term covers one
rounding of each term itself (the product of a dot product, with or without a fused multiply-add), as
in Higham's inner-product bound (section 3.1). Two evaluations each within that of ``s`` give::

    |a - b| <= 2 * gamma_n * sum_i |x_i|  (~ n * eps * sum_i |x_i|)

:func:`sum_rtol` is ``2 * gamma_n`` (plus ``term_ulps * eps`` when the terms themselves differ), relative
to ``sum_i |x_i|``; :func:`sum_atol` multiplies it by ``sum_i |x_i|``. When every term has the same sign,
``sum_i |x_i| = |s|`` and ``rel=sum_rtol(n, dtype)`` alone is the bound; when terms cancel (a loss over
positive and negative advantages) the absolute form is needed, since ``|s|`` can be far below
``sum_i |x_i|``: a bound relative to ``|s|`` alone failed on a machine that sums in another order, on a
float32 loss of 19 terms (relative 1e-6; -0.011952757835 vs -0.0119527354, relative 1.9e-6).

Why ``n`` and not ``sqrt(n)``: the ``sqrt(n) * u`` bound (Higham & Mary, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019) holds only with high probability
under a model of independent rounding errors; a test must hold on every machine and every order, so it
gets the worst case. For the small reductions of CPU tests (tens to thousands of terms) the worst case
is still orders of magnitude below the change a real reduction bug makes (a dropped micro-batch, a
wrong normaliser: the size of a whole term or more). At a million terms it is a few percent (the
gradient norm of tests/workers/test_workers.py): only gross errors are caught there.
"""

from __future__ import annotations

import math

import torch


def sum_rtol(n: int, dtype: torch.dtype = torch.float32, *, term_ulps: float = 0.0) -> float:
    """Bound on ``|a - b| / sum_i |x_i|`` for two evaluations of a sum of ``n`` terms in ``dtype``, in any orders.

    ``2 * gamma_n + term_ulps * eps`` with ``gamma_n = n u / (1 - n u)``, ``u = eps / 2``, ``eps =
    torch.finfo(dtype).eps`` (module docstring). ``n`` counts the terms that round: zeros (masked-out
    positions) add exactly and may be left out. ``term_ulps``: by how many ulps (at most ``eps * |x_i|``
    each) one term may differ between the two evaluations before the sum, when the terms are not computed
    identically (an elementwise ``exp`` runs in the SIMD body or the scalar tail of the loop depending on
    the tensor's length: Sleef and libm each round within 1 ulp, so they differ by up to 2).
    """
    if n < 1:
        raise ValueError(f"a sum has at least one term, got n={n}")
    if not term_ulps >= 0:
        raise ValueError(f"term_ulps must be >= 0, got {term_ulps!r}")
    eps = torch.finfo(dtype).eps
    u = eps / 2
    if n * u >= 1:
        raise ValueError(f"n={n} terms in {dtype}: n * u = {n * u:g} >= 1, no worst-case bound; use a wider dtype")
    return 2 * n * u / (1 - n * u) + term_ulps * eps


def sum_atol(n: int, dtype: torch.dtype, abs_sum: float, *, term_ulps: float = 0.0) -> float:
    """Bound on ``|a - b|`` for two evaluations of a sum of ``n`` terms in ``dtype`` whose ``sum_i |x_i|`` is
    ``abs_sum``: ``sum_rtol(n, dtype, term_ulps=term_ulps) * abs_sum``. The floor for sums that cancel."""
    if not abs_sum >= 0:
        raise ValueError(f"abs_sum is a sum of absolute values, got {abs_sum!r}")
    return sum_rtol(n, dtype, term_ulps=term_ulps) * abs_sum


def log_softmax_atol(x: torch.Tensor) -> float:
    """Bound on the difference of two float32 ``log_softmax`` implementations of ``x`` [..., V].

    Both take ``x_y - (max + log sum_v exp(x_v - max))``. The sum has V terms, each <= 1: its relative
    difference is ``sum_rtol(V)`` plus 2 ulps per ``exp`` (tests/tolerance.py), an absolute one after the
    log. The 4 elementwise steps (``x - max``, ``log``, ``+ max``, ``x_y - logsumexp``) round at a
    magnitude of at most ``2 (max|x| + log V)``, once in each implementation.
    """
    v = x.shape[-1]
    eps = torch.finfo(torch.float32).eps
    return sum_rtol(v, torch.float32, term_ulps=2) + 8 * eps * (x.abs().max().item() + math.log(v))
