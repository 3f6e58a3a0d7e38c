"""Mixtral, GLM-4.5/4.6 and DeepSeek-V3 (issue 31) from HF checkpoints into Megatron at one rank, TP=2,
EP=2 and PP=2 (DeepSeek-V3 with YaRN at one rank and TP=2), and back: logits against ``transformers``,
bit-exact round trips, the weight stream, the expert bias.

One spawned 2-rank gloo world runs every case (``hf_cases.family_cases``); the parent builds the tiny
random models with ``transformers``' own config classes, saves them with ``save_pretrained`` and checks
the exports. GLM's routers carry a random expert bias (``e_score_correction_bias``, a buffer), so
routing depends on it: a loader that skipped it would miss the reference (checked below); so do
DeepSeek-V3's. Last, the weight stream of two layouts goes through SGLang's own ``mixtral`` /
``glm4_moe`` / ``deepseek_v2`` classes' ``load_weights`` on the CPU (``tests/models/sglang_load.py``, a
subprocess).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from sao_megatron.config.hf import model_config_from_hf, read_hf_config
from sao_megatron.config.schema import REPO_ROOT
from sao_megatron.models import hf_bridge
from sao_megatron.rollout.sglang_cpu import STANDIN_DIR
from tests.distributed import run_distributed
from tests.models import hf_cases
from tests.models.test_hf_models import TOL, _state

CASES = [(s, lay) for s in hf_cases.FAMILY_SHAPES for lay in hf_cases.layouts_of(s)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_families")
    hf_cases.make_checkpoints(root, hf_cases.FAMILY_SHAPES)
    results = run_distributed(hf_cases.family_cases, 2, str(root), timeout_s=600)
    return {"root": root, "results": results}


@pytest.mark.parametrize("shape, layout", CASES)
def test_logits_match_transformers(world, shape, layout):
    diffs = [r[f"{shape}/{layout}"]["logits"] for r in world["results"]]
    diffs = [d for d in diffs if d is not None]  # PP: the last stage holds the logits
    assert diffs and max(diffs) <= TOL, (shape, layout, diffs)


@pytest.mark.parametrize("shape", [s for s in hf_cases.FAMILY_SHAPES if s.startswith(("glm", "deepseek"))])
def test_sigmoid_routing_depends_on_the_loaded_expert_bias(world, shape):
    """Zeroing the loaded expert biases moves the logits far beyond the parity tolerance: the parity
    above holds only because the bias buffers were read from the checkpoint."""
    for r in world["results"]:
        assert r[f"{shape}/single"]["logits_without_bias"] > 100 * TOL


@pytest.mark.parametrize("shape, layout", CASES)
def test_round_trip_is_bit_exact(world, shape, layout):
    original = _state(world["root"] / "hf" / shape)
    exported = _state(world["root"] / "export" / f"{shape}-{layout}")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize(
    "export", ["mixtral-ep2", "glm4_moe-pp2", "glm4_moe_qk_norm-tp2", "deepseek_v3-ep2", "deepseek_v3_yarn-tp2"]
)
def test_transformers_loads_the_export(world, export):
    from transformers import AutoModelForCausalLM

    config = json.loads((world["root"] / "export" / export / "config.json").read_text())
    assert config.get("num_nextn_predict_layers", 0) == 0  # no MTP source given: none written (test_hf_families_cli)
    model = AutoModelForCausalLM.from_pretrained(world["root"] / "export" / export).eval()
    reference = torch.load(world["root"] / "reference.pt")[export.rsplit("-", 1)[0]]
    with torch.no_grad():
        logits = model(input_ids=hf_cases.tokens()).logits
    assert torch.equal(logits, reference)  # the same weights into the same code


@pytest.mark.parametrize("case", ["mixtral/ep2", "glm4_moe/tp2", "glm4_moe/ep2", "deepseek_v3/tp2", "deepseek_v3/ep2"])
def test_the_weight_stream_sends_every_tensor_once_to_rank0(world, case):
    """``iter_hf_weights``, the weight sync's names: the on-disk HF names (Mixtral's
    ``block_sparse_moe.experts.{e}.w1``, GLM's ``mlp.gate.e_score_correction_bias``), each once."""
    rank0, rank1 = (r[case]["buckets"] for r in world["results"])
    assert rank0["count"] == rank1["count"] == rank0["nonempty"] > 1 and rank1["nonempty"] == 0
    assert rank0["unique"]
    m = model_config_from_hf(read_hf_config(world["root"] / "hf" / case.split("/")[0]))
    assert sorted(rank0["names"]) == sorted(hf_bridge.expected_hf_names(m))
    assert sorted(rank0["names"]) == sorted(_state(world["root"] / "hf" / case.split("/")[0]))


