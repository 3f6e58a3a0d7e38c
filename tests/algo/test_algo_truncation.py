"""Truncated episodes (``algo.truncated``): exact targets on a hand-built batch, reference == vectorised."""

import random

import pytest
import torch

from sao_megatron.algo import gae, gae_reference, step_gae, truncation_targets

F64 = torch.float64

# Two copies of [a, a, o, o, a, a, end]: two action spans around an observation span; position 6 is the
# sequence's last position (no action: it would predict the token after the end), where the critic's
# value of the state after the last action token sits. Row 0 was cut by a limit, row 1 ended.
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0]] * 2)
VALUES = torch.tensor([[1.0, 2.0, 9.0, 9.0, 3.0, 4.0, 8.0]] * 2, dtype=F64)  # 9: observation, not read
REWARDS = torch.tensor([10.0, 10.0], dtype=F64)  # the grade each episode got (row 0's: of an unfinished one)
TRUNCATED = torch.tensor([True, False])
CUT_VALUES = VALUES[:, 6]  # V at each row's last position L - 1 = 6

# gamma = lam = 0.5, lam_critic = 1; t1 links to t4 across the observation span.
# Terminal (as if the episode ended; reward 10 on t5):
#   t5: delta = 10 - 4 = 6            A = 6
#   t4: delta = 0.5*4 - 3 = -1        A = -1 + 0.25*6 = 0.5
#   t1: delta = 0.5*3 - 2 = -0.5      A = -0.5 + 0.25*0.5 = -0.375
#   t0: delta = 0.5*2 - 1 = 0         A = 0.25*(-0.375) = -0.09375
#   returns (lam_critic 1) = discounted reward: [10*0.5^3, 10*0.5^2, _, _, 10*0.5, 10]
TERMINAL_ADV = [-0.09375, -0.375, 0.0, 0.0, 0.5, 6.0, 0.0]
TERMINAL_RET = [1.25, 2.5, 0.0, 0.0, 5.0, 10.0, 0.0]
# Bootstrap (reward replaced by V_cut = 8 after t5):
#   t5: delta = 0 + 0.5*8 - 4 = 0     A = 0
#   t4: delta = 0.5*4 - 3 = -1        A = -1 + 0.25*0 = -1
#   t1: delta = 0.5*3 - 2 = -0.5      A = -0.5 + 0.25*(-1) = -0.75
#   t0: delta = 0.5*2 - 1 = 0         A = 0.25*(-0.75) = -0.1875
#   returns = discounted V_cut: [8*0.5^4, 8*0.5^3, _, _, 8*0.5^2, 8*0.5]
BOOTSTRAP_ADV = [-0.1875, -0.75, 0.0, 0.0, -1.0, 0.0, 0.0]
BOOTSTRAP_RET = [0.5, 1.0, 0.0, 0.0, 2.0, 4.0, 0.0]


@pytest.mark.parametrize("impl", [gae, gae_reference])
def test_terminal_trains_the_cut_as_the_end_with_its_reward(impl):
    rewards, bootstrap = truncation_targets(REWARDS, CUT_VALUES, TRUNCATED, "terminal")
    assert bootstrap is None and rewards.tolist() == [10.0, 10.0]
    adv, ret, _ = impl(rewards, VALUES, MASK, gamma=0.5, lam=0.5, bootstrap=bootstrap)
    assert adv.tolist() == [TERMINAL_ADV, TERMINAL_ADV]
    assert ret.tolist() == [TERMINAL_RET, TERMINAL_RET]


@pytest.mark.parametrize("impl", [gae, gae_reference])
def test_bootstrap_targets_the_critic_value_at_the_cut(impl):
    rewards, bootstrap = truncation_targets(REWARDS, CUT_VALUES, TRUNCATED, "bootstrap")
    assert rewards.tolist() == [0.0, 10.0] and bootstrap is not None and bootstrap.tolist() == [8.0, 0.0]
    adv, ret, _ = impl(rewards, VALUES, MASK, gamma=0.5, lam=0.5, bootstrap=bootstrap)
    assert adv.tolist() == [BOOTSTRAP_ADV, TERMINAL_ADV]  # the row that ended keeps its reward
    assert ret.tolist() == [BOOTSTRAP_RET, TERMINAL_RET]


