"""Actor and critic initialised from a checkpoint (``actor.init_from`` / ``critic.init_from``).

Every rank reads only its slices: an HF checkpoint from ``transformers`` at TP=2 and EP=2 gives
the same logits as ``transformers`` (float32, <= 1e-4); the critic has the checkpoint's trunk and
a zero value head; a Megatron checkpoint saved at TP=2 loads at EP=2; and initialising actor +
critic from a ~200 MB checkpoint at EP=2 keeps each rank's peak RSS near its own shards.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import hf_cases
from tests.workers import init_from_cases

TOL = 1e-4
"""The actor's float32 logits vs ``transformers``' on the same checkpoint: two implementations of the model,
a model-level difference, not one sum of n terms; the same bound as tests/models/test_hf_models.py."""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_from")
    model = hf_cases.build_hf_model("moe_gqa2")
    model.save_pretrained(root / "hf" / "moe_gqa2", max_shard_size="60KB")
    with torch.no_grad():
        torch.save({"moe_gqa2": model(input_ids=hf_cases.tokens()).logits.float()}, root / "reference.pt")
    big = hf_cases.write_big_checkpoint(root / "big", hf_cases.MEMORY_MODEL)
    results = run_distributed(init_from_cases.all_cases, 2, str(root), timeout_s=300)
    return {"results": results, "big_bytes": big}


@pytest.mark.parametrize("layout", ["tp2", "ep2", "megatron"])
def test_actor_from_checkpoint_matches_transformers(world, layout):
    diffs = [r[layout]["logits"] for r in world["results"] if r[layout]["logits"] is not None]
    assert len(diffs) == 2 and max(diffs) <= TOL, diffs


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_critic_has_the_checkpoint_trunk_and_a_zero_value_head(world, layout):
    for r in world["results"]:
        case = r[layout]
        assert case["trunk_vs_actor"] == 0.0, case  # same names, same slices as the actor
        assert case["embedding_slice"] == 0.0, case  # this rank's rows, read from the files
        assert case["head_abs"] == 0.0 and case["values_abs"] == 0.0, case
        assert case["frozen_attention"], case


def test_critic_from_a_megatron_checkpoint_reshards(world):
    for r in world["results"]:
        assert r["megatron"]["trunk_vs_hf"] == 0.0 and r["megatron"]["head_abs"] == 0.0, r["megatron"]


def test_peak_rss_of_actor_and_critic_init_stays_near_the_shards(world):
    """No rank holds the whole model: peak - base <= 1.5 x (actor + critic shard) + 32 MiB."""
    assert world["big_bytes"] > 100 << 20
    for r in world["results"]:
        mem = r["memory"]
        assert mem["shard"] < world["big_bytes"] * 1.3  # an EP=2 half of each model, not two wholes
        assert mem["peak"] - mem["base"] <= 1.5 * mem["shard"] + (32 << 20), mem
