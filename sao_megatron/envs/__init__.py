"""Environments: the plugin interface, the registry and the chat/tool text format.

Importing this package imports no environment implementation (they load on first use by
name); see ``docs/envs.md``.
"""

from sao_megatron.envs.base import SPLITS, Env, RewardResult, Sample, Split, StepResult, Task
from sao_megatron.envs.registry import list_envs, make_env, make_task, register_env, resolve_env

__all__ = [
    "SPLITS",
    "Env",
    "RewardResult",
    "Sample",
    "Split",
    "StepResult",
    "Task",
    "list_envs",
    "make_env",
    "make_task",
    "register_env",
    "resolve_env",
]
