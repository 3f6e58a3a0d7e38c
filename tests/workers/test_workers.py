"""Actor DIS updates, critic values and K updates, and role checkpoints on spawned gloo worlds."""

import pytest

from tests.tolerance import sum_rtol
from tests.workers import worker_cases

TPS = {"dp2": 1, "tp2": 2}


def case_both_layouts(rank, world, ckpt_root: str) -> dict:
    """``worker_cases.case_actor_critic`` at DP=2 and at TP=2 in one spawned world (the package's,
    conftest.py), each with a checkpoint directory of its own."""
    from megatron.core import parallel_state as ps

    out = {}
    for name, tp in TPS.items():
        out[name] = worker_cases.case_actor_critic(rank, world, f"{ckpt_root}/{name}", tp)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(workers_world) -> dict[str, list[dict]]:
    """The per-rank results of :func:`case_both_layouts`, run in the package's world (conftest.py)."""
    return {name: [r["workers"][name] for r in workers_world] for name in TPS}


@pytest.fixture(params=list(TPS), ids=list(TPS))
def results(request, world):
    return world[request.param]


def test_actor_update_reports_dis_metrics_and_resumes_exactly(results):
    m1, m2, m3, m4 = results[0]["actor"]
    assert m1["updated"] == 1.0 and m1["grad_norm"] > 0
    assert any(k.startswith("kept") or "kept" in k for k in m1), sorted(m1)
    # the same step from the same weights, optimizer state and data: the same computation, bit for bit
    for key in m2:
        if key in ("lr",):
            continue
        assert m2[key] == m3[key], key
        assert m2[key] == m4[key], key  # fresh role + load


def test_gradient_norms_per_module_group(results):
    m1 = results[0]["actor"][0]
    assert {"grad_rms/attention", "grad_rms/experts", "grad_rms/router", "grad_rms/head"} <= set(m1)
    norms = {k.removeprefix("grad_norm/"): v for k, v in m1.items() if k.startswith("grad_norm/")}
    total = sum(v**2 for v in norms.values()) ** 0.5
    # Groups add up to Megatron's global norm. Both sum the same n squared gradient entries (nonnegative),
    # Megatron in float32 in its own order: at most sum_rtol(n) apart relative (tests/tolerance.py), their
    # square roots half that. n = (norm / rms)^2 per group, about 1e6 here: the worst case is loose (~6%).
    n = round(sum((v / m1[f"grad_rms/{g}"]) ** 2 for g, v in norms.items() if v > 0))
    assert total == pytest.approx(m1["grad_norm"], rel=sum_rtol(n) / 2), n
    c1 = results[0]["critic"][0]
    assert "grad_rms/attention" not in c1 and "grad_rms/experts" in c1  # critic attention is frozen


def test_critic_values_from_reporting_ranks_and_updates_reduce_loss(results):
    if results[0]["rows"] == [0, 1, 2, 3]:  # TP=2: one replica; TP rank 0 holds the whole rows
        assert not results[1]["reports"]
    else:  # DP=2: each replica reports its own rows, together every row once
        assert sorted(results[0]["rows"] + results[1]["rows"]) == [0, 1, 2, 3]
    assert results[0]["values_zero"] == 0.0  # zero-initialised value head
    c1, c2 = results[0]["critic"]
    assert c2["value_loss"] < c1["value_loss"], (c1, c2)
