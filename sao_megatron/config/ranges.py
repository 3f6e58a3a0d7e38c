"""Every numeric setting finite, and in range where no other check states its range.

:func:`check_ranges` walks the config's dataclasses: each ``int`` or ``float`` field (optional ones
when set) must be a finite number (``NaN`` passes no comparison, and no setting means infinity), and
the fields of :data:`RANGES` must lie in their range. The other numeric fields have their range
checked with the fields it depends on (:func:`sao_megatron.config.load.validate`, ``shape.py``,
``cluster.py``); tests/config/test_ranges.py walks every numeric field with an out-of-range value,
so a new field needs a range here or there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sao_megatron.config.schema import ConfigError


@dataclass(frozen=True)
class Range:
    """``low <= value`` (``<`` when ``low_open``), and ``value <= high`` when ``high`` is set (``<``
    when ``high_open``); ``meaning``: what a boundary value does, for the message."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        if self.high is None:
            return above
        return above and (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        low = f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is None:
            return f"must be {low}"
        return f"must be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


POSITIVE = Range(0, low_open=True)
AT_LEAST_ONE = Range(1)

RANGES: dict[str, Range] = {
    "model.ffn_hidden_size": Range(0, meaning="0: no dense MLP, every layer MoE"),
    "model.moe_layer_freq": AT_LEAST_ONE,
    "model.moe_aux_loss_coeff": Range(0, meaning="0 turns it off"),
    "model.max_position_embeddings": AT_LEAST_ONE,
    "model.rope_theta": POSITIVE,
    "model.yarn_beta_fast": POSITIVE,
    "model.yarn_beta_slow": POSITIVE,
    "model.yarn_mscale": Range(0),
    "model.yarn_mscale_all_dim": Range(0, meaning="0 turns it off"),
    "model.norm_epsilon": POSITIVE,
    **{
        f"{role}.optim.{key}": bound
        for role in ("actor", "critic")
        for key, bound in (
            ("min_lr", Range(0)),
            ("warmup_steps", Range(0, meaning="0: no warm-up")),
            ("weight_decay", Range(0, meaning="0 turns it off")),
            ("adam_beta1", Range(0, 1, high_open=True)),
            ("adam_beta2", Range(0, 1, high_open=True)),
            ("adam_eps", POSITIVE),
        )
    },
    "algo.lam_alpha": POSITIVE,
    "algo.running_mean_window": AT_LEAST_ONE,
    "algo.value_clip": Range(0, meaning="0 turns clipping off"),
    "algo.critic_warmup_steps": Range(0, meaning="0: the actor trains from the first step"),
    "rollout.tensor_parallel": AT_LEAST_ONE,
    "rollout.expert_parallel": AT_LEAST_ONE,
    "rollout.max_total_tokens": AT_LEAST_ONE,
    "rollout.loop.max_response_tokens": AT_LEAST_ONE,
    "rollout.loop.max_context_tokens": AT_LEAST_ONE,
    "rollout.loop.temperature": Range(0, meaning="0: greedy"),
    "rollout.loop.top_p": Range(0, 1, low_open=True, meaning="1 samples from the whole distribution"),
    "rollout.weight_sync_gb_per_s": POSITIVE,
    "rollout.engine_restart_window_steps": Range(0, meaning="0: the whole run, the restart budget never refills"),
    "train.sft_steps": Range(0, meaning="0 skips SFT"),
    "train.sft_batch_size": AT_LEAST_ONE,
    "train.sft_lr": Range(0),
    "train.value_pretrain_steps": Range(0, meaning="0 skips value pretraining"),
    "train.steps": Range(0, meaning="0: no RL step, the stages before it only"),
    "train.eval_every": Range(0, meaning="0: evaluate only before the first step and after the last"),
    "train.eval_temperature": Range(0, meaning="0: greedy"),
    "train.eval_sample_temperature": Range(0, meaning="0: greedy"),
    "train.save_every": Range(0, meaning="0: a checkpoint only at the end"),
    "train.sample_trajectories": Range(0, meaning="0 writes none"),
    "data.seed": Range(0),
    "run.seed": Range(0),
    "cluster.placement_timeout_s": POSITIVE,
}
"""Ranges of the numeric fields whose range no other check states."""


def numeric_fields(cfg: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """``(key, value)`` of every set ``int`` / ``float`` field under ``cfg`` (booleans are not numbers)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from numeric_fields(value, key + ".")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield key, value


def check_ranges(cfg: Any, defaults: Any) -> None:
    """Every numeric field of ``cfg`` finite and in its :data:`RANGES` range, or a :class:`ConfigError`
    naming the key and, where it is a valid value, suggesting ``defaults``' value for it."""
    default = dict(numeric_fields(defaults))
    for key, value in numeric_fields(cfg):
        bound = RANGES.get(key)
        if math.isfinite(value) and (bound is None or bound.holds(value)):
            continue
        suggestion = default.get(key, math.nan)
        valid = math.isfinite(suggestion) and (bound is None or bound.holds(suggestion))
        fix = f"; set it to e.g. {suggestion}" if valid else ""
        if bound is None or not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number{fix}")
        meaning = f" ({bound.meaning})" if bound.meaning else ""
        raise ConfigError(f"{key}={value} {bound.describe()}{meaning}{fix}")
