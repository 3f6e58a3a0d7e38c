"""Loading, overriding and validating a config (the schema is :mod:`sao_megatron.config.schema`).

Values are checked against the field annotations (:func:`_coerce`: types, ``Literal`` choices,
``X | None``), then across fields (:func:`validate`: parallel layouts, ranges, node groups).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from sao_megatron.algo.choices import GROUP_ESTIMATORS, uses_critic
from sao_megatron.config import hf
from sao_megatron.config.cluster import validate_cluster
from sao_megatron.config.parse import build, read_yaml
from sao_megatron.config.ranges import check_ranges
from sao_megatron.config.schema import (
    DEFAULT_RUN_CONFIG,
    MODEL_CONFIG_DIR,
    AlgoConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    SAOConfig,
)
from sao_megatron.config.shape import divisors, same_shape, validate_model
from sao_megatron.config.tokenizer_files import check_hf_tokenizer
from sao_megatron.config.weights import check_hf_weights


def resolve_model_file(name_or_path: str) -> Path:
    """``tiny_moe`` -> ``configs/models/tiny_moe.yaml``; a path is returned as is."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.is_file():
            raise ConfigError(
                f"model file {candidate} not found; set 'model' to an existing YAML file or a "
                f"name in {MODEL_CONFIG_DIR}"
            )
        return candidate
    path = MODEL_CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        available = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"model '{name_or_path}' not found in {MODEL_CONFIG_DIR}; available: {available}")
    return path


def parse_override(text: str) -> tuple[list[str], Any]:
    """``actor.optim.lr=1e-5`` -> (["actor", "optim", "lr"], 1e-05)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not key=value; write e.g. actor.optim.lr=1e-5")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' has an empty key part; write e.g. actor.optim.lr=1e-5")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{text}': value is not valid YAML; quote it") from err
    if isinstance(value, str) and _looks_numeric(value):
        value = float(value)  # PyYAML reads 1e-5 (no dot) as a string
    return key.split("."), value


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return text.strip().lower() not in ("nan", "inf", "-inf", "infinity", "-infinity")


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {path[-1]: value}
    for part in reversed(path[:-1]):
        out = {part: out}
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SAOConfig:
    """Defaults <- YAML run file (default ``configs/tiny_cpu.yaml``) <- ``key=value`` overrides."""
    run_file = Path(path) if path is not None else DEFAULT_RUN_CONFIG
    data = read_yaml(run_file)
    model_given = "model" in data or any(o.split("=", 1)[0].split(".")[0] == "model" for o in overrides)
    model_spec = data.pop("model", "tiny_moe")
    model_overrides: dict[str, Any] = {}
    if isinstance(model_spec, dict):
        model_overrides = dict(model_spec)
        model_spec = model_overrides.pop("from", "tiny_moe")
    if not isinstance(model_spec, str):
        raise ConfigError(f"{run_file}: 'model' must be a model name, a path or a mapping with 'from'")
    try:
        cfg = SAOConfig()
        cfg.model = build(ModelConfig, read_yaml(resolve_model_file(model_spec)), "model")
        cfg.model = build(ModelConfig, model_overrides, "model", base=cfg.model)
        cfg = build(SAOConfig, data, base=cfg)
    except ConfigError as err:
        raise ConfigError(f"{run_file}: {err}") from None
    for text in overrides:
        try:
            keys, value = parse_override(text)
            if keys == ["model"] and isinstance(value, str):
                cfg.model = build(ModelConfig, read_yaml(resolve_model_file(value)), "model")
                continue
            cfg = build(SAOConfig, _nest(keys, value), base=cfg)
        except ConfigError as err:
            message = str(err)  # parse_override's own errors already name the override
            raise ConfigError(
                message if message.startswith(f"override '{text}'") else f"override '{text}': {message}"
            ) from None
    resolve_init_from(cfg, model_given)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------------------------
# Initial checkpoints (actor.init_from, critic.init_from)
# --------------------------------------------------------------------------------------------
CheckpointKind = typing.Literal["hf", "megatron"]


def checkpoint_kind(path: str | Path, key: str) -> CheckpointKind:
    """``hf`` (``config.json`` + ``*.safetensors``) or ``megatron`` (``metadata.json`` +
    ``model.yaml``, as written by ``sao convert hf-to-mcore``); a one-line ConfigError otherwise."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"{key}={path}: no such directory; point it at an HF model directory or a "
            "Megatron checkpoint from `sao convert hf-to-mcore`, or set it to ''"
        )
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return "hf"
    if (p / "metadata.json").is_file() and (p / "model.yaml").is_file():
        return "megatron"
    raise ConfigError(
        f"{key}={path} is neither an HF checkpoint (config.json + *.safetensors) nor a "
        "Megatron checkpoint (metadata.json + model.yaml from `sao convert hf-to-mcore`)"
    )


