"""Where the critic's trunk comes from (``Session.ensure_critic``) with ``critic.init_from_actor``.

While the actor holds ``actor.init_from``'s weights unchanged (``train.sft_steps: 0``, no actor
checkpoint) the critic reads that checkpoint itself: nothing is exported, and its trunk equals
the HF checkpoint's tensors (a spawned one-rank Megatron world builds it with the session's
source). Once the actor trained (SFT steps, or a loaded actor checkpoint) the actor's current
weights are exported to ``<run_dir>/hf/policy`` and read from there.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sao_megatron.config import load_config
from sao_megatron.driver import session as session_module
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from tests.distributed import run_distributed
from tests.models.hf_cases import write_big_checkpoint


class RecordingActor:
    """``ActorGroup``'s ``export_hf``: records where it exported (writes nothing)."""

    def __init__(self) -> None:
        self.exports: list[Path] = []

    async def export_hf(self, out_dir: Path) -> None:
        self.exports.append(Path(out_dir))


class RecordingCritic:
    """``CriticGroup``: records its trunk source; ``started`` builds the critic from it when ``build``."""

    made: list[RecordingCritic] = []
    build = False

    def __init__(self, cfg, run_dir: Path, init_from: str | None = None):
        self.cfg, self.source, self.diffs = cfg, init_from, None
        RecordingCritic.made.append(self)

    async def started(self) -> None:
        if RecordingCritic.build:
            (self.diffs,) = await asyncio.to_thread(run_distributed, _critic_vs_checkpoint, 1, self.cfg, self.source)

    async def load(self, directory: Path) -> None:
        raise AssertionError("no critic checkpoint in these runs")


def _critic_vs_checkpoint(rank, world, cfg, source: str) -> dict:
    """The critic built from ``source`` as a critic rank builds it; per trunk tensor in HF names,
    the largest difference to the checkpoint's tensor (one rank: every parameter is whole)."""
    from safetensors.torch import load_file

    from sao_megatron.models import hf_bridge, layout
    from sao_megatron.parallel import initialize_model_parallel, seed_everything
    from sao_megatron.workers.role import build_critic_model

    initialize_model_parallel(cfg.critic.parallel)
    seed_everything(cfg.run.seed)
    critic = build_critic_model(cfg.model, cfg.critic, source)
    stored = {k: v for f in sorted(Path(source).glob("*.safetensors")) for k, v in load_file(f).items()}
    diffs = {}
    for local, param in layout.unwrap(critic).named_parameters():
        name = layout.global_name(critic, local)
        if name.startswith("output_layer."):
            continue  # the value head: not in the checkpoint
        for hf_name, tensor in hf_bridge.to_hf(name, param.detach(), cfg.model):
            diffs[hf_name] = float((tensor - stored[hf_name]).abs().max())
    return diffs


@pytest.fixture
def run(tmp_path, monkeypatch):
    cfg = load_config(None, [])
    hf_dir = tmp_path / "init"
    write_big_checkpoint(hf_dir, cfg.model, shard_bytes=1 << 20)
    monkeypatch.setattr(session_module, "CriticGroup", RecordingCritic)
    RecordingCritic.made, RecordingCritic.build = [], False
    return tmp_path, hf_dir


def _ensure_critic(run_dir: Path, overrides: list[str]) -> tuple[RecordingActor, RecordingCritic]:
    cfg = load_config(None, overrides)
    actor = RecordingActor()
    session = Session(cfg, run_dir, actor, RunState())  # pyright: ignore[reportArgumentType]
    asyncio.run(session.ensure_critic())
    (critic,) = RecordingCritic.made
    return actor, critic


def test_an_untrained_actor_is_not_exported_the_critic_reads_its_init_checkpoint(run):
    run_dir, hf_dir = run
    RecordingCritic.build = True
    actor, critic = _ensure_critic(run_dir / "run", [f"actor.init_from={hf_dir}", "train.sft_steps=0"])
    assert actor.exports == [] and critic.source == str(hf_dir)
    assert not (run_dir / "run" / "hf").exists()
    stored = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert critic.diffs is not None
    assert sorted(critic.diffs) == sorted(n for n in stored if n != "lm_head.weight")
    assert max(critic.diffs.values()) == 0.0, critic.diffs  # copied, not computed: exact


@pytest.mark.parametrize("trained", ["sft", "checkpoint"])
def test_a_trained_actor_is_exported_for_the_critic(run, trained):
    run_dir, hf_dir = run
    overrides = [f"actor.init_from={hf_dir}", f"train.sft_steps={5 if trained == 'sft' else 0}"]
    if trained == "checkpoint":  # a resumed run whose critic checkpoint is missing
        (RunState.checkpoint_dir(run_dir / "run") / "actor").mkdir(parents=True)
    actor, critic = _ensure_critic(run_dir / "run", overrides)
    assert actor.exports == [run_dir / "run" / "hf" / "policy"]
    assert critic.source == str(run_dir / "run" / "hf" / "policy")


def test_without_init_from_the_random_actor_is_exported(run):
    run_dir, _ = run
    actor, critic = _ensure_critic(run_dir / "run", ["train.sft_steps=0"])
    assert actor.exports == [run_dir / "run" / "hf" / "policy"] and critic.source == str(actor.exports[0])
