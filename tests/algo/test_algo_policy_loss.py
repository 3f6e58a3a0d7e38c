"""Policy losses: hand-computed cases, closed-form gradients, band behaviour and micro-batch invariance."""

import math

import pytest
import torch

from sao_megatron.algo import (
    count_sequences,
    dis_loss,
    policy_loss,
    ppo_clip_loss,
    vanilla_pg_loss,
)

# One row, three action tokens and one padding token. behavior logprob -1 everywhere; the current
# logprobs are chosen so that rho = exp(logprobs - behavior) = [0.5, 1.2, 7.0].
RHO = [0.5, 1.2, 7.0]
MASK = torch.tensor([[1, 1, 1, 0]])
ADV = torch.tensor([[2.0, -1.0, 3.0, 100.0]], dtype=torch.float64)
BEHAVIOR = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], dtype=torch.float64)


def _logprobs() -> torch.Tensor:
    lp = [-1.0 + math.log(r) for r in RHO] + [5.0]
    return torch.tensor([lp], dtype=torch.float64, requires_grad=True)


def test_dis_hand_computed_detached():
    lp = _logprobs()
    loss, m = dis_loss(lp, BEHAVIOR, ADV, MASK, eps_low=0.3, eps_high=5.0)
    # band (0.7, 6.0): only the middle token (rho 1.2, A -1) is kept.
    # loss = -(1 * 1.2 * (-1) * (-1 + ln 1.2)) / 3 = 1.2 * (-0.8176784) / 3 = -0.32707
    lp1 = -1.0 + math.log(1.2)
    assert loss.item() == pytest.approx(1.2 * lp1 / 3, abs=1e-12)
    loss.backward()
    # d loss / d lp = -keep * rho * A / N = [0, 1.2 / 3, 0, 0]
    assert torch.allclose(lp.grad, torch.tensor([[0.0, 0.4, 0.0, 0.0]], dtype=torch.float64), atol=1e-12)
    assert m["kept_frac"] == pytest.approx(1 / 3)
    assert m["below_frac"] == pytest.approx(1 / 3)  # 0.5 <= 0.7
    assert m["above_frac"] == pytest.approx(1 / 3)  # 7.0 >= 6.0
    assert m["kept_frac/adv_pos"] == 0.0 and m["below_frac/adv_pos"] == pytest.approx(0.5)
    assert m["kept_frac/adv_neg"] == 1.0 and m["num_tokens/adv_neg"] == 1.0
    assert m["ess"] == pytest.approx(1.0) and m["ess_frac"] == pytest.approx(1.0)
    # k3 = rho - 1 - ln rho: 0.193147 + 0.017678 + 4.054090, mean 1.421638
    k3 = sum(r - 1 - math.log(r) for r in RHO) / 3
    assert m["kl_k3"] == pytest.approx(k3, rel=1e-9)
    assert m["kl_k3_rev"] == pytest.approx(sum(r * math.log(r) - r + 1 for r in RHO) / 3, rel=1e-9)
    # linear-interpolated quantiles of [0.5, 1.2, 7.0]: p1 = 0.5 + 0.02 * 0.7, p99 = 1.2 + 0.98 * 5.8
    assert m["ratio/p1"] == pytest.approx(0.514) and m["ratio/p50"] == pytest.approx(1.2)
    assert m["ratio/p99"] == pytest.approx(6.884) and m["ratio/max"] == pytest.approx(7.0)
    assert all(isinstance(v, float) for v in m.values())


def test_dis_hand_computed_literal_non_detached():
    lp = _logprobs()
    loss, _ = dis_loss(lp, BEHAVIOR, ADV, MASK, eps_low=0.3, eps_high=5.0, detach_ratio=False)
    lp1 = -1.0 + math.log(1.2)
    assert loss.item() == pytest.approx(1.2 * lp1 / 3, abs=1e-12)  # same value as detached
    loss.backward()
    # d/dlp of -rho*A*lp = -A * rho * (1 + lp): 1.2 * (1 + lp1) / 3 = 0.0729286
    assert lp.grad[0, 1].item() == pytest.approx(1.2 * (1 + lp1) / 3, abs=1e-12)
    assert lp.grad[0, [0, 2, 3]].abs().sum().item() == 0.0


def test_dis_band_is_strict():
    # eps_low = 0 -> band (1, 1 + eps_high): rho exactly 1 is dropped.
    lp = torch.zeros(1, 2, requires_grad=True)
    beh = torch.tensor([[0.0, -0.5]])
    _, m = dis_loss(lp, beh, torch.ones(1, 2), torch.ones(1, 2), eps_low=0.0, eps_high=5.0)
    assert m["kept_frac"] == 0.5


def test_ppo_clip_hand_computed():
    lp = _logprobs()
    loss, m = ppo_clip_loss(lp, BEHAVIOR, ADV, MASK, eps_low=0.2, eps_high=0.28)
    # token0 A=2, rho 0.5: min(1.0, 0.8*2=1.6) = 1.0 (unclipped) -> l = -1.0, dl/dlp = -rho*A = -1
    # token1 A=-1, rho 1.2 in [0.8, 1.28]: l = 1.2, dl/dlp = 1.2
    # token2 A=3, rho 7: min(21, 1.28*3=3.84) = 3.84 clipped -> l = -3.84, no gradient
    assert loss.item() == pytest.approx((-1.0 + 1.2 - 3.84) / 3, abs=1e-12)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1 / 3, 0.4, 0.0, 0.0]], dtype=torch.float64), atol=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 3) and m["clip_frac_high"] == pytest.approx(1 / 3)
    assert m["clip_frac_low"] == 0.0


