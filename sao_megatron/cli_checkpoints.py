"""``sao convert`` and ``sao export``: the checkpoint commands of the CLI (:mod:`sao_megatron.cli`).

Both run a spawned world on the CPU (``sao_megatron.models.hf_convert``); errors exit 1 with one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def rank_failed(verb: str, err: Exception) -> int:
    """One line for a spawned world that failed: the last line of the failing rank's report."""
    last = [ln for ln in str(err).splitlines() if ln.strip()][-1]
    print(f"{verb} error (a rank failed): {last}", file=sys.stderr)
    return 1


def cmd_export(args) -> int:
    """``sao export RUN_DIR [--step N] OUT_DIR``; errors exit 1 with one line."""
    from sao_megatron.models.hf_convert import ExportError, export_run
    from sao_megatron.models.hf_io import CheckpointError
    from sao_megatron.spawn import WorldFailed

    try:
        summary = export_run(
            args.run_dir,
            args.out_dir,
            args.step,
            world=args.world,
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            overwrite=args.overwrite,
            progress=True,
            timeout_s=args.timeout_s,
        )
    except (ExportError, CheckpointError, FileExistsError, FileNotFoundError, TimeoutError) as err:
        print(f"export error: {err}", file=sys.stderr)
        return 1
    except WorldFailed as err:
        return rank_failed("export", err)
    _print_summary(summary, "sao export")
    print(f"wrote {args.out_dir} (load with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


def add_export_parser(sub) -> None:
    text = "write a run's actor as an HF checkpoint (safetensors, config, tokenizer, chat template)"
    p = sub.add_parser(
        "export",
        help=text,
        description=text + ". Runs keep only their latest checkpoint.",
        epilog="example:\n  sao export runs/tiny_cpu-20260101-120000 hf_out\nsee docs/training.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="expected step of the checkpoint (runs keep only the latest; a mismatch is an error)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor parallel ranks of the export world")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--ep", type=int, default=1, help="expert parallel ranks")
    p.add_argument("--world", type=int, default=None, help="processes (default: PP * lcm(TP, EP))")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="HF weight dtype (default: that of the run's policy export, else the weights')",
    )
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    _add_timeout_argument(p)
    p.set_defaults(fn=cmd_export)


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; give seconds, or 0 for the default")
    return value


def _add_timeout_argument(p) -> None:
    p.add_argument(
        "--timeout-s",
        type=_seconds,
        default=0.0,
        help="stop the conversion world after this many seconds (also its collective timeout); "
        "default: max(900, 3 x checkpoint bytes / 0.5 GB/s)",
    )


CONVERT_EPILOG = """examples:
  sao convert hf-config ~/Qwen3-30B-A3B --out configs/models/qwen3_30b_a3b.yaml
  sao convert hf-to-mcore ~/Qwen3-30B-A3B ckpt/qwen3_30b_a3b --world 2 --ep 2
  sao convert mcore-to-hf ckpt/qwen3_30b_a3b hf_out [--hf-template ~/Qwen3-30B-A3B]
see docs/convert.md
"""


def _print_summary(summary, command: str = "sao convert") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{command} {summary.direction}")
    for column in ("tensors", "MB", "wall s", "copy s", "GB/s (copy)", "copy phases (s)"):
        table.add_column(column, justify="right")
    mb = summary.bytes / 1e6
    phases = ", ".join(f"{k} {v:.2f}" for k, v in summary.phases.items())
    table.add_row(
        f"{summary.tensors:,}",
        f"{mb:,.3f}" if mb < 10 else f"{mb:,.1f}",
        f"{summary.wall_s:.1f}",
        f"{summary.transfer_s:.2f}",
        f"{summary.gb_per_s:.3f}",
        phases,
    )
    Console(width=max(100, Console().width)).print(table)
    if summary.peak_rss:
        mib = [
            f"{peak / 2**20:,.0f} ({shard / 2**20:,.0f})"
            for peak, shard in zip(summary.peak_rss, summary.shard_bytes, strict=True)
        ]
        print(f"peak RSS per rank, MiB (its shard): {' / '.join(mib)}")
    if summary.mtp:
        print(summary.mtp)


