"""Context parallelism in the workers: each CP rank gets its load-balanced share of every
micro-batch (padded rows and packed segments) and per-position outputs gather back whole
(2-rank gloo world, CP=2; no model: the local layer spec has no CP attention, so a CP role is
refused without Transformer Engine, which is tested here too)."""

import pytest
import torch

from sao_megatron.config import ConfigError, ParallelConfig
from sao_megatron.workers.role import check_context_parallel
from tests.workers import ragged_cases


def case_cp_share(rank, world, pack: bool):
    from megatron.core import parallel_state as ps

    from sao_megatron.batch import build_batch
    from sao_megatron.context_parallel import cp_indices
    from sao_megatron.parallel import initialize_model_parallel
    from sao_megatron.workers.micro import full_sequence, micro_batches, micro_batching

    p = ParallelConfig(world_size=2, context_parallel=2, micro_batch_size=2, pack_sequences=pack)
    initialize_model_parallel(p)
    batch = build_batch(ragged_cases.ragged_trajectories())
    shard = batch.shard(1)[0]
    extra = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    micro = micro_batches(shard, micro_batching(p), advantages=extra)
    whole = [shard.batch.micro_batch(mb.rows, micro_batching(p), advantages=extra) for mb in micro]
    out = {"shapes": [], "split_ok": True, "gather_ok": True}
    for mine, full in zip(micro, whole, strict=True):
        assert mine.cp_lengths is not None and mine.advantages is not None and full.advantages is not None
        idx = cp_indices(mine.cp_lengths, 2, ps.get_context_parallel_rank())
        out["shapes"].append((tuple(full.tokens.shape), tuple(mine.tokens.shape)))
        for key in ("tokens", "labels", "action_mask", "advantages", "positions"):
            out["split_ok"] &= torch.equal(getattr(mine, key), getattr(full, key)[:, idx])
        out["gather_ok"] &= torch.equal(full_sequence(mine.advantages, mine), full.advantages)
        if pack:
            assert mine.cu_seqlens is not None and full.cu_seqlens is not None
            out["gather_ok"] &= torch.equal(mine.cu_seqlens, full.cu_seqlens)  # whole, for TE
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_each_cp_rank_holds_its_balanced_share_and_outputs_gather_whole(world, pack):
    for r in world[f"share/{pack}"]:
        assert r["split_ok"] and r["gather_ok"], r
        for full, mine in r["shapes"]:
            assert full[1] % 4 == 0 and tuple(mine) == (full[0], full[1] // 2)  # 2 * CP chunks, half each


def test_a_cp_role_without_transformer_engine_is_refused_with_the_fix():
    check_context_parallel(ParallelConfig(world_size=2), "actor")  # CP=1: nothing to refuse
    with pytest.raises(
        ConfigError,
        match=r"critic\.parallel\.context_parallel=2 needs Transformer Engine.*"
        r"set critic\.parallel\.context_parallel=1",
    ):
        check_context_parallel(ParallelConfig(world_size=2, context_parallel=2), "critic")


LAYOUTS = ["cp2", "dp2"]


class _ReplicatedGrads:
    """A stand-in for Megatron's non-distributed optimizer: its parameters' reduced gradients as the
    DP x CP all-reduce leaves them, the same on every rank."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.param_groups = [{"params": params}]

    def prepare_grads(self) -> None:
        pass


def case_group_norms_of_replicas(rank, world, layout: str):
    from sao_megatron.parallel import initialize_model_parallel
    from sao_megatron.workers.role import module_group_grad_norms

    cp = 2 if layout == "cp2" else 1
    initialize_model_parallel(ParallelConfig(world_size=2, context_parallel=cp))
    module = torch.nn.Module()
    module.layer = torch.nn.Module()
    module.layer.dense = torch.nn.Parameter(torch.zeros(3, 5))
    module.layer.experts = torch.nn.Module()
    module.layer.experts.weight = torch.nn.Parameter(torch.zeros(4, 2))
    g = torch.Generator().manual_seed(0)  # the same reduced gradient on every rank
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    norms = module_group_grad_norms(module, _ReplicatedGrads(list(module.parameters())))
    dense, experts = module.layer.dense.grad, module.layer.experts.weight.grad
    assert dense is not None and experts is not None
    return {
        "norms": norms,
        "one_copy": {
            "grad_norm/other": dense.double().norm().item(),
            "grad_norm/experts": experts.double().norm().item(),
        },
    }


def case_all(rank, world) -> dict:
    """Every case of this module, in the package's spawned 2-rank world (conftest.py)."""
    from megatron.core import parallel_state as ps

    out: dict = {f"share/{pack}": case_cp_share(rank, world, pack) for pack in (False, True)}
    for layout in LAYOUTS:
        out[f"norms/{layout}"] = case_group_norms_of_replicas(rank, world, layout)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(workers_world) -> dict:
    """Results of :func:`case_all` by ``<case>/<parameter>``, per rank, from the package's world
    (conftest.py)."""
    per_rank = [r["cp"] for r in workers_world]
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_grad_norms_count_each_replicated_gradient_once(world, layout):
    """Without the distributed optimizer every DP and CP rank holds the whole reduced gradient: the
    per-group norms divide the summed squares by DP x CP (expert DP, which includes CP, for experts),
    so they equal one copy's norm whatever the layout: float64 sums of at most 2 x 15 squares (two
    ranks' shares) against one of 15, in another order."""
    from tests.tolerance import sum_rtol

    for r in world[f"norms/{layout}"]:
        for key, one_copy in r["one_copy"].items():
            assert r["norms"][key] == pytest.approx(one_copy, rel=sum_rtol(2 * 15, torch.float64)), (key, r)
