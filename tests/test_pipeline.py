"""The SAO loop end to end: real Ray, real Megatron actor/critic workers, a real CPU SGLang engine.

Small and few steps; the figures that matter are exact: engine logprobs equal the actor's
after each sync, the version advances, trajectories span updates, nothing is trained twice,
and a run stopped by SIGTERM resumes with the same prompt sequence.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sao_megatron.batch import build_batch
from sao_megatron.config import REPO_ROOT, load_config
from sao_megatron.driver import stages
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.observe import RunLog, read_metrics
from sao_megatron.pipeline import run_stage, train
from sao_megatron.records import Trajectory, Turn
from sao_megatron.rollout.client import SamplingParams

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

SMALL = [
    "model.num_layers=2",
    "algo.batch_size=4",
    "algo.critic_warmup_steps=0",
    "rollout.max_concurrent=8",
    "rollout.loop.max_turns=2",
    "rollout.env_kwargs={max_turns: 2}",
    "rollout.loop.max_new_tokens=16",
    "rollout.loop.max_response_tokens=64",
    "train.eval_prompts=4",
    "train.value_pretrain_steps=0",
    "train.sample_trajectories=1",
]


async def engine_vs_actor(session: Session, prompt: list[int]) -> tuple[float, int, set[str]]:
    """Sample from the engine, then score the same tokens with the actor: max |diff| of logprobs."""
    gen = await session.clients[0].generate(prompt, SamplingParams(max_new_tokens=12, seed=3))
    n = len(gen.output_ids)
    traj = Trajectory(
        prompt_id="probe",
        prompt_ids=prompt,
        response_ids=gen.output_ids,
        action_mask=[1] * n,
        behavior_logprobs=gen.behavior_logprobs,
        policy_versions=[0] * n,
        turns=[Turn(0, n)],
        reward=0.0,
        status="finished",
    )
    batch = build_batch([traj])
    actor = await session.actor.logprobs(batch)
    mask = batch.action_mask > 0
    return (actor[mask] - batch.behavior_logprobs[mask]).abs().max().item(), n, set(gen.weight_versions)


def test_async_loop_versions_sync_and_buffer(tmp_path):
    cfg = load_config(None, [*SMALL, "train.steps=3", "algo.max_policy_lag=null", "train.sft_steps=0"])

    async def go():
        state = RunState(stage="rl")
        log = RunLog(tmp_path, tensorboard=False, console=False)
        session = await Session.start(cfg, tmp_path, state)
        try:
            await session.start_rollouts(state.version)
            before = await engine_vs_actor(session, [2, 40, 41, 42, 3])
            await run_stage(session, state, log, stages.rl(cfg, session.critic is not None))
            after = await engine_vs_actor(session, [2, 50, 51, 52, 3])
            return state, before, after
        finally:
            await session.shutdown()

    state, before, after = asyncio.run(go())
    assert state.version == 3 and state.step == 3
    assert before[0] <= 1e-4 and before[2] == {"0"}, before  # engine == Megatron actor, same weights
    assert after[0] <= 1e-4 and after[2] == {"3"}, after  # ... and again after three syncs
    keys = [tuple(k[1:]) for k in state.trained_prompts]
    assert len(keys) == 12 and len(set(keys)) == 12, "a trajectory was trained twice"
    rl = [r for r in read_metrics(tmp_path) if r["stage"] == "rl"]
    assert [r["policy_version"] for r in rl] == [1.0, 2.0, 3.0]
    assert any(r["rollout/multi_version"] > 0 or r["lag/max"] > 0 for r in rl[1:]), "no trajectory spanned an update"
    assert all("actor/kept_frac" in r and "critic/explained_var" in r for r in rl)
    assert all(any(k.startswith("dis/kept_frac/lag") for k in r) for r in rl)


def test_sigterm_checkpoints_mid_run_and_the_resume_trains_the_same_prompt_sequence(tmp_path):
    """``sao train`` gets SIGTERM (preemption, ``scancel``) after its first RL step: it checkpoints
    and exits 143 (ray.init replaces Python's SIGTERM handler; the driver takes it back). Synchronous
    with lag 0, an uninterrupted run trains step k on prompts 4(k-1)..4k-1 (the cursor's order): the
    stopped run shows it for its steps, and resumed to the end it continues the sequence exactly
    (cursor, buffer and weights come from its checkpoint)."""
    steps, run_dir = 4, tmp_path / "cut"
    base = [
        *SMALL,
        "algo.synchronous=true",
        "algo.max_policy_lag=0",
        "train.sft_steps=2",
        "train.eval_every=0",
        "train.eval_prompts=0",
        f"train.steps={steps}",
        f"run.run_dir={run_dir}",
    ]

    def per_step():
        state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
        out: dict[int, set] = {}
        for step, split, index, member in state["trained_prompts"]:
            out.setdefault(step, set()).add((split, index, member))
        return state["step"], out

    def uninterrupted(n):
        return {k: {("train", i, 0) for i in range(4 * (k - 1), 4 * k)} for k in range(1, n + 1)}

    log = tmp_path / "cut.out"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sao_megatron.cli", "train", *base],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"stage": "rl"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 143 and "stopped by a signal" in text, text[-3000:]
    stopped_at, trained = per_step()
    assert 1 <= stopped_at < steps and trained == uninterrupted(stopped_at), (stopped_at, trained)

    asyncio.run(train(load_config(None, base), run_dir, resume=True))
    assert per_step() == (steps, uninterrupted(steps))
    assert {r["stage"] for r in read_metrics(run_dir)} == {"sft", "rl"}  # eval_prompts=0: no eval record
