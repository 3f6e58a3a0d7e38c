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

Each step is ``run.next_batch() -> learner_step -> run.after_step`` (:func:`run_stage`, :func:`train_on`);
after_step records the step (:class:`~sao_megatron.driver.run_state.RunState` owns the trained policy
version, the session the version the engines serve), then logs, evaluates and checkpoints.
``algo.synchronous`` adds a batch barrier (exactly one batch of prompts per step, submitted
after the previous weight update): the synchronous baseline of the same loop. Before RL: SFT
on demonstrations, and value pretraining, which is this loop with the actor frozen.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from sao_megatron.config import SAOConfig, save_config, to_dict
from sao_megatron.driver.learner import learner_step, run_whole
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.driver.stages import Stage, StageRun, TakenBatch, final_evaluation, rl, sft, value_pretraining
from sao_megatron.observe import RunLog


async def run_stage(s: Session, state: RunState, log: RunLog, stage: Stage) -> dict[str, float]:
    """Take batches as they become ready and train on each; a stop signal never splits a step.
    Returns the last step's metrics (empty when no step ran)."""
    run = StageRun(s, state, log, stage)
    metrics: dict[str, float] = {}
    try:
        while run.step < stage.steps:
            batch = await run.next_batch()
            metrics, stopping = await run_whole(train_on(s, run, batch))
            if stopping:
                raise asyncio.CancelledError
            if stage.done(metrics):
                break
        return metrics
    finally:
        await run.close()  # a resumable stage checkpoints; episodes in flight are recorded, then cancelled


async def train_on(s: Session, run: StageRun, batch: TakenBatch) -> dict[str, float]:
    """One step: critic values -> advantages -> critic x K || actor update -> weight sync, then the
    step's record, logs, evaluation and checkpoint."""
    outcome = await learner_step(s, run.estimator, batch.trajectories, run.state.version, run.trains_actor())
    return await run.after_step(outcome, batch)


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
        state.final_eval = await final_evaluation(s, state, log, last)
        state.save(run_dir)
        return {"initial": state.initial_eval, "final": state.final_eval}
    finally:
        await s.shutdown()
        log.close()
