"""``sao export``: a run's actor role checkpoint (model + optimizer) -> an HF checkpoint transformers loads.

A tiny run directory is made without Ray: a spawned 1-rank world builds the actor role, takes one
optimizer step (so the checkpoint holds Adam state and trained weights), saves it with
``save_role`` and records its logits; then ``sao export`` runs at two layouts and transformers'
logits must equal the Megatron actor's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sao_megatron.cli import main
from sao_megatron.config import load_config, save_config

SEQ, BATCH = 12, 2


def tokens() -> torch.Tensor:
    return torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _make_run_rank(rank, world, run_dir: str) -> None:
    from sao_megatron.batch import MicroBatch
    from sao_megatron.parallel import initialize_model_parallel, seed_everything
    from sao_megatron.workers.checkpoint import save_role
    from sao_megatron.workers.role import build_actor_role

    cfg = load_config(Path(run_dir) / "config.yaml")
    initialize_model_parallel(cfg.actor.parallel)
    seed_everything(1234)
    role = build_actor_role(cfg.model, cfg.actor)
    toks = tokens()
    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()

    def loss(output, micro):
        nll = torch.nn.functional.cross_entropy(output.flatten(0, 1).float(), micro.labels.flatten())
        return nll, {"nll": nll.detach().item()}

    role.forward_backward([MicroBatch.of_tokens(toks, positions)], loss)
    role.step()
    save_role(role, Path(run_dir) / "checkpoint" / "actor")
    role.module.eval()
    with torch.no_grad():
        logits = role.module(toks, positions, attention_mask=None)
    torch.save(logits.float(), Path(run_dir) / "actor_logits.pt")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from sao_megatron.spawn import run_world

    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(None, ["model.num_layers=2", "actor.optim.lr=1e-2", "actor.parallel.micro_batch_size=2"])
    save_config(cfg, run_dir)
    run_world(_make_run_rank, 1, str(run_dir), backend="gloo")
    (run_dir / "checkpoint" / "state.json").write_text(json.dumps({"stage": "rl", "step": 3, "version": 3}))
    return {"dir": run_dir, "logits": torch.load(run_dir / "actor_logits.pt")}


def _hf_logits(out: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens()).logits.float()


@pytest.mark.parametrize("layout", [[], ["--tp", "2", "--ep", "2"]], ids=["1rank", "tp2ep2"])
def test_export_matches_the_actor(run, tmp_path: Path, layout: list[str]) -> None:
    out = tmp_path / "hf"
    if layout:  # the run's policy export (engines' start) is the template of config and tokenizer files
        import shutil

        from sao_megatron.config.hf import hf_config_from_model
        from sao_megatron.tokenizer import TOKENIZER_DIR

        policy = run["dir"] / "hf" / "policy"
        shutil.copytree(TOKENIZER_DIR, policy)
        m = load_config(run["dir"] / "config.yaml").model
        (policy / "config.json").write_text(json.dumps(hf_config_from_model(m, "float32")))
        (policy / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert main(["export", str(run["dir"]), "--step", "3", str(out), *layout]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    assert ("generation_config.json" in names) == bool(layout)
    diff = (_hf_logits(out) - run["logits"]).abs().max().item()
    # transformers vs Megatron on the same weights: model-level, as tests/models/test_hf_models.py's TOL
    assert diff <= 1e-4, diff

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False)


def test_export_errors(run, tmp_path: Path, capsys) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(run["dir"]), "--step", "2", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "keeps only its latest checkpoint (stage rl, step 3;" in err and "step 2 is not stored" in err
    assert "\n" not in err and not out.exists()
    assert main(["export", str(tmp_path), str(out)]) == 1
    assert "is not a run directory (no config.yaml)" in capsys.readouterr().err
    save_config(load_config(None, []), tmp_path / "empty_run")
    assert main(["export", str(tmp_path / "empty_run"), str(out)]) == 1
    assert "has no actor checkpoint" in capsys.readouterr().err
