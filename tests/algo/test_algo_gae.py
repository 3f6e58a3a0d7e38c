"""GAE: hand-computed cases, reference loop == vectorised on random multi-turn batches, invariants."""

import random

import pytest
import torch

from sao_megatron.algo import (
    gae,
    gae_reference,
    length_adaptive_lambda,
    reverse_discounted_cumsum,
    segment_ids_from_cu_seqlens,
    step_gae,
)

F64 = torch.float64

# [a, a, o, o, a, a, pad]: two action spans separated by an observation span, one padding token.
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
VALUES = torch.tensor([[1.0, 2.0, 9.0, 9.0, 3.0, 4.0, 9.0]], dtype=F64)  # 9 = ignored (not an action)
REWARD = torch.tensor([10.0], dtype=F64)  # terminal reward, lands on token 5


@pytest.mark.parametrize("impl", [gae, gae_reference])
def test_gae_hand_computed(impl):
    adv, ret, m = impl(REWARD, VALUES, MASK, gamma=0.5, lam=0.5)
    # gamma = lam = 0.5, action tokens t0, t1, t4, t5 (t1 links to t4 across the observation span):
    # t5: delta = 10 + 0 - 4 = 6                          A = 6
    # t4: delta = 0 + 0.5*4 - 3 = -1                      A = -1 + 0.25*6 = 0.5
    # t1: delta = 0 + 0.5*3 - 2 = -0.5                    A = -0.5 + 0.25*0.5 = -0.375
    # t0: delta = 0 + 0.5*2 - 1 = 0                       A = 0 + 0.25*(-0.375) = -0.09375
    expected = torch.tensor([[-0.09375, -0.375, 0, 0, 0.5, 6.0, 0]], dtype=F64)
    assert torch.allclose(adv, expected, atol=1e-12)
    # lam_critic = 1: A_c = [0.25, 0.5, _, _, 2, 6]; returns = A_c + V = discounted Monte Carlo returns
    assert torch.allclose(ret, torch.tensor([[1.25, 2.5, 0, 0, 5.0, 10.0, 0]], dtype=F64), atol=1e-12)
    assert m["num_traj"] == 1.0 and m["num_action_tokens"] == 4.0
    assert m["adv/max"] == pytest.approx(6.0) and m["lambda/mean"] == 0.5


def test_gae_gamma1_lam1_is_reward_minus_value():
    adv, ret, _ = gae(REWARD, VALUES, MASK, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[9.0, 8.0, 0, 0, 7.0, 6.0, 0]], dtype=F64))
    assert torch.allclose(ret, torch.tensor([[10.0, 10.0, 0, 0, 10.0, 10.0, 0]], dtype=F64))


def test_gae_lam0_is_one_step_td():
    adv, _, _ = gae(REWARD, VALUES, MASK, gamma=1.0, lam=0.0)
    # A = delta = r + V(next action) - V: [2-1, 3-2, _, _, 4-3, 10-4]
    assert torch.allclose(adv, torch.tensor([[1.0, 1.0, 0, 0, 1.0, 6.0, 0]], dtype=F64))


@pytest.mark.parametrize("impl", [gae, gae_reference])
def test_gae_packed_hand_computed(impl):
    # One row, two trajectories: seg 0 = tokens 0-2 (actions 0, 2), seg 1 = tokens 3-5 (actions 3, 4).
    mask = torch.tensor([[1, 0, 1, 1, 1, 0]])
    seg = torch.tensor([[0, 0, 0, 1, 1, 1]])
    values = torch.tensor([[1.0, 0.0, 2.0, 3.0, 4.0, 0.0]], dtype=F64)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 5.0, 0.0]], dtype=F64)
    adv, _, _ = impl(rewards, values, mask, gamma=1.0, lam=1.0, segment_ids=seg)
    # seg 0: t2: 1 - 2 = -1, t0: (0 + 2 - 1) + (-1) = 0 = R - V0; seg 1: t4: 5 - 4 = 1, t3: 5 - 3 = 2
    assert torch.allclose(adv, torch.tensor([[0.0, 0, -1.0, 2.0, 1.0, 0]], dtype=F64))
    unpacked, _, _ = impl(rewards, values, mask, gamma=1.0, lam=1.0)  # bootstraps t2 from t3 instead
    assert unpacked[0, 2].item() == pytest.approx(1.0 + 3.0 - 2.0 + 2.0)


