"""SIGKILL the whole ``sao train`` at each fault point, resume, and train the same prompts.

One run directory is killed in turn at every point of :mod:`sao_megatron.faults` (a chain: killed
-> ``--resume-if-present`` killed at the next point -> ... -> a resume that completes), with no
chance to clean up, as the OOM killer or a failed node would. Synchronous with lag 0, so the
prompts trained at each step are deterministic: the chain must train exactly the prompts of an
uninterrupted run (step k: prompts 4(k-1)..4k-1), step by step, none twice, and every resume must
load a complete checkpoint.
After each kill no process of the run may be left (Ray's processes, the SGLang engine).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sao_megatron.config import REPO_ROOT
from sao_megatron.driver.run_state import RunState
from sao_megatron.observe import read_metrics

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

STEPS = 3
RUN = [
    "configs/tiny_cpu.yaml",
    "model.num_layers=2",
    "algo.batch_size=4",
    "algo.critic_warmup_steps=0",
    "rollout.max_concurrent=8",
    "rollout.loop.max_turns=2",
    "rollout.env_kwargs={max_turns: 2}",
    "rollout.loop.max_new_tokens=16",
    "rollout.loop.max_response_tokens=64",
    "train.eval_prompts=4",
    "train.eval_every=0",
    "train.sample_trajectories=1",
    "train.sft_steps=0",
    "train.value_pretrain_steps=0",
    "cluster.cpus_per_rank=0.5",
    "algo.synchronous=true",
    "algo.max_policy_lag=0",
    f"train.steps={STEPS}",
    "train.save_every=1",
]

# (SAO_KILL_AT, RL step of the complete checkpoint the next run resumes from). Counts are per
# process: a resumed run starts counting again.
CHAIN = [
    ("rl:after_update@2", 1),  # step 2 trained, synced and logged; its checkpoint never written
    ("checkpoint:staged@2", 2),  # step 2's checkpoint published; step 3's staged, not published
    ("checkpoint:renaming", 2),  # step 3's publish: checkpoint/ is checkpoint.old/, the new one unplaced
    ("weight_sync:bucket@2", 2),  # actor rank 0's Ray worker: 1st sync at start, 2nd after step 3's update
]
# Not in the chain, to keep CI under 40 minutes: ``rollout:generate`` (mid-episode), whose SIGKILL
# leaves the same on-disk state as one at ``rl:after_update`` (the last published checkpoint, the
# engine and episodes in flight).
RUN_TIMEOUT_S = 600
GRACE_S = 60.0
"""How long the run's processes may take to exit on their own after the driver was killed (Ray's
agents notice the raylet's death, then try to report it to the dead GCS first)."""