def checkpoint_model(path: str | Path, key: str) -> ModelConfig:
    """The model shape recorded in a checkpoint directory (HF ``config.json`` or ``model.yaml``)."""
    p = Path(path).expanduser()
    try:
        if checkpoint_kind(p, key) == "megatron":
            return build(ModelConfig, read_yaml(p / "model.yaml"), "model")
        return hf.model_config_from_hf(hf.read_hf_config(p), name=p.name)
    except ConfigError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(key) else f"{key}={path}: {message}") from None


def resolve_init_from(cfg: SAOConfig, model_given: bool = True) -> None:
    """Check ``actor.init_from`` / ``critic.init_from`` against ``cfg.model``; without a ``model``
    in the run file (``model_given`` false) the shape comes from ``actor.init_from``.

    A directory that does not exist is accepted here when the model shape is given, so that
    ``sao plan`` and ``sao submit --dry-run`` work where the checkpoint is not (a laptop);
    :func:`check_init_from` (``sao train`` start-up) refuses it."""
    sources = [(f"{role}.init_from", getattr(cfg, role).init_from) for role in ("actor", "critic")]
    sources = [(key, path) for key, path in sources if path]
    if not model_given and sources:  # actor.init_from first, else critic.init_from
        key, path = sources[0]
        if not Path(path).expanduser().exists():
            raise ConfigError(
                f"{key}={path}: no such directory, and the run file gives no 'model' to plan "
                "with; fix the path or add 'model: NAME'"
            )
        cfg.model = checkpoint_model(path, key)
    for key, path in sources:
        if not Path(path).expanduser().exists():
            continue
        found = checkpoint_model(path, key)
        diff = same_shape(found, cfg.model)
        if diff:
            shown = ", ".join(f"{f}={getattr(cfg.model, f)!r} vs {getattr(found, f)!r}" for f in diff[:4])
            raise ConfigError(
                f"model '{cfg.model.name}' and {key}={path} disagree on {shown}; drop 'model' "
                "from the run file (the checkpoint's shape is used) or fix it"
            )


def check_init_from(cfg: SAOConfig) -> None:
    """``sao train`` start-up: every ``init_from`` must be a readable checkpoint of ``cfg.model``."""
    for role in ("actor", "critic"):
        path = getattr(cfg, role).init_from
        if path and checkpoint_kind(path, f"{role}.init_from") == "hf":
            check_hf_weights(path, f"{role}.init_from")
    resolve_init_from(cfg)


def check_init_tokenizer(cfg: SAOConfig, tools_from: str = "") -> None:
    """``sao train`` start-up, after :func:`check_init_from`: an HF ``actor.init_from`` (whose
    tokenizer and chat template the run uses) must carry a tokenizer that fits the model
    (:func:`check_hf_tokenizer`; ``tools_from`` names what declares tools, e.g.
    ``rollout.env=math_python``, or is empty)."""
    if cfg.actor.init_from and checkpoint_kind(cfg.actor.init_from, "actor.init_from") == "hf":
        check_hf_tokenizer(cfg.actor.init_from, cfg.model.vocab_size, tools_from)


