"""``sao submit``: render the Slurm job of a config and hand it to ``sbatch``.

The node groups (actor, critic, rollout) come from the config's ``cluster`` section
(:func:`sao_megatron.plan.role_nodes`); everything else the batch script needs travels as
``SAO_*`` environment variables, which ``sbatch`` exports to the job, together with
``cluster.env`` (exported on every node: sbatch passes its environment to the job, srun to every
step). ``--dry-run`` prints the ``sbatch`` command and then the exact commands the batch script
will run on each node group, produced by the batch script itself in its dry-run mode (one
source of truth).

Jobs are requeueable by default (``--requeue``) and start the driver as ``sao train
--resume-if-present``: a job Slurm restarts continues from the run's latest complete
checkpoint. ``--signal=B:USR1@<grace>`` gives the driver :func:`signal_grace_s` seconds before
the time limit to checkpoint, from the checkpoint size and ``cluster.checkpoint_gb_per_s``.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sao_megatron.config import REPO_ROOT, ParallelConfig, SAOConfig, load_config
from sao_megatron.plan import GiB, role_nodes, stage_parameters, uses_critic

SBATCH_SCRIPT = REPO_ROOT / "launch" / "slurm" / "sao.sbatch"
GRACE_FLOOR_S = 120
"""Seconds before the time limit besides the checkpoint write: the step in flight finishes (a stop
never splits a step), rollouts stop and the driver reaches its save."""
SLURM_MAX_SIGNAL_S = 65535
"""The largest ``--signal=...@TIME`` Slurm accepts."""


def checkpoint_bytes(cfg: SAOConfig) -> dict[str, int]:
    """Bytes of one checkpoint per training role, from ``sao plan``'s parameter accounting
    (:func:`sao_megatron.plan.stage_parameters` on the unsharded layout; memory model of
    :mod:`sao_megatron.plan.memory`): every parameter once in the role's dtype (2 bytes bf16, 4
    fp32) plus Adam state of the trainable ones (12 bytes bf16: fp32 master, m, v; 8 fp32). A
    distributed checkpoint stores each tensor once whatever the layout, so DP replicas add nothing."""
    out = {}
    for role in ("actor", "critic") if uses_critic(cfg) else ("actor",):
        rc = getattr(cfg, role)
        params = stage_parameters(cfg.model, ParallelConfig(), 0, cfg.critic if role == "critic" else None)
        total = sum(n for n, _ in params.values())
        trainable = sum(n for n, t in params.values() if t)
        out[role] = total * (2 if rc.bf16 else 4) + trainable * (12 if rc.bf16 else 8)
    return out


def signal_grace_s(cfg: SAOConfig, nodes: dict[str, int]) -> int:
    """Seconds before the time limit Slurm signals the job (``--signal=B:USR1@<this>``).

    ``GRACE_FLOOR_S`` plus the checkpoint write time: the actor's and then the critic's bytes
    (:func:`checkpoint_bytes`; they are saved one after the other), each written by its node
    group at ``cluster.checkpoint_gb_per_s`` GiB/s per node (one shared node on CPU configs)."""
    rate = cfg.cluster.checkpoint_gb_per_s * GiB
    write_s = sum(b / (rate * max(1, nodes.get(role, 0))) for role, b in checkpoint_bytes(cfg).items())
    return min(SLURM_MAX_SIGNAL_S, GRACE_FLOOR_S + math.ceil(write_s))


def container_env(cfg: SAOConfig, run_dir: Path) -> dict[str, str]:
    """``SAO_CONTAINER_*`` for the batch script (empty without a container runtime). The checkout
    and the run directory are always mounted at their host paths (the driver writes checkpoints
    there; the script runs from the checkout).

    An image's own variables take precedence over the job's in both runtimes, so ``cluster.env``
    is forced through: pyxis gets the names as ``--container-env`` (``SAO_CONTAINER_ENV``),
    Apptainer reads ``APPTAINERENV_<NAME>``."""
    c, env = cfg.cluster.container, cfg.cluster.env
    if c.runtime == "none":
        return {}
    mounts = list(c.mounts)
    for path in (str(REPO_ROOT), str(run_dir)):
        if not any(m.split(":")[0] == path for m in mounts):
            mounts.append(path)
    out = {
        "SAO_CONTAINER_RUNTIME": c.runtime,
        "SAO_CONTAINER_IMAGE": c.image,
        "SAO_CONTAINER_MOUNTS": ",".join(mounts),
        "SAO_CONTAINER_WORKDIR": c.workdir or str(REPO_ROOT),
    }
    if c.runtime == "pyxis" and env:
        out["SAO_CONTAINER_ENV"] = ",".join(env)
    if c.runtime == "apptainer":
        out |= {f"APPTAINERENV_{name}": str(value) for name, value in env.items()}
    return out


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
    grace_s: int = GRACE_FLOOR_S
    requeue: bool = True

    @property
    def num_nodes(self) -> int:
        return max(1, sum(self.nodes.values()))

    def command(self) -> str:
        """The submission as one shell line (environment assignments, then sbatch)."""
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{assigns} {shlex.join(self.sbatch + [str(SBATCH_SCRIPT)] + self.train_args)}"


def render(
    config: str | None,
    overrides: list[str],
    sbatch_args: Sequence[str] = (),
    resume: str | None = None,
    requeue: bool = True,
) -> Job:
    """Resolve the config (validating it) and build the ``sbatch`` command line.

    The run directory is fixed here (``run.run_dir``, the ``--resume`` directory, or
    ``<output_dir>/<name>-<timestamp>``) and passed to ``sao train`` as an override, so the job's
    logs (``<run_dir>/slurm/``) sit next to its checkpoints. With ``requeue`` the job may be
    restarted by Slurm (``--requeue``, output appended) and the driver runs ``sao train
    --resume-if-present``; ``sbatch_args`` come last, so they override any option set here."""
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
        **container_env(cfg, run_dir),
        **{name: str(value) for name, value in cfg.cluster.env.items()},
    }
    grace = signal_grace_s(cfg, nodes)
    sbatch = [
        "sbatch",
        "--parsable",
        f"--job-name=sao-{cfg.run.name}",
        f"--nodes={max(1, sum(nodes.values()))}",
        f"--output={log_dir}/%x-%j.out",
        f"--signal=B:USR1@{grace}",
    ]
    sbatch += ["--requeue", "--open-mode=append"] if requeue else ["--no-requeue"]
    if cfg.cluster.gpus_per_node:
        sbatch.append(f"--gpus-per-node={cfg.cluster.gpus_per_node}")
    sbatch += list(sbatch_args)
    if resume:
        train_args = ["--resume", str(run_dir)]
    else:
        train_args = ["--resume-if-present"] if requeue else []
    if config is not None:
        train_args.append(str(Path(config).absolute()))
    train_args += overrides
    if not any(o.startswith("run.run_dir=") for o in overrides):
        train_args.append(f"run.run_dir={run_dir}")
    return Job(cfg, nodes, run_dir, log_dir, env, sbatch, train_args, grace, requeue)


def describe(job: Job) -> list[str]:
    """Comment lines on what the submission sets up besides the node groups."""
    c = job.cfg.cluster
    sizes = ", ".join(
        f"{role} {b / GiB:,.1f} GiB" if b >= GiB else f"{role} {b / 2**20:,.1f} MiB"
        for role, b in checkpoint_bytes(job.cfg).items()
    )
    lines = [
        f"# requeue: {
            'on: a restarted job resumes from the latest complete checkpoint (sao train --resume-if-present)'
            if job.requeue
            else 'off (--no-requeue)'
        }",
        f"# signal: SIGUSR1 {job.grace_s} s before the time limit = {GRACE_FLOOR_S} s + checkpoint ({sizes}) at "
        f"cluster.checkpoint_gb_per_s={c.checkpoint_gb_per_s:g} GiB/s per node",
    ]
    k = c.container
    if k.runtime == "none":
        lines.append("# container: none (commands run on the host)")
    else:
        lines.append(
            f"# container: {k.runtime} image {k.image}, mounts {job.env['SAO_CONTAINER_MOUNTS']}, "
            f"workdir {job.env['SAO_CONTAINER_WORKDIR']}"
        )
    if c.env:
        lines.append("# cluster.env, exported on every node before Ray starts (sbatch -> job -> every srun step):")
        lines += [f"export {name}={shlex.quote(str(value))}" for name, value in c.env.items()]
    return lines


def dry_run(job: Job) -> str:
    """The submission and, per node group, the commands the batch script runs (placeholder nodes)."""
    names = [f"node{i + 1:02d}" for i in range(job.num_nodes)]
    env = dict(os.environ, **job.env, SAO_DRY_RUN="1", SAO_NODES=" ".join(names))
    proc = subprocess.run(
        ["bash", str(SBATCH_SCRIPT), *job.train_args], env=env, capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{SBATCH_SCRIPT} --dry-run failed: {proc.stderr.strip()}")
    groups = ", ".join(f"{k} {v}" for k, v in job.nodes.items()) if sum(job.nodes.values()) else "one shared node"
    return "\n".join(
        [
            f"# node groups: {groups} ({job.num_nodes} node(s)); run directory {job.run_dir}",
            *describe(job),
            job.command(),
            f"# the batch script then runs (nodes named {names[0]}..{names[-1]} here):",
            proc.stdout.rstrip(),
        ]
    )


def submit(job: Job) -> str:
    """Run ``sbatch``; returns the job id."""
    if shutil.which("sbatch") is None:
        raise RuntimeError("sbatch not found: run sao submit on a Slurm login node (or use --dry-run)")
    job.log_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create --output directories
    proc = subprocess.run(
        [*job.sbatch, str(SBATCH_SCRIPT), *job.train_args],
        env=dict(os.environ, **job.env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]
