"""Configuration: nested dataclasses are the one source of truth for defaults.

A run is configured in three layers, each only overriding the one before:

1. the dataclass defaults below (docstring under each field);
2. a YAML run file (``configs/*.yaml``); its ``model`` key names a model shape file
   (``configs/models/<name>.yaml`` or a path) and may override single shape fields;
3. command-line ``key.sub=value`` overrides (values parsed as YAML scalars/lists).

Unknown keys, wrong types and inconsistent parallel layouts raise :class:`ConfigError` with a
one-line reason and the fix, before any process starts. The resolved config is written as
``config.yaml`` into every run directory (:func:`save_config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
MODEL_CONFIG_DIR = CONFIG_DIR / "models"
DEFAULT_RUN_CONFIG = CONFIG_DIR / "tiny_cpu.yaml"


class ConfigError(ValueError):
    """A configuration problem, stated in one line with the fix."""


# --------------------------------------------------------------------------------------------
# Model shape (configs/models/*.yaml)
# --------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """Shape of a Qwen3-MoE-family decoder (dense Qwen3 when ``num_experts == 0``)."""

    name: str = ""
    """Human-readable name, e.g. ``tiny_moe`` or ``qwen3_30b_a3b``."""
    num_layers: int = 0
    """Transformer layers (HF ``num_hidden_layers``)."""
    hidden_size: int = 0
    """Residual stream width (HF ``hidden_size``)."""
    num_attention_heads: int = 0
    """Query heads (HF ``num_attention_heads``)."""
    num_query_groups: int = 0
    """Key/value heads for GQA (HF ``num_key_value_heads``)."""
    head_dim: int = 0
    """Per-head width (HF ``head_dim``); may differ from hidden_size / heads in Qwen3."""
    ffn_hidden_size: int = 0
    """Dense MLP width (HF ``intermediate_size``), used by dense layers and dense models."""
    vocab_size: int = 0
    """Embedding rows; must equal the tokenizer's vocabulary (plus any padding you choose)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 builds a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int = 0
    """Expert MLP width (HF ``moe_intermediate_size``)."""
    moe_shared_expert_intermediate_size: int = 0
    """Shared-expert width; 0 means no shared expert (Qwen3-MoE has none)."""
    moe_layer_freq: int = 1
    """Every n-th layer is MoE (HF ``decoder_sparse_step``)."""
    dense_layers: list[int] = field(default_factory=list)
    """Layer indices forced dense (HF ``mlp_only_layers``)."""
    moe_aux_loss_coeff: float = 0.001
    """Load-balancing auxiliary loss coefficient (HF ``router_aux_loss_coef``)."""
    max_position_embeddings: int = 4096
    """Longest sequence the RoPE tables are built for."""
    rope_theta: float = 1_000_000.0
    """RoPE base (HF ``rope_theta``)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (HF ``rms_norm_eps``)."""
    qk_layernorm: bool = True
    """RMSNorm on per-head queries and keys (Qwen3)."""
    tie_word_embeddings: bool = False
    """Share input embedding and LM head (Qwen3-MoE: untied)."""


# --------------------------------------------------------------------------------------------
# Roles: parallel layout and optimizer
# --------------------------------------------------------------------------------------------
@dataclass
class ParallelConfig:
    """Megatron parallel layout of one role (actor or critic). DP is world / (TP * PP * CP)."""

    world_size: int = 1
    """Processes (GPUs, or CPU processes locally) of this role."""
    tensor_parallel: int = 1
    """TP: splits attention heads, MLP width and the vocabulary."""
    pipeline_parallel: int = 1
    """PP: splits layers into stages."""
    context_parallel: int = 1
    """CP: splits the sequence (long-context runs)."""
    expert_parallel: int = 1
    """EP: splits the routed experts across ranks."""
    expert_tensor_parallel: int = 1
    """Expert TP: splits each expert's width."""
    sequence_parallel: bool | None = None
    """Megatron sequence parallelism; None means on exactly when TP > 1 (required by MoE)."""
    moe_token_dispatcher: str = "alltoall"
    """``alltoall`` or ``allgather`` token dispatch for MoE layers."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP ranks (ZeRO-1)."""
    recompute_activations: bool = False
    """Full-layer activation recompute (memory for time)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on one rank."""

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel * self.context_parallel)

    @property
    def effective_sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel


