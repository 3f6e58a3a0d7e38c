"""``sao submit``: render the Slurm job of a config and hand it to ``sbatch``.

The node groups (actor, critic, rollout) come from the config's ``cluster`` section
(:func:`sao_megatron.plan.role_nodes`); everything else the batch script needs travels as
``SAO_*`` environment variables, which ``sbatch`` exports to the job. ``--dry-run`` prints the
``sbatch`` command and then the exact commands the batch script will run on each node group,
produced by the batch script itself in its dry-run mode (one source of truth).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sao_megatron.config import REPO_ROOT, SAOConfig, load_config
from sao_megatron.plan import role_nodes

SBATCH_SCRIPT = REPO_ROOT / "launch" / "slurm" / "sao.sbatch"


@dataclass
class Job:
    """A rendered submission: ``env`` + ``sbatch`` + the batch script's ``sao train`` arguments."""

    cfg: SAOConfig
    nodes: dict[str, int]
    run_dir: Path
    log_dir: Path
    env: dict[str, str]
    sbatch: list[str]
    train_args: list[str] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return max(1, sum(self.nodes.values()))

    def command(self) -> str:
        """The submission as one shell line (environment assignments, then sbatch)."""
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{assigns} {shlex.join(self.sbatch + [str(SBATCH_SCRIPT)] + self.train_args)}"


def render(config: str | None, overrides: list[str], sbatch_args: Sequence[str] = (),
           resume: str | None = None) -> Job:  # fmt: skip
    """Resolve the config (validating it) and build the ``sbatch`` command line.

    The run directory is fixed here (``run.run_dir``, the ``--resume`` directory, or
    ``<output_dir>/<name>-<timestamp>``) and passed to ``sao train`` as an override, so the job's
    logs (``<run_dir>/slurm/``) sit next to its checkpoints."""
    cfg = load_config(config, overrides)
    if resume:
        run_dir = Path(resume)
    elif cfg.run.run_dir:
        run_dir = Path(cfg.run.run_dir)
    else:
        run_dir = Path(cfg.run.output_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = run_dir.absolute()
    log_dir = run_dir / "slurm"
    nodes = role_nodes(cfg)
    env = {
        "SAO_ROOT": str(REPO_ROOT),
        "SAO_ACTOR_NODES": str(nodes["actor"]),
        "SAO_CRITIC_NODES": str(nodes["critic"]),
        "SAO_ROLLOUT_NODES": str(nodes["rollout"]),
        "SAO_GPUS_PER_NODE": str(cfg.cluster.gpus_per_node),
        "SAO_LOG_DIR": str(log_dir),
    }
    sbatch = ["sbatch", "--parsable", f"--job-name=sao-{cfg.run.name}", f"--nodes={max(1, sum(nodes.values()))}",
              f"--output={log_dir}/%x-%j.out"]  # fmt: skip
    if cfg.cluster.gpus_per_node:
        sbatch.append(f"--gpus-per-node={cfg.cluster.gpus_per_node}")
    sbatch += list(sbatch_args)
    train_args = ["--resume", str(run_dir)] if resume else []
    if config is not None:
        train_args.append(str(Path(config).absolute()))
    train_args += overrides
    if not any(o.startswith("run.run_dir=") for o in overrides):
        train_args.append(f"run.run_dir={run_dir}")
    return Job(cfg, nodes, run_dir, log_dir, env, sbatch, train_args)


def dry_run(job: Job) -> str:
    """The submission and, per node group, the commands the batch script runs (placeholder nodes)."""
    names = [f"node{i + 1:02d}" for i in range(job.num_nodes)]
    env = dict(os.environ, **job.env, SAO_DRY_RUN="1", SAO_NODES=" ".join(names))
    proc = subprocess.run(["bash", str(SBATCH_SCRIPT), *job.train_args], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{SBATCH_SCRIPT} --dry-run failed: {proc.stderr.strip()}")
    groups = (
        ", ".join(f"{k} {v}" for k, v in job.nodes.items()) if sum(job.nodes.values()) else "one shared node"
    )
    return "\n".join([
        f"# node groups: {groups} ({job.num_nodes} node(s)); run directory {job.run_dir}",
        job.command(),
        f"# the batch script then runs (nodes named {names[0]}..{names[-1]} here):",
        proc.stdout.rstrip(),
    ])  # fmt: skip


def submit(job: Job) -> str:
    """Run ``sbatch``; returns the job id."""
    if shutil.which("sbatch") is None:
        raise RuntimeError("sbatch not found: run sao submit on a Slurm login node (or use --dry-run)")
    job.log_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create --output directories
    proc = subprocess.run([*job.sbatch, str(SBATCH_SCRIPT), *job.train_args], env=dict(os.environ, **job.env),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]
