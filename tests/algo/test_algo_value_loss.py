"""Value loss: hand-computed values, clipping, gradient, micro-batch invariance."""

import pytest
import torch

from sao_megatron.algo import count_sequences, value_loss

V = torch.tensor([[1.0, 2.0, 3.0, 7.0]], dtype=torch.float64)
R = torch.tensor([[2.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0]])


def test_value_loss_hand_computed():
    v = V.clone().requires_grad_(True)
    loss, m = value_loss(v, R, MASK)
    # 0.5 * (V - R)^2 = [0.5, 0, 4.5] -> token mean 5/3
    assert loss.item() == pytest.approx(5 / 3)
    loss.backward()
    assert torch.allclose(v.grad, torch.tensor([[-1 / 3, 0.0, 1.0, 0.0]], dtype=torch.float64))  # (V - R) / N
    # R - V = [1, 0, -3]: Var = 78/27; Var[R] = 24/27 (biased) -> EV = 1 - 78/24 = -2.25
    assert m["explained_var"] == pytest.approx(-2.25)
    assert m["values/mean"] == pytest.approx(2.0) and m["returns/mean"] == pytest.approx(4 / 3)
    assert m["values/std"] == pytest.approx((2 / 3) ** 0.5) and m["num_tokens"] == 3.0


def test_value_loss_clipped_hand_computed():
    old = torch.tensor([[0.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    loss, m = value_loss(V, R, MASK, old_values=old, clip_range=0.5)
    # V_clip = [0.5, 2, 0.5]: clipped terms [1.125, 0, 0.125] vs [0.5, 0, 4.5] -> max [1.125, 0, 4.5]
    assert loss.item() == pytest.approx((1.125 + 4.5) / 3)
    assert m["clip_frac"] == pytest.approx(1 / 3)


def test_perfect_critic_explains_all_variance():
    _, m = value_loss(R, R, MASK)
    assert m["explained_var"] == pytest.approx(1.0) and m["value_loss"] == 0.0


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_value_loss_micro_batches_sum_to_full_batch(agg):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(5, 9, generator=g, dtype=torch.float64).requires_grad_(True)
    ret = torch.randn(5, 9, generator=g, dtype=torch.float64)
    old = v.detach() + 0.3 * torch.randn(5, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 9, generator=g) > 0.3
    mask[:, 0] = True
    kw = {"old_values": old, "clip_range": 0.2, "agg": agg}
    full, _ = value_loss(v, ret, mask, **kw)
    (g_full,) = torch.autograd.grad(full, v)
    norm = {"num_tokens_global": mask.sum()} if agg == "token_mean" else {"num_seqs_global": count_sequences(mask)}
    total = sum(
        value_loss(v[s], ret[s], mask[s], old_values=old[s], clip_range=0.2, agg=agg, **norm)[0]
        for s in (slice(0, 1), slice(1, 4), slice(4, 5))
    )
    (g_split,) = torch.autograd.grad(total, v)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(g_split, g_full, atol=1e-14, rtol=0)