def test_vanilla_hand_computed():
    lp = _logprobs()
    loss, m = vanilla_pg_loss(lp, BEHAVIOR, ADV, MASK)
    lps = [-1.0 + math.log(r) for r in RHO]
    assert loss.item() == pytest.approx(-(2 * lps[0] - lps[1] + 3 * lps[2]) / 3, abs=1e-12)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2 / 3, 1 / 3, -1.0, 0.0]], dtype=torch.float64))
    assert "below_frac" not in m
    _, m = vanilla_pg_loss(lp, BEHAVIOR, ADV, MASK, eps_low=0.3, eps_high=5.0)
    assert m["below_frac"] == pytest.approx(1 / 3)


def test_seq_mean_hand_computed():
    # row0 has 2 action tokens, row1 has 1: seq_mean = -((lp00 + lp01) / 2 + lp10) / 2
    lp = torch.tensor([[-1.0, -2.0, -9.0], [-4.0, -9.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = vanilla_pg_loss(lp, lp.detach(), torch.ones(2, 3), mask, agg="seq_mean")
    assert loss.item() == pytest.approx(-((-1 - 2) / 2 + -4) / 2)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-0.25, -0.25, 0.0], [-0.5, 0.0, 0.0]]))


def test_policy_loss_dispatch_matches_direct_call():
    lp = _logprobs()
    a, _ = policy_loss("dis", lp, BEHAVIOR, ADV, MASK, eps_low=0.3, eps_high=5.0)
    b, _ = dis_loss(lp, BEHAVIOR, ADV, MASK, eps_low=0.3, eps_high=5.0)
    assert a.item() == b.item()


def _random_inputs(seed: int, b: int = 6, t: int = 16):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.35
    mask[:, 0] = True  # every row has an action token
    beh = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lp = (beh + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.6).requires_grad_(True)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    return lp, beh, adv, mask


def test_dis_gradient_closed_form():
    lp, beh, adv, mask = _random_inputs(0)
    loss, _ = dis_loss(lp, beh, adv, mask, eps_low=0.3, eps_high=0.5)
    loss.backward()
    rho = torch.exp(lp.detach() - beh)
    keep = mask & (rho > 0.7) & (rho < 1.5)
    expected = -keep.double() * rho * adv / mask.sum()  # -keep * rho * A / N
    assert 0 < keep.sum() < mask.sum()
    assert torch.allclose(lp.grad, expected, atol=1e-14, rtol=0)


def test_out_of_band_tokens_get_exactly_zero_gradient_for_both_signs():
    # Four action tokens: (A>0, rho low), (A>0, rho high), (A<0, rho low), (A<0, rho high).
    beh = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.log(torch.tensor([[0.1, 50.0, 0.1, 50.0]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    for detach in (True, False):
        lp.grad = None
        loss, m = dis_loss(lp, beh, adv, mask, eps_low=0.2, eps_high=0.28, detach_ratio=detach)
        loss.backward()
        assert torch.equal(lp.grad, torch.zeros_like(lp)), detach
        assert m["kept_frac"] == 0.0
    # PPO-clip does not zero them: A>0 with a tiny ratio and A<0 with a huge ratio keep gradient -rho*A/N.
    lp.grad = None
    loss, _ = ppo_clip_loss(lp, beh, adv, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    assert lp.grad[0, 0].item() == pytest.approx(-0.1 / 4)
    assert lp.grad[0, 3].item() == pytest.approx(50.0 / 4)
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 2].item() == 0.0


def test_large_sentinels_off_mask_and_huge_ratios_stay_finite():
    lp = torch.tensor([[-1.0, 80.0, -1.0]], requires_grad=True)  # exp(81) overflows float32
    beh = torch.tensor([[-1.0, -1.0, -1e30]])  # sentinel on the padding token
    mask = torch.tensor([[1, 1, 0]])
    for name, kw in (("dis", {"detach_ratio": False}), ("ppo_clip", {}), ("vanilla", {})):
        lp.grad = None
        eps = {} if name == "vanilla" else {"eps_low": 0.2, "eps_high": 0.2}
        loss, m = policy_loss(name, lp, beh, torch.ones(1, 3), mask, **eps, **kw)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), name
        assert not any(math.isnan(v) for v in m.values()), name


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("name", ["dis", "ppo_clip", "vanilla"])
def test_micro_batches_sum_to_full_batch(name, agg):
    lp, beh, adv, mask = _random_inputs(1)
    kw = {} if name == "vanilla" else {"eps_low": 0.3, "eps_high": 0.5}
    full, _ = policy_loss(name, lp, beh, adv, mask, agg=agg, **kw)
    (g_full,) = torch.autograd.grad(full, lp)
    norm = {"num_tokens_global": int(mask.sum())} if agg == "token_mean" else {"num_seqs_global": count_sequences(mask)}
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part, _ = policy_loss(name, lp[rows], beh[rows], adv[rows], mask[rows], agg=agg, **norm, **kw)
        total = total + part
    (g_split,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(g_split, g_full, atol=1e-14, rtol=0)


def test_seq_mean_with_packed_segments_counts_each_trajectory_once():
    # One packed row with two trajectories (ids 0 and 1) = two unpacked rows.
    lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 0]])
    seg = torch.tensor([[0, 0, 0, 1, 1]])
    loss, _ = vanilla_pg_loss(lp, lp.detach(), torch.ones(1, 5), mask, agg="seq_mean", segment_ids=seg)
    assert loss.item() == pytest.approx(-((-1 - 2) / 2 + -4) / 2)
    assert count_sequences(mask, seg) == 2