def to_dict(cfg: SAOConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: SAOConfig, run_dir: str | Path) -> Path:
    """Write the resolved config as ``<run_dir>/config.yaml`` (loadable by :func:`load_config`)."""
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_dict(cfg)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def validate_parallel(p: ParallelConfig, m: ModelConfig, role: str) -> None:
    """Reject layouts Megatron would refuse, naming the key and the values that work."""
    tp, pp, cp, ep, etp = (
        p.tensor_parallel,
        p.pipeline_parallel,
        p.context_parallel,
        p.expert_parallel,
        p.expert_tensor_parallel,
    )
    for name, value in (
        ("world_size", p.world_size),
        ("tensor_parallel", tp),
        ("pipeline_parallel", pp),
        ("context_parallel", cp),
        ("expert_parallel", ep),
        ("expert_tensor_parallel", etp),
        ("micro_batch_size", p.micro_batch_size),
    ):
        if value < 1:
            raise ConfigError(f"{role}.parallel.{name} must be >= 1 (got {value})")
    key = f"{role}.parallel"
    if p.max_tokens_per_micro_batch < 0:
        raise ConfigError(
            f"{key}.max_tokens_per_micro_batch must be >= 0 (got {p.max_tokens_per_micro_batch}); "
            "0 means micro_batch_size rows per micro-batch"
        )
    if m.num_attention_heads % tp or m.num_query_groups % tp:
        options = [d for d in divisors(m.num_query_groups) if m.num_attention_heads % d == 0]
        raise ConfigError(
            f"{key}.tensor_parallel={tp} does not divide model.num_attention_heads={m.num_attention_heads} "
            f"and model.num_query_groups={m.num_query_groups}; use one of {options}"
        )
    latent = {"q_lora_rank": m.q_lora_rank, "kv_lora_rank + qk_rope_head_dim": m.kv_lora_rank + m.qk_rope_head_dim}
    for name, rows in latent.items():  # MLA's down-projections are column-parallel on the local spec
        if rows % tp:
            raise ConfigError(
                f"{key}.tensor_parallel={tp} does not divide model.{name}={rows} (multi-latent attention's "
                f"down-projections are split over TP); use one of {divisors(rows)[:8]}"
            )
    if m.vocab_size % tp:
        raise ConfigError(
            f"{key}.tensor_parallel={tp} does not divide model.vocab_size={m.vocab_size}; "
            f"use one of {divisors(m.vocab_size)[:8]} or pad the vocabulary"
        )
    if m.num_layers % pp:
        raise ConfigError(
            f"{key}.pipeline_parallel={pp} does not divide model.num_layers={m.num_layers}; "
            f"use one of {divisors(m.num_layers)}"
        )
    if p.world_size % (tp * pp * cp):
        raise ConfigError(
            f"{key}.world_size={p.world_size} is not a multiple of tensor_parallel*"
            f"pipeline_parallel*context_parallel={tp * pp * cp}; change world_size or the layout"
        )
    if m.num_experts:
        if m.num_experts % ep:
            raise ConfigError(
                f"{key}.expert_parallel={ep} does not divide model.num_experts={m.num_experts}; "
                f"use one of {divisors(m.num_experts)}"
            )
        if (p.world_size // pp) % (ep * etp):
            raise ConfigError(
                f"{key}.expert_parallel*expert_tensor_parallel={ep * etp} must divide "
                f"world_size/pipeline_parallel={p.world_size // pp}; lower expert_parallel"
            )
        if tp > 1 and p.sequence_parallel is False:
            raise ConfigError(
                f"{key}.sequence_parallel=false with tensor_parallel={tp}: Megatron MoE "
                "training needs sequence parallelism with TP > 1; set it true or null"
            )
    elif ep > 1:
        raise ConfigError(f"{key}.expert_parallel={ep} but the model is dense (num_experts=0); set it to 1")
    if p.overlap_param_gather and not p.use_distributed_optimizer:
        raise ConfigError(
            f"{key}.overlap_param_gather=true needs {key}.use_distributed_optimizer=true "
            "(without it there is no parameter all-gather); set that true, or this null or false"
        )
    if p.selective_recompute and p.recompute_activations:
        raise ConfigError(
            f"{key}.selective_recompute=true with recompute_activations=true (full recompute "
            "already covers every module); set selective_recompute to null or false"
        )


def validate(cfg: SAOConfig) -> None:
    check_ranges(cfg, SAOConfig())  # first: a NaN passes every comparison below
    validate_model(cfg.model)
    validate_parallel(cfg.actor.parallel, cfg.model, "actor")
    validate_parallel(cfg.critic.parallel, cfg.model, "critic")
    if cfg.critic.updates_per_step < 1:
        raise ConfigError(f"critic.updates_per_step={cfg.critic.updates_per_step}; K must be >= 1")
    for name, role in (("actor", cfg.actor), ("critic", cfg.critic)):
        for key in ("lr", "clip_grad"):
            if getattr(role.optim, key) < 0:
                raise ConfigError(f"{name}.optim.{key}={getattr(role.optim, key)} must be >= 0")
    if cfg.actor.router_bias_update_rate < 0:
        raise ConfigError(f"actor.router_bias_update_rate={cfg.actor.router_bias_update_rate} must be >= 0")
    for pattern in [*cfg.critic.freeze_patterns, *cfg.critic.train_patterns]:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"critic.freeze_patterns/train_patterns: bad regex {pattern!r} ({err})") from None
    validate_algo(cfg.algo)
    validate_corrections(cfg)
    validate_rollout(cfg.rollout)
    validate_gateway(cfg.rollout, cfg.algo.group_size, bool(cfg.cluster.ray_address))
    validate_routing_replay(cfg)
    validate_data(cfg.data, evaluates=cfg.train.eval_prompts > 0)
    for name in ("eval_prompts", "eval_samples", "eval_max_turns"):
        if getattr(cfg.train, name) < 0:
            zero = "0 uses rollout.loop.max_turns" if name == "eval_max_turns" else "0 turns it off"
            raise ConfigError(f"train.{name}={getattr(cfg.train, name)} must be >= 0 ({zero})")
    window, steps = cfg.train.value_pretrain_stop_window, cfg.train.value_pretrain_steps
    if window < 1 or (steps > 0 and window > steps):
        raise ConfigError(
            f"train.value_pretrain_stop_window={window} with train.value_pretrain_steps={steps}: the stop "
            f"averages the last window steps, so use 1 to {max(steps, 1)}"
        )
    if cfg.train.max_skipped_steps < 1:
        raise ConfigError(f"train.max_skipped_steps={cfg.train.max_skipped_steps} must be >= 1")
    validate_run(cfg.run)
    every = cfg.rollout.weight_sync_every
    if every < 1:
        raise ConfigError(f"rollout.weight_sync_every={every}; use 1 (every step) or more")
    if cfg.algo.max_policy_lag is not None and cfg.algo.max_policy_lag < every - 1:
        raise ConfigError(
            f"rollout.weight_sync_every={every} with algo.max_policy_lag={cfg.algo.max_policy_lag}: "
            f"episodes run on weights up to {every - 1} versions old and would be dropped as stale; "
            f"raise algo.max_policy_lag to >= {every - 1} (or null)"
        )
    validate_cluster(cfg)


