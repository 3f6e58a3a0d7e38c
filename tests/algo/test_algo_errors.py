"""Bad input raises ValueError naming the argument; NaN never reaches a loss silently."""

import math

import pytest
import torch

from sao_megatron.algo import (
    dis_loss,
    gae,
    gae_reference,
    grpo_advantages,
    length_adaptive_lambda,
    policy_loss,
    ppo_clip_loss,
    rloo_advantages,
    step_gae,
    value_loss,
    whiten_advantages,
)

B, T = 2, 4
MASK = torch.ones(B, T)
LP = torch.zeros(B, T)
ADV = torch.ones(B, T)
VALS = torch.zeros(B, T)
REW = torch.ones(B)


def _nan_at(x):
    y = x.clone()
    y[1, 2] = math.nan
    return y


def _dis(**over):
    kw = {"logprobs": LP, "behavior_logprobs": LP, "advantages": ADV, "action_mask": MASK}
    kw.update(over)
    return dis_loss(
        kw.pop("logprobs"),
        kw.pop("behavior_logprobs"),
        kw.pop("advantages"),
        kw.pop("action_mask"),
        eps_low=kw.pop("eps_low", 0.2),
        eps_high=kw.pop("eps_high", 0.2),
        **kw,
    )


# ------------------------------------------------------------------------------- shape mismatches
@pytest.mark.parametrize("arg", ["logprobs", "behavior_logprobs", "advantages"])
def test_policy_loss_shape_mismatch(arg):
    with pytest.raises(ValueError, match=f"`{arg}` has shape"):
        _dis(**{arg: torch.zeros(B, T + 1)})


def test_gae_shape_mismatch():
    with pytest.raises(ValueError, match="`values` has shape"):
        gae(REW, torch.zeros(B, T + 1), MASK, lam=0.9)
    with pytest.raises(ValueError, match="`rewards` has shape"):
        gae(torch.ones(B + 1), VALS, MASK, lam=0.9)
    with pytest.raises(ValueError, match="`lam` has shape"):
        gae(REW, VALS, MASK, lam=torch.full((B + 1,), 0.9))
    with pytest.raises(ValueError, match="`segment_ids` has shape"):
        gae(torch.ones(B, T), VALS, MASK, lam=0.9, segment_ids=torch.zeros(B, 1, dtype=torch.long))


def test_value_loss_shape_mismatch():
    with pytest.raises(ValueError, match="`returns` has shape"):
        value_loss(VALS, torch.zeros(B, 1), MASK)


# ------------------------------------------------------------------------------------- NaN / inf
@pytest.mark.parametrize("arg", ["logprobs", "behavior_logprobs", "advantages"])
def test_policy_loss_nan(arg):
    with pytest.raises(ValueError, match=f"`{arg}` contains 1 NaN/inf"):
        _dis(**{arg: _nan_at(LP if arg != "advantages" else ADV)})


def test_inf_in_logprobs_and_nan_on_padding_also_rejected():
    lp = LP.clone()
    lp[0, 0] = -math.inf
    with pytest.raises(ValueError, match="`logprobs`"):
        _dis(logprobs=lp)
    mask = MASK.clone()
    mask[1, 2] = 0  # NaN on a padding token is still an upstream bug
    with pytest.raises(ValueError, match="`advantages`"):
        _dis(advantages=_nan_at(ADV), action_mask=mask)


@pytest.mark.parametrize("impl", [gae, gae_reference])
def test_gae_nan(impl):
    with pytest.raises(ValueError, match="`values` contains"):
        impl(REW, _nan_at(VALS), MASK, lam=0.9)
    with pytest.raises(ValueError, match="`rewards` contains"):
        impl(torch.tensor([1.0, math.inf]), VALS, MASK, lam=0.9)
    with pytest.raises(ValueError, match="`rewards` contains"):
        impl(_nan_at(VALS), VALS, MASK, lam=0.9)


