"""Ragged batches (odd lengths, micro-batches of different lengths) at TP=2 with sequence
parallelism and at PP=2: actor and critic match the single-rank layout (spawned gloo worlds)."""

import pytest
import torch

from sao_megatron.batch import build_batch
from sao_megatron.config import ParallelConfig
from sao_megatron.workers.common import micro_batches, seq_multiple
from tests.distributed import run_distributed
from tests.workers import ragged_cases

LAYOUTS = {
    "tp2_sp": {"actor.parallel.tensor_parallel": 2, "critic.parallel.tensor_parallel": 2},
    "pp2": {"actor.parallel.pipeline_parallel": 2, "critic.parallel.pipeline_parallel": 2},
}
TOL = 1e-5


def test_micro_batches_pad_to_the_layout_multiple_with_exact_masks():
    batch = build_batch(ragged_cases.ragged_trajectories())
    assert batch.lengths.tolist() == [7, 12, 5, 9]
    assert seq_multiple(ParallelConfig(world_size=2, tensor_parallel=2)) == 2
    assert seq_multiple(ParallelConfig(world_size=2, tensor_parallel=2, sequence_parallel=False)) == 1
    assert seq_multiple(ParallelConfig(world_size=8, tensor_parallel=2, context_parallel=2)) == 8
    shard = batch.shard(1)[0]
    extra = torch.randn(4, 12)
    for multiple, widths in ((1, [12, 9]), (2, [12, 10]), (8, [16, 16])):
        micro = micro_batches(shard, {"advantages": extra}, 2, multiple)
        assert [mb["tokens"].shape[1] for mb in micro] == widths
        for i, mb in enumerate(micro):
            rows, t = slice(2 * i, 2 * i + 2), mb["tokens"].shape[1]
            w = min(t, 12)
            for key in ("tokens", "labels", "action_mask", "behavior_logprobs", "policy_versions"):
                assert torch.equal(mb[key][:, :w], getattr(batch, key)[rows, :w]), key
            assert torch.equal(mb["advantages"][:, :w], extra[rows, :w])
            pad = torch.arange(t) >= batch.lengths[rows, None]  # past each row's own length
            assert (mb["action_mask"][pad] == 0).all() and (mb["labels"][pad] == 0).all()
            assert (mb["tokens"][pad] == 0).all() and (mb["policy_versions"][pad] == -1).all()
            assert (mb["advantages"][:, w:] == 0).all()
            assert torch.equal(mb["positions"], torch.arange(t).expand(2, t))


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def result(request):
    results = run_distributed(ragged_cases.case_ragged, 2, LAYOUTS[request.param])
    return request.param, results


def test_actor_logprobs_update_and_critic_values_update_match_single_rank(result):
    name, results = result
    for r in results:
        assert r["lengths"] == [7, 12, 5, 9]
        assert r["logprobs"] <= TOL, (name, r["logprobs"])
        assert r["actor_grads"][0] <= TOL and r["actor_grad_scale"] > 1e-3, (name, r["actor_grads"])
        assert r["values"] <= TOL and r["values_scale"] > 1e-3, (name, r["values"])
        assert r["critic_grads"][0] <= TOL and r["critic_grad_scale"] > 1e-3, (name, r["critic_grads"])
    reporting = [r for r in results if r["actor_reports"]]
    assert len(reporting) == 1 and reporting[0]["critic_reports"]  # TP rank 0 / the last stage
    for role in ("actor", "critic"):
        metrics = reporting[0][f"{role}_metrics"]
        assert ("loss" if role == "actor" else "value_loss") in metrics, sorted(metrics)
        for key, (mine, ref) in metrics.items():
            assert ref is not None, key
            assert mine == pytest.approx(ref, rel=1e-4, abs=TOL), (name, role, key)
