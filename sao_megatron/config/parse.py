"""From YAML mappings to config dataclasses: type checks, coercion, and errors naming the key.

The lowest layer of :mod:`sao_megatron.config`: it imports only the schema, so both the run-file
loader (:mod:`~sao_megatron.config.load`) and the HF mapping (:mod:`~sao_megatron.config.hf`) build on it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from sao_megatron.config.schema import ConfigError


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _choices(options: tuple) -> str:
    return ", ".join(repr(o) for o in options)


def _describe(annotation: Any) -> str:
    """What a value of ``annotation`` looks like, for error messages."""
    if typing.get_origin(annotation) is typing.Literal:
        options = typing.get_args(annotation)
        return repr(options[0]) if len(options) == 1 else f"one of {_choices(options)}"
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a mapping",
        type(None): "null",
    }
    if annotation in names:
        return names[annotation]
    return "a list" if typing.get_origin(annotation) is list else getattr(annotation, "__name__", str(annotation))


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
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{key}: expected {' or '.join(map(_describe, options))}, got {value!r}")
    if origin is typing.Literal:
        options = typing.get_args(annotation)
        if isinstance(value, bool) and {"on", "off"} <= set(options):
            value = "on" if value else "off"  # YAML 1.1 reads on/off (and yes/no, true/false) as booleans
        if any(value == o and type(value) is type(o) for o in options):
            return value
        raise ConfigError(f"{key}: {value!r} is not one of {_choices(options)}")
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}; write it as [a, b, ...]")
        return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return build(annotation, value, key)
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
    for sub, annotation in _field_types(cls).items():  # a key that lives one section down, e.g. rollout.loop
        if dataclasses.is_dataclass(annotation) and name in _field_types(annotation):
            return ConfigError(f"unknown config key '{key}'; it is '{key[: -len(name)]}{sub}.{name}'")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
    return ConfigError(f"unknown config key '{key}'; {hint}")


def build(cls, values: dict[str, Any], prefix: str = "", base=None):
    """Instantiate ``cls`` from ``values`` on top of ``base`` (or the defaults)."""
    obj = base if base is not None else cls()
    hints = _field_types(cls)
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in hints:
            raise _unknown_key(cls, key, name)
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation) and isinstance(value, dict) and annotation is not dict:
            setattr(obj, name, build(annotation, value, key, base=getattr(obj, name)))
        else:
            setattr(obj, name, _coerce(value, annotation, key))
    return obj


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        hint = "" if path.suffix in (".yaml", ".yml") else " (an override is written key=value)"
        raise ConfigError(f"config file {path} not found; pass an existing YAML file{hint}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or err.__class__.__name__
        context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and start is not None and (start.line, start.column) != (mark and (mark.line, mark.column)):
            problem += f"; {context} started at line {start.line + 1}"  # e.g. an unclosed '{' or '['
        raise ConfigError(f"{where}: invalid YAML ({problem}); fix the syntax there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values")
    return data
