"""The stages of ``sao train``: SFT on demonstrations, then value pretraining and RL as one loop.

Value pretraining is the RL loop with the actor frozen and its own stop rule (explained
variance reached, over every action token or at the first, over a window of steps); see :class:`Stage`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sao_megatron.batch import build_batch
from sao_megatron.buffer import ReadyBuffer
from sao_megatron.config import ConfigError, SAOConfig
from sao_megatron.driver.demos import demonstration_trajectory
from sao_megatron.driver.estimator import AdvantageEstimator
from sao_megatron.driver.learner import StepOutcome, TrainingDiverged
from sao_megatron.driver.observer import StepObserver
from sao_megatron.driver.rollouts import RolloutSource
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.faults import kill_point
from sao_megatron.observe import RunLog
from sao_megatron.records import Trajectory
from sao_megatron.rollout.manager import PromptCursor, RolloutManager

log = logging.getLogger(__name__)


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

    The stop watches ``train.value_pretrain_stop_on`` averaged over the last
    ``train.value_pretrain_stop_window`` steps; prompts come from far beyond the RL cursor, so the
    RL data stays unseen."""
    t = cfg.train
    key, recent = f"critic/{t.value_pretrain_stop_on}", deque(maxlen=t.value_pretrain_stop_window)

    def done(metrics: dict[str, float]) -> bool:
        recent.append(metrics.get(key, math.nan))
        return len(recent) == recent.maxlen and sum(recent) / len(recent) >= t.value_pretrain_target_ev  # NaN: never

    return Stage(
        "value_pretrain",
        t.value_pretrain_steps,
        trains_actor=lambda step: False,
        done=done,
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


@dataclass(frozen=True)
class TakenBatch:
    """A batch as the learner took it from the buffer."""

    trajectories: list[Trajectory]
    waited_s: float
    """How long the learner waited for it."""
    in_flight: int
    """Episodes in flight when it was taken."""
    taken_at: float
    """When it was taken (``time.time()``)."""


class StageRun:
    """One stage's loop state: estimator, buffer, rollout manager, batch source, observer and step count.

    A resumable stage (RL) continues from the run state (cursor, waiting trajectories, baselines) and
    records its steps, trained prompts and policy version there: :class:`RunState` is the one owner of
    the trained policy version (``state.version``); the session owns the version the engines serve."""

    def __init__(self, s: Session, state: RunState, log: RunLog, stage: Stage):
        a = s.cfg.algo
        rows, prompts = s.task.size("train"), a.batch_size // a.group_size
        if rows is not None and rows < prompts:
            raise ConfigError(
                f"the train split has {rows} prompts but a batch takes {prompts} distinct ones (algo.batch_size="
                f"{a.batch_size} / algo.group_size={a.group_size}): add rows to data.train or lower algo.batch_size"
            )
        self.s, self.state, self.log, self.stage = s, state, log, stage
        self.estimator = AdvantageEstimator(a)
        budget = s.cfg.rollout.loop.max_response_tokens
        self.buffer = ReadyBuffer(a.batch_size, a.group_size, a.max_policy_lag, budget, a.over_lag, a.batch_order)
        self.manager = s.manager(self.buffer, lambda: state.version, PromptCursor("train", stage.first_prompt))
        if stage.resumable and state.cursor:
            self.estimator.load_state_dict(state.advantages)
            self.buffer.load_state_dict(state.buffer)
            self.manager.load_state_dict(state.cursor)
        self.source = RolloutSource(self.manager, self.buffer, prompts if stage.synchronous else None)
        self.observer = StepObserver(self.manager, self.buffer, len(s.engines))
        self.step = self.first = state.step if stage.resumable else 0
        self.warned_surplus = False
        self.skipped_in_a_row = 0
        log.set_total(stage.name, stage.steps)
        self._allow()
        self.source.start()

    def _allow(self) -> None:
        """Flow control: the engines at most ``algo.max_batches_ahead`` batches ahead of the learner."""
        ahead = self.s.cfg.algo.max_batches_ahead
        if ahead is not None and not self.stage.synchronous:
            self.manager.allow((self.step - self.first + ahead) * self.s.cfg.algo.batch_size)

    def trains_actor(self) -> bool:
        return self.stage.trains_actor(self.step)

    async def next_batch(self) -> TakenBatch:
        t0 = time.perf_counter()
        trajectories = await self.source.next_batch()
        return TakenBatch(trajectories, time.perf_counter() - t0, self.manager.in_flight, time.time())

    async def after_step(self, outcome: StepOutcome, taken: TakenBatch) -> dict[str, float]:
        """Record a learner step (policy version, step, trained prompts), check the run still trains,
        then log, evaluate and checkpoint as configured. Returns the step's metrics."""
        state, stage = self.state, self.stage
        state.version = outcome.version  # before any await: an engine restart syncs the trained version
        self.step += 1
        self.buffer.discard_stale(state.version)
        metrics = self.observer.step(outcome, taken.waited_s, taken.in_flight, taken.taken_at)
        if stage.resumable:
            state.step = self.step
            state.trained_prompts += [
                [self.step, t.split, t.sample_index, t.reward_details.get("group_index", 0)] for t in taken.trajectories
            ]
        self._check_skipped(outcome)  # the step is recorded whole, then the run may stop
        self._warn_surplus()
        if stage.eval_every and self.step % stage.eval_every == 0:
            metrics |= await evaluate_paused(self.s, self.manager, state.version)
        self.log.log(self.step, stage.name, metrics)
        self.log.samples(self.step, taken.trajectories, self.s.tokenizer, self.s.cfg.train.sample_trajectories)
        if stage.resumable:
            kill_point("rl:after_update")  # trained, synced and logged; not yet checkpointed
        if stage.save_every and self.step % stage.save_every == 0:
            await self.checkpoint()
        self._allow()
        return metrics

    def _warn_surplus(self) -> None:
        """Once a run: the engines, uncapped, have generated more episodes that the lag bound dropped
        than the learner trained (engine time wasted, and the data cursor running ahead of the steps)."""
        a = self.s.cfg.algo
        trained, dropped = self.buffer.stats.handed_out, self.buffer.stats.dropped_stale  # both kept across a resume
        if self.warned_surplus or a.max_batches_ahead is not None or self.stage.synchronous or dropped <= trained:
            return
        self.warned_surplus = True
        log.warning(
            "%s: the engines ran ahead of the learner: %d episodes dropped as stale (algo.max_policy_lag=%s) "
            "against %d trained by step %d. algo.max_batches_ahead=N starts episodes at most N batches "
            "ahead: no engine time on episodes that will be dropped, fresher trajectories, and prompt "
            "indices that follow the steps (a task keyed to them, such as arith_tool's reward phases, then "
            "switches at a known step; rollout/prompt_index shows where a run is)",
            self.stage.name,
            dropped,
            a.max_policy_lag,
            trained,
            self.step,
        )

    def _check_skipped(self, outcome: StepOutcome) -> None:
        """Count steps in a row that skipped an update (non-finite loss or gradient); stop the run at
        ``train.max_skipped_steps``."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if outcome.skipped else 0
        if not outcome.skipped:
            return
        ids = sorted({t.prompt_id for t in outcome.trajectories})
        log.warning(
            "step at version %d: %s update skipped (non-finite loss or gradient, %d in a row); trajectories %s",
            outcome.trained_from,
            " and ".join(outcome.skipped),
            self.skipped_in_a_row,
            ids,
        )
        limit = self.s.cfg.train.max_skipped_steps
        if self.skipped_in_a_row >= limit:
            raise TrainingDiverged(
                f"{self.skipped_in_a_row} steps in a row skipped an update for non-finite losses or gradients "
                f"(train.max_skipped_steps={limit}); last batch's trajectories {ids[:8]}. Lower the learning "
                "rate or inspect those trajectories (sao report shows samples); resume from the last checkpoint"
            )

    async def checkpoint(self) -> None:
        await self.s.checkpoint(self.state, self.manager, self.buffer, self.estimator)

    async def close(self) -> None:
        """Stop submitting; a resumable stage records the episodes in flight for resubmission (checkpoint)
        before they are cancelled."""
        self.source.stop()
        try:
            if self.stage.resumable:
                await self.checkpoint()
        finally:
            await self.source.close()


async def evaluate_paused(s: Session, manager: RolloutManager, version: int) -> dict[str, float]:
    """Evaluate policy ``version`` without distorting the lag distribution: no new training episode
    starts meanwhile (the ones in flight finish, at most ``rollout.max_concurrent``, as many as in any
    step), so the learner's stall does not pile up batches of one old version; engines a delayed sync
    left behind (``rollout.weight_sync_every``) get the actor's weights first. ``time/eval_s`` is the
    stall."""
    t0 = time.perf_counter()
    manager.pause()
    try:
        if s.served_version != version:
            async with s.weights_lock:
                await s.sync_weights(version)
        metrics = await s.evaluate()
    finally:
        manager.resume()
    return metrics | {"time/eval_s": time.perf_counter() - t0}


async def final_evaluation(s: Session, state: RunState, log: RunLog, last: dict[str, float]) -> dict | None:
    """The run's closing evaluation: the initial one when nothing trained (``train.steps=0``: a shared
    start), the last step's when it evaluated (``train.eval_every`` divides ``train.steps``), else a new one."""
    if state.step == 0 and state.version == 0:
        return state.initial_eval
    if "eval/accuracy" in last:
        return {k: v for k, v in last.items() if k.startswith("eval/")}
    metrics = await s.evaluate()
    if metrics:
        log.log(state.step, "eval", metrics)
    return metrics


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
