"""Masked reductions, whitening, quantiles and the metrics helper."""

import pytest
import torch

from sao_megatron.algo import (
    masked_mean,
    masked_quantiles,
    masked_var,
    masked_whiten,
    metrics_to_floats,
    whiten_advantages,
)

X = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_masked_mean_var():
    assert masked_mean(X, M).item() == 2.5
    assert masked_var(X, M).item() == pytest.approx(5 / 3)  # unbiased: sum (x - 2.5)^2 = 5, / 3
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(5 / 4)
    assert masked_mean(X, M, dim=1).tolist() == [1.5, 3.5]


def test_masked_quantiles_match_torch_quantile():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=g, dtype=torch.float64)
    m = torch.rand(50, generator=g) > 0.3
    q = masked_quantiles(x, m, (0.01, 0.5, 0.99, 1.0))
    assert torch.allclose(q, torch.quantile(x[m], torch.tensor([0.01, 0.5, 0.99, 1.0], dtype=torch.float64)))


def test_whitening():
    w = masked_whiten(X, M)
    assert masked_mean(w, M).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(w, M).item() == pytest.approx(1.0, abs=1e-6)
    assert w[0, 2].item() == 0.0 and w[1, 2].item() == 0.0
    a, m = whiten_advantages(X, M, shift_mean=False)
    assert masked_mean(a, M).item() == pytest.approx(2.5)
    assert m["adv/mean_raw"] == 2.5


def test_metrics_to_floats():
    out = metrics_to_floats({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor([3.0]).sum()})
    assert out == {"a": 1.5, "b": 2.0, "c": 3.0} and all(type(v) is float for v in out.values())