@dataclass
class OptimizerConfig:
    """Adam optimizer and schedule of one role."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""


@dataclass
class ActorConfig:
    """The policy model's role."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    bf16: bool = False
    """bf16 weights and compute (GPU runs); float32 otherwise."""


@dataclass
class CriticConfig:
    """The value model's role: same architecture as the actor with a scalar value head."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-6))
    bf16: bool = False
    """bf16 weights and compute (GPU runs); float32 otherwise."""
    init_from_actor: bool = True
    """Initialise the trunk from the actor's weights (paper: both from the SFT checkpoint)."""
    freeze_patterns: list[str] = field(default_factory=lambda: [r"\.self_attention\."])
    """Regexes over parameter names to freeze (paper: critic attention frozen)."""
    train_patterns: list[str] = field(default_factory=list)
    """Regexes that un-freeze parameters matched by ``freeze_patterns`` (applied after)."""
    value_head_init: str = "zero"
    """``zero`` or ``normal`` initialisation of the value head."""
    updates_per_step: int = 2
    """K: critic optimizer steps per actor step (paper: 2)."""


@dataclass
class AlgoConfig:
    """The RL algorithm: policy loss, advantages, batching and staleness (defaults: SAO)."""

    policy_loss: str = "dis"
    """``dis`` (SAO), ``ppo_clip`` or ``vanilla`` (GRPO baselines)."""
    eps_low: float = 0.3
    """DIS keeps ``1 - eps_low < rho``; PPO clips at ``1 - eps_low`` (paper, math: 0.3)."""
    eps_high: float = 5.0
    """DIS keeps ``rho < 1 + eps_high``; PPO clips at ``1 + eps_high`` (paper, math: 5.0)."""
    detach_ratio: bool = True
    """DIS weight as a stop-gradient (truncated IS); false gives the paper's literal formula."""
    loss_agg: str = "token_mean"
    """``token_mean`` over the global batch's action tokens or ``seq_mean``."""
    advantage: str = "gae"
    """``gae`` (token level), ``step_mean`` / ``step_last`` (turn level), ``grpo``, ``rloo``,
    ``running_mean_prompt`` or ``running_mean_global``."""
    gamma: float = 1.0
    lam: float = -1.0
    """Policy GAE lambda; a negative value selects length-adaptive ``1 - 1/(alpha * l)``."""
    lam_alpha: float = 1.5
    """alpha of length-adaptive lambda (VAPO; the paper uses 1.5)."""
    lam_critic: float = 1.0
    """Lambda of the critic's targets (decoupled GAE)."""
    whiten_advantages: bool = False
    """Normalise advantages over the batch (paper silent; off)."""
    grpo_std_normalize: bool = True
    running_mean_window: int = 8
    """Rewards per prompt (or globally) in running-mean baselines (paper ablation: 8)."""
    value_clip: float = 0.0
    """PPO-style value clipping range; 0 disables."""
    batch_size: int = 128
    """Trajectories per learner step (paper: 128)."""
    group_size: int = 1
    """Rollouts per prompt: 1 for SAO, G for GRPO (batch = batch_size / G prompts x G)."""
    max_policy_lag: int = 4
    """Drop trajectories whose oldest action token is more than this many versions old; -1: unbounded."""
    synchronous: bool = False
    """Batch barrier: rollouts of the next batch start only after the weight update (sync baseline)."""
    critic_warmup_steps: int = 10
    """Critic-only steps before the actor trains (paper: 10)."""