def validate_algo(a: AlgoConfig) -> None:
    if a.eps_low < 0 or a.eps_high < 0:
        raise ConfigError(f"algo.eps_low={a.eps_low}, algo.eps_high={a.eps_high} must be >= 0")
    if not 0 <= a.gamma <= 1 or not 0 <= a.lam_critic <= 1:
        raise ConfigError(f"algo.gamma={a.gamma}, algo.lam_critic={a.lam_critic} must be in [0, 1]")
    if a.lam != "adaptive" and not 0 <= a.lam <= 1:
        raise ConfigError(
            f"algo.lam={a.lam} must be in [0, 1], or adaptive for length-adaptive "
            "1 - 1/(lam_alpha * l) (formerly any negative value)"
        )
    if a.batch_size < 1 or a.group_size < 1 or a.batch_size % a.group_size:
        raise ConfigError(
            f"algo.batch_size={a.batch_size} must be a positive multiple of algo.group_size={a.group_size}"
        )
    if a.advantage in GROUP_ESTIMATORS and a.group_size < 2:
        raise ConfigError(f"algo.advantage={a.advantage} needs algo.group_size >= 2 (same-prompt groups)")
    if a.truncated == "bootstrap" and not uses_critic(a.advantage):
        raise ConfigError(
            f"algo.truncated=bootstrap needs a critic but algo.advantage={a.advantage}; use gae, step_mean or "
            "step_last, or algo.truncated=terminal"
        )
    if a.max_policy_lag is not None and a.max_policy_lag < 0:
        raise ConfigError(f"algo.max_policy_lag={a.max_policy_lag}; use null (unbounded) or >= 0")
    if a.over_lag == "mask" and a.max_policy_lag is None:
        raise ConfigError("algo.over_lag=mask masks tokens past algo.max_policy_lag, which is null: set a bound")
    if a.max_batches_ahead is not None and a.max_batches_ahead < 1:
        raise ConfigError(f"algo.max_batches_ahead={a.max_batches_ahead}; use null (no cap) or >= 1")


