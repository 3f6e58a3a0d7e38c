"""``sao submit``: requeue, the pre-timeout signal grace, containers and ``cluster.env``, as the
dry run prints them (no Slurm needed: the batch script renders its own commands)."""

import math
import os
import subprocess
import sys

import pytest

from sao_megatron import submit
from sao_megatron.cli import build_parser
from sao_megatron.config import REPO_ROOT, load_config
from sao_megatron.models.counting import parameter_counts
from sao_megatron.plan import GiB

BIG = "configs/moe_750b_a40b.yaml"
TINY = "configs/tiny_cpu.yaml"
PYXIS = 'cluster.container={runtime: pyxis, image: "nvcr.io#nvidia/pytorch:25.01-py3", mounts: [/lustre:/lustre]}'
APPTAINER = "cluster.container={runtime: apptainer, image: /images/sao.sif, mounts: ['/scratch:/scratch:ro']}"


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    """The dry run inherits this process's environment; SAO_* of the caller must not leak in."""
    for name in [n for n in os.environ if n.startswith(("SAO_", "SLURM_"))]:
        monkeypatch.delenv(name)


def _dry(tmp_path, config: str = TINY, *overrides: str, **kw) -> tuple[submit.Job, list[str]]:
    job = submit.render(config, [*overrides, f"run.run_dir={tmp_path}/run"], **kw)
    return job, submit.dry_run(job).splitlines()


def _line(lines: list[str], needle: str) -> str:
    return next(line for line in lines if needle in line)


def test_requeue_is_the_default_and_the_driver_resumes_if_a_checkpoint_is_present(tmp_path):
    job, lines = _dry(tmp_path)
    sbatch = _line(lines, " sbatch ")
    assert " --requeue --open-mode=append " in sbatch  # a restart appends to the same .out file
    assert f"sao.sbatch --resume-if-present {REPO_ROOT}/configs/tiny_cpu.yaml " in sbatch
    assert _line(lines, "# requeue:").startswith("# requeue: on: a restarted job resumes")
    driver = _line(lines, "env --default-signal=INT sao train ")
    assert driver.startswith("env --default-signal=INT sao train --resume-if-present ")
    assert job.requeue and build_parser().parse_args(["submit", TINY]).requeue


def test_no_requeue_runs_once_and_starts_fresh(tmp_path):
    assert build_parser().parse_args(["submit", TINY, "--no-requeue"]).requeue is False
    job, lines = _dry(tmp_path, requeue=False)
    sbatch = _line(lines, " sbatch ")
    assert " --no-requeue " in sbatch and "--requeue " not in sbatch.replace("--no-requeue", "")
    assert "--resume-if-present" not in "\n".join(lines)
    assert "# requeue: off (--no-requeue)" in lines


def test_explicit_resume_keeps_its_run_directory_across_restarts(tmp_path):
    job = submit.render(None, [], resume=str(tmp_path / "old"))
    assert job.train_args[:2] == ["--resume", str(tmp_path / "old")]
    assert "--resume-if-present" not in job.train_args
    assert f"run.run_dir={tmp_path / 'old'}" in job.train_args


def test_signal_grace_is_the_floor_plus_the_checkpoint_write_time(tmp_path):
    cfg = load_config(BIG)
    sizes = submit.checkpoint_bytes(cfg)
    # weights (bf16) + Adam state (fp32 master, m, v) of every actor parameter; the critic has a
    # value head instead of the LM head and freezes attention, so it holds less optimizer state
    assert sizes["actor"] == parameter_counts(cfg.model)["total"] * (2 + 12)
    assert sizes["critic"] < sizes["actor"]
    nodes = {"actor": 32, "critic": 32, "rollout": 32}
    write_s = sizes["actor"] / (2 * GiB * 32) + sizes["critic"] / (2 * GiB * 32)
    assert submit.signal_grace_s(cfg, nodes) == 120 + math.ceil(write_s) == 419
    job, lines = _dry(tmp_path, BIG)
    assert " --signal=B:USR1@419 " in _line(lines, " sbatch ")
    assert _line(lines, "# signal:").startswith("# signal: SIGUSR1 419 s before the time limit = 120 s + checkpoint")
    faster = submit.render(BIG, ["cluster.checkpoint_gb_per_s=8"])
    assert faster.grace_s == 120 + math.ceil(write_s / 4)


