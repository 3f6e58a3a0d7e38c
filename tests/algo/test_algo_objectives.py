"""The learners' objectives: hand-computed cases, the losses they are built from, and micro-batch
invariance of their losses and gradients."""

import math

import pytest
import torch

from sao_megatron.algo import (
    LAG_BUCKETS,
    count_sequences,
    dis_band,
    kept_by_lag,
    masked_mean,
    policy_loss,
    policy_objective,
    sft_nll,
    value_loss,
    value_objective,
)


def _inputs(seed: int, b: int = 6, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).requires_grad_()
    behavior = logprobs.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    advantages = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1.0  # every row has an action token
    lag = torch.randint(0, 5, (b, t), generator=g) * mask.long()
    entropy = torch.rand(b, t, generator=g, dtype=torch.float64)
    return logprobs, entropy, behavior, advantages, mask, lag


def _settings(name: str, agg: str, mask: torch.Tensor) -> dict:
    return {
        "loss": name,
        "eps_low": 0.3,
        "eps_high": 0.5,
        "detach_ratio": True,
        "agg": agg,
        "num_tokens_global": float(mask.sum()),
        "num_seqs_global": float(count_sequences(mask)),
    }


def test_kept_by_lag_hand_computed():
    kept = torch.tensor([[True, False, True, True, False]])
    lag = torch.tensor([[0, 0, 1, 4, 9]])
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.0, -3.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    got = kept_by_lag(kept, lag, adv, mask)
    assert got == {
        "dis/tokens/lag0": 2.0,
        "dis/kept_frac/lag0": 0.5,
        "dis/kept_frac/lag0#n": 2.0,
        "dis/kept_frac/lag0/adv_pos": 1.0,
        "dis/kept_frac/lag0/adv_pos#n": 1.0,
        "dis/kept_frac/lag0/adv_neg": 0.0,
        "dis/kept_frac/lag0/adv_neg#n": 1.0,
        "dis/tokens/lag1": 1.0,
        "dis/kept_frac/lag1": 1.0,
        "dis/kept_frac/lag1#n": 1.0,
        "dis/kept_frac/lag1/adv_pos": 1.0,
        "dis/kept_frac/lag1/adv_pos#n": 1.0,
        "dis/tokens/lag2": 0.0,
        "dis/tokens/lag3+": 1.0,  # lag 4 (A = 0: in no sign); lag 9 is off the mask
        "dis/kept_frac/lag3+": 1.0,
        "dis/kept_frac/lag3+#n": 1.0,
    }
    assert [name for _, _, name in LAG_BUCKETS] == ["0", "1", "2", "3+"]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("name", ["dis", "ppo_clip", "vanilla"])
def test_policy_objective_is_the_policy_loss_with_entropy_tokens_and_lag_bands(name, agg):
    lp, ent, beh, adv, mask, lag = _inputs(0)
    s = _settings(name, agg, mask)
    loss, metrics = policy_objective(lp, ent, beh, adv, mask, lag, **s)
    bounds = {} if name == "vanilla" else {"eps_low": 0.3, "eps_high": 0.5}
    norm = (
        {"num_tokens_global": s["num_tokens_global"]}
        if agg == "token_mean"
        else {"num_seqs_global": s["num_seqs_global"]}
    )
    want_loss, want = policy_loss(name, lp, beh, adv, mask > 0, agg=agg, **bounds, **norm)
    want["entropy"] = masked_mean(ent, mask).item()
    want["micro_tokens"] = float(mask.sum())
    want |= kept_by_lag(dis_band(lp.detach(), beh, 0.3, 0.5), lag, adv, mask > 0)
    assert loss.item() == want_loss.item()
    assert metrics == want
    assert ("below_frac" in metrics) == (name != "vanilla")


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("name", ["dis", "ppo_clip", "vanilla"])
def test_policy_objective_micro_batches_sum_to_the_full_batch(name, agg):
    lp, ent, beh, adv, mask, lag = _inputs(1)
    s = _settings(name, agg, mask)
    full, _ = policy_objective(lp, ent, beh, adv, mask, lag, **s)
    (g_full,) = torch.autograd.grad(full, lp)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part, _ = policy_objective(lp[rows], ent[rows], beh[rows], adv[rows], mask[rows], lag[rows], **s)
        total = total + part
    (g_split,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(g_split, g_full, atol=1e-14, rtol=0)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("name", ["dis", "ppo_clip", "vanilla"])
def test_stale_lag_gives_the_tokens_past_it_no_gradient_and_keeps_the_normalisers(name, agg):
    lp, ent, beh, adv, mask, lag = _inputs(2)
    s = _settings(name, agg, mask)
    loss, metrics = policy_objective(lp, ent, beh, adv, mask, lag, **s, stale_lag=2)
    (grad,) = torch.autograd.grad(loss, lp)
    stale = (lag > 2) & (mask > 0)
    assert stale.any() and ((lag <= 2) & (mask > 0)).any()
    fresh_only, _ = policy_objective(lp, ent, beh, adv * (lag <= 2), mask, lag, **s)  # same counts
    (want,) = torch.autograd.grad(fresh_only, lp)
    assert loss.item() == fresh_only.item() and torch.equal(grad, want)
    assert torch.all(grad[stale] == 0) and grad[(lag <= 2) & (mask > 0)].abs().sum() > 0
    assert metrics["stale_masked"] == pytest.approx(float(stale.sum() / (mask > 0).sum()), rel=1e-12)
    assert "stale_masked" not in policy_objective(lp, ent, beh, adv, mask, lag, **s)[1]


def test_policy_objective_refuses_an_unknown_loss():
    lp, ent, beh, adv, mask, lag = _inputs(2)
    with pytest.raises(ValueError, match="policy loss"):
        policy_objective(lp, ent, beh, adv, mask, lag, **{**_settings("dis", "token_mean", mask), "loss": "dys"})


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_value_objective_is_the_value_loss_clipped_only_when_asked(clip):
    g = torch.Generator().manual_seed(3)
    values = torch.randn(4, 5, generator=g).requires_grad_()
    returns, old = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    n = float(mask.sum())
    loss, metrics = value_objective(
        values, returns, mask, old, value_clip=clip, agg="token_mean", num_tokens_global=n, num_seqs_global=4.0
    )
    clipped = {"old_values": old, "clip_range": clip} if clip else {}
    want_loss, want = value_loss(values, returns, mask > 0, num_tokens_global=n, **clipped)
    assert loss.item() == want_loss.item()
    assert metrics == {**want, "micro_tokens": n}
    assert (metrics["clip_frac"] > 0) == bool(clip)


def test_sft_nll_hand_computed():
    logprobs = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -3.0, -8.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, metrics = sft_nll(logprobs, mask, num_tokens_global=7.0)  # 7: the step's other micro-batches too
    assert loss.item() == pytest.approx(3.5 / 7)
    assert metrics == {"nll": pytest.approx(3.5 / 3), "micro_tokens": 3.0}
    loss.backward()
    assert torch.equal(logprobs.grad, -mask / 7)
    empty, m = sft_nll(logprobs, torch.zeros(2, 3), num_tokens_global=7.0)
    assert empty.item() == 0.0 and m == {"nll": 0.0, "micro_tokens": 0.0} and not math.isnan(m["nll"])
