"""Configuration: defaults, YAML and CLI overrides, and errors that say how to fix them."""

import dataclasses

import pytest
import yaml

from sao_megatron.config import ConfigError, SAOConfig, load_config, parse_override, save_config


def test_default_is_the_tiny_model():
    cfg = load_config()
    assert cfg.model.name == "tiny_moe" and cfg.model.vocab_size == 512
    assert cfg.actor.optim.lr == 1e-4  # configs/tiny_cpu.yaml overrides the dataclass default
    assert SAOConfig().critic.optim.lr == 5e-6  # dataclass default (paper)


def test_cli_overrides_apply_in_order_and_parse_types():
    cfg = load_config(
        None,
        [
            "actor.optim.lr=1e-5",
            "actor.parallel.world_size=2",
            "critic.freeze_patterns=[router]",
            "actor.parallel.sequence_parallel=null",
        ],
    )
    assert cfg.actor.optim.lr == 1e-5 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.parallel.world_size == 2
    assert cfg.critic.freeze_patterns == ["router"]
    assert cfg.actor.parallel.sequence_parallel is None


def test_model_file_and_inline_model_overrides(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  from: tiny_moe\n  num_layers: 2\n")
    assert load_config(run).model.num_layers == 2


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["critic.updates_per_step=3"])
    path = save_config(cfg, tmp_path)
    data = yaml.safe_load(path.read_text())
    run = tmp_path / "again.yaml"
    model = data.pop("model")
    run.write_text(yaml.safe_dump({**data, "model": {"from": "tiny_moe", **model}}))
    assert dataclasses.asdict(load_config(run)) == dataclasses.asdict(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.optim.lrr=1", "unknown config key 'actor.optim.lrr'; did you mean 'lr'?"),
        ("actorr.optim.lr=1", "unknown config key 'actorr'"),
        ("actor.optim.lr=abc", "actor.optim.lr: expected a number"),
        ("actor.parallel.world_size=1.5", "expected an integer"),
        ("critic.init_from_actor=3", "expected true or false"),
        ("actor.parallel.tensor_parallel=3", "does not divide model.num_attention_heads=4"),
        (
            "critic.parallel.expert_parallel=3",
            "expert_parallel=3 does not divide model.num_experts=8; use one of",
        ),
        ("actor.parallel.pipeline_parallel=3", "does not divide model.num_layers=4"),
        ("actor.parallel.moe_token_dispatcher=flex", "use alltoall or allgather"),
        ("critic.updates_per_step=0", "K must be >= 1"),
        ("noequals", "is not key=value"),
    ],
)
def test_bad_config_fails_with_one_line_reason_and_fix(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    text = str(err.value)
    assert message in text and "\n" not in text


def test_world_size_must_fit_layout():
    with pytest.raises(ConfigError, match="world_size=3 is not a multiple"):
        load_config(None, ["actor.parallel.world_size=3", "actor.parallel.tensor_parallel=2"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    unknown_model = tmp_path / "m.yaml"
    unknown_model.write_text("model: no_such_model\n")
    with pytest.raises(ConfigError, match="model 'no_such_model' not found"):
        load_config(unknown_model)


def test_parse_override_reads_exponent_floats():
    assert parse_override("a.b=1e-5") == (["a", "b"], 1e-5)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