def test_signal_grace_floor_and_slurm_ceiling(tmp_path):
    assert submit.render(TINY, []).grace_s == 121  # a few MB: the floor plus one second
    slow = submit.render(BIG, ["cluster.checkpoint_gb_per_s=0.001"])
    assert slow.grace_s == submit.SLURM_MAX_SIGNAL_S
    assert f"--signal=B:USR1@{submit.SLURM_MAX_SIGNAL_S}" in slow.sbatch


def test_sbatch_args_come_last_and_override(tmp_path):
    job = submit.render(TINY, [], sbatch_args=["--signal=B:USR1@900", "--partition=gpu"])
    assert job.sbatch[-2:] == ["--signal=B:USR1@900", "--partition=gpu"]


def test_cluster_env_is_exported_to_every_node_and_printed(tmp_path):
    env = "cluster.env={NCCL_IB_HCA: mlx5, NCCL_SOCKET_IFNAME: ib0, NCCL_IB_TIMEOUT: 22, NCCL_DEBUG: 'WARN x'}"
    job, lines = _dry(tmp_path, TINY, env)
    assert job.env["NCCL_IB_HCA"] == "mlx5" and job.env["NCCL_IB_TIMEOUT"] == "22"
    assert "export NCCL_IB_HCA=mlx5" in lines and "export NCCL_SOCKET_IFNAME=ib0" in lines
    assert "export NCCL_DEBUG='WARN x'" in lines
    sbatch = _line(lines, " sbatch ")
    assert "NCCL_IB_HCA=mlx5 NCCL_SOCKET_IFNAME=ib0 NCCL_IB_TIMEOUT=22 NCCL_DEBUG='WARN x' sbatch " in sbatch
    _, plain = _dry(tmp_path)
    assert not any(line.startswith("export NCCL") for line in plain)


# ray start, with the CPU count read on each node inside its srun step
RAY_START = (
    """bash -c 'exec ray start --num-cpus="${SAO_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-$(nproc)}}" "$@"' ray-start"""
)


def test_pyxis_wraps_every_srun_and_runs_the_driver_as_a_step(tmp_path):
    job, lines = _dry(tmp_path, BIG, PYXIS)
    opts = (
        "'--container-image=nvcr.io#nvidia/pytorch:25.01-py3' "
        f"--container-workdir={REPO_ROOT} --container-mounts=/lustre:/lustre,{REPO_ROOT},{tmp_path}/run"
    )
    sruns = [line for line in lines if line.startswith("srun ")]
    assert len(sruns) == 4 and all(f" {opts} {RAY_START} " in line for line in sruns)
    driver = _line(lines, "env --default-signal=INT ")
    assert driver.startswith(
        f"env --default-signal=INT srun --nodes=1 --ntasks=1 --overlap --nodelist=node01 {opts} "
        "sao train --resume-if-present "
    )
    assert f"until srun --nodes=1 --ntasks=1 --overlap --nodelist=node01 {opts} ray status " in _line(lines, "# wait")
    assert "# on SIGUSR1/SIGTERM/SIGINT: kill -USR1 <driver pid>; wait for it" in lines  # srun relays USR1
    assert "SAO_CONTAINER_RUNTIME=pyxis " in _line(lines, " sbatch ")
    assert _line(lines, "# container:").startswith("# container: pyxis image nvcr.io#nvidia/pytorch:25.01-py3")


