"""Slurm end to end: ``sao submit`` -> launch/slurm/sao.sbatch on a real (one-node) Slurm cluster.

Runs only with ``SAO_SLURM_TEST=1`` and a reachable cluster (``.ci/slurm.sh`` starts one and sets
both). The test submits through the users' path with a stand-in driver (no training: nothing here
needs one), waits with a bounded timeout, and checks the job's state, its logs and that no Ray
process of the job outlives it. The helpers serve the five-node tests (``test_slurm_multinode.py``),
where the real ``sao train`` runs: a tiny run that USR1 stops (it checkpoints), that Slurm requeues,
that resumes by itself, trains the same prompts as an uninterrupted run and reports.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sao_megatron.config import REPO_ROOT

pytestmark = pytest.mark.skipif(
    os.environ.get("SAO_SLURM_TEST") != "1",
    reason="needs a Slurm cluster: run .ci/slurm.sh (SAO_SLURM_TEST=1)",
)

STUB = Path(__file__).with_name("stub_driver.py")
TINY = [
    "configs/tiny_cpu.yaml",
    "train.sft_steps=2",
    "train.value_pretrain_steps=0",
    "train.eval_prompts=4",
    "train.eval_every=0",
    "train.sample_trajectories=1",
    "cluster.cpus_per_rank=0.5",
]
JOB_TIMEOUT_S = float(os.environ.get("SAO_SLURM_JOB_TIMEOUT_S", "1500"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Ray on loopback with private ports and temp dir, so the job cannot meet another Ray."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_")}
    ports = [_free_port() for _ in range(4)]
    env.update(
        SAO_RAY_PORT=str(ports[0]),
        SAO_RAY_TMP=f"/tmp/ray-sao-{ports[0]}",
        SAO_RAY_ARGS=(
            f"--ray-client-server-port={ports[1]} --dashboard-agent-listen-port={ports[2]} "
            f"--metrics-export-port={ports[3]} --object-store-memory={256 << 20}"
        ),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # Ray advertises 127.0.0.1, not the host's address
        **extra,
    )
    return env


def _submit(args: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "sao_megatron.cli", "submit", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    match = re.search(r"submitted job (\d+)", out.stdout)
    assert match, out.stdout
    return match.group(1)


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def _wait(job_id: str, timeout_s: float, until=lambda job: False, poll_s: float = 2.0) -> dict[str, str]:
    """Poll until the job ends (or ``until(job)``); cancel it and fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = _job(job_id)
        if job.get("JobState") in (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        ):
            return job
        if until(job):
            return job
        time.sleep(poll_s)
    subprocess.run(["scancel", job_id], timeout=30)
    raise AssertionError(f"job {job_id} still {_job(job_id).get('JobState')} after {timeout_s:.0f} s; cancelled")


def _logs(run_dir: Path, job_id: str) -> str:
    parts = []
    for path in sorted((run_dir / "slurm").rglob("*")):
        if path.is_file():
            parts.append(f"--- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:]))
    return "\n".join(parts)


def _assert_ray_gone(env: dict[str, str]) -> None:
    """No process of the job's Ray (found by its private temp dir) survives; then remove the dir."""
    leftover = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(env["SAO_RAY_TMP"] in part for part in proc.info["cmdline"] or []):
            leftover.append(proc.info["pid"])
    assert not leftover, f"Ray processes of the job still running: {leftover}"
    shutil.rmtree(env["SAO_RAY_TMP"], ignore_errors=True)


def test_usr1_before_time_limit_reaches_the_driver_as_sigint(tmp_path):
    """``--signal=B:USR1@120`` goes to the batch shell only; the launcher forwards it (stub driver).
    On one node the Ray head is on 127.0.0.1."""
    run_dir, marker = tmp_path / "run", tmp_path / "marker"
    env = _env(tmp_path, SAO_TRAIN=f"{sys.executable} {STUB} {marker}")
    job_id = _submit([*TINY, f"run.run_dir={run_dir}"], env)
    _wait(job_id, 300, until=lambda job: marker.exists())
    assert marker.read_text().strip() == "started", _logs(run_dir, job_id)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    job = _wait(job_id, 120)
    logs = _logs(run_dir, job_id)
    assert job["JobState"] == "COMPLETED", logs
    assert marker.read_text().strip() == "SIGINT", logs
    assert "received SIGUSR1" in logs
    job_dir = run_dir / "slurm" / f"job-{job_id}"
    assert "SAO_HEAD_ADDRESS=127.0.0.1:" in (job_dir / "topology.env").read_text()
    assert list(job_dir.glob("ray-head-*.log")), logs
    _assert_ray_gone(env)
