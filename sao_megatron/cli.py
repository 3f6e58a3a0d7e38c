"""The ``sao`` command.

    sao train [CONFIG] [key.sub=value ...]   train (default config: configs/tiny_cpu.yaml)
    sao config [CONFIG] [key=value ...]      print the resolved configuration
    sao plan [CONFIG] [key=value ...]        parameter counts and parallel layouts per role
    sao convert ...                          HF <-> Megatron checkpoints
    sao export RUN_DIR [--step N] OUT_DIR     a run's actor as an HF checkpoint
    sao swe import RECORDS --repos DIR --out F  SWE-bench records as a task file of the swe env

Configuration errors exit with status 2 and one line naming the key and the fix, before any
process starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import yaml

from sao_megatron.cli_checkpoints import add_convert_parser, add_export_parser
from sao_megatron.cli_swe import add_swe_parser
from sao_megatron.config import ConfigError, SAOConfig, load_config, save_config, to_dict
from sao_megatron.config.load import check_init_from, check_init_tokenizer
from sao_megatron.faults import DRIVER_PID
from sao_megatron.logs import quiet_third_party

EPILOG = """examples:
  sao train                                   # tiny MoE on CPU, configs/tiny_cpu.yaml
  sao train configs/tiny_cpu.yaml actor.optim.lr=5e-4 critic.parallel.world_size=2
  sao config configs/tiny_cpu.yaml actor.parallel.tensor_parallel=2
  sao plan configs/tiny_cpu.yaml