def _sao_train(run_dir: Path, out: Path, token: str, kill_at: str = "", resume: bool = False):
    """One ``sao train`` in a session of its own; (return code, stdout, stderr, driver pid, seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_")}
    env["SAO_KILL_TEST"] = token  # inherited by everything the run starts: how leftovers are found
    if kill_at:
        env["SAO_KILL_AT"] = kill_at
    cmd = [
        sys.executable,
        "-m",
        "sao_megatron.cli",
        "train",
        *(["--resume-if-present"] if resume else []),
        *RUN,
        f"run.run_dir={run_dir}",
    ]
    t0 = time.perf_counter()
    with (out.with_suffix(".out")).open("w") as so, (out.with_suffix(".err")).open("w") as se:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=so, stderr=se, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    seconds = time.perf_counter() - t0
    return rc, out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text(), proc.pid, seconds


def _processes(token: str, sid: int) -> dict[int, str]:
    """pid -> command line of every live process of a run: it carries the run's ``SAO_KILL_TEST``
    (the SGLang engine leads a session of its own) or is in the driver's session."""
    found = {}
    mark = f"SAO_KILL_TEST={token}".encode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session ...
            if fields[0] == "Z":
                continue
            if int(fields[3]) == sid or mark in (p / "environ").read_bytes().split(b"\0"):
                found[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        except (OSError, ValueError):
            continue
    return found


def _leftovers(token: str, sid: int, exits: dict[str, float], name: str) -> dict[int, str]:
    """Processes of the run still alive ``GRACE_S`` after it ended; SIGKILLed (by pid) here.
    ``exits[name]``: seconds until the last of them was gone."""
    t0 = time.monotonic()
    while (alive := _processes(token, sid)) and time.monotonic() < t0 + GRACE_S:
        time.sleep(0.5)
    exits[name] = time.monotonic() - t0
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def _per_step_prompts(checkpoint: Path) -> dict[int, set]:
    state = json.loads((checkpoint / "state.json").read_text())
    steps: dict[int, set] = {}
    for step, split, index, member in state["trained_prompts"]:
        steps.setdefault(step, set()).add((split, index, member))
    return steps


def _kill_line(run_dir: Path, stderr: str, point: str) -> tuple[int, str]:
    """(pid, where) of the ``SAO_KILL_AT`` line: the driver's stderr, or a Ray worker's log."""
    name = point.partition("@")[0]
    pattern = re.compile(rf"^SAO_KILL_AT {re.escape(name)} pid=(\d+)$", re.M)
    sources = [("driver stderr", stderr)] + [
        (p.name, p.read_text(errors="replace")) for p in sorted((run_dir / "logs").glob("*.log"))
    ]
    hits = [(int(m.group(1)), where) for where, text in sources for m in pattern.finditer(text)]
    assert len(hits) == 1, f"{point}: expected one kill line, found {hits}"
    return hits[0]


def _assert_continues(stdout: str, checkpoint_step: int) -> None:
    """The RL steps a resumed run logged start right after its checkpoint's step."""
    steps = [int(s) for s in re.findall(r"^\[rl\s+(\d+)\]", stdout, re.M)]
    assert not steps or steps == list(range(checkpoint_step + 1, checkpoint_step + 1 + len(steps))), steps


def test_sigkill_at_every_fault_point_then_resume_trains_the_same_prompts(tmp_path):
    token = uuid.uuid4().hex
    timings: dict[str, float] = {}
    exits: dict[str, float] = {}
    leftovers: dict[str, dict[int, str]] = {}
    try:
        run_dir = tmp_path / "chain"
        for i, (point, checkpoint_step) in enumerate(CHAIN):
            rc, out, err, pid, timings[point] = _sao_train(run_dir, tmp_path / f"kill{i}", token, point, resume=True)
            leftovers[point] = _leftovers(token, pid, exits, point)
            assert rc == -signal.SIGKILL, f"{point}: exit {rc}\n{out[-3000:]}\n{err[-3000:]}"
            killer, where = _kill_line(run_dir, err, point)
            if point.startswith("weight_sync:"):  # actor rank 0's Ray worker took the driver down
                assert killer != pid and where == "actor_rank0.log", (killer, where)
            else:
                assert killer == pid and where == "driver stderr", (killer, where)
            if i == 0:
                assert "no complete checkpoint" in out and "starting a fresh run" in out, out
            else:
                assert "resuming from the complete checkpoint" in out, out
                _assert_continues(out, CHAIN[i - 1][1])
            # What the next run will resume: complete (published), at the expected step.
            checkpoint = RunState.complete_checkpoint(run_dir)
            assert checkpoint is not None, f"{point}: no complete checkpoint left"
            state = json.loads((checkpoint / "state.json").read_text())
            assert state["stage"] == "rl" and state["step"] == checkpoint_step, (
                point,
                checkpoint,
                state["step"],
            )
            assert (checkpoint / "actor").is_dir() and (checkpoint / "critic").is_dir(), sorted(checkpoint.iterdir())
            if point.startswith("checkpoint:renaming"):
                assert checkpoint.name == "checkpoint.old" and not (run_dir / "checkpoint").exists()
            if point.startswith("checkpoint:"):
                staged = json.loads((RunState.staging_dir(run_dir) / "state.json").read_text())
                assert staged["step"] == checkpoint_step + 1  # the half-published one is not picked

        rc, out, err, pid, timings["final resume"] = _sao_train(run_dir, tmp_path / "final", token, resume=True)
        leftovers["final resume"] = _leftovers(token, pid, exits, "final resume")
        assert rc == 0, out[-3000:] + err[-3000:]
        assert "resuming from the complete checkpoint" in out and "done in" in out, out
        _assert_continues(out, CHAIN[-1][1])
    finally:
        for pid in _processes(token, -1):  # whatever a failed assertion left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(
            "\nkill/resume wall times: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
            + f"; total {sum(timings.values()):.0f} s; processes gone after: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in exits.items())
        )

    assert not any(leftovers.values()), f"processes left {GRACE_S:.0f} s after a run ended: {leftovers}"
    # An uninterrupted synchronous run trains step k on prompts 4(k-1)..4k-1 (the cursor's order;
    # tests/test_pipeline.py checks it on a run's first steps, then across a stop and resume).
    full = {k: {("train", i, 0) for i in range(4 * (k - 1), 4 * k)} for k in range(1, STEPS + 1)}
    chain = _per_step_prompts(run_dir / "checkpoint")
    assert chain == full, f"resumed run trained other prompts:\n{chain}\nvs uninterrupted\n{full}"
    trained = json.loads((run_dir / "checkpoint" / "state.json").read_text())["trained_prompts"]
    keys = [tuple(k[1:]) for k in trained]
    assert len(keys) == len(set(keys)) == 4 * STEPS, "a prompt was trained twice (or lost)"

    # metrics.jsonl: every RL step once (a step re-run after a resume replaces the lost attempt's record).
    rl = [r["step"] for r in read_metrics(run_dir) if r["stage"] == "rl"]
    assert rl == list(range(1, STEPS + 1)), rl