def validate_corrections(cfg: SAOConfig) -> None:
    """The policy-loss corrections (``algo.seq_mask_*``, ``algo.tis_cap``) and the actor's MoE router keys."""
    a = cfg.algo
    low, high, cap = a.seq_mask_low, a.seq_mask_high, a.tis_cap
    if low is not None and not 0 < low < 1:
        raise ConfigError(
            f"algo.seq_mask_low={low} must be in (0, 1): the band must hold 1, an on-policy trajectory; "
            "use null for no lower bound"
        )
    if high is not None and not high > 1:
        raise ConfigError(
            f"algo.seq_mask_high={high} must be > 1: the band must hold 1, an on-policy trajectory; "
            "use null for no upper bound"
        )
    cp = cfg.actor.parallel.context_parallel
    if (low is not None or high is not None) and cp > 1:
        raise ConfigError(
            f"algo.seq_mask_low/seq_mask_high with actor.parallel.context_parallel={cp}: a trajectory is split "
            "over the context-parallel ranks, so its geometric mean is not known on one; turn the sequence mask off (null) or use context_parallel 1"
        )
    if cap is not None and not cap >= 1:
        raise ConfigError(
            f"algo.tis_cap={cap} must be >= 1 (a cap below 1 down-weights on-policy tokens, rho = 1); "
            "use null to turn truncated IS off"
        )
    if cap is not None and a.policy_loss == "dis" and cap >= 1 + a.eps_high:
        raise ConfigError(
            f"algo.tis_cap={cap} truncates nothing with algo.policy_loss=dis: DIS drops every token with "
            f"rho >= 1 + algo.eps_high = {1 + a.eps_high}; set tis_cap below it or null"
        )
    if cfg.actor.moe_aux_loss_coeff < 0:
        raise ConfigError(f"actor.moe_aux_loss_coeff={cfg.actor.moe_aux_loss_coeff} must be >= 0 (0 turns it off)")
    if cfg.actor.freeze_router and not cfg.model.num_experts:
        raise ConfigError("actor.freeze_router=true but the model is dense (model.num_experts=0); set it false")


def validate_run(r: RunConfig) -> None:
    if r.export_timeout_s < 0:
        raise ConfigError(f"run.export_timeout_s={r.export_timeout_s} must be >= 0 (0: sized from the bytes moved)")
    if not r.export_gb_per_s > 0:
        raise ConfigError(f"run.export_gb_per_s={r.export_gb_per_s} must be > 0 (GB/s)")
    if r.export_inflight_mb < 1:
        raise ConfigError(f"run.export_inflight_mb={r.export_inflight_mb} must be >= 1 (MiB)")


