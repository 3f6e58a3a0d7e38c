"""GRPO / RLOO / running-mean baselines: hand-computed values and checkpoint round trips."""

import math

import torch

from sao_megatron.algo import (
    GlobalRunningMeanBaseline,
    PromptRunningMeanBaseline,
    broadcast_to_tokens,
    grpo_advantages,
    rloo_advantages,
)


def test_grpo_hand_computed():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv, m = grpo_advantages(r, torch.tensor([0, 0, 1, 1]))
    # group 0: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / 0.70711 = +-0.70711; group 1: std 0 -> 0
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(adv, torch.tensor([s, -s, 0.0, 0.0]))
    assert m["zero_std_group_frac"] == 0.5 and m["num_groups"] == 2.0
    adv, _ = grpo_advantages(r, torch.tensor([0, 0, 1, 1]), normalize_std=False)
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]


def test_grpo_singleton_group_gives_zero():
    adv, _ = grpo_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([7, 8, 8]))
    assert adv[0].item() == 0.0


def test_rloo_hand_computed():
    adv, _ = rloo_advantages(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 0]))
    # baselines: (0 + 3) / 2 = 1.5, (1 + 3) / 2 = 2, (1 + 0) / 2 = 0.5
    assert adv.tolist() == [-0.5, -2.0, 2.5]


def test_prompt_running_mean_excludes_own_reward_and_round_trips():
    b = PromptRunningMeanBaseline(window=2)
    adv, m = b.advantages(torch.tensor([1.0, 0.0, 1.0, 5.0]), ["a", "a", "a", "b"])
    # baselines before insertion: a: [] -> 0, [1] -> 1, [1, 0] -> 0.5; b: [] -> 0
    assert adv.tolist() == [1.0, -1.0, 0.5, 5.0]
    assert m["new_prompt_frac"] == 0.5
    assert b.baseline("a") == 0.5  # window 2 keeps [0, 1]
    c = PromptRunningMeanBaseline(window=2)
    c.load_state_dict(b.state_dict())
    assert c.advantages(torch.tensor([2.0]), ["a"])[0].tolist() == b.advantages(torch.tensor([2.0]), ["a"])[0].tolist()
    # another window (an arm continuing a shared start with its own running_mean_window): the most
    # recent rewards of each prompt, up to the new window
    narrow = PromptRunningMeanBaseline(window=1)
    narrow.load_state_dict(b.state_dict())
    assert narrow.baseline("a") == 2.0 and narrow.state_dict()["window"] == 1
    wide = PromptRunningMeanBaseline(window=8)
    wide.load_state_dict(b.state_dict())
    assert wide.baseline("a") == 1.5  # mean(1, 2): all two kept, room for six more


def test_global_running_mean_hand_computed_and_round_trip():
    b = GlobalRunningMeanBaseline(window=2)
    adv, _ = b.advantages(torch.tensor([1.0, 3.0, 5.0]))
    assert adv.tolist() == [1.0, 2.0, 3.0]  # baselines 0, 1, mean(1, 3) = 2
    c = GlobalRunningMeanBaseline(window=2)
    c.load_state_dict(b.state_dict())
    assert c.baseline() == 4.0  # mean(3, 5)
    d = GlobalRunningMeanBaseline(window=1)  # another window: the most recent rewards
    d.load_state_dict(b.state_dict())
    assert d.baseline() == 5.0
    e = GlobalRunningMeanBaseline(window=128)
    e.load_state_dict(GlobalRunningMeanBaseline(window=8).state_dict())  # an empty start's state
    assert e.baseline() == 0.0 and e.advantages(torch.tensor([1.0]))[0].tolist() == [1.0]


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 0, 1], [0, 1, 1]]))
    assert out.tolist() == [[2.0, 0.0, 2.0], [0.0, -1.0, -1.0]]