"""


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="run YAML (default: configs/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. actor.optim.lr=1e-5")


def _split_config_arg(args) -> tuple[str | None, list[str]]:
    """Allow ``sao train key=value`` with no config file."""
    if args.config is not None and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def _load(args) -> SAOConfig:
    path, overrides = _split_config_arg(args)
    return load_config(path, overrides)


def _run_dir(cfg: SAOConfig) -> Path:
    if cfg.run.run_dir:
        return Path(cfg.run.run_dir)
    return Path(cfg.run.output_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _tools_from(cfg: SAOConfig) -> str:
    """What declares tools for this run (``rollout.env=NAME`` / ``data.tools_field=F``), or ''."""
    if cfg.data.train and cfg.data.tools_field:
        return f"data.tools_field={cfg.data.tools_field}"
    from sao_megatron.envs.registry import make_env

    try:
        env = make_env(cfg.rollout.env, **cfg.rollout.env_kwargs)
    except Exception:  # reported where the run builds its environments
        return ""
    return f"rollout.env={cfg.rollout.env}" if getattr(env, "tools", None) else ""


def resume_if_present(cfg: SAOConfig) -> Path | None:
    """``sao train --resume-if-present``: ``run.run_dir`` when it holds a complete checkpoint
    (a Slurm restart of a requeued job, or a resubmission), else None (a fresh run there).

    A half-written checkpoint (``checkpoint.staging/``) never counts:
    :meth:`RunState.complete_checkpoint` decides."""
    from sao_megatron.driver.run_state import RunState

    if not cfg.run.run_dir:
        raise ConfigError(
            "sao train --resume-if-present needs run.run_dir=DIR (where to look for a "
            "checkpoint and where a fresh run writes); sao submit sets it"
        )
    run_dir = Path(cfg.run.run_dir)
    checkpoint = RunState.complete_checkpoint(run_dir)
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    if checkpoint is None:
        print(f"no complete checkpoint in {run_dir} (Slurm restart count {restart}): starting a fresh run")
        return None
    print(f"resuming from the complete checkpoint {checkpoint} (Slurm restart count {restart})")
    return run_dir


def cmd_train(args) -> int:
    if args.resume == "auto":  # the same decision as --resume-if-present
        args.resume, args.resume_if_present = None, True
    if args.resume_if_present:
        args.resume = resume_if_present(_load(args))
    if args.resume:
        run_dir = Path(args.resume)
        path, overrides = _split_config_arg(args)
        if path is None:
            # The run's own config; the Ray cluster it ran on is gone (the launchers pass the new one).
            cfg = load_config(run_dir / "config.yaml", ["cluster.ray_address=", *overrides])
        else:
            cfg = load_config(path, overrides)
    else:
        cfg = _load(args)
        check_init_from(cfg)  # a missing checkpoint fails before a run directory is made
        check_init_tokenizer(cfg, _tools_from(cfg))  # ... and one without a fitting tokenizer
        run_dir = _run_dir(cfg)
    if cfg.data.train:  # every row, before any process starts (ConfigError: file:line and the fix)
        from sao_megatron.envs.dataset import check_data

        rows = check_data(cfg.data)
        print("data: " + ", ".join(f"{split} {n} rows" for split, n in rows.items()))
    print(f"run directory: {run_dir}")
    os.environ[DRIVER_PID] = str(os.getpid())  # before Ray starts: a fault point in a worker kills the run
    import asyncio

    from sao_megatron.pipeline import train

    t0 = time.perf_counter()
    try:
        result = asyncio.run(train(cfg, run_dir, resume=bool(args.resume)))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print(
            f"stopped by a signal; checkpoint in {run_dir / 'checkpoint'}; continue with "
            f"'sao train --resume {run_dir}'",
            file=sys.stderr,
        )
        return 143
    wall = time.perf_counter() - t0
    initial, final = result["initial"] or {}, result["final"] or {}
    if "eval/accuracy" in initial or "eval/accuracy" in final:
        accuracy = (
            f"held-out accuracy {initial.get('eval/accuracy', float('nan')):.3f} (start of RL) -> "
            f"{final.get('eval/accuracy', float('nan')):.3f} (end)"
        )
    else:
        accuracy = "no held-out evaluation (train.eval_prompts=0)"
    print(f"done in {wall / 60:.1f} min: {accuracy}; report: sao report {run_dir}")
    sampled = ("eval/mean_accuracy@", "eval/pass@")
    for key in sorted(k for k in {*initial, *final} if k.startswith(sampled) and not k.endswith("_se")):
        print(
            f"  held-out {key.removeprefix('eval/')} at temperature {cfg.train.eval_sample_temperature:g}: "
            f"{initial.get(key, float('nan')):.3f} (start of RL) -> {final.get(key, float('nan')):.3f} (end)"
        )
    if args.report:
        from sao_megatron.report import write_report

        print(write_report(run_dir))
    return 0


def cmd_check(args) -> int:
    cfg = _load(args)
    if args.mismatch:
        return _check_mismatch(cfg, args.episodes)
    run_dir = _run_dir(cfg)
    save_config(cfg, run_dir)
    print(f"run directory: {run_dir} (resolved config: {run_dir / 'config.yaml'})")
    print("foundation check: one real actor step and critic steps on a synthetic batch per role world")
    from sao_megatron.driver import smoke

    t0 = time.perf_counter()
    report = smoke.run(cfg, run_dir)
    report["wall_s"] = time.perf_counter() - t0
    (run_dir / "foundation_check.json").write_text(json.dumps(report, indent=2))
    a, c = report["actor"], report["critic"]
    print(
        f"actor  ({cfg.actor.parallel.world_size} ranks): next-token NLL {a['nll_before']:.4f} -> "
        f"{a['nll_after']:.4f} after 1 step, grad norm {a['grad_norm']:.3f}, "
        f"params on rank 0 {a['params_on_rank']['total']:,}"
    )
    print(
        f"critic ({cfg.critic.parallel.world_size} ranks): value loss {c['value_loss_before']:.4f} -> "
        f"{c['value_loss_after']:.4f} after {cfg.critic.updates_per_step} steps, trainable "
        f"{c['params_on_rank']['trainable']:,} of {c['params_on_rank']['total']:,} on rank 0 "
        "(attention frozen)"
    )
    print(f"done in {report['wall_s']:.1f} s; report: {run_dir / 'foundation_check.json'}")
    return 0


def _check_mismatch(cfg, episodes: int) -> int:
    """``sao check --mismatch`` (:mod:`sao_megatron.driver.mismatch`)."""
    if not cfg.model.num_experts:
        raise ConfigError("sao check --mismatch needs an MoE model, but model.num_experts=0; drop --mismatch")
    if episodes < 1:
        raise ConfigError(f"sao check --mismatch --episodes {episodes}: give at least 1")
    import asyncio

    from sao_megatron.driver.mismatch import mismatch_check, render

    run_dir = _run_dir(cfg)
    save_config(cfg, run_dir)
    print(f"run directory: {run_dir}")
    print("mismatch check: engine vs trainer logprobs and routes at the same weights, before any training")
    report = asyncio.run(mismatch_check(cfg, run_dir, episodes))
    (run_dir / "mismatch_check.json").write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"done in {report['wall_s']:.1f} s; report: {run_dir / 'mismatch_check.json'}")
    return 0


def cmd_report(args) -> int:
    from sao_megatron.report import write_report

    print(write_report(Path(args.run_dir)))
    return 0


def cmd_config(args) -> int:
    cfg = _load(args)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def cmd_plan(args) -> int:
    """Parameters and memory per GPU of every role; exit 1 with one line per role that does not fit."""
    from sao_megatron import plan
    from sao_megatron.plan import sync_traffic

    cfg = _load(args)
    result = plan.make_plan(cfg, analytic=args.analytic)
    print(plan.render(result))
    print(f"\n{sync_traffic.summary(cfg)}")
    for line in result.mismatches:
        print(f"warning: analytic per-rank count disagrees with the meta build: {line}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_json(result), indent=2))
    failures = result.failures()
    for line in failures:
        print(f"plan error: {line}", file=sys.stderr)
    return 1 if failures else 0


def cmd_simulate(args) -> int:
    """The pipeline simulator at the config's cluster scale (``plan/cluster_sim.py``)."""
    from sao_megatron.plan.cluster_sim import report

    return report(_load(args), args)