def validate_data(d: DataConfig, evaluates: bool = True) -> None:
    """The ``data`` section's shape; the rows themselves are checked by ``sao train`` at start-up
    (:func:`sao_megatron.envs.dataset.check_data`), where the files must exist."""
    if d.eval and not d.train:
        raise ConfigError(f"data.eval={d.eval!r} needs data.train (the training prompts file) as well")
    if d.train and not d.eval and evaluates:
        raise ConfigError(
            "data.train is set but data.eval is empty; set data.eval=FILE (held-out prompts) or train.eval_prompts=0"
        )
    if d.train:
        for key in ("prompt_field", "answer_field"):
            if not getattr(d, key):
                raise ConfigError(f"data.{key} is empty; name the field of each row that holds it")


def validate_routing_replay(cfg: SAOConfig) -> None:
    """``rollout.routing_replay`` needs an MoE model (routes are top-k expert ids)."""
    mode = cfg.rollout.routing_replay
    if mode != "off" and not cfg.model.num_experts:
        raise ConfigError(
            f"rollout.routing_replay={mode} needs an MoE model, but model.num_experts=0 (dense: no routers to "
            "replay); set rollout.routing_replay=off"
        )


def validate_rollout(r: RolloutConfig) -> None:
    for name in ("num_engines", "max_concurrent"):
        if getattr(r, name) < 1:
            raise ConfigError(f"rollout.{name} must be >= 1 (got {getattr(r, name)})")
    if r.weight_sync_bucket_mb < 1:
        raise ConfigError(f"rollout.weight_sync_bucket_mb={r.weight_sync_bucket_mb} must be >= 1 (MiB), e.g. 1024")
    if r.weight_sync_senders < 1:
        raise ConfigError(f"rollout.weight_sync_senders={r.weight_sync_senders} must be >= 1, e.g. 8")
    if not r.weight_sync_timeout_s > 0:
        raise ConfigError(f"rollout.weight_sync_timeout_s={r.weight_sync_timeout_s} must be > 0 (seconds), e.g. 120")
    if r.weight_sync == "disk" and r.update_policy != "retract":
        raise ConfigError(
            f"rollout.update_policy={r.update_policy} has no effect with rollout.weight_sync=disk (the disk sync does "
            "not pause: each engine finishes its requests, then loads); use rollout.weight_sync=distributed or "
            "leave update_policy at retract"
        )
    for name in ("max_turns", "max_new_tokens"):
        if getattr(r.loop, name) < 1:
            raise ConfigError(f"rollout.loop.{name} must be >= 1 (got {getattr(r.loop, name)})")
    if r.loop.max_calls_per_turn < 1:
        raise ConfigError(
            f"rollout.loop.max_calls_per_turn={r.loop.max_calls_per_turn} must be >= 1 (tool calls run per action; "
            "1 runs only the first call of an action)"
        )
    for name in ("max_output_tokens_per_call", "max_observation_tokens_per_episode"):
        if getattr(r.loop, name) < 0:
            raise ConfigError(f"rollout.loop.{name}={getattr(r.loop, name)} must be >= 0 (0: no limit)")
    budget = r.loop.max_observation_tokens_per_episode
    if budget and budget >= r.loop.max_context_tokens:
        raise ConfigError(
            f"rollout.loop.max_observation_tokens_per_episode={budget} is not below "
            f"rollout.loop.max_context_tokens={r.loop.max_context_tokens}: it would never bite; lower it or use 0 (no limit)"
        )
    for name in ("generate_timeout_s", "env_step_timeout_s"):
        if not getattr(r.loop, name) > 0:
            raise ConfigError(f"rollout.loop.{name}={getattr(r.loop, name)} must be > 0 (seconds)")
    if not 0 < r.max_failed_fraction <= 1:
        raise ConfigError(
            f"rollout.max_failed_fraction={r.max_failed_fraction} must be in (0, 1]; "
            "1 never stops the run for failed episodes"
        )
    if r.failure_window < 1:
        raise ConfigError(f"rollout.failure_window must be >= 1 (got {r.failure_window})")
    for key in ("engine_max_restarts", "episode_max_retries"):
        if getattr(r, key) < 0:
            raise ConfigError(f"rollout.{key} must be >= 0 (got {getattr(r, key)})")
    if r.engine_check_s <= 0:
        raise ConfigError(f"rollout.engine_check_s must be > 0 (got {r.engine_check_s})")
    if r.env_workers < 0:
        raise ConfigError(f"rollout.env_workers={r.env_workers} must be >= 0 (0: environments in the driver)")
    if r.env_worker_episodes < 1:
        raise ConfigError(f"rollout.env_worker_episodes must be >= 1 (got {r.env_worker_episodes})")
    if not r.env_worker_cpus > 0:
        raise ConfigError(f"rollout.env_worker_cpus={r.env_worker_cpus} must be > 0 (Ray CPUs per worker)")


