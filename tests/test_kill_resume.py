"""A real ``sao train`` SIGKILLed, then resumed and stopped by SIGTERM: the resume trains the
prompts of an uninterrupted run, and the stop checkpoints them.

One run directory, two runs of ``sao train --resume-if-present`` through real processes (Ray, the
Megatron workers, the SGLang engine), synchronous with lag 0 so that the prompts trained at each
step are deterministic (step k: prompts 4(k-1)..4k-1, the cursor's order):

1. a fresh run (SFT, then RL) is SIGKILLed mid-way through its third weight sync (after step 2's
   update) by actor rank 0's Ray worker (``SAO_KILL_AT=weight_sync:bucket@3``), which takes the
   driver and its process group down with no chance to clean up, as the OOM killer or a failed
   node would; step 1's checkpoint is the latest complete one;
2. its resume gets SIGTERM (preemption, ``scancel``) after its first RL step: it checkpoints and
   exits 143 (``ray.init`` replaces Python's SIGTERM handler; the driver takes it back), having
   trained, from step 2 on, the uninterrupted run's prompts.

No process of either run may be left after it ended (Ray's, the engine's). What a SIGKILL leaves at
each fault point of :mod:`sao_megatron.faults` and the resume from there, and the resume after a
stop mid-batch, are checked in-process by ``tests/test_kill_points.py``; a resume after a stop
through real processes is the five-node Slurm requeue (``tests/launch/test_slurm_multinode.py``).
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

STEPS = 4
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
    "train.eval_prompts=0",
    "train.eval_every=0",
    "train.sample_trajectories=1",
    "train.sft_steps=2",
    "train.value_pretrain_steps=0",
    "cluster.cpus_per_rank=0.5",
    "algo.synchronous=true",
    "algo.max_policy_lag=0",
    f"train.steps={STEPS}",
    "train.save_every=1",
]
KILL_AT = "weight_sync:bucket@3"
"""Counted per process (one bucket per sync here): the sync at the start, then one after each update."""
RUN_TIMEOUT_S = 600
GRACE_S = 60.0
"""How long the run's processes may take to exit on their own after the driver ended or was killed
(Ray's agents notice the raylet's death, then try to report it to the dead GCS first)."""


def _uninterrupted(steps: int) -> dict[int, set]:
    return {k: {("train", i, 0) for i in range(4 * (k - 1), 4 * k)} for k in range(1, steps + 1)}


class Run:
    """One ``sao train --resume-if-present`` in a session of its own, its output in ``<out>.out/.err``."""

    def __init__(self, run_dir: Path, out: Path, token: str, kill_at: str = ""):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_")}
        env["SAO_KILL_TEST"] = token  # inherited by everything the run starts: how leftovers are found
        if kill_at:
            env["SAO_KILL_AT"] = kill_at
        cmd = [sys.executable, "-m", "sao_megatron.cli", "train", "--resume-if-present", *RUN, f"run.run_dir={run_dir}"]
        self.out, self.err = out.with_suffix(".out"), out.with_suffix(".err")
        self.t0 = time.perf_counter()
        with self.out.open("w") as so, self.err.open("w") as se:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=env, stdout=so, stderr=se, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.pid = self.proc.pid

    def wait(self) -> tuple[int, str, str, float]:
        """(return code, stdout, stderr, seconds); killed after ``RUN_TIMEOUT_S``."""
        try:
            rc = self.proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.perf_counter() - self.t0)))
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            rc = self.proc.wait()
        return rc, self.out.read_text(), self.err.read_text(), time.perf_counter() - self.t0


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


def _complete(run_dir: Path) -> tuple[Path, dict]:
    """The latest complete checkpoint (what the next run resumes) and its run state."""
    checkpoint = RunState.complete_checkpoint(run_dir)
    assert checkpoint is not None, f"no complete checkpoint in {run_dir}"
    assert (checkpoint / "actor").is_dir() and (checkpoint / "critic").is_dir(), sorted(checkpoint.iterdir())
    return checkpoint, json.loads((checkpoint / "state.json").read_text())


def _per_step_prompts(state: dict) -> dict[int, set]:
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


def _rl_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [r["step"] for r in lines if r.get("stage") == "rl"]


def test_sigkill_then_resume_and_sigterm_trains_the_same_prompts(tmp_path):
    token, run_dir = uuid.uuid4().hex, tmp_path / "run"
    timings: dict[str, float] = {}
    exits: dict[str, float] = {}
    leftovers: dict[str, dict[int, str]] = {}
    try:
        # 1. A fresh run, SIGKILLed by actor rank 0's Ray worker during step 2's weight sync.
        run = Run(run_dir, tmp_path / "sigkill", token, KILL_AT)
        rc, out, err, timings["sigkill"] = run.wait()
        leftovers["sigkill"] = _leftovers(token, run.pid, exits, "sigkill")
        assert rc == -signal.SIGKILL, f"exit {rc}\n{out[-3000:]}\n{err[-3000:]}"
        killer, where = _kill_line(run_dir, err, KILL_AT)
        assert killer != run.pid and where == "actor_rank0.log", (killer, where)
        assert "no complete checkpoint" in out and "starting a fresh run" in out, out
        checkpoint, state = _complete(run_dir)  # step 2 trained, its sync killed: never checkpointed
        assert checkpoint.name == "checkpoint" and state["stage"] == "rl", (checkpoint, state["stage"])
        assert state["step"] == 1 and _per_step_prompts(state) == _uninterrupted(1), state

        # 2. The resume gets SIGTERM after its first RL step: a checkpoint, exit 143.
        run = Run(run_dir, tmp_path / "sigterm", token)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not any(step > 1 for step in _rl_steps(run_dir)):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.out.read_text()[-3000:]
            time.sleep(0.1)
        run.proc.send_signal(signal.SIGTERM)
        rc, out, err, timings["sigterm"] = run.wait()
        leftovers["sigterm"] = _leftovers(token, run.pid, exits, "sigterm")
        assert rc == 143 and "stopped by a signal" in err, f"exit {rc}\n{out[-3000:]}\n{err[-3000:]}"
        assert "resuming from the complete checkpoint" in out, out
        _assert_continues(out, 1)
    finally:
        for pid in _processes(token, -1):  # whatever a failed assertion left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(
            "\nsigkill/resume/sigterm wall times: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
            + f"; total {sum(timings.values()):.0f} s; processes gone after: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in exits.items())
        )

    assert not any(leftovers.values()), f"processes left {GRACE_S:.0f} s after a run ended: {leftovers}"
    checkpoint, state = _complete(run_dir)
    stopped_at = state["step"]
    assert checkpoint.name == "checkpoint" and 2 <= stopped_at < STEPS, (checkpoint, stopped_at)
    assert _per_step_prompts(state) == _uninterrupted(stopped_at), state["trained_prompts"]
    keys = [tuple(k[1:]) for k in state["trained_prompts"]]
    assert len(keys) == len(set(keys)) == 4 * stopped_at, "a prompt was trained twice (or lost)"
    # metrics.jsonl: every RL step once (a step re-run after a resume replaces the lost attempt's record)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if r["stage"] == "rl"] == list(range(1, stopped_at + 1))
    assert {r["stage"] for r in records} == {"sft", "rl"}  # train.eval_prompts=0: no eval record
