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
after the previous weight update): the synchronous baseline of the same loop. Stages before
RL: SFT on demonstrations and value pretraining on rollouts of the frozen SFT policy.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from sao_megatron.buffer import ReadyBuffer
from sao_megatron.config import SAOConfig, save_config, to_dict
from sao_megatron.observe import RunLog
from sao_megatron.driver import stages
from sao_megatron.driver.advantages import Advantages, explained_variance
from sao_megatron.batch import build_batch
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Services


async def learner_step(
    svc: Services, state: RunState, adv: Advantages, trajectories, train_actor: bool
) -> dict:
    """One step: values -> advantages -> K critic updates || one actor update -> weight sync."""
    cfg = svc.cfg
    t0 = time.perf_counter()
    batch = build_batch(trajectories)
    values = await svc.critic.call("values", batch) if svc.critic else None
    advantages, returns, metrics = adv(batch, values, [t.prompt_id for t in trajectories],
                                       [t.group_id for t in trajectories])  # fmt: skip
    metrics = {f"adv/{k}": v for k, v in metrics.items()}

    async def critic_updates():
        out = {}
        for _ in range(cfg.critic.updates_per_step):
            out = await svc.critic.call("update", batch, returns, values)
        return out

    jobs = [critic_updates() if svc.critic else asyncio.sleep(0, {})]
    if train_actor:
        jobs.append(svc.actor.call("update", batch, advantages, state.version))
    results = await asyncio.gather(*jobs)
    metrics.update({f"critic/{k}": v for k, v in results[0].items() if k != "explained_var"})
    if returns is not None:
        metrics["critic/explained_var"] = explained_variance(values, returns, batch.action_mask)
    if train_actor:
        metrics.update({(k if k.startswith("dis/") else f"actor/{k}"): v for k, v in results[1].items()})
        state.version += 1
        metrics.update(await svc.sync_weights(state.version))
    metrics["time/step_s"] = time.perf_counter() - t0
    return metrics


async def rl_stage(svc: Services, state: RunState, log: RunLog) -> None:
    cfg = svc.cfg
    a = cfg.algo
    adv = Advantages(a)
    if state.advantages:
        adv.load_state_dict(state.advantages)
    buffer = ReadyBuffer(a.batch_size, a.group_size, None if a.max_policy_lag < 0 else a.max_policy_lag)
    if state.buffer:
        buffer.load_state_dict(state.buffer)
    manager = svc.manager(lambda t: buffer.admit(t, state.version), state.cursor)
    stop = asyncio.Event()
    prompts_per_step = a.batch_size // a.group_size
    log.set_total("rl", cfg.train.steps)
    runner = asyncio.create_task(manager.run(stop, max_prompts=prompts_per_step if a.synchronous else None))
    last = (time.monotonic(), 0, 0, 0.0)  # time, finished, generated tokens, engine busy seconds
    try:
        while state.step < cfg.train.steps:
            wait0 = time.perf_counter()
            while (batch := buffer.take()) is None:
                if runner.done():
                    runner.result()  # surfaces a manager crash
                    if a.synchronous:
                        runner = asyncio.create_task(manager.run(stop, max_prompts=prompts_per_step))
                await asyncio.sleep(0.02)
            learner_wait = time.perf_counter() - wait0
            train_actor = state.step >= a.critic_warmup_steps or not svc.critic
            in_flight = manager.in_flight
            # A stop signal never splits a step: weights, version and bookkeeping stay consistent.
            step_task = asyncio.ensure_future(learner_step(svc, state, adv, batch, train_actor))
            try:
                metrics = await asyncio.shield(step_task)
            except asyncio.CancelledError:
                metrics, stopping = await step_task, True
            else:
                stopping = False
            buffer.discard_stale(state.version)
            metrics.update(stages.batch_metrics(batch, state.version - (1 if train_actor else 0)))
            metrics.update({"time/learner_wait_s": learner_wait, "buffer/waiting": float(len(buffer)),
                            "buffer/dropped_stale": float(buffer.stats.dropped_stale),
                            "buffer/dropped_failed": float(sum(buffer.stats.dropped_failed.values())),
                            "rollout/in_flight_at_take": float(in_flight),
                            "policy_version": float(state.version)})  # fmt: skip
            now = (
                time.monotonic(),
                manager.stats.finished,
                manager.stats.generated_tokens,
                manager.busy_seconds(),
            )
            dt = max(now[0] - last[0], 1e-9)
            metrics.update({"rollout/trajectories_per_s": (now[1] - last[1]) / dt,
                            "rollout/tokens_per_s": (now[2] - last[2]) / dt,
                            "rollout/engine_util": (now[3] - last[3]) / (dt * len(svc.engines))})  # fmt: skip
            last = now
            if buffer.stats.group_waits_s:
                metrics["buffer/group_wait_s"] = sum(buffer.stats.group_waits_s) / len(
                    buffer.stats.group_waits_s
                )
            state.step += 1
            state.trained_prompts += [[state.step, t.split, t.sample_index, t.reward_details.get("group_index", 0)]
                                      for t in batch]  # fmt: skip
            if cfg.train.eval_every and state.step % cfg.train.eval_every == 0:
                metrics.update(await svc.evaluate())
            log.log(state.step, "rl", metrics)
            log.samples(state.step, batch, svc.tokenizer, cfg.train.sample_trajectories)
            if cfg.train.save_every and state.step % cfg.train.save_every == 0:
                await svc.checkpoint(state, manager, buffer, adv)
            if stopping:
                raise asyncio.CancelledError
    finally:
        stop.set()
        manager.pause()
        await svc.checkpoint(state, manager, buffer, adv)
        await manager.drain(cancel=True)
        if not runner.done():
            runner.cancel()


async def train(cfg: SAOConfig, run_dir: Path, resume: bool = False) -> dict:
    """``sao train``: SFT -> value pretraining -> asynchronous RL, resumable from ``run_dir``."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # preemption (Slurm --signal): checkpoint, then exit
        loop.add_signal_handler(sig, task.cancel)
    save_config(cfg, run_dir)
    log = RunLog(run_dir, wandb_project=cfg.run.wandb_project, config=to_dict(cfg))
    state = RunState.load(run_dir) if resume else RunState()
    svc = await Services.start(cfg, run_dir, state, log)
    try:
        if state.stage == "sft":
            await stages.sft(svc, state, log)
            state.stage = "value_pretrain"
        await svc.ensure_critic()
        await svc.start_rollouts(state)
        if state.stage == "value_pretrain":
            if svc.critic is not None:
                await stages.value_pretrain(svc, state, log)
            state.stage = "rl"
        if state.initial_eval is None:
            state.initial_eval = await svc.evaluate()
            log.log(state.step, "eval", state.initial_eval)
        await rl_stage(svc, state, log)
        final = await svc.evaluate()
        log.log(state.step, "eval", final)
        state.final_eval = final
        state.save(run_dir)
        return {"initial": state.initial_eval, "final": final}
    finally:
        await svc.shutdown()
        log.close()