def cmd_sweep(args) -> int:
    """Every (arm, seed) of a sweep file not done yet, then the comparison table."""
    from sao_megatron.sweep import compare, finished_runs, load_sweep, run_sweep, wall_time

    sweep = load_sweep(args.sweep)
    runs = [r for r in sweep.runs() if not args.only or r[0] in args.only]
    if args.dry_run:
        runs = sweep.starts() + runs
        for arm, seed, run_dir in runs:
            state = "done" if (run_dir / "done.json").exists() else "to run"
            print(f"{arm} seed {seed} ({state}): {shlex.join(sweep.command(arm, seed, run_dir))}")
        return 0
    started = time.monotonic()
    results = run_sweep(sweep, parallel=args.parallel, only=args.only)
    wall_s = time.monotonic() - started
    failed = [r for r in results if r["exit"] != 0]
    runs = finished_runs(sweep)
    print(
        compare(runs, sweep.metrics, sweep.out_dir / f"compare_{sweep.name}", sweep.windows, sweep.paired_with)
        if runs
        else "no run finished"
    )
    seconds, n = wall_time(sweep)
    print(
        f"{sweep.name}: {n} finished runs (arms and their starts) took {seconds / 60:.1f} min of run time, "
        f"one after another; this command ran {wall_s / 60:.1f} min (--parallel {args.parallel})"
    )
    for r in failed:
        print(
            f"failed: {r['arm']} seed {r['seed']} (exit {r['exit']}); rerun the sweep to resume it",
            file=sys.stderr,
        )
    return 1 if failed else 0


def compare_options(args) -> dict:
    """``sao compare``'s arguments as :func:`sao_megatron.sweep.compare`'s keywords (but ``out_dir``);
    ``tests/test_results_table.py`` runs the README's quoted commands through it."""
    from sao_megatron.sweep import parse_window

    return {
        "paths": [Path(p) for p in args.runs],
        "metrics": args.metric or ["eval/accuracy"],
        "windows": [parse_window(w) for w in args.window or []],
        "paired_with": args.paired_with,
        "recoveries": args.recovery or [],
    }


def cmd_compare(args) -> int:
    """Mean +- standard error and 95% intervals over seeds, per arm, the runs' provenance and
    overlaid curves."""
    from sao_megatron.sweep import compare

    try:
        print(compare(**compare_options(args), out_dir=Path(args.out) if args.out else None))
    except ValueError as err:
        print(f"compare: {err}", file=sys.stderr)
        return 2
    if args.out:
        print(f"plots and compare.md in {args.out}")
    return 0


