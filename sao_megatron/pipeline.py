"""The SAO training loop: asynchronous single rollouts, learned critic, DIS, weight sync.

    task cursor --prompt--> RolloutManager (many episodes in flight on SGLang engines)
                                 | finished trajectory (tokens, behavior logprobs, versions)
                                 v
                            ReadyBuffer (lag bound, drop accounting; B distinct prompts)
                                 | batch (no barrier: whatever finished first)
                                 v
      critic.values --> GAE (skip-observation, length-adaptive lambda) --> advantages, returns
         |                                                  |
      critic.update x K (frozen attention)          actor.update (DIS)      (concurrently)
                                                            |
                                     weight sync to engines, policy_version += 1

``algo.synchronous`` adds a batch barrier (exactly one batch of prompts per step, submitted
after the previous weight update): the synchronous baseline of the same loop. Before RL: SFT
on demonstrations, and value pretraining, which is this loop with the actor frozen.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from sao_megatron.config import SAOConfig, save_config, to_dict
from sao_megatron.driver.learner import learner_step, run_whole
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.driver.stages import Stage, open_stage, rl, sft, value_pretraining
from sao_megatron.faults import kill_point
from sao_megatron.observe import RunLog
from sao_megatron.records import Trajectory
from sao_megatron.rollout.manager import RolloutManager


async def run_stage(s: Session, state: RunState, log: RunLog, stage: Stage) -> dict[str, float]:
    """Take batches as they become ready and train on each; a stop signal never splits a step.
    Returns the last step's metrics (empty when no step ran)."""
    estimator, buffer, manager, source, observer = open_stage(s, state, stage)
    step = state.step if stage.resumable else 0
    first, ahead = step, s.cfg.algo.max_batches_ahead

    def allow() -> None:  # flow control: the engines at most `ahead` batches ahead of the learner
        if ahead is not None and not stage.synchronous:
            manager.allow((step - first + ahead) * s.cfg.algo.batch_size)

    async def train_on(
        trajectories: list[Trajectory], waited: float, in_flight: int, taken_at: float
    ) -> dict[str, float]:
        """Step ``step + 1`` and its bookkeeping (logs, eval, checkpoint), run whole once started."""
        outcome = await learner_step(s, estimator, trajectories, state.version, stage.trains_actor(step))
        state.version, done = outcome.version, step + 1
        buffer.discard_stale(state.version)
        metrics = observer.step(outcome, waited, in_flight, taken_at)
        if stage.resumable:
            state.step = done
            state.trained_prompts += [
                [done, t.split, t.sample_index, t.reward_details.get("group_index", 0)] for t in trajectories
            ]
        if stage.eval_every and done % stage.eval_every == 0:
            metrics |= await evaluate_paused(s, manager, state.version)
        log.log(done, stage.name, metrics)
        log.samples(done, trajectories, s.tokenizer, s.cfg.train.sample_trajectories)
        if stage.resumable:
            kill_point("rl:after_update")  # trained, synced and logged; not yet checkpointed
        if stage.save_every and done % stage.save_every == 0:
            await s.checkpoint(state, manager, buffer, estimator)
        return metrics

    log.set_total(stage.name, stage.steps)
    allow()
    source.start()
    metrics: dict[str, float] = {}
    try:
        while step < stage.steps:
            waited = time.perf_counter()
            trajectories = await source.next_batch()
            metrics, stopping = await run_whole(
                train_on(trajectories, time.perf_counter() - waited, manager.in_flight, time.time())
            )
            step += 1
            allow()
            if stopping:
                raise asyncio.CancelledError
            if stage.done(metrics):
                break
        return metrics
    finally:
        source.stop()
        if stage.resumable:  # in-flight episodes are recorded for resubmission before they are cancelled
            await s.checkpoint(state, manager, buffer, estimator)
        await source.close()


async def evaluate_paused(s: Session, manager: RolloutManager, version: int) -> dict[str, float]:
    """Evaluate the current policy without distorting the lag distribution: no new training
    episode starts meanwhile (the ones in flight finish, at most ``rollout.max_concurrent``, as
    many as in any step), so the learner's stall does not pile up batches of one old version;
    engines a delayed sync left behind (``rollout.weight_sync_every``) get the actor's weights
    first. ``time/eval_s`` is the stall."""
    t0 = time.perf_counter()
    manager.pause()
    try:
        if s.version != version:
            async with s.weights_lock:
                await s.sync_weights(version)
        metrics = await s.evaluate()
    finally:
        manager.resume()
    return metrics | {"time/eval_s": time.perf_counter() - t0}


def _stop_on_signals(task: asyncio.Task) -> None:
    """SIGTERM (preemption, ``scancel``, ``kill``) and SIGUSR1 (Slurm ``--signal``) cancel the run's
    main task: it checkpoints in ``finally:`` and ``sao train`` exits 143 (SIGINT does the same
    through KeyboardInterrupt)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        loop.add_signal_handler(sig, task.cancel)


async def train(cfg: SAOConfig, run_dir: Path, resume: bool = False) -> dict:
    """``sao train``: SFT -> value pretraining -> asynchronous RL, resumable from ``run_dir``."""
    task = asyncio.current_task()
    assert task is not None
    _stop_on_signals(task)
    save_config(cfg, run_dir)
    log = RunLog(run_dir, wandb_project=cfg.run.wandb_project, config=to_dict(cfg))
    state = RunState.load(run_dir) if resume else RunState()
    s = await Session.start(cfg, run_dir, state)
    _stop_on_signals(task)  # ray.init replaced SIGTERM's handler with sys.exit: take it back
    try:
        if state.stage == "sft":
            await sft(s, log)
            state.stage = "value_pretrain"
        await s.ensure_critic()
        await s.start_rollouts(state.version)
        if state.stage == "value_pretrain":
            if s.critic is not None and cfg.train.value_pretrain_steps > 0:
                await run_stage(s, state, log, value_pretraining(cfg))
            state.stage = "rl"
        if state.initial_eval is None:
            state.initial_eval = await s.evaluate()
            if state.initial_eval:  # empty when train.eval_prompts=0: nothing to log
                log.log(state.step, "eval", state.initial_eval)
        last = await run_stage(s, state, log, rl(cfg, s.critic is not None))
        if state.step == 0 and state.version == 0:  # nothing trained (train.steps=0: a shared start)
            state.final_eval = state.initial_eval
        elif "eval/accuracy" in last:  # the last step evaluated (train.eval_every divides train.steps)
            state.final_eval = {k: v for k, v in last.items() if k.startswith("eval/")}
        else:
            state.final_eval = await s.evaluate()
            if state.final_eval:
                log.log(state.step, "eval", state.final_eval)
        state.save(run_dir)
        return {"initial": state.initial_eval, "final": state.final_eval}
    finally:
        await s.shutdown()
        log.close()