def validate_gateway(r: RolloutConfig, group_size: int = 1, cluster_run: bool = False) -> None:
    """``rollout.gateway`` and, with ``rollout.env=openai_agent``, ``rollout.agent`` (``group_size``:
    ``algo.group_size``; ``cluster_run``: ``cluster.ray_address`` is set, so env workers may be on other nodes)."""
    g = r.gateway
    if not 0 <= g.port <= 65535:
        raise ConfigError(f"rollout.gateway.port={g.port} must be in [0, 65535] (0: a free port)")
    if not g.session_timeout_s > 0:
        raise ConfigError(f"rollout.gateway.session_timeout_s={g.session_timeout_s} must be > 0 (seconds), e.g. 600")
    if not g.served_model_name:
        raise ConfigError("rollout.gateway.served_model_name is empty; name the model agents ask for, e.g. sao-policy")
    a = r.agent
    for key, low in (("memory_mb", 64), ("cpu_s", 1), ("processes", 8)):
        if getattr(a, key) < low:
            raise ConfigError(f"rollout.agent.{key}={getattr(a, key)} must be >= {low} (a sandboxed agent's limit)")
    if r.env != "openai_agent":
        return
    if bool(a.entry_point) == bool(a.command):
        raise ConfigError(
            f"rollout.env=openai_agent needs exactly one of rollout.agent.entry_point (got {a.entry_point!r}) and "
            f"rollout.agent.command (got {a.command!r}), e.g. rollout.agent.entry_point=examples.arith_agent:run"
        )
    if a.entry_point and ":" not in a.entry_point:
        raise ConfigError(f"rollout.agent.entry_point={a.entry_point!r} is not 'package.module:function'")
    if a.entry_point and a.sandbox == "require":
        raise ConfigError(
            f"rollout.agent.sandbox=require with rollout.agent.entry_point={a.entry_point!r}: an entry point runs "
            "in the rollout process and cannot be sandboxed; give the agent as rollout.agent.command or set "
            "rollout.agent.sandbox=auto"
        )
    if r.env_workers > 0 and a.entry_point:
        raise ConfigError(
            f"rollout.agent.entry_point={a.entry_point!r} with rollout.env_workers={r.env_workers}: an entry "
            "point runs in the rollout process, beside the gateway; give the agent as rollout.agent.command (run on "
            "the env workers) or set rollout.env_workers=0"
        )
    if r.env_workers > 0 and cluster_run and r.gateway.host in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(
            f"rollout.gateway.host={r.gateway.host} with rollout.env_workers={r.env_workers} on a cluster: agents "
            "on the env workers' nodes cannot reach loopback; set rollout.gateway.host=0.0.0.0 (every session keeps "
            "its key)"
        )
    if group_size > 1:
        raise ConfigError(
            f"rollout.env=openai_agent with algo.group_size={group_size}: a session's segments have no group "
            "to share a baseline with; use algo.group_size=1 (SAO)"
        )
