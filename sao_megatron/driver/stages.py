"""Stages before RL (SFT, value pretraining) and the per-batch rollout metrics."""

from __future__ import annotations

import asyncio
import random
import time

import torch

from sao_megatron.buffer import ReadyBuffer
from sao_megatron.records import Trajectory
from sao_megatron.driver.advantages import Advantages, explained_variance
from sao_megatron.batch import build_batch
from sao_megatron.driver.demos import demonstration_trajectory


async def sft(svc, state, log) -> None:
    """Supervised warm start on expert demonstrations of the train split (action tokens only)."""
    cfg = svc.cfg
    t = cfg.train
    if t.sft_steps <= 0:
        return
    rng = random.Random(cfg.run.seed)
    log.set_total("sft", t.sft_steps)
    await svc.actor.call("set_lr", t.sft_lr)
    for step in range(1, t.sft_steps + 1):
        indices = [rng.randrange(1 << 30) for _ in range(t.sft_batch_size)]
        demos = [demonstration_trajectory(cfg.rollout.env, svc.task, svc.tokenizer, "train", i,
                                          cfg.rollout.env_kwargs) for i in indices]  # fmt: skip
        metrics = await svc.actor.call("sft_step", build_batch(demos))
        if step % 10 == 0 or step == t.sft_steps:
            log.log(step, "sft", {f"sft/{k}": v for k, v in metrics.items()})
    await svc.actor.call("set_lr", cfg.actor.optim.lr)


async def value_pretrain(svc, state, log) -> None:
    """Critic-only training on rollouts of the frozen policy until explained variance is reached."""
    cfg = svc.cfg
    steps = cfg.train.value_pretrain_steps
    if steps <= 0:
        return
    buffer = ReadyBuffer(cfg.algo.batch_size, cfg.algo.group_size)
    manager = svc.manager(lambda t: buffer.admit(t, state.version), {})
    manager.cursor.split = "train"
    manager.cursor.next_index = 1 << 40  # prompts far from the RL cursor: RL data stays unseen
    adv = Advantages(cfg.algo)
    stop = asyncio.Event()
    runner = asyncio.create_task(manager.run(stop))
    try:
        for step in range(1, steps + 1):
            while (trajectories := buffer.take()) is None:
                if runner.done():
                    runner.result()
                await asyncio.sleep(0.02)
            batch = build_batch(trajectories)
            values = await svc.critic.call("values", batch)
            _, returns, _ = adv(
                batch, values, [t.prompt_id for t in trajectories], [t.group_id for t in trajectories]
            )
            metrics = await svc.critic.call("update", batch, returns, values)
            metrics = {f"critic/{k}": v for k, v in metrics.items() if k != "explained_var"}
            metrics["critic/explained_var"] = explained_variance(values, returns, batch.action_mask)
            metrics.update(batch_metrics(trajectories, state.version))
            log.log(step, "value_pretrain", metrics)
            if metrics["critic/explained_var"] >= cfg.train.value_pretrain_target_ev:  # NaN compares False
                break
    finally:
        stop.set()
        await manager.drain(cancel=True)
        if not runner.done():
            runner.cancel()


def batch_metrics(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """Reward, accuracy, lengths, turns and policy lag of a training batch (version = trained policy)."""
    n = len(trajectories)
    lags = torch.tensor([version - max(t.min_version, 0) for t in trajectories], dtype=torch.float32)
    token_lags = torch.tensor([version - v for t in trajectories for v, m in zip(t.policy_versions, t.action_mask,
                                                                                  strict=True) if m], dtype=torch.float32)  # fmt: skip
    now = time.time()
    out = {
        "rollout/reward": sum(t.reward for t in trajectories) / n,
        "rollout/accuracy": sum(bool(t.correct) for t in trajectories) / n,
        "rollout/response_tokens": sum(len(t.response_ids) for t in trajectories) / n,
        "rollout/action_tokens": sum(t.num_action_tokens for t in trajectories) / n,
        "rollout/turns": sum(t.num_turns for t in trajectories) / n,
        "rollout/truncated": sum(t.status == "truncated" for t in trajectories) / n,
        "rollout/multi_version": sum(
            len({v for v, m in zip(t.policy_versions, t.action_mask, strict=True) if m}) > 1
            for t in trajectories
        )
        / n,  # fmt: skip
        "rollout/episode_s": sum(t.finished_at - t.started_at for t in trajectories) / n,
        "buffer/wait_s": sum(now - t.finished_at for t in trajectories) / n,
        "lag/mean": float(lags.mean()),
        "lag/max": float(lags.max()),
        "lag/token_mean": float(token_lags.mean()) if token_lags.numel() else 0.0,
    }
    for k in range(4):
        sel = lags >= 3 if k == 3 else lags == k
        out[f"lag/hist{k if k < 3 else '3+'}"] = float(sel.float().mean())
    return out
