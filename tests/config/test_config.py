"""Configuration: defaults, YAML and CLI overrides, and errors that say how to fix them."""

import dataclasses
import typing

import pytest
import yaml

from sao_megatron import algo
from sao_megatron.config import (
    REPO_ROOT,
    AgentLoopConfig,
    AlgoConfig,
    ConfigError,
    SAOConfig,
    load_config,
    parse_override,
    save_config,
)
from sao_megatron.rollout import agent_loop


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
        (
            "actor.parallel.moe_token_dispatcher=flex",
            "actor.parallel.moe_token_dispatcher: 'flex' is not one of 'alltoall', 'allgather'",
        ),
        ("algo.policy_loss=ppo", "algo.policy_loss: 'ppo' is not one of 'dis', 'ppo_clip', 'vanilla'"),
        ("algo.loss_agg=3", "algo.loss_agg: 3 is not one of 'token_mean', 'seq_mean'"),
        ("algo.advantage=gea", "algo.advantage: 'gea' is not one of 'gae', 'step_mean', 'step_last', 'grpo'"),
        ("rollout.weight_sync=nfs", "rollout.weight_sync: 'nfs' is not one of 'distributed', 'disk'"),
        ("critic.value_head_init=xavier", "critic.value_head_init: 'xavier' is not one of 'zero', 'normal'"),
        ("run.backend=mpi", "run.backend: 'mpi' is not one of 'auto', 'nccl', 'gloo'"),
        ("rollout.dtype=fp8", "rollout.dtype: 'fp8' is not one of 'auto', 'half'"),
        ("algo.lam=adapt", "algo.lam: expected a number or 'adaptive', got 'adapt'"),
        ("algo.lam=-1", "algo.lam=-1.0 must be in [0, 1], or adaptive"),
        ("algo.max_policy_lag=-1", "algo.max_policy_lag=-1; use null (unbounded) or >= 0"),
        ("rollout.weight_sync_every=0", "rollout.weight_sync_every=0; use 1 (every step) or more"),
        ("algo.max_batches_ahead=0", "algo.max_batches_ahead=0; use null (no cap) or >= 1"),
        (
            "rollout.weight_sync_every=6",
            "rollout.weight_sync_every=6 with algo.max_policy_lag=4: episodes run on weights up to 5 versions old",
        ),
        ("rollout.max_turns=2", "unknown config key 'rollout.max_turns'; it is 'rollout.loop.max_turns'"),
        ("rollout.loop.max_turns=0", "rollout.loop.max_turns must be >= 1"),
        ("rollout.loop.max_calls_per_turn=0", "rollout.loop.max_calls_per_turn=0 must be >= 1"),
        ("rollout.loop.max_output_tokens_per_call=-1", "rollout.loop.max_output_tokens_per_call=-1 must be >= 0"),
        (
            "rollout.loop.max_observation_tokens_per_episode=256",
            "rollout.loop.max_observation_tokens_per_episode=256 is not below rollout.loop.max_context_tokens=256",
        ),
        ("cluster.cpus_per_rank=-1", "cluster.cpus_per_rank=-1.0 must be >= 0"),
        ("critic.updates_per_step=0", "K must be >= 1"),
        ("rollout.max_failed_fraction=0", "rollout.max_failed_fraction=0.0 must be in (0, 1]"),
        ("rollout.failure_window=0", "rollout.failure_window must be >= 1"),
        ("rollout.engine_max_restarts=-1", "rollout.engine_max_restarts must be >= 0"),
        ("rollout.episode_max_retries=-1", "rollout.episode_max_retries must be >= 0"),
        ("rollout.engine_check_s=0", "rollout.engine_check_s must be > 0"),
        (
            "actor.parallel.max_tokens_per_micro_batch=-1",
            "actor.parallel.max_tokens_per_micro_batch must be >= 0",
        ),
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


def test_literal_error_is_one_line_naming_key_value_and_choices():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algo.policy_loss=ppo"])
    assert str(err.value) == "override 'algo.policy_loss=ppo': algo.policy_loss: 'ppo' is not one of " + (
        "'dis', 'ppo_clip', 'vanilla'"
    )