def test_cu_seqlens_helper():
    seg = segment_ids_from_cu_seqlens(torch.tensor([0, 3, 5]), 7)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 2]]


def test_length_adaptive_lambda_hand_computed():
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 0, 0, 0]])
    lam = length_adaptive_lambda(mask, alpha=1.5)  # [B] without segment_ids
    # row 0: l = 4 -> 1 - 1/6; row 1: l = 1 -> 1 - 1/1.5 = 1/3
    assert torch.allclose(lam, torch.tensor([5 / 6, 1 / 3], dtype=F64))
    assert length_adaptive_lambda(mask, alpha=0.5)[1].item() == 0.0  # 1 - 2 clamped to 0
    _, _, m = gae(torch.ones(2, dtype=F64), torch.zeros(2, 5, dtype=F64), mask, lam=lam)
    assert m["lambda/mean"] == pytest.approx((5 / 6 + 1 / 3) / 2)
    # packed: one row, trajectories of 2 and 1 action tokens -> [B, T], constant per trajectory
    packed = length_adaptive_lambda(torch.tensor([[1, 1, 0, 1]]), 1.5, segment_ids=torch.tensor([[0, 0, 1, 1]]))
    assert torch.allclose(packed, torch.tensor([[2 / 3, 2 / 3, 0.0, 1 / 3]], dtype=F64))


STEP_MASK = torch.tensor([[1, 1, 0, 1, 1, 1, 0]])  # turn 0 = t0, t1; turn 1 = t3, t4, t5
STEP_VALUES = torch.tensor([[1.0, 3.0, 9.0, 2.0, 4.0, 6.0, 9.0]], dtype=F64)


def test_step_gae_hand_computed():
    r = torch.tensor([10.0], dtype=F64)
    adv, ret, m = step_gae(r, STEP_VALUES, STEP_MASK, mode="step_mean", gamma=1.0, lam=0.5)
    # turn values (mean) V0 = 2, V1 = 4: A1 = 10 - 4 = 6; A0 = (0 + 4 - 2) + 0.5 * 6 = 5
    assert adv.tolist() == [[5.0, 5.0, 0.0, 6.0, 6.0, 6.0, 0.0]]
    # lam_critic = 1: A_c1 = 6, A_c0 = 2 + 6 = 8 -> returns = A_c + V_turn = 10 for both turns
    assert ret.tolist() == [[10.0, 10.0, 0.0, 10.0, 10.0, 10.0, 0.0]]
    assert m["num_turns"] == 2.0
    adv, _, _ = step_gae(r, STEP_VALUES, STEP_MASK, mode="step_last", gamma=1.0, lam=0.5)
    # turn values (last token) V0 = 3, V1 = 6: A1 = 4; A0 = (0 + 6 - 3) + 0.5 * 4 = 5
    assert adv.tolist() == [[5.0, 5.0, 0.0, 4.0, 4.0, 4.0, 0.0]]


def test_step_gae_explicit_turn_ids():
    # turn_ids split the first span and join t1 with the second span: turns {t0}, {t1, t3, t4, t5}
    turn_ids = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
    adv, _, m = step_gae(
        torch.tensor([10.0], dtype=F64), STEP_VALUES, STEP_MASK, mode="step_last", lam=1.0, turn_ids=turn_ids
    )
    # V0 = 1, V1 = 6 (last token t5), gamma = lam = 1: A1 = 10 - 6 = 4, A0 = 10 - 1 = 9
    assert adv.tolist() == [[9.0, 4.0, 0.0, 4.0, 4.0, 4.0, 0.0]]
    assert m["num_turns"] == 2.0


def test_step_gae_single_token_turns_equal_token_gae():
    mask = torch.tensor([[1, 0, 1, 0, 1, 0, 1]])
    v = torch.randn(1, 7, dtype=F64, generator=torch.Generator().manual_seed(0))
    r = torch.tensor([1.0], dtype=F64)
    tok = gae(r, v, mask, gamma=0.99, lam=0.9)
    for mode in ("step_mean", "step_last"):
        st = step_gae(r, v, mask, mode=mode, gamma=0.99, lam=0.9)
        assert torch.allclose(tok[0], st[0]) and torch.allclose(tok[1], st[1])


