"""Diagnostics and choices: policy lag, explained variance, the DIS band, estimator choices (hand-computed)."""

import math
import typing

import pytest
import torch

from sao_megatron import algo
from sao_megatron.algo import dis_band, dis_loss, explained_variance, policy_lag, uses_critic


def test_policy_lag_hand_computed():
    versions = torch.tensor([[3, 3, -1, 5, 7], [0, -1, 1, 2, -1]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 1, 1, 0]])
    lag = policy_lag(5, versions, mask)
    # 5 - 3 = 2; off-action tokens 0; 5 - 5 = 0; version 7 is newer: clamped to 0
    assert lag.tolist() == [[2, 2, 0, 0, 0], [5, 0, 4, 3, 0]]
    assert lag.dtype == versions.dtype
    assert policy_lag(5, versions, mask.bool()).equal(lag)


def test_policy_lag_rejects_a_shape_mismatch():
    with pytest.raises(ValueError, match="policy_versions"):
        policy_lag(1, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))


def test_explained_variance_hand_computed():
    # action tokens: R = [1, 2, 3, 4] (Var 1.25), V = [1, 2, 3, 3] -> R - V = [0, 0, 0, 1] (Var 0.1875)
    returns = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, -5.0]])
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert explained_variance(values, returns, mask) == pytest.approx(1 - 0.1875 / 1.25)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # the batch mean as the prediction explains nothing
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask) == pytest.approx(0.0)


def test_first_action_explained_variance_reads_each_rows_first_action_token_only():
    # rows' first action tokens at 1, 0, 2; row 3 has none. There: R = [0, 1, 1], V = [0, 1, 0]
    # -> R - V = [0, 0, 1]: Var 2/9 over Var[R] 2/9 = 0; later tokens, perfectly predicted, do not count
    returns = torch.tensor([[5.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 9.0], [7.0, 7.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    values = torch.tensor([[-4.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 9.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]])
    assert algo.first_action_explained_variance(values, returns, mask) == pytest.approx(0.0)
    assert explained_variance(values, returns, mask) > 0.5  # over all action tokens: a different figure
    values[2, 2] = 1.0  # the first tokens now all predicted: 1
    assert algo.first_action_explained_variance(values, returns, mask) == pytest.approx(1.0)
    values[:, :] = 0.5  # the mean of the first tokens' returns [0, 1, 1] is 2/3: 1 - Var[R - .5]/Var[R] = 1 - 1 = 0
    assert algo.first_action_explained_variance(values, returns, mask) == pytest.approx(0.0)


def test_between_prompt_share_hand_computed():
    # prompt means 1, 0 (Var, n-1: 0.5); no within-prompt variance: all between
    assert algo.between_prompt_share([[1.0, 1.0], [0.0, 0.0]]) == pytest.approx(1.0)
    # every prompt the same coin: within var 0.5 (k-1), means all 0.5 -> between floored at 0
    assert algo.between_prompt_share([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]) == pytest.approx(0.0)
    # means [1, 0.5, 0] (Var 0.25); within [0, 0.5, 0] mean 1/6; B = 0.25 - 1/12 = 1/6; share 0.5
    assert algo.between_prompt_share([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]) == pytest.approx(0.5)
    for bad in ([], [[1.0, 0.0]], [[1.0], [0.0]], [[1.0, 0.0], [1.0]], [[1.0, 1.0], [1.0, 1.0]]):
        assert math.isnan(algo.between_prompt_share(bad))


def test_explained_variance_is_nan_without_variance_or_tokens():
    r = torch.tensor([[2.0, 2.0, 2.0]])
    assert math.isnan(explained_variance(torch.zeros(1, 3), r, torch.ones(1, 3)))  # Var[R] = 0
    assert math.isnan(explained_variance(torch.zeros(1, 3), torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0, 1, 0]])))
    assert math.isnan(explained_variance(torch.zeros(1, 3), r, torch.zeros(1, 3)))


def test_dis_band_hand_computed():
    behavior = torch.zeros(1, 6, dtype=torch.float64)
    rho = torch.tensor([[0.5, 0.7, 0.71, 1.0, 5.99, 6.0]], dtype=torch.float64)
    kept = dis_band(rho.log(), behavior, eps_low=0.3, eps_high=5.0)
    # open band (0.7, 6.0): both edges excluded
    assert kept.tolist() == [[False, False, True, True, True, False]]
    assert kept.dtype == torch.bool


def test_dis_band_huge_ratios_are_dropped_not_overflowed():
    lp = torch.tensor([[80.0, -80.0, 0.0]])  # exp(+-80) over/underflows float32
    kept = dis_band(lp, torch.zeros(1, 3), eps_low=0.2, eps_high=0.2)
    assert kept.tolist() == [[False, False, True]]


def test_dis_band_is_what_dis_keeps():
    g = torch.Generator().manual_seed(0)
    lp, beh = torch.randn(3, 8, generator=g) * 0.5, torch.randn(3, 8, generator=g) * 0.5
    mask = torch.rand(3, 8, generator=g) < 0.7
    _, m = dis_loss(lp, beh, torch.ones(3, 8), mask, eps_low=0.3, eps_high=0.4)
    kept = dis_band(lp, beh, 0.3, 0.4) & mask
    assert m["kept_frac"] == pytest.approx(float(kept.sum()) / float(mask.sum()))


@pytest.mark.parametrize("kw", [{"eps_low": -0.1, "eps_high": 1.0}, {"eps_low": 0.1, "eps_high": math.nan}])
def test_dis_band_rejects_bad_bounds(kw):
    with pytest.raises(ValueError):
        dis_band(torch.zeros(1, 2), torch.zeros(1, 2), **kw)


def test_choices_are_the_literal_types():
    assert algo.POLICY_LOSSES == ("dis", "ppo_clip", "vanilla")
    assert algo.POLICY_LOSSES == typing.get_args(algo.PolicyLossName)
    assert algo.AGG_MODES == ("token_mean", "seq_mean")
    assert set(algo.CRITIC_ESTIMATORS) | {
        "grpo",
        "rloo",
        "running_mean_prompt",
        "running_mean_global",
    } == set(algo.ADVANTAGE_ESTIMATORS)
    assert [e for e in algo.ADVANTAGE_ESTIMATORS if uses_critic(e)] == ["gae", "step_mean", "step_last"]
    assert not uses_critic("grpo")