@dataclass
class RolloutConfig:
    """Environment, engines and the agent loop."""

    env: str = "arith_tool"
    """Registered environment name or ``package.module:Class``."""
    env_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the Env class (one instance per episode), e.g. ``max_turns``."""
    task_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the environment's Task (the prompt source), e.g. difficulty knobs."""
    num_engines: int = 1
    tensor_parallel: int = 1
    expert_parallel: int = 1
    dtype: str = "auto"
    """``float32`` on CPU (engine logprobs then match the trainer's); ``auto`` on GPU."""
    max_total_tokens: int = 32768
    max_concurrent: int = 64
    """Episodes in flight per manager."""
    max_turns: int = 4
    max_new_tokens: int = 64
    max_response_tokens: int = 512
    max_context_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    weight_sync: str = "distributed"
    """``distributed`` (broadcast group trainer rank 0 -> engines) or ``disk``."""
    weight_sync_bucket_mb: int = 512


@dataclass
class TrainConfig:
    """Stages and loop length."""

    sft_steps: int = 0
    """Supervised warm-start steps on demonstrations (0 skips the stage)."""
    sft_batch_size: int = 32
    """Demonstrations per SFT step."""
    sft_lr: float = 1e-3
    """Actor learning rate during SFT (RL then uses ``actor.optim.lr``)."""
    value_pretrain_steps: int = 0
    """Critic-only steps on rollouts of the frozen SFT policy (0 skips)."""
    value_pretrain_target_ev: float = 0.5
    """Stop value pretraining early once explained variance reaches this."""
    steps: int = 100
    """Learner steps of RL."""
    eval_every: int = 0
    eval_prompts: int = 64
    """Held-out prompts per evaluation."""
    eval_temperature: float = 0.0
    """Sampling temperature of evaluation episodes (0: greedy)."""
    save_every: int = 0
    """Checkpoint every n steps (0: only at the end)."""
    sample_trajectories: int = 4
    """Trajectories per step written as text to the run directory."""


@dataclass
class RunConfig:
    """Where and how a run executes."""

    name: str = "sao"
    """Run name; the run directory is ``<output_dir>/<name>-<timestamp>`` unless ``run_dir`` is set."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    run_dir: str = ""
    """Explicit run directory (resume uses it)."""
    seed: int = 1234
    """Seed of every RNG (torch, python, data order)."""
    backend: str = "auto"
    """torch.distributed backend: ``auto`` (nccl with CUDA, gloo otherwise), ``nccl`` or ``gloo``."""
    wandb_project: str = ""
    """Also log metrics to this Weights & Biases project (needs ``wandb`` installed); empty: off."""


@dataclass
class ClusterConfig:
    """Hardware and node placement of a run, read by ``sao submit`` (Slurm + Ray) and ``sao plan``.

    Node groups are disjoint and ordered actor, critic, rollout; the first actor node hosts the
    Ray head and the driver (``sao train``). See docs/launch.md."""

    gpus_per_node: int = 0
    """GPUs per node; 0 for CPU-only runs, where every role shares one node (laptop, CI)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB (H100: 80, H200: 141); ``sao plan`` rejects roles that do not fit."""
    actor_nodes: int = 0
    """Nodes of the actor group; 0 derives ceil(actor.parallel.world_size / gpus_per_node)."""
    critic_nodes: int = 0
    """Nodes of the critic group; 0 derives ceil(critic.parallel.world_size / gpus_per_node)."""
    rollout_nodes: int = 0
    """Nodes of the SGLang engines; 0 derives ceil(num_engines * rollout.tensor_parallel / gpus_per_node)."""
    engine_dp_attention: int = 1
    """Data-parallel attention ranks per SGLang engine (``--dp-size`` with ``--enable-dp-attention``;
    attention TP = rollout.tensor_parallel / this); 1 turns DP attention off."""
    engine_mem_fraction: float = 0.85
    """Share of GPU memory an SGLang engine takes for weights and KV cache (``--mem-fraction-static``)."""


@dataclass
class SAOConfig:
    """A whole run: model shape, roles and run settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


# --------------------------------------------------------------------------------------------
# Loading, overriding, validating
# --------------------------------------------------------------------------------------------
def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check ``value`` against a field annotation, converting int -> float where harmless."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}; write it as [a, b, ...]")
        return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return _build(annotation, value, key)
    if annotation is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}; quote it")
    raise ConfigError(f"{key}: unsupported field type {annotation!r}")


