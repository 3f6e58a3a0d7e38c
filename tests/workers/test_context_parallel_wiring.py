"""Context parallelism in the workers: each CP rank gets its load-balanced share of every
micro-batch (padded rows and packed segments) and per-position outputs gather back whole
(2-rank gloo world, CP=2; no model: the local layer spec has no CP attention, so a CP role is
refused without Transformer Engine, which is tested here too)."""

import pytest
import torch

from sao_megatron.config import ConfigError, ParallelConfig
from sao_megatron.workers.role import check_context_parallel
from tests.distributed import run_distributed
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
        assert mine.cp_lengths is not None and mine.advantages is not None
        idx = cp_indices(mine.cp_lengths, 2, ps.get_context_parallel_rank())
        out["shapes"].append((tuple(full.tokens.shape), tuple(mine.tokens.shape)))
        for key in ("tokens", "labels", "action_mask", "advantages", "positions"):
            out["split_ok"] &= torch.equal(getattr(mine, key), getattr(full, key)[:, idx])
        out["gather_ok"] &= torch.equal(full_sequence(mine.advantages, mine), full.advantages)
        if pack:
            out["gather_ok"] &= torch.equal(mine.cu_seqlens, full.cu_seqlens)  # whole, for TE
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_each_cp_rank_holds_its_balanced_share_and_outputs_gather_whole(pack):
    results = run_distributed(case_cp_share, 2, pack)
    for r in results:
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
