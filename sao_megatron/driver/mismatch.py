"""``sao check CONFIG --mismatch``: training-inference mismatch at the same weights, before any training.

The logprob-alignment check peers run in CI (slime, verl), with MoE routes: the run's actor starts (its
``actor.init_from`` or random weights), the engines start and receive the actor's weights by the run's
own weight sync (version 0), episodes of the run's environment are generated on the engines with their
routes captured (``rollout.routing_replay``: ``record`` unless the config says ``on``), and the actor
computes the logprobs of the same tokens twice: its routers routing themselves, then replaying the
engine's routes. Reported for each, over every action token (all at version 0, so all lag 0): mean and
max |trainer logprob - engine logprob|, the k3 KL estimate, ratio quantiles
(:func:`~sao_megatron.algo.mismatch_metrics`), and the share of routed tokens whose router top-k set
equals the engine's (``routing/agreement``), and the share whose experts used are the engine's
(``routing/replayed``: 1 when replaying, the agreement otherwise). Both passes see the same
tokens, so the difference between them is what replay removes; what remains is kernel and dtype noise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from sao_megatron import algo
from sao_megatron.batch import build_batch
from sao_megatron.config import SAOConfig
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session

KEYS = (
    "mismatch/abs_diff",
    "mismatch/abs_diff/max",
    "mismatch/k3",
    "mismatch/ratio/p1",
    "mismatch/ratio/p50",
    "mismatch/ratio/p99",
    "routing/agreement",
    "routing/replayed",
)


async def mismatch_check(cfg: SAOConfig, run_dir: Path, episodes: int) -> dict:
    """Run the check (module docstring); the report: per mode (``router``, ``replay``) its metrics,
    plus the episodes, tokens and positions whose routes the engines returned."""
    if not cfg.model.num_experts:
        raise ValueError("sao check --mismatch needs an MoE model (model.num_experts > 0)")
    mode = cfg.rollout.routing_replay if cfg.rollout.routing_replay != "off" else "record"
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, routing_replay=mode))
    started = time.monotonic()
    s = await Session.start(cfg, run_dir, RunState())
    try:
        await s.start_rollouts(0)
        make_env = s.env_factory()
        sem = asyncio.Semaphore(cfg.rollout.max_concurrent)

        async def one(i: int):
            async with sem:
                return await s.loops[i % len(s.loops)].run(await make_env(), s.task.get("train", i), index=i)

        trajectories = await asyncio.gather(*(one(i) for i in range(episodes)))
        finished = [t for t in trajectories if t.status != "failed" and t.num_action_tokens]
        if not finished:
            reasons = sorted({t.status_reason for t in trajectories})
            raise RuntimeError(f"sao check --mismatch: no episode produced action tokens ({reasons})")
        batch = build_batch(finished)
        report: dict = {
            "episodes": len(finished),
            "failed": len(trajectories) - len(finished),
            "action_tokens": int(batch.action_mask.sum()),
            "routed_positions": sum(t.num_routed_positions for t in finished),
            "positions": int(batch.lengths.sum()),
        }
        for name, replay in (("router", False), ("replay", True)):
            logprobs, routing = await s.actor.routed_logprobs(batch, replay)
            metrics = algo.mismatch_metrics(logprobs, batch.behavior_logprobs, batch.action_mask > 0)
            report[name] = {k: v for k, v in {**metrics, **routing}.items() if k in KEYS}
        report["wall_s"] = time.monotonic() - started
        return report
    finally:
        await s.shutdown()


def render(report: dict) -> str:
    """The report as a small table, one row per metric, one column per mode."""
    lines = [
        f"{report['episodes']} episodes ({report['failed']} failed), {report['action_tokens']} action tokens, "
        f"routes for {report['routed_positions']} of {report['positions']} positions",
        f"{'metric':<24}{'router (own routing)':>22}{'replay (engine routes)':>24}",
    ]
    for key in KEYS:
        a, b = report["router"].get(key), report["replay"].get(key)
        cells = ["" if v is None else f"{v:.6g}" for v in (a, b)]
        lines.append(f"{key:<24}{cells[0]:>22}{cells[1]:>24}")
    return "\n".join(lines)
