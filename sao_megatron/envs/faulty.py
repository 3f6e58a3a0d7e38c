"""faulty: ``arith_tool`` with faults injected at set rates, to test that failures stay contained.

Each episode draws at most one fault, deterministically from its prompt id and ``seed``
(:func:`injected_fault`; nothing is recorded anywhere, so a test recomputes the expected faults
with the same function)::

    fault          where                        the episode's status_reason
    hang           first astep: sleeps hang_s   environment: tool timed out after Xs (rollout.loop.env_step_timeout_s)
    raise_reset    areset raises                environment: RuntimeError: injected fault ...
    raise_step     first astep raises           environment: RuntimeError: injected fault ...
    reward_raise   areward raises               reward: RuntimeError: injected fault ...
    nan            areward returns NaN          reward: non-finite reward nan

``raise_rate`` is split between ``raise_reset`` and ``raise_step`` (by another bit of the same
hash). Without a fault the episode is an ordinary ``arith_tool`` one (the remaining env kwargs go
to :class:`~sao_megatron.envs.arith_tool.ArithToolEnv`; the task is ``arith_tool``'s, with its
``task_kwargs``). The hang is an ``await`` (it yields the event loop), so the agent loop's
``rollout.loop.env_step_timeout_s`` ends it; the sync ``step`` never hangs.

Use: ``rollout.env=faulty rollout.env_kwargs={hang_rate: 0.1, raise_rate: 0.1, ...}``; env workers
load it by name or as ``sao_megatron.envs.faulty:FaultyArithEnv``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Literal

from sao_megatron.envs.arith_tool import ArithToolEnv
from sao_megatron.envs.base import RewardResult, Sample, StepResult
from sao_megatron.envs.registry import register_env

Fault = Literal["hang", "raise_reset", "raise_step", "reward_raise", "nan"]

RATES: tuple[str, ...] = ("hang_rate", "raise_rate", "reward_raise_rate", "nan_rate")
"""The env kwargs (and :func:`injected_fault` ``rates`` keys) of the four kinds of fault, in the
order their intervals are laid out on [0, 1)."""

CAUSE: dict[str, str] = {
    "hang": "environment",
    "raise_reset": "environment",
    "raise_step": "environment",
    "reward_raise": "reward",
    "nan": "reward",
}
"""The failure cause (``status_reason`` prefix, ``buffer/dropped_failed/<cause>``) of each fault."""


def _check_rates(rates: Mapping[str, float]) -> list[float]:
    values = [float(rates.get(name, 0.0)) for name in RATES]
    if any(not 0.0 <= v <= 1.0 for v in values) or sum(values) > 1.0:
        raise ValueError(
            f"faulty: rates {dict(zip(RATES, values, strict=True))} must each be in [0, 1] and sum to at most 1"
        )
    return values


def injected_fault(prompt_id: str, seed: int, rates: Mapping[str, float]) -> Fault | None:
    """The fault episode ``prompt_id`` gets under ``seed`` and ``rates`` (keys of :data:`RATES`,
    missing ones 0; other keys ignored, so an env kwargs dict can be passed as is), or None.

    A SHA-256 of ``seed`` and ``prompt_id`` gives a uniform draw ``u``; the rates are consecutive
    intervals of [0, 1), and ``u`` falls in at most one."""
    values = _check_rates(rates)
    digest = hashlib.sha256(f"faulty:{seed}:{prompt_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    edge = 0.0
    for name, rate in zip(RATES, values, strict=True):
        edge += rate
        if u < edge:
            if name == "hang_rate":
                return "hang"
            if name == "raise_rate":
                return "raise_reset" if digest[8] % 2 == 0 else "raise_step"
            return "reward_raise" if name == "reward_raise_rate" else "nan"
    return None


class InjectedFault(RuntimeError):
    """What the faulty environment raises (``RuntimeError`` in the failure reason)."""


@register_env("faulty")
class FaultyArithEnv(ArithToolEnv):
    """``arith_tool`` whose episodes fail as :func:`injected_fault` decides (see the module docstring).

    Args:
        hang_rate / raise_rate / reward_raise_rate / nan_rate: share of episodes with each fault.
        seed: the fault draw's seed (independent of the task's).
        hang_s: how long a hanging tool call sleeps.
        **arith_kwargs: :class:`ArithToolEnv`'s (``max_turns``, ...).
    """

    def __init__(
        self,
        hang_rate: float = 0.0,
        raise_rate: float = 0.0,
        reward_raise_rate: float = 0.0,
        nan_rate: float = 0.0,
        seed: int = 0,
        hang_s: float = 1e6,
        **arith_kwargs,
    ) -> None:
        super().__init__(**arith_kwargs)
        self.rates = dict(zip(RATES, (hang_rate, raise_rate, reward_raise_rate, nan_rate), strict=True))
        _check_rates(self.rates)
        self.seed = seed
        self.hang_s = hang_s
        self.fault: Fault | None = None

    def reset(self, sample: Sample) -> str:
        self.fault = injected_fault(sample.prompt_id, self.seed, self.rates)
        if self.fault == "raise_reset":
            raise InjectedFault(f"injected fault in reset of {sample.prompt_id}")
        return super().reset(sample)

    def _step_fault(self) -> None:
        if self.fault == "raise_step" and self.turns == 0:
            raise InjectedFault(f"injected fault in the tool call of {self.sample and self.sample.prompt_id}")

    def step(self, action: str) -> StepResult:
        self._step_fault()
        return super().step(action)

    async def astep(self, action: str) -> StepResult:
        if self.fault == "hang" and self.turns == 0:
            await asyncio.sleep(self.hang_s)
        self._step_fault()
        return await super().astep(action)

    def reward(self) -> RewardResult:
        result = super().reward()
        if self.fault == "reward_raise":
            raise InjectedFault(f"injected fault in the reward of {self.sample and self.sample.prompt_id}")
        if self.fault == "nan":
            return RewardResult(float("nan"), result.correct, result.details)
        return result
