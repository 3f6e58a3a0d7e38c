"""Engines start while the roles start: random weights from the actor's config, real ones by the first sync.

The end-to-end runs (``tests/test_pipeline.py``, ``tests/test_from_hf.py``) check that the engines
then serve exactly the actor's logprobs; these tests pin what the engines start from and that no
engine outlives a run whose roles failed to start.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

import sao_megatron.driver.session as session_mod
from sao_megatron.config import load_config
from sao_megatron.config.hf import hf_config_from_model
from sao_megatron.driver.engines import engine_model_dir, wait_healthy
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.rollout.engine import EngineSpec, _command
from sao_megatron.tokenizer import TOKENIZER_DIR
from tests.driver.test_engine_restart import FakeEngine


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_the_engine_directory_holds_the_exports_config_and_tokenizer_without_weights(tmp_path, bf16):
    cfg = load_config(None, [f"actor.bf16={str(bf16).lower()}"])
    out = engine_model_dir(cfg, tmp_path)
    assert out == tmp_path / "hf" / "engine"
    config = json.loads((out / "config.json").read_text())
    assert config == hf_config_from_model(cfg.model, "bfloat16" if bf16 else "float32")  # as the export writes
    assert {p.name for p in out.iterdir()} == {"config.json"} | {p.name for p in TOKENIZER_DIR.iterdir()}
    assert not list(out.glob("*.safetensors"))
    engine_model_dir(cfg, tmp_path)  # a resumed run rewrites it in place


def test_the_engine_directory_takes_the_tokenizer_of_an_hf_init_checkpoint(tmp_path, qwen3_tokenizer_dir):
    source = tmp_path / "qwen3"
    shutil.copytree(qwen3_tokenizer_dir, source)
    cfg = load_config(None, [])
    cfg.actor.init_from = str(source)  # only its tokenizer matters here
    out = engine_model_dir(cfg, tmp_path / "run")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()


def test_dummy_load_format_reaches_the_server_command():
    spec = EngineSpec(model_path="/m", port=1)
    assert "--load-format" not in _command(spec, cpu=True)
    spec.load_format = "dummy"
    cmd = _command(spec, cpu=True)
    assert cmd[cmd.index("--load-format") + 1] == "dummy"


class _Launches:
    """``launch_engines`` replaced: records (model path, load format) and returns FakeEngines."""

    def __init__(self, fail_health: bool = False):
        self.calls: list[tuple[str, str]] = []
        self.engines: list[FakeEngine] = []
        self.fail_health = fail_health

    def __call__(self, cfg, model_path, run_dir, indices=None, restart=0, load_format="auto"):
        self.calls.append((model_path.name, load_format))
        self.engines = [FakeEngine(f"http://e{i}") for i in range(cfg.rollout.num_engines)]
        if self.fail_health:
            self.engines[-1].wait_healthy = lambda: (_ for _ in ()).throw(TimeoutError("not healthy"))  # type: ignore[method-assign]
        return self.engines


class _FailingActor:
    def __init__(self, cfg, run_dir):
        pass

    async def started(self):
        raise RuntimeError("no node can hold the actor")


@pytest.mark.parametrize("sync", ["distributed", "disk"])
def test_engines_launched_with_the_roles_are_stopped_when_a_role_fails_to_start(tmp_path, monkeypatch, sync):
    launches = _Launches()
    monkeypatch.setattr(session_mod, "launch_engines", launches)
    monkeypatch.setattr(session_mod, "start_ray", lambda cfg: None)
    monkeypatch.setattr(session_mod, "ActorGroup", _FailingActor)
    cfg = load_config(None, ["rollout.num_engines=2", f"rollout.weight_sync={sync}"])
    with pytest.raises(RuntimeError, match="no node can hold the actor"):
        asyncio.run(Session.start(cfg, tmp_path, RunState(stage="rl")))
    if sync == "disk":  # engines load the actor's export later (start_rollouts)
        assert launches.calls == []
        return
    assert launches.calls == [("engine", "dummy")]
    assert len(launches.engines) == 2 and not any(e.running for e in launches.engines)


def test_an_engine_that_never_becomes_healthy_stops_all_of_them():
    launches = _Launches(fail_health=True)
    engines = launches(load_config(None, ["rollout.num_engines=3"]), TOKENIZER_DIR, None)
    with pytest.raises(TimeoutError, match="not healthy"):
        asyncio.run(wait_healthy(engines))  # type: ignore[arg-type]
    assert not any(e.running for e in engines)
