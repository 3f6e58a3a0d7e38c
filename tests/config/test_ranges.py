"""Every numeric setting of the schema is refused out of range, in one line naming its key.

The walker sets each ``int`` / ``float`` field of the schema's dataclasses (optional ones too) to
-1, and each float field to NaN and to +-infinity, through the ``key=value`` overrides of
:func:`load_config`; each must raise a :class:`ConfigError` whose message names the key. A value
that is meaningful for a field (its docstring says so) is listed in :data:`MEANINGFUL` with the
reason, and must then be accepted."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from sao_megatron.config import ConfigError, SAOConfig, load_config
from sao_megatron.config.ranges import RANGES

MEANINGFUL = {
    ("train.value_pretrain_target_ev", "-1"): "explained variance lies in (-inf, 1]: a target at or below the "
    "first step's stops value pretraining at once, one above 1 never stops it early",
}


def numeric_keys(cls: type = SAOConfig, prefix: str = "") -> list[tuple[str, type]]:
    """``(key, int or float)`` of every numeric field, from the annotations (unset optional ones included)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            out += numeric_keys(annotation, f"{prefix}{f.name}.")
            continue
        options = (
            typing.get_args(annotation)
            if typing.get_origin(annotation) in (typing.Union, types.UnionType)
            else (annotation,)
        )
        if float in options or int in options:
            out.append((f"{prefix}{f.name}", float if float in options else int))
    return out


CASES = [
    (key, value)
    for key, kind in numeric_keys()
    for value in (["-1", ".nan", ".inf", "-.inf"] if kind is float else ["-1"])
]


def test_the_walk_covers_the_schema():
    keys = {key for key, _ in numeric_keys()}
    assert len(keys) >= 140 and {"rollout.loop.temperature", "train.steps", "train.eval_every"} <= keys
    assert set(RANGES) <= keys  # no range of a field that is gone
    assert {key for key, _ in MEANINGFUL} <= keys


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_every_numeric_setting_out_of_range_is_refused_naming_its_key(key, value):
    if (key, value) in MEANINGFUL:
        load_config(overrides=[f"{key}={value}"])  # accepted: MEANINGFUL says why
        return
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"{key}={value}"])
    message = str(err.value)
    assert key in message and "\n" not in message, message


@pytest.mark.parametrize(
    "override",
    ["train.eval_every=0", "train.steps=0", "rollout.loop.temperature=0", "algo.value_clip=0", "train.sft_steps=0"],
)
def test_a_zero_documented_as_meaningful_is_accepted(override):
    load_config(overrides=[override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.loop.temperature=-1", "rollout.loop.temperature=-1.0 must be >= 0 (0: greedy); set it to e.g. 1.0"),
        ("train.steps=-5", "train.steps=-5 must be >= 0 (0: no RL step, the stages before it only); set it to e.g. 100"),
        ("rollout.loop.top_p=1.5", "rollout.loop.top_p=1.5 must be in (0, 1] (1 samples from the whole distribution); set it to e.g. 1.0"),
        ("actor.optim.lr=.nan", "actor.optim.lr=nan is not a finite number; set it to e.g. 1e-06"),
    ],
)  # fmt: skip
def test_the_message_names_the_key_the_range_and_a_fix(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert str(err.value) == message