def cmd_submit(args) -> int:
    """Render the Slurm job of a config (node groups from its ``cluster`` section) and sbatch it."""
    import shlex

    from sao_megatron import submit

    path, overrides = _split_config_arg(args)
    extra = args.sbatch_args if args.sbatch_args is not None else os.environ.get("SAO_SBATCH_ARGS", "")
    job = submit.render(path, overrides, shlex.split(extra), resume=args.resume, requeue=args.requeue)
    if args.dry_run:
        print(submit.dry_run(job))
        return 0
    try:
        job_id = submit.submit(job)
    except RuntimeError as err:
        print(f"submit error: {err}", file=sys.stderr)
        return 1
    print(
        f"submitted job {job_id}: {job.num_nodes} node(s); logs in {job.log_dir}/job-{job_id}/ "
        f"(train.log, ray-*.log); run directory {job.run_dir}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sao",
        description="Asynchronous single-rollout agentic RL (SAO) for MoE models on Megatron-Core.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, fn, text in (
        ("train", cmd_train, "SFT -> value pretraining -> asynchronous SAO (default: the tiny MoE on CPU)"),
        ("check", cmd_check, "build actor and critic at their layouts and take real optimizer steps"),
        ("config", cmd_config, "print the resolved configuration"),
        ("plan", cmd_plan, "parameters and memory per GPU of every role; fails when a role does not fit"),
        ("submit", cmd_submit, "submit a multi-node run to Slurm (launch/slurm/sao.sbatch)"),
        ("simulate", cmd_simulate, "predict throughput and policy lag at cluster scale; the best GPU split"),
    ):
        p = sub.add_parser(
            name, help=text, description=text, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        _add_config_args(p)
        p.set_defaults(fn=fn)
        if name == "train":
            resume = p.add_mutually_exclusive_group()
            resume.add_argument(
                "--resume",
                metavar="RUN_DIR",
                help="continue the run in RUN_DIR from its checkpoint ('auto': as --resume-if-present)",
            )
            resume.add_argument(
                "--resume-if-present",
                action="store_true",
                help="continue from run.run_dir's complete checkpoint when it has one, else start "
                "a fresh run there (what sao submit's jobs do, so a requeued job resumes)",
            )
            p.add_argument("--report", action="store_true", help="write plots and the summary at the end")
        if name == "check":
            p.add_argument(
                "--mismatch",
                action="store_true",
                help="instead: generate on the engines and compare their logprobs and MoE routes with the "
                "actor's at the same weights, with and without routing replay (docs/training.md)",
            )
            p.add_argument("--episodes", type=int, default=16, help="episodes the mismatch check generates")
        if name == "plan":
            p.add_argument(
                "--analytic",
                action="store_true",
                help="count per-rank parameters in closed form instead of a meta-device build",
            )
            p.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
        if name == "simulate":
            for flag, default, text in (
                ("--turns", 8.0, "median turns per episode"),
                ("--tokens", 512.0, "median action tokens per turn"),
                ("--tool-latency-s", 2.0, "median tool latency"),
                ("--sigma", 1.0, "lognormal sigma (tail weight)"),
                ("--hbm-gb-per-s", 3350.0, "GPU memory bandwidth (assumed H100)"),
                ("--peak-tflops", 989.0, "GPU bf16 peak (assumed H100)"),
                ("--mfu", 0.35, "training MFU"),
                ("--lag-bound", 2.0, "largest mean policy lag a split may have"),
            ):
                p.add_argument(flag, type=float, default=default, help=f"{text} (default {default:g})")
            p.add_argument("--steps", type=int, default=40, help="learner steps simulated")
            p.add_argument("--warmup", type=int, default=5, help="steps left out of the rates")
        if name == "submit":
            p.add_argument("--dry-run", action="store_true", help="print sbatch and the per-node commands")
            p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR (its checkpoint)")
            p.add_argument(
                "--requeue",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="let Slurm restart the job (preemption, node failure, scontrol requeue); a "
                "restarted job resumes from its latest complete checkpoint (default: on)",
            )
            p.add_argument(
                "--sbatch-args",
                default=None,
                help="extra sbatch options, e.g. '--partition=gpu --time=48:00:00' (default: $SAO_SBATCH_ARGS)",
            )
    p = sub.add_parser("sweep", help="run a grid of arms x seeds (resumable), then compare them")
    p.add_argument("sweep", help="a sweep file (configs/experiments/*.yaml)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--only", nargs="+", metavar="ARM", help="run only these arms")
    p.add_argument("--dry-run", action="store_true", help="print each run's command and whether it is done")
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser(
        "compare",
        help="curves and a table (mean +- s.e., 95%% CI over seeds) of runs by arm, with their start, end and commit",
    )
    p.add_argument("runs", nargs="+", help="a sweep's out_dir, or run directories (<arm>/seed<s>)")
    p.add_argument("--metric", action="append", help="metric to compare (repeatable; default eval/accuracy)")
    p.add_argument(
        "--window",
        action="append",
        metavar="FIRST-LAST",
        help="also each metric's mean over these RL steps, e.g. 11-15 (repeatable)",
    )
    p.add_argument(
        "--paired-with",
        metavar="ARM",
        help="also each arm's final value minus this arm's, seed by seed (mean +- s.e. of the differences)",
    )
    p.add_argument(
        "--recovery",
        action="append",
        type=int,
        metavar="STEP",
        help="also the RL steps each metric takes to regain 90%% of its level before STEP, the first step "
        "of a new reward (repeatable; a run that never does counts one step past its end)",
    )
    p.add_argument("--out", help="directory for compare.md and one PNG per metric")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("report", help="plots and a summary table of a run directory")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_report)
    add_convert_parser(sub)
    add_export_parser(sub)
    add_swe_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    quiet_third_party()  # before anything imports Megatron: some notices fire at import time
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 0
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