# ------------------------------------------------------------------------------------ randomised
def _random_batch(rng: random.Random, b: int, packed: bool, allow_empty: bool):
    """Rows of trajectories [prompt obs, (action span, obs span) x turns], padded left or right."""
    rows = []
    for _ in range(b):
        toks = []  # (is_action, segment id)
        n_traj = rng.randint(1, 3) if packed else 1
        for s in range(n_traj):
            toks += [(0, s)] * rng.randint(0, 4)  # prompt
            if allow_empty and rng.random() < 0.15:
                continue  # a segment/row with no action token at all
            for _ in range(rng.randint(1, 50)):
                toks += [(1, s)] * rng.randint(1, 8) + [(0, s)] * rng.randint(0, 6)
        rows.append(toks)
    t = max(len(r) for r in rows) + rng.randint(1, 5)
    mask = torch.zeros(b, t, dtype=torch.bool)
    seg = torch.full((b, t), -1, dtype=torch.long)
    for i, toks in enumerate(rows):
        off = rng.randint(0, t - len(toks))  # arbitrary left/right padding
        for j, (a, s) in enumerate(toks):
            mask[i, off + j], seg[i, off + j] = bool(a), s
    return mask, seg


def _random_case(seed: int):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b = rng.randint(1, 4)
    packed = rng.random() < 0.5
    scalar_reward = not packed and rng.random() < 0.5
    adaptive = rng.random() < 0.4
    allow_empty = not scalar_reward and not (adaptive and not packed)
    mask, seg = _random_batch(rng, b, packed, allow_empty)
    if not mask.any():
        mask[0, 0] = True
    t = mask.shape[1]
    values = torch.randn(b, t, generator=g, dtype=F64)
    if scalar_reward:
        rewards = torch.randn(b, generator=g, dtype=F64)
    else:  # sparse per-token rewards, also on observation tokens (must be ignored)
        rewards = torch.randn(b, t, generator=g, dtype=F64) * (torch.rand(b, t, generator=g) < 0.05)
    kind = rng.choice(["float", "row", "edge"]) if not adaptive else "adaptive"
    if kind == "float":
        lam = rng.random()
    elif kind == "row":
        lam = torch.rand(b, generator=g, dtype=F64)
    elif kind == "edge":
        lam = rng.choice([0.0, 1.0])
    else:
        lam = length_adaptive_lambda(mask, alpha=rng.uniform(0.5, 3.0), segment_ids=seg if packed else None)
    kw = {
        "gamma": rng.choice([1.0, 0.99]),
        "lam": lam,
        "lam_critic": rng.choice([1.0, rng.random()]),
        "segment_ids": seg if packed else None,
    }
    return rewards, values, mask, kw