def _unknown_key(cls, key: str, name: str) -> ConfigError:
    known = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
    return ConfigError(f"unknown config key '{key}'; {hint}")


def _build(cls, values: dict[str, Any], prefix: str = "", base=None):
    """Instantiate ``cls`` from ``values`` on top of ``base`` (or the defaults)."""
    obj = base if base is not None else cls()
    hints = _field_types(cls)
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in hints:
            raise _unknown_key(cls, key, name)
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation) and isinstance(value, dict) and annotation is not dict:
            setattr(obj, name, _build(annotation, value, key, base=getattr(obj, name)))
        else:
            setattr(obj, name, _coerce(value, annotation, key))
    return obj


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as err:
        raise ConfigError(f"config file {path} not found; pass an existing YAML file") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML ({err.__class__.__name__}); fix the syntax") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values")
    return data


def resolve_model_file(name_or_path: str) -> Path:
    """``tiny_moe`` -> ``configs/models/tiny_moe.yaml``; a path is returned as is."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
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
    data = _read_yaml(run_file)
    model_spec = data.pop("model", "tiny_moe")
    model_overrides: dict[str, Any] = {}
    if isinstance(model_spec, dict):
        model_overrides = dict(model_spec)
        model_spec = model_overrides.pop("from", "tiny_moe")
    if not isinstance(model_spec, str):
        raise ConfigError(f"{run_file}: 'model' must be a model name, a path or a mapping with 'from'")
    try:
        cfg = SAOConfig()
        cfg.model = _build(ModelConfig, _read_yaml(resolve_model_file(model_spec)), "model")
        cfg.model = _build(ModelConfig, model_overrides, "model", base=cfg.model)
        cfg = _build(SAOConfig, data, base=cfg)
    except ConfigError as err:
        raise ConfigError(f"{run_file}: {err}") from None
    for text in overrides:
        try:
            keys, value = parse_override(text)
            if keys == ["model"] and isinstance(value, str):
                cfg.model = _build(ModelConfig, _read_yaml(resolve_model_file(value)), "model")
                continue
            cfg = _build(SAOConfig, _nest(keys, value), base=cfg)
        except ConfigError as err:
            raise ConfigError(f"override '{text}': {err}") from None
    validate(cfg)
    return cfg


def to_dict(cfg: SAOConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: SAOConfig, run_dir: str | Path) -> Path:
    """Write the resolved config as ``<run_dir>/config.yaml`` (loadable by :func:`load_config`)."""
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_dict(cfg)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_model(m: ModelConfig) -> None:
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
                 "vocab_size"):  # fmt: skip
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name} must be > 0 (got {getattr(m, name)}); set it in the model file")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={m.num_query_groups} must divide "
            f"model.num_attention_heads={m.num_attention_heads}; use one of {_divisors(m.num_attention_heads)}"
        )
    if m.num_experts < 0:
        raise ConfigError(f"model.num_experts must be >= 0 (got {m.num_experts}); use 0 for a dense model")
    if m.num_experts:
        if not 1 <= m.moe_router_topk <= m.num_experts:
            raise ConfigError(
                f"model.moe_router_topk={m.moe_router_topk} must be in [1, num_experts={m.num_experts}]"
            )
        if m.moe_ffn_hidden_size <= 0:
            raise ConfigError("model.moe_ffn_hidden_size must be > 0 for an MoE model; set the expert width")
    elif m.ffn_hidden_size <= 0:
        raise ConfigError("model.ffn_hidden_size must be > 0 for a dense model; set the MLP width")


def validate_parallel(p: ParallelConfig, m: ModelConfig, role: str) -> None:
    """Reject layouts Megatron would refuse, naming the key and the values that work."""
    tp, pp, cp, ep, etp = (p.tensor_parallel, p.pipeline_parallel, p.context_parallel,
                           p.expert_parallel, p.expert_tensor_parallel)  # fmt: skip
    for name, value in (("world_size", p.world_size), ("tensor_parallel", tp), ("pipeline_parallel", pp),
                        ("context_parallel", cp), ("expert_parallel", ep),
                        ("expert_tensor_parallel", etp), ("micro_batch_size", p.micro_batch_size)):  # fmt: skip
        if value < 1:
            raise ConfigError(f"{role}.parallel.{name} must be >= 1 (got {value})")
    key = f"{role}.parallel"
    if m.num_attention_heads % tp or m.num_query_groups % tp:
        options = [d for d in _divisors(m.num_query_groups) if m.num_attention_heads % d == 0]
        raise ConfigError(
            f"{key}.tensor_parallel={tp} does not divide model.num_attention_heads={m.num_attention_heads} "
            f"and model.num_query_groups={m.num_query_groups}; use one of {options}"
        )
    if m.vocab_size % tp:
        raise ConfigError(f"{key}.tensor_parallel={tp} does not divide model.vocab_size={m.vocab_size}; "
                          f"use one of {_divisors(m.vocab_size)[:8]} or pad the vocabulary")  # fmt: skip
    if m.num_layers % pp:
        raise ConfigError(f"{key}.pipeline_parallel={pp} does not divide model.num_layers={m.num_layers}; "
                          f"use one of {_divisors(m.num_layers)}")  # fmt: skip
    if p.world_size % (tp * pp * cp):
        raise ConfigError(f"{key}.world_size={p.world_size} is not a multiple of tensor_parallel*"
                          f"pipeline_parallel*context_parallel={tp * pp * cp}; change world_size or the layout")  # fmt: skip
    if m.num_experts:
        if m.num_experts % ep:
            raise ConfigError(f"{key}.expert_parallel={ep} does not divide model.num_experts={m.num_experts}; "
                              f"use one of {_divisors(m.num_experts)}")  # fmt: skip
        if (p.world_size // pp) % (ep * etp):
            raise ConfigError(f"{key}.expert_parallel*expert_tensor_parallel={ep * etp} must divide "
                              f"world_size/pipeline_parallel={p.world_size // pp}; lower expert_parallel")  # fmt: skip
        if tp > 1 and p.sequence_parallel is False:
            raise ConfigError(f"{key}.sequence_parallel=false with tensor_parallel={tp}: Megatron MoE "
                              "training needs sequence parallelism with TP > 1; set it true or null")  # fmt: skip
    elif ep > 1:
        raise ConfigError(f"{key}.expert_parallel={ep} but the model is dense (num_experts=0); set it to 1")
    if p.moe_token_dispatcher not in ("alltoall", "allgather"):
        raise ConfigError(f"{key}.moe_token_dispatcher='{p.moe_token_dispatcher}'; use alltoall or allgather")


def validate(cfg: SAOConfig) -> None:
    validate_model(cfg.model)
    validate_parallel(cfg.actor.parallel, cfg.model, "actor")
    validate_parallel(cfg.critic.parallel, cfg.model, "critic")
    if cfg.critic.value_head_init not in ("zero", "normal"):
        raise ConfigError(f"critic.value_head_init='{cfg.critic.value_head_init}'; use zero or normal")
    if cfg.critic.updates_per_step < 1:
        raise ConfigError(f"critic.updates_per_step={cfg.critic.updates_per_step}; K must be >= 1")
    if cfg.run.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"run.backend='{cfg.run.backend}'; use auto, gloo or nccl")
    for role in (cfg.actor, cfg.critic):
        if role.optim.lr < 0 or role.optim.clip_grad < 0:
            raise ConfigError("optim.lr and optim.clip_grad must be >= 0")
    for pattern in [*cfg.critic.freeze_patterns, *cfg.critic.train_patterns]:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(
                f"critic.freeze_patterns/train_patterns: bad regex {pattern!r} ({err})"
            ) from None
    validate_algo(cfg.algo)
    validate_rollout(cfg.rollout)
    validate_cluster(cfg)


_ADVANTAGES = ("gae", "step_mean", "step_last", "grpo", "rloo", "running_mean_prompt", "running_mean_global")


def validate_algo(a: AlgoConfig) -> None:
    if a.policy_loss not in ("dis", "ppo_clip", "vanilla"):
        raise ConfigError(f"algo.policy_loss='{a.policy_loss}'; use dis, ppo_clip or vanilla")
    if a.loss_agg not in ("token_mean", "seq_mean"):
        raise ConfigError(f"algo.loss_agg='{a.loss_agg}'; use token_mean or seq_mean")
    if a.advantage not in _ADVANTAGES:
        raise ConfigError(f"algo.advantage='{a.advantage}'; use one of {', '.join(_ADVANTAGES)}")
    if a.eps_low < 0 or a.eps_high < 0:
        raise ConfigError(f"algo.eps_low={a.eps_low}, eps_high={a.eps_high} must be >= 0")
    if not 0 <= a.gamma <= 1 or not 0 <= a.lam_critic <= 1 or a.lam > 1:
        raise ConfigError(
            "algo.gamma, algo.lam_critic must be in [0, 1] and algo.lam <= 1 (negative: adaptive)"
        )
    if a.batch_size < 1 or a.group_size < 1 or a.batch_size % a.group_size:
        raise ConfigError(f"algo.batch_size={a.batch_size} must be a positive multiple of "
                          f"algo.group_size={a.group_size}")  # fmt: skip
    if a.advantage in ("grpo", "rloo") and a.group_size < 2:
        raise ConfigError(f"algo.advantage={a.advantage} needs algo.group_size >= 2 (same-prompt groups)")
    if a.max_policy_lag < -1:
        raise ConfigError(f"algo.max_policy_lag={a.max_policy_lag}; use -1 (unbounded) or >= 0")


def validate_rollout(r: RolloutConfig) -> None:
    if r.weight_sync not in ("distributed", "disk"):
        raise ConfigError(f"rollout.weight_sync='{r.weight_sync}'; use distributed or disk")
    for name in ("num_engines", "max_concurrent", "max_turns", "max_new_tokens"):
        if getattr(r, name) < 1:
            raise ConfigError(f"rollout.{name} must be >= 1 (got {getattr(r, name)})")


def validate_cluster(cfg: SAOConfig) -> None:
    """Node groups must hold their role's GPUs; SGLang engines must tile whole nodes."""
    c, r = cfg.cluster, cfg.rollout
    for name in ("gpus_per_node", "actor_nodes", "critic_nodes", "rollout_nodes"):
        if getattr(c, name) < 0:
            raise ConfigError(f"cluster.{name} must be >= 0 (got {getattr(c, name)})")
    if c.gpu_memory_gb <= 0:
        raise ConfigError(f"cluster.gpu_memory_gb={c.gpu_memory_gb} must be > 0; e.g. 80 (H100), 141 (H200)")
    if not 0 < c.engine_mem_fraction < 1:
        raise ConfigError(f"cluster.engine_mem_fraction={c.engine_mem_fraction} must be in (0, 1), e.g. 0.85")
    if c.engine_dp_attention < 1 or r.tensor_parallel % c.engine_dp_attention:
        raise ConfigError(f"cluster.engine_dp_attention={c.engine_dp_attention} must divide "
                          f"rollout.tensor_parallel={r.tensor_parallel}; use 1 (off) or a divisor")  # fmt: skip
    g = c.gpus_per_node
    if not g:
        return
    if r.tensor_parallel % g and g % r.tensor_parallel:
        raise ConfigError(f"rollout.tensor_parallel={r.tensor_parallel} GPUs per engine must divide or be a "
                          f"multiple of cluster.gpus_per_node={g}; engines cannot straddle part nodes")  # fmt: skip
    for key, nodes, gpus in (("actor_nodes", c.actor_nodes, cfg.actor.parallel.world_size),
                             ("critic_nodes", c.critic_nodes, cfg.critic.parallel.world_size),
                             ("rollout_nodes", c.rollout_nodes, r.num_engines * r.tensor_parallel)):  # fmt: skip
        if nodes and nodes * g < gpus:
            raise ConfigError(f"cluster.{key}={nodes} x gpus_per_node={g} < {gpus} GPUs the role needs; set it "
                              f"to {-(-gpus // g)} or 0 (derived)")  # fmt: skip
