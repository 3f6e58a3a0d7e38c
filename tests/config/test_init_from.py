"""``actor.init_from`` / ``critic.init_from``: the model shape from the checkpoint, one-line errors.

Only ``config.json`` / ``model.yaml`` are read at config loading; a directory that does not exist
is accepted when the run file gives the model (``sao plan`` on a laptop) and refused at ``sao
train`` start-up (:func:`check_init_from`).
"""

import dataclasses
import json

import pytest

from sao_megatron.config import ConfigError, load_config
from sao_megatron.config import hf as hf_config
from sao_megatron.config.load import check_init_from

EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"
"""A safetensors file without tensors: only headers are read before training."""


def _tiny():
    return load_config().model


def _hf_dir(path, m=None, **changes):
    path.mkdir(parents=True)
    config = hf_config.hf_config_from_model(m or _tiny())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)  # a valid header, no tensors
    return path


def _run(tmp_path, text):
    run = tmp_path / "run.yaml"
    run.write_text(text)
    return run


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_model_shape_comes_from_the_hf_config_when_the_run_file_has_none(tmp_path):
    m = dataclasses.replace(_tiny(), num_layers=3, hidden_size=96)
    hf = _hf_dir(tmp_path / "ckpt", m)
    cfg = load_config(_run(tmp_path, f"actor:\n  init_from: {hf}\n"))
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 96 and cfg.model.name == "ckpt"
    assert cfg.actor.init_from == str(hf)
    check_init_from(cfg)  # exists, HF, same shape


def test_model_shape_comes_from_a_megatron_checkpoint(tmp_path):
    m = dataclasses.replace(_tiny(), num_layers=3)
    mcore = tmp_path / "mcore"
    mcore.mkdir()
    (mcore / "metadata.json").write_text("{}")
    (mcore / "model.yaml").write_text(hf_config.model_yaml(m))
    cfg = load_config(_run(tmp_path, "run: {name: x}\n"), [f"actor.init_from={mcore}"])
    assert cfg.model.num_layers == 3


def test_a_given_model_that_agrees_is_kept(tmp_path):
    hf = _hf_dir(tmp_path / "ckpt")
    cfg = load_config(_run(tmp_path, "model: tiny_moe\n"), [f"actor.init_from={hf}", f"critic.init_from={hf}"])
    assert cfg.model.name == "tiny_moe"


def test_a_given_model_that_disagrees_fails_naming_both(tmp_path):
    hf = _hf_dir(tmp_path / "ckpt", dataclasses.replace(_tiny(), num_layers=7))
    with pytest.raises(ConfigError) as err:
        load_config(_run(tmp_path, "model: tiny_moe\n"), [f"actor.init_from={hf}"])
    message = _one_line(err)
    assert "tiny_moe" in message and str(hf) in message and "num_layers" in message, message


def test_critic_checkpoint_must_match_the_model_too(tmp_path):
    hf = _hf_dir(tmp_path / "ckpt", dataclasses.replace(_tiny(), hidden_size=96))
    with pytest.raises(ConfigError) as err:
        load_config(_run(tmp_path, "model: tiny_moe\n"), [f"critic.init_from={hf}"])
    assert "critic.init_from" in _one_line(err)


def test_missing_directory_without_a_model_fails_at_loading(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_run(tmp_path, f"actor:\n  init_from: {tmp_path / 'nope'}\n"))
    message = _one_line(err)
    assert "actor.init_from" in message and "nope" in message and "no such directory" in message


def test_missing_directory_with_a_model_plans_but_does_not_train(tmp_path):
    """``sao plan`` / ``sao submit --dry-run`` work without the checkpoint; ``sao train`` refuses."""
    cfg = load_config(_run(tmp_path, "model: tiny_moe\n"), [f"actor.init_from={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError) as err:
        check_init_from(cfg)
    message = _one_line(err)
    assert "actor.init_from" in message and "no such directory" in message


def test_directory_that_is_neither_kind_fails(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")  # config.json but no safetensors
    with pytest.raises(ConfigError) as err:
        load_config(_run(tmp_path, "model: tiny_moe\n"), [f"critic.init_from={other}"])
    message = _one_line(err)
    assert "critic.init_from" in message and "neither an HF checkpoint" in message


def test_unsupported_architecture_is_refused_with_the_key(tmp_path):
    hf = _hf_dir(tmp_path / "ckpt", architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError) as err:
        load_config(_run(tmp_path, "run: {name: x}\n"), [f"actor.init_from={hf}"])
    message = _one_line(err)
    assert "actor.init_from" in message and "LlamaForCausalLM" in message


@pytest.mark.parametrize("path", ["configs/qwen3_30b_a3b_math.yaml", "configs/qwen3_30b_a3b_swe.yaml"])
def test_paper_configs_name_a_checkpoint_that_plans_without_it(path):
    cfg = load_config(path)
    assert cfg.actor.init_from and cfg.critic.init_from == ""  # the critic starts from the SFT'd actor
    assert cfg.model.num_experts == 128
    with pytest.raises(ConfigError, match="actor.init_from"):
        check_init_from(cfg)  # the placeholder must be replaced before `sao train`
