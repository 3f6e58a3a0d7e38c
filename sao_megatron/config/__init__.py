"""Configuration: nested dataclasses are the one source of truth for defaults.

A run is configured in three layers, each only overriding the one before:

1. the dataclass defaults (:mod:`sao_megatron.config.schema`, docstring under each field);
2. a YAML run file (``configs/*.yaml``); its ``model`` key names a model shape file
   (``configs/models/<name>.yaml`` or a path) and may override single shape fields;
3. command-line ``key.sub=value`` overrides (values parsed as YAML scalars/lists).

Unknown keys, wrong types, values outside a field's ``Literal`` choices, numbers that are not
finite or out of their range (:mod:`sao_megatron.config.ranges`) and inconsistent parallel layouts
raise :class:`ConfigError` with a one-line reason and the fix, before any process starts
(:mod:`sao_megatron.config.load`). The resolved config is written as ``config.yaml`` into every run
directory (:func:`save_config`).
"""

from sao_megatron.config.cluster import validate_cluster
from sao_megatron.config.load import (
    load_config,
    parse_override,
    resolve_model_file,
    save_config,
    to_dict,
    validate,
    validate_algo,
    validate_model,
    validate_parallel,
    validate_rollout,
)
from sao_megatron.config.schema import (
    CONFIG_DIR,
    DEFAULT_RUN_CONFIG,
    MODEL_CONFIG_DIR,
    REPO_ROOT,
    ActorConfig,
    AgentLoopConfig,
    AlgoConfig,
    Backend,
    ClusterConfig,
    ConfigError,
    CriticConfig,
    EngineDtype,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    SAOConfig,
    TokenDispatcher,
    TrainConfig,
    UpdatePolicy,
    ValueHeadInit,
    WeightSync,
)

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_RUN_CONFIG",
    "MODEL_CONFIG_DIR",
    "REPO_ROOT",
    "ActorConfig",
    "AgentLoopConfig",
    "AlgoConfig",
    "Backend",
    "ClusterConfig",
    "ConfigError",
    "CriticConfig",
    "EngineDtype",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RolloutConfig",
    "RunConfig",
    "SAOConfig",
    "TokenDispatcher",
    "TrainConfig",
    "UpdatePolicy",
    "ValueHeadInit",
    "WeightSync",
    "load_config",
    "parse_override",
    "resolve_model_file",
    "save_config",
    "to_dict",
    "validate",
    "validate_algo",
    "validate_cluster",
    "validate_model",
    "validate_parallel",
    "validate_rollout",
]