@pytest.mark.parametrize("shape", [s for s, lay in CASES if lay == "pp2"])
def test_each_pipeline_stage_sends_its_own_tensors(world, shape):
    ranks = [r[f"{shape}/pp2"]["per_stage"] for r in world["results"]]
    names = [[n for b in r["got"] for n, _, _ in b] for r in ranks]
    assert not set(names[0]) & set(names[1])
    original = _state(world["root"] / "hf" / shape)
    assert sorted(names[0] + names[1]) == sorted(original)
    for rank in (0, 1):
        for name, tensor in torch.load(world["root"] / "per_stage" / f"{shape}-rank{rank}.pt").items():
            assert torch.equal(tensor, original[name]), name


@pytest.mark.parametrize("mode", ["freeze", "train"])
def test_router_bias_update_modes(world, mode):
    """``freeze``: an actor step leaves every expert bias as loaded. ``train``: Megatron moves each
    bias by exactly +-``router_bias_update_rate`` (1e-3) or 0 (an expert at the mean load), the
    same on both DP ranks. Either way the weight stream sends the bias the trainer holds, in float32."""
    results = [r[f"bias_update/{mode}"] for r in world["results"]]
    rate = 1e-3 if mode == "train" else 0.0
    for r in results:
        moved = torch.tensor([v for vs in r["moved"].values() for v in vs])
        assert moved.numel() == 3 * 8  # three MoE layers of 8 experts
        # +-rate added to a float32 bias of |b| < 2: exact up to the sum's rounding, 2^-23 * 2
        assert ((moved.abs() - rate).abs() <= 2.4e-7).logical_or(moved == 0).all(), moved
        assert (moved != 0).any() if mode == "train" else (moved == 0).all()
    assert results[0]["moved"] == results[1]["moved"]
    sent = results[0]["sent"]
    assert results[0]["sent_dtypes"] == ["torch.float32"] and len(sent) == 3
    for name, bias in results[0]["after"].items():
        layer = name.split(".")[2]
        assert sent[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] == bias


# DeepSeek: the YaRN shape (SGLang's CPU rotary embedding for DeepSeek asserts a rope_scaling)
SGLANG_CASES = ["mixtral/ep2", "glm4_moe/tp2", "glm4_moe_qk_norm/tp2", "deepseek_v3_yarn/tp2"]
SGLANG_CLASS = {
    "mixtral": "mixtral",
    "glm4_moe": "glm4_moe",
    "glm4_moe_qk_norm": "glm4_moe",
    "deepseek_v3_yarn": "deepseek_v2",
}


@pytest.fixture(scope="module")
def sglang_loaded(world):
    """SGLang's own Mixtral / GLM-4.5 / DeepSeek-V3 classes fed the weight stream (``tests/models/sglang_load.py``)."""
    root, out = world["root"], world["root"] / "sglang.json"
    argv = []
    for case in SGLANG_CASES:
        shape, layout = case.split("/")
        argv += [str(root / "hf" / shape), str(root / "stream" / f"{shape}-{layout}.pt")]
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join([str(STANDIN_DIR), str(REPO_ROOT)]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.models.sglang_load", str(out), *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", SGLANG_CASES)
def test_sglang_loads_the_stream_into_transformers_weights(world, sglang_loaded, case):
    """Every parameter of SGLang's model class is written by the stream (none left NaN) and equals
    transformers' tensor for it, the GLM and DeepSeek expert biases included; DeepSeek's per-head MLA
    key/value up-projections SGLang derives after loading equal transformers' ``kv_b_proj`` split."""
    shape, layout = case.split("/")
    r = sglang_loaded[str(world["root"] / "stream" / f"{shape}-{layout}.pt")]
    assert r["class"] == f"sglang.srt.models.{SGLANG_CLASS[shape]}"
    assert r["unloaded"] == [] and r["mismatched"] == [] and r["compared"] > 10, r
    expected_biases = sum(1 for n in _state(world["root"] / "hf" / shape) if n.endswith("e_score_correction_bias"))
    assert len(r["bias"]) == expected_biases and (expected_biases > 0) == (shape != "mixtral")
    if shape.startswith("deepseek"):
        assert r["mla_absorbed"] == {"layers": 2, "equal": 2}, r["mla_absorbed"]
