"""The driver's advantage estimator: ``algo.truncated`` reads the critic's value at each row's end."""

import pytest
import torch

from sao_megatron.batch import build_batch
from sao_megatron.config import AlgoConfig
from sao_megatron.driver.estimator import AdvantageEstimator
from sao_megatron.records import OBSERVATION_VERSION, Trajectory, Turn


def _trajectory(status: str) -> Trajectory:
    """Prompt of 2 tokens, response [a, a, o, o, a, a]: action labels sit at positions 1, 2, 5, 6 and the
    sequence's last position (L - 1 = 7) holds the value of the state after the last action token."""
    obs = OBSERVATION_VERSION
    return Trajectory(
        prompt_id=status,
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5, 6, 7, 8],
        action_mask=[1, 1, 0, 0, 1, 1],
        behavior_logprobs=[-0.1] * 6,
        policy_versions=[0, 0, obs, obs, 0, 0],
        turns=[Turn(0, 2), Turn(4, 6)],
        reward=10.0,
        status=status,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("mode", ["terminal", "bootstrap"])
def test_truncated_rows_bootstrap_from_the_value_at_their_last_position(mode):
    trajectories = [_trajectory("truncated"), _trajectory("finished")]
    batch = build_batch(trajectories)
    assert batch.value_mask[0].tolist() == [0, 1, 1, 0, 0, 1, 1, 1]  # actions and the last position
    values = torch.tensor([[0.0, 1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 8.0]] * 2)  # as the critic reports them
    estimator = AdvantageEstimator(AlgoConfig(gamma=0.5, lam=0.5, truncated=mode))
    adv, ret, _ = estimator(batch, values, trajectories)
    assert ret is not None
    # gamma = lam = 0.5, lam_critic = 1 (tests/algo/test_algo_truncation.py works these out by hand)
    terminal_adv, terminal_ret = [0, -0.09375, -0.375, 0, 0, 0.5, 6.0, 0], [0, 1.25, 2.5, 0, 0, 5.0, 10.0, 0]
    bootstrap_adv, bootstrap_ret = [0, -0.1875, -0.75, 0, 0, -1.0, 0.0, 0], [0, 0.5, 1.0, 0, 0, 2.0, 4.0, 0]
    cut = (bootstrap_adv, bootstrap_ret) if mode == "bootstrap" else (terminal_adv, terminal_ret)
    assert adv.tolist() == [cut[0], terminal_adv] and ret.tolist() == [cut[1], terminal_ret]
