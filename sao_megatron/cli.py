"""The ``sao`` command.

    sao train [CONFIG] [key.sub=value ...]   train (default config: configs/tiny_cpu.yaml)
    sao config [CONFIG] [key=value ...]      print the resolved configuration
    sao plan [CONFIG] [key=value ...]        parameter counts and parallel layouts per role
    sao convert ...                          HF <-> Megatron checkpoints

Configuration errors exit with status 2 and one line naming the key and the fix, before any
process starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from sao_megatron.config import ConfigError, SAOConfig, load_config, save_config, to_dict

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


def cmd_train(args) -> int:
    cfg = _load(args)
    run_dir = _run_dir(cfg)
    save_config(cfg, run_dir)
    print(f"run directory: {run_dir} (resolved config: {run_dir / 'config.yaml'})")
    print("foundation check: one real actor step and critic steps on a synthetic batch "
          "(the asynchronous SAO loop is not built yet)")  # fmt: skip
    from sao_megatron.train import smoke

    t0 = time.perf_counter()
    report = smoke.run(cfg, run_dir)
    report["wall_s"] = time.perf_counter() - t0
    (run_dir / "foundation_check.json").write_text(json.dumps(report, indent=2))
    a, c = report["actor"], report["critic"]
    print(f"actor  ({cfg.actor.parallel.world_size} ranks): next-token NLL {a['nll_before']:.4f} -> "
          f"{a['nll_after']:.4f} after 1 step, grad norm {a['grad_norm']:.3f}, "
          f"params on rank 0 {a['params_on_rank']['total']:,}")  # fmt: skip
    print(f"critic ({cfg.critic.parallel.world_size} ranks): value loss {c['value_loss_before']:.4f} -> "
          f"{c['value_loss_after']:.4f} after {cfg.critic.updates_per_step} steps, trainable "
          f"{c['params_on_rank']['trainable']:,} of {c['params_on_rank']['total']:,} on rank 0 "
          "(attention frozen)")  # fmt: skip
    print(f"done in {report['wall_s']:.1f} s; report: {run_dir / 'foundation_check.json'}")
    return 0


def cmd_config(args) -> int:
    cfg = _load(args)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def cmd_plan(args) -> int:
    from sao_megatron.models.counting import parameter_counts

    cfg = _load(args)
    counts = parameter_counts(cfg.model)
    print(f"model {cfg.model.name}: {counts['total'] / 1e6:,.2f} M parameters, "
          f"{counts['active'] / 1e6:,.2f} M active per token")  # fmt: skip
    for role in ("actor", "critic"):
        p = getattr(cfg, role).parallel
        print(f"{role:6s}: world {p.world_size} = TP {p.tensor_parallel} x PP {p.pipeline_parallel} x "
              f"CP {p.context_parallel} x DP {p.data_parallel}; EP {p.expert_parallel}, "
              f"expert-TP {p.expert_tensor_parallel}, SP {p.effective_sequence_parallel}")  # fmt: skip
    return 0


def cmd_convert(args) -> int:
    print("sao convert: HF <-> Megatron conversion is not available in this build yet", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sao", description="Asynchronous single-rollout agentic RL (SAO) for MoE models on Megatron-Core.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, fn, text in (
        ("train", cmd_train, "train a model (default: the tiny MoE on CPU)"),
        ("config", cmd_config, "print the resolved configuration"),
        ("plan", cmd_plan, "parameter counts and parallel layout per role"),
    ):
        p = sub.add_parser(name, help=text, description=text, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        _add_config_args(p)
        p.set_defaults(fn=fn)
    p = sub.add_parser("convert", help="convert checkpoints between HF and Megatron formats")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
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
