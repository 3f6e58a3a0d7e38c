"""The corrections beside the policy loss: the sequence mask on the geometric-mean ratio and truncated
IS. Hand-computed cases, packed segments against rows, invariants (a band holding every trajectory and
a cap above every ratio change nothing; micro-batches add up to the whole batch)."""

import math

import pytest
import torch

from sao_megatron.algo import count_sequences, policy_objective
from sao_megatron.algo.corrections import sequence_log_ratio, sequence_mask, truncated_is
from sao_megatron.workers.metrics import reduce_metrics

LN2 = math.log(2.0)


def _rows():
    """Three trajectories; log rho on action tokens (mask) as stated, position 3 of each row is off the mask.

    row 0: rho 2, 2, 1/2 -> g = 2^(1/3) ~ 1.26 (inside [0.5, 1.5] though two tokens have rho 2)
    row 1: rho 2, 2, 2 -> g = 2 (above 1.5)
    row 2: rho 1/4, 1/2 (and a masked token) -> g = 2^(-3/2) ~ 0.354 (below 0.5)
    """
    lr = torch.tensor([[LN2, LN2, -LN2, 9.0], [LN2, LN2, LN2, -9.0], [-2 * LN2, 5.0, -LN2, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 1, 0]], dtype=torch.bool)
    behavior = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    return behavior + lr, behavior, mask


def test_sequence_mask_hand_computed():
    lp, beh, mask = _rows()
    keep, m = sequence_mask(lp, beh, mask, low=0.5, high=1.5)
    assert keep.tolist() == [[True, True, True, False], [False] * 4, [False] * 4]
    g = [2 ** (1 / 3), 2.0, 2**-1.5]
    want = {
        "seq_mask/dropped_seq_frac": 2 / 3,
        "seq_mask/dropped_low_seq_frac": 1 / 3,
        "seq_mask/dropped_high_seq_frac": 1 / 3,
        "seq_mask/geo_ratio/mean": sum(g) / 3,
        "seq_mask/geo_ratio/max": 2.0,
        "seq_mask/geo_ratio/min": 2**-1.5,
        "seq_mask/dropped_token_frac": 5 / 8,
    }
    for key, value in want.items():  # float64 means of <= 3 logs: a few ulps
        assert m[key] == pytest.approx(value, rel=1e-14), key
        assert m[key + "#n"] == (8.0 if key.endswith("token_frac") else 3.0), key
    # one side open: only the other bound drops
    assert sequence_mask(lp, beh, mask, low=None, high=1.5)[0].tolist()[2] == [True, False, True, False]
    assert sequence_mask(lp, beh, mask, low=0.5, high=None)[0].tolist()[1] == [True, True, True, False]


def test_sequence_mask_band_is_inclusive():
    lp = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    beh = torch.tensor([[-LN2, LN2]], dtype=torch.float64)  # one single-token trajectory each: g = 2, 1/2
    segs = torch.tensor([[0, 1]])
    keep, m = sequence_mask(lp, beh, torch.ones(1, 2, dtype=torch.bool), low=0.5, high=2.0, segment_ids=segs)
    assert keep.tolist() == [[True, True]] and m["seq_mask/dropped_seq_frac"] == 0.0
    keep, _ = sequence_mask(lp, beh, torch.ones(1, 2, dtype=torch.bool), low=0.51, high=1.99, segment_ids=segs)
    assert keep.tolist() == [[False, False]]


def test_packed_segments_equal_their_rows():
    lp, beh, mask = _rows()
    # pack rows 0..2 end to end into one row (observation/padding tokens included), segment ids 0, 1, 2
    packed_lp, packed_beh, packed_mask = lp.reshape(1, -1), beh.reshape(1, -1), mask.reshape(1, -1)
    segs = torch.arange(3).repeat_interleave(4).view(1, -1)
    keep_rows, m_rows = sequence_mask(lp, beh, mask, low=0.5, high=1.5)
    keep_packed, m_packed = sequence_mask(packed_lp, packed_beh, packed_mask, low=0.5, high=1.5, segment_ids=segs)
    assert torch.equal(keep_packed, keep_rows.reshape(1, -1))
    assert m_packed == m_rows
    # without segment ids the packed row is one trajectory: g = (2 * 2 / 2 * 8 / 8)^(1/8) = 2^(1/8), kept
    keep_one, m_one = sequence_mask(packed_lp, packed_beh, packed_mask, low=0.5, high=1.5)
    assert torch.equal(keep_one, packed_mask) and m_one["seq_mask/geo_ratio/mean"] == pytest.approx(2 ** (1 / 8))


