"""The named choices of the algorithm, as ``typing.Literal`` types: one list per choice.

The same types annotate the config fields (``sao_megatron.config``: the loader rejects any other
value, naming the allowed ones) and the algo functions that dispatch on them; the tuples below are
derived from the types, never written out twice. Standard library only.
"""

from __future__ import annotations

from typing import Literal, get_args

PolicyLossName = Literal["dis", "ppo_clip", "vanilla"]
"""``dis``: direct double-sided importance sampling (SAO); ``ppo_clip``; ``vanilla`` policy gradient."""

LossAgg = Literal["token_mean", "seq_mean"]
"""How per-token losses are averaged: over the batch's action tokens, or per trajectory then over them."""

StepMode = Literal["step_mean", "step_last"]
"""Turn value of step-level GAE: the mean of the turn's action-token values, or its last one."""

AdvantageName = Literal["gae", "step_mean", "step_last", "grpo", "rloo", "running_mean_prompt", "running_mean_global"]
"""``gae`` (token level), ``step_mean`` / ``step_last`` (turn level, see :data:`StepMode`), ``grpo``,
``rloo``, ``running_mean_prompt`` or ``running_mean_global`` (running-mean reward baselines)."""

OverLag = Literal["drop", "mask"]
"""A trajectory past the lag bound: ``drop`` it (its oldest action token is too old), or ``mask``: keep
it while its newest action token is within the bound, its older tokens carrying no policy gradient."""

BatchOrder = Literal["finish", "start"]
"""Which waiting trajectories a batch takes first: the first to ``finish`` (SAO: no barrier), or the
first to have ``start``ed (an age-aware order: long episodes train before they pass the lag bound)."""

Truncation = Literal["terminal", "bootstrap"]
"""An episode cut by a limit (turns, context, token budgets): ``terminal``, its last action token's
target is the episode's reward as if it had ended; ``bootstrap``, the critic's value at the cut instead."""

POLICY_LOSSES: tuple[PolicyLossName, ...] = get_args(PolicyLossName)
AGG_MODES: tuple[LossAgg, ...] = get_args(LossAgg)
STEP_MODES: tuple[StepMode, ...] = get_args(StepMode)
ADVANTAGE_ESTIMATORS: tuple[AdvantageName, ...] = get_args(AdvantageName)
OVER_LAG: tuple[OverLag, ...] = get_args(OverLag)
BATCH_ORDERS: tuple[BatchOrder, ...] = get_args(BatchOrder)
TRUNCATIONS: tuple[Truncation, ...] = get_args(Truncation)

CRITIC_ESTIMATORS: tuple[AdvantageName, ...] = ("gae", *STEP_MODES)
"""The estimators that bootstrap from a learned value function (the others need no critic)."""

GROUP_ESTIMATORS: tuple[AdvantageName, ...] = ("grpo", "rloo")
"""The estimators that compare rollouts of the same prompt (they need ``group_size >= 2``)."""


def uses_critic(estimator: str) -> bool:
    """Whether advantage estimator ``estimator`` needs a critic (value model): GAE, token or step level."""
    return estimator in CRITIC_ESTIMATORS