def test_apptainer_prefixes_every_command_with_gpus_on_gpu_nodes(tmp_path):
    _, lines = _dry(tmp_path, BIG, APPTAINER)
    prefix = (
        f"apptainer exec --nv --bind /scratch:/scratch:ro,{REPO_ROOT},{tmp_path}/run --pwd {REPO_ROOT} /images/sao.sif"
    )
    sruns = [line for line in lines if line.startswith("srun ")]
    assert len(sruns) == 4 and all(f" {prefix} {RAY_START} " in line for line in sruns)
    assert _line(lines, "env --default-signal=INT ").startswith(f"env --default-signal=INT {prefix} sao train ")
    _, cpu = _dry(tmp_path, TINY, APPTAINER)
    assert " --nv " not in "\n".join(cpu)  # CPU-only nodes: no GPU passthrough


def test_no_container_leaves_the_commands_on_the_host(tmp_path):
    _, lines = _dry(tmp_path)
    text = "\n".join(lines)
    assert "--container" not in text and "apptainer" not in text
    assert "# container: none (commands run on the host)" in lines


def test_sbatch_rejects_an_unknown_runtime_or_a_missing_image(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SAO_", "SLURM_"))}
    base.update(SAO_DRY_RUN="1", SAO_NODES="n1", SAO_LOG_DIR=str(tmp_path))
    for extra, message in (
        ({"SAO_CONTAINER_RUNTIME": "docker"}, "use none, pyxis or apptainer"),
        ({"SAO_CONTAINER_RUNTIME": "pyxis"}, "needs SAO_CONTAINER_IMAGE"),
    ):
        out = subprocess.run(
            ["bash", str(submit.SBATCH_SCRIPT), "cfg.yaml"],
            env={**base, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_restarted_job_logs_into_its_own_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAO_", "SLURM_"))}
    env.update(SAO_DRY_RUN="1", SAO_NODES="n1", SAO_LOG_DIR=str(tmp_path), SLURM_JOB_ID="42", SLURM_RESTART_COUNT="2")
    out = subprocess.run(
        ["bash", str(submit.SBATCH_SCRIPT), "cfg.yaml"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert f"export SAO_JOB_LOG_DIR={tmp_path}/job-42-restart2" in out.stdout.splitlines()


def test_cli_dry_run_prints_everything_and_config_errors_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAO_", "SLURM_"))}
    cmd = [
        sys.executable,
        "-m",
        "sao_megatron.cli",
        "submit",
        BIG,
        PYXIS,
        "cluster.env={NCCL_IB_HCA: mlx5}",
        f"run.run_dir={tmp_path}/run",
        "--dry-run",
    ]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for needle in (
        "--requeue",
        "--signal=B:USR1@419",
        "--container-image=",
        "export NCCL_IB_HCA=mlx5",
        "--nodes=96",
        "sao train --resume-if-present",
    ):
        assert needle in out.stdout, needle
    bad = subprocess.run(
        [*cmd[:4], "cluster.container.runtime=pyxis", "--dry-run"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "config error: cluster.container.runtime=pyxis needs cluster.container.image" in bad.stderr


def test_cluster_env_beats_the_image_environment_in_containers(tmp_path):
    """Both runtimes let an image's own variables win over the job's; cluster.env is forced through."""
    env = "cluster.env={NCCL_IB_HCA: mlx5, NCCL_SOCKET_IFNAME: ib0}"
    _, lines = _dry(tmp_path, BIG, PYXIS, env)
    sruns = [line for line in lines if line.startswith("srun ")]
    assert all(" --container-env=NCCL_IB_HCA,NCCL_SOCKET_IFNAME " in line for line in sruns)
    assert " --container-env=NCCL_IB_HCA,NCCL_SOCKET_IFNAME " in _line(lines, "env --default-signal=INT ")
    job, lines = _dry(tmp_path, BIG, APPTAINER, env)
    assert job.env["APPTAINERENV_NCCL_IB_HCA"] == "mlx5" and job.env["NCCL_IB_HCA"] == "mlx5"
    assert "APPTAINERENV_NCCL_SOCKET_IFNAME=ib0 " in _line(lines, " sbatch ")
    _, plain = _dry(tmp_path, BIG, PYXIS)
    assert "--container-env" not in "\n".join(plain)
