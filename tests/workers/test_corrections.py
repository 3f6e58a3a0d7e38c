"""The policy-loss corrections (sequence mask, truncated IS) and the MoE router settings of the actor
(``actor.moe_aux_loss_coeff``, ``actor.freeze_router``) in real Megatron actor steps: one spawned
1-rank world (:mod:`tests.workers.corrections_cases`)."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.tolerance import sum_atol
from tests.workers import corrections_cases


@pytest.fixture(scope="module")
def world() -> dict:
    return run_distributed(corrections_cases.case_all, 1)[0]


def test_sequence_mask_drops_the_trajectories_outside_the_band(world):
    r = world["corrections"]
    keep = r["keep"]  # rows 2 and 3 (geometric-mean ratio e and 1/e) leave [0.5, 2]; rows 0-1 stay
    assert any(keep[0]) and any(keep[1]) and not any(keep[2]) and not any(keep[3])
    got, plain, zeroed, want = r["seq_mask"], r["plain"], r["rows_zeroed"], r["want_seq_mask"]
    assert got["seq_mask/dropped_seq_frac"] == want["seq_mask/dropped_seq_frac"] == 0.5
    assert got["seq_mask/dropped_token_frac"] == pytest.approx(want["seq_mask/dropped_token_frac"], rel=1e-15)
    # the masked step is the plain step without rows 2-3's advantages: same arithmetic, bit for bit
    assert got["loss"] == zeroed["loss"] and got["grad_norm"] == zeroed["grad_norm"]
    assert got["grad_norm"] != plain["grad_norm"] and got["loss"] != plain["loss"]
    # and its loss is the algo function's on the whole batch (float32 sums in another order)
    atol = sum_atol(int(got["num_tokens"]), torch.float32, r["abs_seq"], term_ulps=4)
    assert got["loss"] == pytest.approx(want["loss"], rel=0, abs=atol)
    assert "seq_mask/dropped_seq_frac" not in plain


def test_truncated_is_weights_each_token_by_min_rho_cap(world):
    r = world["corrections"]
    got, weighted, vanilla, want = r["tis"], r["weighted"], r["vanilla"], r["want_tis"]
    assert 0 < got["tis/clipped_frac"] < 1 and got["tis/clipped_frac"] == pytest.approx(want["tis/clipped_frac"])
    assert got["tis/weight/mean"] == pytest.approx(want["tis/weight/mean"], rel=1e-12)
    assert got["loss"] == pytest.approx(weighted["loss"], rel=1e-6) and got["loss"] != vanilla["loss"]
    assert got["grad_norm"] == pytest.approx(weighted["grad_norm"], rel=1e-5) != vanilla["grad_norm"]
    atol = sum_atol(int(got["num_tokens"]), torch.float32, r["abs_tis"], term_ulps=4)
    assert got["loss"] == pytest.approx(want["loss"], rel=0, abs=atol)


def test_rl_adds_no_load_balancing_gradient_by_default(world):
    r = world["corrections"]
    assert r["aux_default"]["grad_norm"] == 0.0 and r["aux_default"]["loss"] == 0.0  # A = 0: nothing else
    assert r["aux_on"]["grad_norm"] > 0.0 and r["aux_on"]["loss"] == 0.0  # the aux loss's alone
    assert r["coeff_after_sft"] == 0.001 and r["coeff_after_rl"] == 0.0  # SFT keeps model.moe_aux_loss_coeff


def test_frozen_routers_do_not_change_across_an_update(world):
    r = world["freeze_router"]
    trainable, frozen = r["trainable"], r["frozen"]
    assert trainable["updated"] == frozen["updated"] == 1.0
    assert trainable["routers"] == frozen["routers"] > 0
    assert trainable["routers_changed"] == trainable["routers"]
    assert frozen["routers_changed"] == 0
    assert frozen["others_changed"] == trainable["others_changed"] > 0