def cmd_convert(args) -> int:
    """HF <-> Megatron checkpoint conversion; errors about the checkpoint exit 1 with one line."""
    from sao_megatron.config import hf as hf_config
    from sao_megatron.models import hf_convert
    from sao_megatron.spawn import WorldFailed

    try:
        if args.convert == "hf-config":
            m = hf_config.model_config_from_hf(hf_config.read_hf_config(args.hf), name=args.name or "")
            text = hf_config.model_yaml(m, source=args.hf)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(text)
                print(f"wrote {args.out}")
            else:
                print(text, end="")
            return 0
        p = hf_convert.parallel_config(args.world, args.tp, args.pp, args.ep)
        if args.convert == "hf-to-mcore":
            bf16 = {"auto": None, "bfloat16": True, "float32": False}[args.dtype]
            summary = hf_convert.hf_to_mcore(
                args.src, args.dst, p, bf16=bf16, overwrite=args.overwrite, progress=True, timeout_s=args.timeout_s
            )
        else:
            summary = hf_convert.mcore_to_hf(
                args.src,
                args.dst,
                p,
                template=args.hf_template,
                dtype=args.dtype,
                max_shard_bytes=int(args.max_shard_gb * 2**30),
                overwrite=args.overwrite,
                progress=True,
                timeout_s=args.timeout_s,
            )
    except (hf_convert.CheckpointError, FileExistsError, FileNotFoundError, TimeoutError) as err:
        print(f"convert error: {err}", file=sys.stderr)
        return 1
    except WorldFailed as err:
        return rank_failed("convert", err)
    _print_summary(summary)
    return 0


def add_convert_parser(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "convert",
        help="convert checkpoints between HF and Megatron formats",
        description="HF safetensors <-> Megatron torch_dist checkpoints (Qwen3, Qwen3-MoE)",
        epilog=CONVERT_EPILOG,
        formatter_class=fmt,
    )
    p.set_defaults(fn=cmd_convert)
    conv = p.add_subparsers(dest="convert", metavar="DIRECTION", required=True)
    c = conv.add_parser("hf-config", help="emit a model YAML from an HF config.json", formatter_class=fmt)
    c.add_argument("hf", metavar="HF_DIR_OR_CONFIG_JSON")
    c.add_argument("--out", help="write the YAML here (e.g. configs/models/<name>.yaml) instead of stdout")
    c.add_argument("--name", help="model name in the YAML (default: the directory's name)")
    for name, text, src, dst in (
        ("hf-to-mcore", "HF checkpoint -> Megatron distributed checkpoint", "HF_DIR", "OUT_DIR"),
        ("mcore-to-hf", "Megatron checkpoint (from hf-to-mcore) -> HF checkpoint", "MCORE_DIR", "OUT_DIR"),
    ):
        c = conv.add_parser(name, help=text, description=text, epilog=CONVERT_EPILOG, formatter_class=fmt)
        c.add_argument("src", metavar=src)
        c.add_argument("dst", metavar=dst)
        c.add_argument("--tp", type=int, default=1, help="tensor parallel ranks of the conversion world")
        c.add_argument("--pp", type=int, default=1, help="pipeline stages")
        c.add_argument("--ep", type=int, default=1, help="expert parallel ranks")
        c.add_argument("--world", type=int, default=None, help="processes (default: PP * lcm(TP, EP))")
        c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
        _add_timeout_argument(c)
        if name == "hf-to-mcore":
            c.add_argument(
                "--dtype",
                choices=("auto", "bfloat16", "float32"),
                default="auto",
                help="Megatron weight dtype (auto: the HF config's dtype)",
            )
        else:
            c.add_argument("--hf-template", help="HF dir for config/tokenizer files (default: MCORE_DIR/hf)")
            c.add_argument(
                "--dtype",
                choices=("bfloat16", "float32"),
                default=None,
                help="HF weight dtype (default: the template's)",
            )
            c.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GiB)")