def test_sequence_log_ratio_is_the_trajectory_mean():
    g = torch.Generator().manual_seed(1)
    lr = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 9, generator=g) > 0.4
    segs = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2]).expand(4, 9)
    got = sequence_log_ratio(lr, mask, segs)
    for r in range(4):  # a plain loop over (row, segment)
        for s in range(3):
            sel = mask[r] & (segs[r] == s)
            if sel.any():
                want = lr[r][sel].sum() / sel.sum()
                assert torch.allclose(got[r][sel], want.expand(int(sel.sum())), rtol=1e-15, atol=0)
    assert (got[~mask] == 0).all()


def _tis_case():
    rho = torch.tensor([[0.5, 1.0, 3.0, 10.0, 7.0]], dtype=torch.float64)
    beh = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0]], dtype=torch.float64)
    lp = (beh + rho.log()).requires_grad_()
    adv = torch.tensor([[1.0, -2.0, 0.5, -1.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)  # rho = 7 is off the mask
    return lp, beh, adv, mask


def test_truncated_is_weights_and_metrics_hand_computed():
    lp, beh, _, mask = _tis_case()
    w, m = truncated_is(lp, beh, mask, cap=2.0, loss_has_ratio=False)
    assert torch.allclose(w, torch.tensor([[0.5, 1.0, 2.0, 2.0, 0.0]], dtype=torch.float64), rtol=1e-15, atol=0)
    f, _ = truncated_is(lp, beh, mask, cap=2.0, loss_has_ratio=True)  # min(rho, C) / rho
    assert f[0, 0] == 1.0 and f[0, 1] == 1.0  # exactly: rho <= C
    assert torch.allclose(f[0, 2:], torch.tensor([2 / 3, 0.2, 0.0], dtype=torch.float64), rtol=1e-15, atol=0)
    assert m == pytest.approx(
        {"tis/clipped_frac": 0.5, "tis/clipped_frac#n": 4.0, "tis/weight/mean": 5.5 / 4, "tis/weight/mean#n": 4.0},
        rel=1e-15,
    )


@pytest.mark.parametrize("loss", ["vanilla", "dis", "ppo_clip"])
def test_truncated_is_gradient_hand_computed(loss):
    """d loss / d logprobs_t = -min(rho_t, C) A_t / N on every action token (DIS's band and PPO's clip
    set wide enough to keep them all; PPO's A < 0 token with rho = 10 is on its unclipped side)."""
    lp, beh, adv, mask = _tis_case()
    lag = torch.zeros(1, 5, dtype=torch.long)
    n = float(mask.sum())
    settings = {"eps_low": 0.9, "eps_high": 20.0, "detach_ratio": True, "agg": "token_mean"}
    if loss == "ppo_clip":
        adv = torch.tensor([[1.0, -2.0, -0.5, -1.0, 3.0]], dtype=torch.float64)  # A < 0 where rho = 3 > 1 + eps
        settings["eps_high"] = 0.5
    out, m = policy_objective(
        lp, torch.zeros_like(beh), beh, adv, mask, lag, loss=loss, num_tokens_global=n, num_seqs_global=1.0,
        tis_cap=2.0, **settings,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out, lp)
    weight = torch.tensor([[0.5, 1.0, 2.0, 2.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(grad, -weight * adv * mask / n, rtol=1e-14, atol=0)
    assert m["tis/clipped_frac"] == 0.5


def _inputs(seed: int, b: int = 6, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).requires_grad_()
    behavior = logprobs.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    behavior[1] -= 1.5  # row 1: g ~ e^1.5 ~ 4.5, row 4: g ~ e^-1.5 ~ 0.22, both outside [0.5, 2]
    behavior[4] += 1.5
    advantages = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    lag = torch.zeros(b, t, dtype=torch.long)
    return logprobs, torch.zeros(b, t, dtype=torch.float64), behavior, advantages, mask, lag


def _settings(loss: str, agg: str, mask: torch.Tensor, **extra) -> dict:
    return {
        "loss": loss,
        "eps_low": 0.3,
        "eps_high": 0.5,
        "detach_ratio": True,
        "agg": agg,
        "num_tokens_global": float(mask.sum()),
        "num_seqs_global": float(count_sequences(mask)),
        **extra,
    }


def _loss_and_grad(inputs, **settings):
    lp = inputs[0]
    out, metrics = policy_objective(*inputs, **settings)
    (grad,) = torch.autograd.grad(out, lp)
    return out.detach(), grad, metrics


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("loss", ["dis", "ppo_clip"])
@pytest.mark.parametrize("detach_ratio", [True, False])
def test_open_band_and_huge_cap_equal_the_plain_loss_exactly(loss, agg, detach_ratio):
    inputs = _inputs(2)
    s = _settings(loss, agg, inputs[4], detach_ratio=detach_ratio)
    plain, plain_grad, _ = _loss_and_grad(inputs, **s)
    out, grad, m = _loss_and_grad(inputs, **s, seq_mask_low=1e-6, seq_mask_high=1e6, tis_cap=1e6)
    assert torch.equal(out, plain) and torch.equal(grad, plain_grad)
    assert m["seq_mask/dropped_seq_frac"] == 0.0 and m["tis/clipped_frac"] == 0.0


def test_vanilla_with_a_huge_cap_is_the_importance_weighted_gradient():
    lp, ent, beh, adv, mask, lag = _inputs(3)
    s = _settings("vanilla", "token_mean", mask)
    _, grad, _ = _loss_and_grad((lp, ent, beh, adv, mask, lag), **s, tis_cap=1e6)
    rho = torch.exp(lp.detach() - beh)
    assert torch.allclose(grad, -rho * adv * mask / mask.sum(), rtol=1e-14, atol=0)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("loss", ["dis", "ppo_clip", "vanilla"])
def test_sequence_mask_is_the_plain_loss_without_the_dropped_trajectories(loss, agg):
    lp, ent, beh, adv, mask, lag = _inputs(4)
    s = _settings(loss, agg, mask)
    out, grad, m = _loss_and_grad((lp, ent, beh, adv, mask, lag), **s, seq_mask_low=0.5, seq_mask_high=2.0)
    dropped = torch.zeros(6, 1)
    dropped[1] = dropped[4] = 1.0  # the two rows placed outside the band (normalisers unchanged)
    want, want_grad, _ = _loss_and_grad((lp, ent, beh, adv * (1 - dropped), mask, lag), **s)
    assert torch.equal(out, want) and torch.equal(grad, want_grad)
    assert (grad[1] == 0).all() and (grad[4] == 0).all() and grad.abs().sum() > 0
    assert m["seq_mask/dropped_seq_frac"] == 2 / 6
    assert m["seq_mask/dropped_token_frac"] == float(mask[[1, 4]].sum()) / float(mask.sum())


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_micro_batches_add_up_to_the_whole_batch_with_both_corrections(agg):
    """Sums of losses and gradients, and the reduced correction metrics, over row micro-batches."""
    lp, ent, beh, adv, mask, lag = _inputs(5)
    s = _settings("dis", agg, mask, eps_high=3.0, seq_mask_low=0.5, seq_mask_high=2.0, tis_cap=1.5)
    whole, whole_grad, whole_m = _loss_and_grad((lp, ent, beh, adv, mask, lag), **s)
    total, grads, per_micro = torch.zeros((), dtype=torch.float64), [], []
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        x = lp.detach()[rows].clone().requires_grad_()
        out, m = policy_objective(x, ent[rows], beh[rows], adv[rows], mask[rows], lag[rows], **s)
        total += out.detach()
        grads.append(torch.autograd.grad(out, x)[0])
        per_micro.append(m)
    assert torch.allclose(total, whole, rtol=1e-14, atol=0)
    assert torch.allclose(torch.cat(grads), whole_grad, rtol=1e-14, atol=0)
    got = reduce_metrics(per_micro, dp=False)
    for key in [k for k in whole_m if k.startswith(("seq_mask/", "tis/")) and not k.endswith("#n")]:
        assert got[key] == pytest.approx(whole_m[key], rel=1e-14), key


def test_bad_arguments_fail():
    lp, beh, mask = _rows()
    with pytest.raises(ValueError, match="cap"):
        truncated_is(lp, beh, mask, cap=0.0, loss_has_ratio=True)
    with pytest.raises(ValueError, match="must be > `low`"):
        sequence_mask(lp, beh, mask, low=1.5, high=1.5)
    with pytest.raises(ValueError, match="low"):
        sequence_mask(lp, beh, mask, low=-1.0, high=1.5)
