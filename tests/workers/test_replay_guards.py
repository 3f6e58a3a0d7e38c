"""Routing replay through the real actor at EP2 (a spawned 2-rank world, ``ragged_cases``): a route row
naming an expert twice or outside the model, given to the trainer as known, is routed by the router and
counted (``routing/invalid``), a normal step equal to the one with those positions missing; selective
recompute of the MoE layer (``recompute_modules`` ``moe``) replays the recompute too."""

from types import SimpleNamespace

import pytest

from sao_megatron.models.replay import reruns_routers
from tests.distributed import run_distributed
from tests.workers import ragged_cases
from tests.workers.test_ragged import TOL


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(ragged_cases.case_replay_guards, 2)


def test_an_unfit_route_row_falls_back_to_the_router_and_is_counted(results):
    for r in results:
        assert r["unfit_logprobs"] <= TOL, r["unfit_logprobs"]
        assert r["unfit_grads"][0] <= TOL and r["grad_scale"] > 1e-3, r["unfit_grads"]
        share = 2 / r["known_tokens"]  # 2 positions x every MoE layer, over all known tokens x layers
        assert r["unfit_routing"] == [pytest.approx(share), None], r["unfit_routing"]
    reporting = [r for r in results if r["unfit_update"][0] is not None]
    assert reporting, "no rank reported the update's metrics"
    for invalid, loss, grad_norm in (r["unfit_update"] for r in reporting):
        assert invalid == pytest.approx(share) and loss == loss and 0 < grad_norm < float("inf")


def test_selective_recompute_of_the_moe_layer_replays_its_recompute(results):
    for r in results:
        assert r["recompute"] == "selective"
        assert r["replay_effect"] > 1e-3, r["replay_effect"]  # the replayed routing is not the routers' own
        assert r["recompute_logprobs"] <= TOL, r["recompute_logprobs"]
        assert r["recompute_grads"][0] <= TOL and r["grad_scale"] > 1e-3, r["recompute_grads"]


@pytest.mark.parametrize(
    ("granularity", "modules", "reruns"),
    [
        ("full", None, True),
        ("selective", ["layernorm", "moe"], True),
        ("selective", ["layernorm", "moe_act"], False),  # the experts' activation only, not the router
        ("selective", ["core_attn"], False),
        (None, None, False),
    ],
)
def test_which_recompute_runs_the_routers_again(granularity, modules, reruns):
    config = SimpleNamespace(recompute_granularity=granularity, recompute_modules=modules)
    assert reruns_routers(config) is reruns