def test_value_loss_and_baselines_nan():
    with pytest.raises(ValueError, match="`values` contains"):
        value_loss(_nan_at(VALS), VALS, MASK)
    with pytest.raises(ValueError, match="`returns` contains"):
        value_loss(VALS, _nan_at(VALS), MASK)
    with pytest.raises(ValueError, match="`old_values` contains"):
        value_loss(VALS, VALS, MASK, old_values=_nan_at(VALS), clip_range=0.2)
    with pytest.raises(ValueError, match="`rewards` contains"):
        grpo_advantages(torch.tensor([1.0, math.nan]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="`advantages` contains"):
        whiten_advantages(_nan_at(ADV), MASK)


# ----------------------------------------------------------------------------------- empty masks
def test_empty_batch():
    empty = torch.zeros(B, T)
    with pytest.raises(ValueError, match="no action tokens in the whole batch"):
        _dis(action_mask=empty)
    with pytest.raises(ValueError, match="no action tokens in the whole batch"):
        value_loss(VALS, VALS, empty)
    with pytest.raises(ValueError, match="no action tokens in the whole batch"):
        gae(torch.zeros(B, T), VALS, empty, lam=0.9)
    with pytest.raises(ValueError, match="no action tokens in the whole batch"):
        _dis(action_mask=empty, agg="seq_mean")


@pytest.mark.parametrize("norm", [{"num_tokens_global": 10}, {"agg": "seq_mean", "num_seqs_global": 3}])
def test_empty_micro_batch_with_global_normaliser_is_a_zero_loss(norm):
    lp = LP.clone().requires_grad_(True)
    loss, m = dis_loss(lp, LP, ADV, torch.zeros(B, T), eps_low=0.2, eps_high=0.2, **norm)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp)) and m["num_tokens"] == 0.0


def test_empty_row_where_one_is_required():
    mask = MASK.clone()
    mask[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] have zero action tokens"):
        gae(REW, VALS, mask, lam=0.9)  # the scalar reward of row 1 has nowhere to go
    with pytest.raises(ValueError, match=r"rows \[1\] have zero action tokens"):
        length_adaptive_lambda(mask, alpha=1.5)
    gae(torch.zeros(B, T), VALS, mask, lam=0.9)  # per-token rewards: an empty (padding) row is fine


# -------------------------------------------------------------------------------- ranges / names
@pytest.mark.parametrize(
    "kw",
    [
        {"gamma": 1.5},
        {"gamma": -0.1},
        {"lam": 1.01},
        {"lam": -1.0},
        {"lam_critic": 2.0},
        {"lam": torch.tensor([0.5, 1.5])},
    ],
)
def test_gamma_lambda_outside_unit_interval(kw):
    name = next(iter(kw))
    full = {"lam": 0.9, **kw}
    with pytest.raises(ValueError, match=f"`{name}` must lie in"):
        gae(REW, VALS, MASK, **full)
    with pytest.raises(ValueError, match=f"`{name}` must lie in"):
        step_gae(REW, VALS, MASK, mode="step_mean", **full)


def test_lambda_tensor_must_be_constant_per_trajectory():
    with pytest.raises(ValueError, match="`lam` \\[B, T\\] must be constant"):
        gae(REW, VALS, MASK, lam=torch.rand(B, T, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("kw", [{"eps_low": -0.1}, {"eps_high": -1.0}, {"eps_low": math.nan}])
def test_negative_eps(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"`{name}` must be a finite float >= 0"):
        _dis(**kw)
    with pytest.raises(ValueError, match=f"`{name}`"):
        ppo_clip_loss(LP, LP, ADV, MASK, **{"eps_low": 0.2, "eps_high": 0.2, **kw})


def test_unknown_names():
    with pytest.raises(ValueError, match="Unknown policy loss name 'grpo'; choose one of 'dis'"):
        policy_loss("grpo", LP, LP, ADV, MASK)
    with pytest.raises(ValueError, match="Unknown aggregation `agg` 'sum'"):
        _dis(agg="sum")
    with pytest.raises(ValueError, match="Unknown step-level mode"):
        step_gae(REW, VALS, MASK, mode="step_max", lam=0.9)


def test_bad_normalisers():
    with pytest.raises(ValueError, match="`num_tokens_global`=3 is smaller than"):
        _dis(num_tokens_global=3)
    with pytest.raises(ValueError, match="`num_tokens_global` must be > 0"):
        _dis(num_tokens_global=0)
    with pytest.raises(ValueError, match="`num_seqs_global` is for agg='seq_mean'"):
        _dis(num_seqs_global=4)


def test_misc_bad_inputs():
    with pytest.raises(ValueError, match="`action_mask` must hold only 0/1"):
        _dis(action_mask=torch.full((B, T), 2.0))
    with pytest.raises(ValueError, match="`rewards` of shape \\[B\\] cannot be used with `segment_ids`"):
        gae(REW, VALS, MASK, lam=0.9, segment_ids=torch.zeros(B, T, dtype=torch.long))
    with pytest.raises(ValueError, match="`alpha` must be a finite number > 0"):
        length_adaptive_lambda(MASK, alpha=0.0)
    with pytest.raises(ValueError, match="needs both `old_values` and `clip_range`"):
        value_loss(VALS, VALS, MASK, clip_range=0.2)
    with pytest.raises(ValueError, match="RLOO needs >= 2 samples per group"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="`group_ids` has shape"):
        grpo_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0]))