def test_step_gae_bootstraps_after_the_last_turn():
    rewards, bootstrap = truncation_targets(REWARDS, CUT_VALUES, TRUNCATED, "bootstrap")
    adv, ret, _ = step_gae(rewards, VALUES, MASK, mode="step_last", gamma=0.5, lam=0.5, bootstrap=bootstrap)
    # turn values (last token) V0 = 2, V1 = 4. Row 0 (cut, V_cut = 8): A1 = 0.5*8 - 4 = 0,
    # A0 = (0.5*4 - 2) + 0.25*0 = 0; returns: A_c1 + V1 = 4, A_c0 + V0 = 0 + 0.5*0 + 2 = 2.
    # Row 1 (ended, reward 10): A1 = 10 - 4 = 6, A0 = 0 + 0.25*6 = 1.5; returns 10, (0 + 0.5*6) + 2 = 5.
    assert adv.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.5, 1.5, 0.0, 0.0, 6.0, 6.0, 0.0]]
    assert ret.tolist() == [[2.0, 2.0, 0.0, 0.0, 4.0, 4.0, 0.0], [5.0, 5.0, 0.0, 0.0, 10.0, 10.0, 0.0]]


@pytest.mark.parametrize("seed", range(12))
def test_bootstrap_vectorised_matches_reference(seed):
    """Random multi-turn rows, padded ([B] bootstrap) or packed ([B, T], read at each last action token)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b, t = rng.randint(1, 4), 64
    mask = torch.rand(b, t, generator=g) < 0.6
    mask[:, 0] = True
    values = torch.randn(b, t, generator=g, dtype=F64)
    packed = seed % 2 == 1
    gamma, lam, lam_critic = rng.choice([1.0, 0.99]), rng.random(), rng.choice([1.0, 0.8])
    seg = None
    if packed:
        seg = (torch.arange(t) >= rng.randint(8, t - 8)).long().expand(b, t)  # two trajectories per row
        rewards = torch.randn(b, t, generator=g, dtype=F64)
        bootstrap = torch.randn(b, t, generator=g, dtype=F64)
    else:
        rewards = torch.randn(b, generator=g, dtype=F64)
        bootstrap = torch.randn(b, generator=g, dtype=F64) * (torch.rand(b, generator=g) < 0.5)  # some rows end
        bootstrap[0] = 1.5

    def run(impl, boot):
        return impl(rewards, values, mask, gamma=gamma, lam=lam, lam_critic=lam_critic, segment_ids=seg, bootstrap=boot)

    adv, ret, _ = run(gae, bootstrap)
    adv_ref, ret_ref, _ = run(gae_reference, bootstrap)
    assert (adv - adv_ref).abs().max().item() <= 1e-9 and (ret - ret_ref).abs().max().item() <= 1e-9
    plain, _, _ = run(gae, None)
    assert not torch.equal(adv, plain)  # the bootstrap reached the advantages


def test_bootstrap_errors_name_the_fix():
    with pytest.raises(ValueError, match="segment_ids"):
        gae(torch.zeros(1, 7), VALUES[:1], MASK[:1], lam=1.0, segment_ids=torch.zeros(1, 7), bootstrap=REWARDS[:1])
    with pytest.raises(ValueError, match="bootstrap"):
        gae(REWARDS, VALUES, MASK, lam=1.0, bootstrap=torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="truncation"):
        truncation_targets(REWARDS, CUT_VALUES, TRUNCATED, "drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cut_values"):
        truncation_targets(REWARDS, torch.tensor([float("nan"), 0.0]), TRUNCATED, "bootstrap")
