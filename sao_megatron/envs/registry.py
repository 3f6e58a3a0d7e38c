"""Name -> environment class registry, plus loading a user's class from ``package.module:ClassName``.

Built-in environments are listed by dotted path and imported on first use, so importing
``sao_megatron.envs`` imports none of them (and nothing registers itself at import time unless
a user module applies :func:`register_env`). The registry dict is the package's only global
mutable state.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sao_megatron.envs.base import Env, Task

if TYPE_CHECKING:
    from sao_megatron.config.schema import DataConfig

_REGISTRY: dict[str, type[Env] | str] = {
    "arith_tool": "sao_megatron.envs.arith_tool:ArithToolEnv",
    "faulty": "sao_megatron.envs.faulty:FaultyArithEnv",
    "longtail": "sao_megatron.envs.longtail:LongTailEnv",
    "math_python": "sao_megatron.envs.math_python:MathPythonEnv",
    "openai_agent": "sao_megatron.envs.openai_agent:OpenAIAgentEnv",
    "swe": "sao_megatron.envs.swe.env:SWEEnv",
    "writing_shift": "sao_megatron.envs.writing_shift:WritingShiftEnv",
}

_HOW = (
    "use a registered name ({names}) or 'package.module:ClassName' where the module is importable "
    "(on PYTHONPATH) and ClassName is a subclass of sao_megatron.envs.Env"
)


def register_env[E: Env](name: str) -> Callable[[type[E]], type[E]]:
    """Class decorator: make ``make_env(name)`` build this Env subclass."""

    def deco(cls: type[E]) -> type[E]:
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise TypeError(f"register_env({name!r}) needs an Env subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls and _path_of(cls) != existing:
            raise ValueError(f"environment name {name!r} is already registered to {existing!r}")
        _REGISTRY[name] = cls
        return cls

    return deco


def _path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def list_envs() -> list[str]:
    """Registered environment names."""
    return sorted(_REGISTRY)


def _load_path(path: str) -> type[Env]:
    how = _HOW.format(names=", ".join(list_envs()))
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"cannot load environment {path!r}: not a registered name nor a dotted path; {how}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot load environment {path!r}: importing {module_name!r} failed ({exc}); {how}") from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"cannot load environment {path!r}: {module_name!r} has no attribute {attr!r}; {how}")
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise ValueError(f"cannot load environment {path!r}: {obj!r} is not an Env subclass; {how}")
    return obj


def resolve_env(name_or_path: str) -> type[Env]:
    """The Env class for a registered name or a ``package.module:ClassName`` path."""
    entry = _REGISTRY.get(name_or_path, name_or_path)
    return entry if isinstance(entry, type) else _load_path(entry)


def make_env(name_or_path: str, **kwargs: Any) -> Env:
    """A fresh Env instance (one episode) built with ``kwargs``; ValueError names the fix."""
    return resolve_env(name_or_path)(**kwargs)


def make_task(name_or_path: str, *, dataset: DataConfig | None = None, **kwargs: Any) -> Task:
    """The prompt source: the Env's ``task_class`` built with ``kwargs``, or, when ``dataset.train``
    is set, a :class:`~sao_megatron.envs.dataset.DatasetTask` over its files (``kwargs`` unused)."""
    cls = resolve_env(name_or_path)
    if dataset is not None and dataset.train:
        from sao_megatron.envs.dataset import DatasetTask

        return DatasetTask(dataset)
    task_class = getattr(cls, "task_class", None)
    if not (isinstance(task_class, type) and issubclass(task_class, Task)):
        raise ValueError(f"environment {name_or_path!r} defines no task_class (a Task subclass); set one")
    return task_class(**kwargs)