@pytest.mark.parametrize("seed", range(40))
def test_gae_vectorised_matches_reference(seed):
    rewards, values, mask, kw = _random_case(seed)
    adv, ret, m = gae(rewards, values, mask, **kw)
    adv_ref, ret_ref, m_ref = gae_reference(rewards, values, mask, **kw)
    assert (adv - adv_ref).abs().max().item() <= 1e-6
    assert (ret - ret_ref).abs().max().item() <= 1e-6
    assert m["num_traj"] == m_ref["num_traj"]
    assert m["lambda/mean"] == pytest.approx(m_ref["lambda/mean"])
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def _step_reference(rewards, values, mask, seg, mode, gamma, lam, lam_c):
    """Loop over rows and turns (maximal runs of adjacent action tokens of one segment)."""
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    for b in range(mask.shape[0]):
        turns, cur, prev = [], None, None  # turns as lists of token indices, grouped by trajectory
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            new_traj = prev is None or seg[b, t] != seg[b, prev]
            if new_traj or t != prev + 1:
                cur = [t]
                turns.append((new_traj, cur))
            else:
                cur.append(t)
            prev = t
        trajs = []
        for new_traj, tok in turns:
            if new_traj:
                trajs.append([])
            trajs[-1].append(tok)
        for traj in trajs:
            a_next = ac_next = v_next = 0.0
            for tok in reversed(traj):
                v = (
                    sum(values[b, t].item() for t in tok) / len(tok)
                    if mode == "step_mean"
                    else values[b, tok[-1]].item()
                )
                r = sum(rewards[b, t].item() for t in tok)
                delta = r + gamma * v_next - v
                a_next, ac_next, v_next = delta + gamma * lam * a_next, delta + gamma * lam_c * ac_next, v
                for t in tok:
                    adv[b, t], ret[b, t] = a_next, ac_next + v
    return adv, ret


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("mode", ["step_mean", "step_last"])
def test_step_gae_matches_loop(seed, mode):
    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(seed)
    mask, seg = _random_batch(rng, 3, packed=seed % 2 == 0, allow_empty=True)
    mask[0, 0] = True
    values = torch.randn(mask.shape, generator=g, dtype=F64)
    rewards = torch.randn(mask.shape, generator=g, dtype=F64) * (torch.rand(mask.shape, generator=g) < 0.1)
    gamma, lam, lam_c = rng.choice([1.0, 0.99]), rng.random(), rng.choice([1.0, 0.7])
    adv, ret, _ = step_gae(rewards, values, mask, mode=mode, gamma=gamma, lam=lam, lam_critic=lam_c, segment_ids=seg)
    adv_ref, ret_ref = _step_reference(rewards, values, mask, seg, mode, gamma, lam, lam_c)
    assert (adv - adv_ref).abs().max().item() <= 1e-9
    assert (ret - ret_ref).abs().max().item() <= 1e-9


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("impl", ["gae", "step_mean", "step_last"])
def test_observation_values_and_rewards_do_not_change_action_outputs(seed, impl):
    rewards, values, mask, kw = _random_case(seed)
    if rewards.dim() == 1:
        rewards = torch.zeros(values.shape, dtype=F64).index_put_(
            (torch.arange(mask.shape[0]), mask.shape[1] - 1 - mask.flip(1).long().argmax(1)), rewards
        )
    g = torch.Generator().manual_seed(1000 + seed)
    noise_v = torch.randn(values.shape, generator=g, dtype=F64) * 100 * ~mask
    noise_r = torch.randn(values.shape, generator=g, dtype=F64) * 100 * ~mask

    def run(r, v):
        if impl == "gae":
            return gae(r, v, mask, **kw)
        return step_gae(r, v, mask, mode=impl, **kw)

    a0, r0, _ = run(rewards, values)
    a1, r1, _ = run(rewards + noise_r, values + noise_v)
    assert torch.equal(a0, a1) and torch.equal(r0, r1)


@pytest.mark.parametrize("c", [0.0, 1e-3, 0.5, 0.99, 1.0])
def test_scan_exact_and_underflow_safe(c):
    # 70_000 tokens: c^T underflows to 0 for c < 1; the chunked scan never divides by c^t.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 70_000, generator=g, dtype=F64)
    y = reverse_discounted_cumsum(x, torch.tensor([c], dtype=F64))
    ref, acc = [0.0] * x.shape[1], 0.0
    for t, v in zip(reversed(range(x.shape[1])), reversed(x[0].tolist()), strict=True):
        acc = v + c * acc
        ref[t] = acc
    assert (y[0] - torch.tensor(ref, dtype=F64)).abs().max().item() <= 1e-9


def test_long_trajectory_with_observation_gaps_matches_reference():
    # One 128K-token row, c = 0.99 * 0.95: c^T underflows; compare the vectorised GAE with the loop.
    g = torch.Generator().manual_seed(3)
    t = 131_072
    mask = torch.rand(1, t, generator=g) < 0.6
    values = torch.randn(1, t, generator=g, dtype=F64)
    r = torch.tensor([1.0], dtype=F64)
    adv, ret, _ = gae(r, values, mask, gamma=0.99, lam=0.95)
    adv_ref, ret_ref, _ = gae_reference(r, values, mask, gamma=0.99, lam=0.95)
    assert (adv - adv_ref).abs().max().item() <= 1e-6 and (ret - ret_ref).abs().max().item() <= 1e-6


def test_float32_inputs_give_float32_outputs():
    adv, ret, _ = gae(REWARD.float(), VALUES.float(), MASK, gamma=0.5, lam=0.5)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    assert adv[0, 5].item() == 6.0
