"""The stages of ``sao train``: SFT on demonstrations, then value pretraining and RL as one loop.

Value pretraining is the RL loop with the actor frozen and its own stop rule (explained
variance reached); see :class:`Stage`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from sao_megatron.batch import build_batch
from sao_megatron.buffer import ReadyBuffer
from sao_megatron.config import ConfigError, SAOConfig
from sao_megatron.driver.demos import demonstration_trajectory
from sao_megatron.driver.estimator import AdvantageEstimator
from sao_megatron.driver.observer import StepObserver
from sao_megatron.driver.rollouts import RolloutSource
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.observe import RunLog
from sao_megatron.rollout.manager import PromptCursor, RolloutManager


@dataclass(frozen=True)
class Stage:
    """How one run of the learner loop differs between value pretraining and RL."""

    name: str
    steps: int
    trains_actor: Callable[[int], bool]
    """Whether the actor trains at a (0-based) step of the stage."""
    done: Callable[[dict[str, float]], bool]
    """Early stop rule on a step's metrics."""
    resumable: bool
    """Steps, cursor, buffer and baselines live in the run state and are checkpointed (RL)."""
    first_prompt: int
    """Prompt index the stage starts from when not resuming."""
    synchronous: bool
    eval_every: int
    save_every: int


def value_pretraining(cfg: SAOConfig) -> Stage:
    """Critic-only steps on rollouts of the frozen policy until explained variance is reached.

    Prompts come from far beyond the RL cursor, so the RL data stays unseen."""
    target = cfg.train.value_pretrain_target_ev
    return Stage(
        "value_pretrain",
        cfg.train.value_pretrain_steps,
        trains_actor=lambda step: False,
        done=lambda m: m.get("critic/explained_var", math.nan) >= target,  # NaN: never
        resumable=False,
        first_prompt=1 << 40,
        synchronous=False,
        eval_every=0,
        save_every=0,
    )


def rl(cfg: SAOConfig, has_critic: bool) -> Stage:
    """Asynchronous SAO (or a baseline): the actor trains after ``critic_warmup_steps`` critic-only steps."""
    warmup = cfg.algo.critic_warmup_steps if has_critic else 0
    return Stage(
        "rl",
        cfg.train.steps,
        trains_actor=lambda step: step >= warmup,
        done=lambda m: False,
        resumable=True,
        first_prompt=0,
        synchronous=cfg.algo.synchronous,
        eval_every=cfg.train.eval_every,
        save_every=cfg.train.save_every,
    )


def open_stage(
    s: Session,
    state: RunState,
    stage: Stage,
) -> tuple[AdvantageEstimator, ReadyBuffer, RolloutManager, RolloutSource, StepObserver]:
    """The estimator, buffer, manager, batch source and observer of one stage; a resumable stage
    continues from the run state (cursor, waiting trajectories, baselines)."""
    a = s.cfg.algo
    rows, prompts = s.task.size("train"), a.batch_size // a.group_size
    if rows is not None and rows < prompts:
        raise ConfigError(
            f"the train split has {rows} prompts but a batch takes {prompts} distinct ones (algo.batch_size="
            f"{a.batch_size} / algo.group_size={a.group_size}): add rows to data.train or lower algo.batch_size"
        )
    estimator, buffer = AdvantageEstimator(a), ReadyBuffer(a.batch_size, a.group_size, a.max_policy_lag)
    manager = s.manager(buffer, lambda: state.version, PromptCursor("train", stage.first_prompt))
    if stage.resumable and state.cursor:
        estimator.load_state_dict(state.advantages)
        buffer.load_state_dict(state.buffer)
        manager.load_state_dict(state.cursor)
    source = RolloutSource(manager, buffer, a.batch_size // a.group_size if stage.synchronous else None)
    return estimator, buffer, manager, source, StepObserver(manager, buffer, len(s.engines))


async def sft(s: Session, log: RunLog) -> None:
    """Supervised warm start on expert demonstrations of the train split (action tokens only)."""
    cfg, t = s.cfg, s.cfg.train
    if t.sft_steps <= 0:
        return
    rng = random.Random(cfg.run.seed)
    log.set_total("sft", t.sft_steps)
    await s.actor.set_lr(t.sft_lr)
    for step in range(1, t.sft_steps + 1):
        demos = [
            demonstration_trajectory(
                cfg.rollout.env,
                s.task,
                s.tokenizer,
                "train",
                rng.randrange(1 << 30),
                cfg.rollout.env_kwargs,
                enable_thinking=cfg.rollout.loop.enable_thinking,
            )
            for _ in range(t.sft_batch_size)
        ]
        metrics = await s.actor.sft_step(build_batch(demos))
        if step % 10 == 0 or step == t.sft_steps:
            log.log(step, "sft", {f"sft/{k}": v for k, v in metrics.items()})
    await s.actor.set_lr(cfg.actor.optim.lr)
