"""``sao convert`` and ``sao export`` for Mixtral, GLM-4.5 and DeepSeek-V3 (issue 31), one tiny model each, one chain:

``sao convert hf-to-mcore`` (one rank; the 2-rank layouts are test_hf_families') writes the tiny HF
checkpoint as Megatron torch_dist; an actor starts from it (``actor.init_from``: its logits must be
transformers' on the original) and takes one optimizer step (``actor.router_bias_update=train``: GLM's
expert biases move; so do DeepSeek-V3's); ``sao export`` writes the run's actor as HF with a config.json generated from the
model shape, and transformers reproduces the trained actor's logits. The bit-exact convert round trip
of a Qwen3-MoE checkpoint is test_hf_convert's. The DeepSeek-V3 and GLM-4.5 checkpoints also carry the
tensors of a multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``, as the published
checkpoints do): the model does not load them, the conversion keeps them in ``hf/mtp`` and the export
writes them back with their values (``num_nextn_predict_layers: 1``), from the conversion's ``hf/mtp``
(DeepSeek-V3's run starts from the conversion) or from the HF directory (GLM's run starts from it);
transformers loads that export (it ignores MTP tensors).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sao_megatron.cli import main
from sao_megatron.config import load_config, save_config
from sao_megatron.config.hf import model_config_from_hf, read_hf_config
from sao_megatron.models.hf_bridge import Read
from tests.models import hf_cases
from tests.models.test_hf_models import TOL

FAMILIES = {"mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("families_cli")
    hf_cases.make_checkpoints(root, {k: hf_cases.FAMILY_SHAPES[k] for k in FAMILIES})
    for shape in MTP_FAMILIES:
        _add_mtp_layer(root / "hf" / shape)
    return root


MTP_FAMILIES = ("glm4_moe", "deepseek_v3")


def _add_mtp_layer(hf: Path) -> None:
    """A shard of MTP-layer tensors (DeepSeek's / GLM's names, random values) beside the model's, listed
    in the index; config.json says one MTP layer (as the published configs)."""
    from safetensors.torch import save_file

    config = json.loads((hf / "config.json").read_text())
    layer, h = config["num_hidden_layers"], config["hidden_size"]
    config["num_nextn_predict_layers"] = 1
    (hf / "config.json").write_text(json.dumps(config))
    attention = "self_attn.q_a_proj.weight" if "q_lora_rank" in config else "self_attn.q_proj.weight"
    mtp = {
        f"model.layers.{layer}.enorm.weight": 1.0 + 0.2 * torch.randn(h),
        f"model.layers.{layer}.hnorm.weight": 1.0 + 0.2 * torch.randn(h),
        f"model.layers.{layer}.eh_proj.weight": torch.randn(h, 2 * h),
        f"model.layers.{layer}.{attention}": torch.randn(config.get("q_lora_rank", h), h),
        f"model.layers.{layer}.mlp.gate.e_score_correction_bias": torch.randn(config["n_routed_experts"]),
        f"model.layers.{layer}.shared_head.norm.weight": 1.0 + 0.2 * torch.randn(h),
    }
    save_file(mtp, str(hf / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def _make_run_rank(rank, world, run_dir: str) -> None:
    from sao_megatron.batch import MicroBatch
    from sao_megatron.parallel import initialize_model_parallel, seed_everything
    from sao_megatron.workers.checkpoint import save_role
    from sao_megatron.workers.role import build_actor_role

    cfg = load_config(Path(run_dir) / "config.yaml")
    initialize_model_parallel(cfg.actor.parallel)
    seed_everything(1234)
    role = build_actor_role(cfg.model, cfg.actor)
    toks = hf_cases.tokens()
    positions = torch.arange(toks.shape[1]).expand_as(toks).contiguous()
    with torch.no_grad():
        loaded = role.module(toks, positions, attention_mask=None).float()

    def loss(output, micro):
        nll = torch.nn.functional.cross_entropy(output.flatten(0, 1).float(), micro.labels.flatten())
        return nll, {}

    biases = [b for n, b in role.module.named_buffers() if n.endswith("router.expert_bias")]
    before = [b.clone() for b in biases]
    role.forward_backward([MicroBatch.of_tokens(toks)], loss)
    role.step()
    moved = sum(int((b != a).sum()) for a, b in zip(before, biases, strict=True))
    save_role(role, Path(run_dir) / "checkpoint" / "actor")
    role.module.eval()
    with torch.no_grad():
        logits = role.module(toks, positions, attention_mask=None)
    torch.save({"loaded": loaded, "logits": logits.float(), "moved": moved}, Path(run_dir) / "actor.pt")


@pytest.mark.parametrize("shape", FAMILIES)
def test_convert_train_export_matches_transformers(checkpoints, tmp_path, shape):
    from transformers import AutoModelForCausalLM

    from sao_megatron.spawn import run_world

    hf, mcore = checkpoints / "hf" / shape, tmp_path / "mcore"
    assert main(["convert", "hf-to-mcore", str(hf), str(mcore)]) == 0
    assert json.loads((mcore / "hf" / "config.json").read_text())["architectures"] == [FAMILIES[shape]]
    mtp_prefix = f"model.layers.{read_hf_config(hf)['num_hidden_layers']}."  # past the decoder: MTP
    source_mtp = _tensors(hf, mtp_prefix)
    assert (shape in MTP_FAMILIES) == bool(source_mtp) == (mcore / "hf" / "mtp").is_dir()
    cfg = load_config(None, ["actor.optim.lr=1e-2", "actor.parallel.micro_batch_size=2"])
    # GLM's run starts from the HF directory itself (its export reads the MTP tensors there), the others
    # from the conversion (its hf/mtp)
    init_from = hf if shape == "glm4_moe" else mcore
    actor = dataclasses.replace(cfg.actor, init_from=str(init_from), router_bias_update="train")
    cfg = dataclasses.replace(cfg, model=model_config_from_hf(read_hf_config(hf), name=shape), actor=actor)
    run_dir = tmp_path / "run"
    save_config(cfg, run_dir)
    run_world(_make_run_rank, 1, str(run_dir), backend="gloo")
    actor_out = torch.load(run_dir / "actor.pt")
    reference = torch.load(checkpoints / "reference.pt")[shape]
    assert (actor_out["loaded"] - reference).abs().max().item() <= TOL  # the converted checkpoint
    assert (actor_out["moved"] > 0) == (shape != "mixtral")  # the trained expert biases moved
    out = tmp_path / "export"
    assert main(["export", str(run_dir), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[shape]]
    exported = _tensors(out, mtp_prefix)  # through the index: listed there
    assert exported.keys() == source_mtp.keys()
    assert all(torch.equal(exported[n], source_mtp[n]) for n in exported)  # float32 both: bit-exact
    assert config.get("num_nextn_predict_layers", 0) == (1 if source_mtp else 0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # MTP tensors ignored
    with torch.no_grad():
        logits = model(input_ids=hf_cases.tokens()).logits
    assert (logits - actor_out["logits"]).abs().max().item() <= TOL


def _tensors(hf: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of an HF checkpoint (found through its index) whose names start with ``prefix``."""
    from sao_megatron.models import hf_io

    with hf_io.HFCheckpoint(hf) as ckpt:
        names = [n for n in ckpt.names() if n.startswith(prefix)]
        return {n: ckpt.read(Read(n, 0, ckpt.info(n).shape[0])) for n in names}