def test_literal_error_from_a_yaml_file_names_the_file(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("algo:\n  advantage: ppo\n")
    with pytest.raises(ConfigError, match=r"run.yaml: algo.advantage: 'ppo' is not one of 'gae', "):
        load_config(run)


def test_algo_choices_are_the_algo_literals():
    hints = typing.get_type_hints(AlgoConfig)
    assert hints["policy_loss"] is algo.PolicyLossName
    assert hints["loss_agg"] is algo.LossAgg
    assert hints["advantage"] is algo.AdvantageName
    for name in algo.POLICY_LOSSES:
        assert load_config(None, [f"algo.policy_loss={name}"]).algo.policy_loss == name
    assert load_config(None, ["algo.advantage=grpo", "algo.group_size=2"]).algo.advantage == "grpo"


def test_lam_is_a_float_or_adaptive_and_max_policy_lag_null_is_unbounded():
    assert SAOConfig().algo.lam == "adaptive" and load_config().algo.lam == "adaptive"
    assert load_config(None, ["algo.lam=0.95"]).algo.lam == 0.95
    assert load_config(None, ["algo.lam=1"]).algo.lam == 1.0
    assert load_config(None, ["algo.max_policy_lag=null"]).algo.max_policy_lag is None
    assert load_config(None, ["algo.max_policy_lag=0"]).algo.max_policy_lag == 0


def test_truncated_bootstrap_needs_a_critic():
    assert SAOConfig().algo.truncated == "terminal"
    assert load_config(None, ["algo.truncated=bootstrap"]).algo.truncated == "bootstrap"
    with pytest.raises(ConfigError, match=r"algo.truncated=bootstrap needs a critic but algo.advantage=rloo"):
        load_config(None, ["algo.truncated=bootstrap", "algo.advantage=rloo", "algo.group_size=2"])


def test_agent_loop_settings_are_nested_under_rollout_loop():
    cfg = load_config(None, ["rollout.loop.temperature=0.5", "rollout.loop.generate_timeout_s=10"])
    assert isinstance(cfg.rollout.loop, AgentLoopConfig)
    assert cfg.rollout.loop.max_turns == 3 and cfg.rollout.loop.max_context_tokens == 256  # tiny_cpu.yaml
    assert cfg.rollout.loop.temperature == 0.5 and cfg.rollout.loop.generate_timeout_s == 10.0
    assert agent_loop.AgentLoopConfig is AgentLoopConfig


def test_cluster_ray_settings_default_to_a_local_ray():
    cfg = load_config()
    assert cfg.cluster.ray_address == "" and cfg.cluster.cpus_per_rank == 0.5
    cfg = load_config(None, ["cluster.ray_address=10.0.0.1:6379", "cluster.cpus_per_rank=2"])
    assert cfg.cluster.ray_address == "10.0.0.1:6379" and cfg.cluster.cpus_per_rank == 2.0


def test_repo_root_is_the_checkout():
    assert (REPO_ROOT / "configs" / "tiny_cpu.yaml").exists() and (REPO_ROOT / "sao_megatron").is_dir()


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_run_configs_load(path):
    load_config(path)


def test_resume_reads_the_run_config_and_drops_its_stale_ray_address(tmp_path, monkeypatch):
    """``sao train --resume DIR [overrides]``: the saved config, minus the old job's Ray address; the
    launchers append the new one (``cluster.ray_address=...``) as an override."""
    import sys
    import types

    from sao_megatron import cli

    save_config(load_config(None, ["cluster.ray_address=10.0.0.1:6379", "train.steps=7"]), tmp_path)
    seen = []

    async def train(cfg, run_dir, resume=False):
        seen.append(cfg)
        return {"initial": {}, "final": {}}

    monkeypatch.setitem(sys.modules, "sao_megatron.pipeline", types.SimpleNamespace(train=train))
    for extra, address in (([], ""), (["cluster.ray_address=10.0.0.2:6379"], "10.0.0.2:6379")):
        args = cli.build_parser().parse_args(["train", "--resume", str(tmp_path), *extra])
        assert cli.cmd_train(args) == 0
        assert seen[-1].cluster.ray_address == address and seen[-1].train.steps == 7
