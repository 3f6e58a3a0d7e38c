"""One learner step: values -> advantages -> K critic updates || one actor update -> weight sync."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from sao_megatron.batch import TrainBatch, build_batch
from sao_megatron.driver.estimator import AdvantageEstimator
from sao_megatron.driver.session import Session
from sao_megatron.records import Trajectory


@dataclass
class StepOutcome:
    """What one learner step did (a record: the run's state is changed by its caller, ``StageRun.after_step``);
    :mod:`sao_megatron.driver.observer` turns it into metrics."""

    trajectories: list[Trajectory]
    batch: TrainBatch
    trained_from: int
    """The policy version the batch trained (token lag is measured against it)."""
    trained_actor: bool
    """The stage asked the actor to train (False in value pretraining and the critic warm-up)."""
    advantages: dict[str, float]
    """Estimator metrics."""
    values: torch.Tensor | None
    """``[B, T]`` critic values before its updates (None without a critic)."""
    returns: torch.Tensor | None
    """``[B, T]`` critic targets."""
    critic: dict[str, float] = field(default_factory=dict)
    actor: dict[str, float] = field(default_factory=dict)
    sync: dict[str, float] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    """Roles whose optimizer skipped the step (non-finite loss or gradient): ``actor``, ``critic``."""
    seconds: float = 0.0

    @property
    def actor_updated(self) -> bool:
        return self.trained_actor and "actor" not in self.skipped

    @property
    def version(self) -> int:
        """The policy version after the step: ``trained_from + 1`` when the actor's update applied."""
        return self.trained_from + int(self.actor_updated)


async def learner_step(
    s: Session, estimator: AdvantageEstimator, trajectories: list[Trajectory], version: int, train_actor: bool
) -> StepOutcome:
    """Train on one batch of policy ``version``. The critic's K updates run concurrently with the actor's
    update (separate worlds); the engines get the new weights as ``version + 1`` (every
    ``rollout.weight_sync_every`` versions: a delayed sync is a staleness knob for experiments). Returns
    what happened; the caller records the new version (:attr:`StepOutcome.version`)."""
    t0 = time.perf_counter()
    batch = build_batch(trajectories)
    critic, actor = s.critic, s.actor
    critic_batch = critic.place(batch) if critic else None
    values = None
    if critic and critic_batch is not None:
        values = await critic.values(critic_batch, batch.size, batch.tokens.shape[1])
    advantages, returns, adv_metrics = estimator(batch, values, trajectories)
    out = StepOutcome(trajectories, batch, version, train_actor, adv_metrics, values, returns)

    async def critic_updates() -> None:
        if critic is None or critic_batch is None or returns is None or values is None:
            return
        for _ in range(s.cfg.critic.updates_per_step):
            out.critic = await critic.update(critic_batch, returns, values)

    async def actor_update() -> None:
        if train_actor:
            out.actor = await actor.update(actor.place(batch), advantages, version)

    async with s.weights_lock:  # from the actor's update to the engines' sync: no engine restart between
        await asyncio.gather(critic_updates(), actor_update())
        out.skipped = [role for role, m in (("actor", out.actor), ("critic", out.critic)) if m.get("updated", 1) == 0]
        if out.actor_updated and out.version % s.cfg.rollout.weight_sync_every == 0:
            out.sync = await s.sync_weights(out.version)
    out.seconds = time.perf_counter() - t0
    return out


class TrainingDiverged(RuntimeError):
    """Too many consecutive learner steps had non-finite losses or gradients."""


async def run_whole[R](work: Coroutine[Any, Any, R]) -> tuple[R, bool]:
    """Run ``work`` to completion even if cancelled meanwhile; True when it was (a stop signal
    arrived): a learner step and its bookkeeping are never split."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task), False
    except asyncio.CancelledError:
        return await task, True
