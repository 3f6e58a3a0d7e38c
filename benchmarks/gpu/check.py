"""One-command GPU check: bf16 peak, single-GPU layout cases, TE vs local spec, ~1B MoE throughput.

    bash benchmarks/gpu/run.sh [--out DIR] [--budget-s 420]   # installs carried wheels, then this
    python -m benchmarks.gpu.check --cpu-smoke --out /tmp/x    # CI: every CPU-capable section, tiny

Sections (each is measured, skipped with a reason, or failed with the error; all appear in the JSON):

- ``environment``: versions (torch, CUDA, megatron-core, Transformer Engine), the device.
- ``memory``: the logprob function's peak bytes per logit beyond the logits (ours vs the algorithm
  before issue 29) at 1.2e9 logits, and one actor and one critic step (distributed optimizer, local
  spec) at 8,192 tokens x 151,936 vocabulary: ``torch.cuda.max_memory_allocated`` vs ``sao plan``.
- ``matmul_peak``: bf16 ``8192^3`` products, TFLOP/s (``peak.py``); the MFU denominator.
- ``layout``: a ragged batch (odd lengths, 1-token actions, many turns) through the real
  ``ActorWorker`` (logprobs, update, logprobs) and ``CriticWorker`` (values, update) on a
  one-rank NCCL world in bf16; finiteness and bf16-vs-fp32 differences on action tokens, with
  ``pack_sequences`` off and on, and on with ``max_tokens_per_micro_batch`` (the packed modes
  only where the workers read those keys: :func:`packing_hook`).
- ``te_vs_local``: logits of the TE layer spec vs the local spec, same weights (needs TE).
- ``gpu_tests``: the suite's tests marked ``gpu`` (skipped on CPU), run by pytest in a subprocess:
  passed / failed / errors (check: none failed, at least one passed).
- ``moe_1b``: actor and critic steps of a 1.0 B-total MoE (``workload.MOE_1B``) on ~6K tokens:
  tokens/s, MFU (``workload`` module docstring: ``6 * N_active_matmul * tokens + attention``)
  and our RL actor step vs a plain Megatron-Core step of the same model (ratio plain/ours,
  target >= 0.9).

A global ``--budget-s`` (default 420) bounds the run: a section whose minimum (``MIN_SECONDS``)
does not fit in what is left is skipped with that reason; a spawned section is killed once it
would eat into the minimums of the sections after it (or after ``MAX_SECONDS``).
``--cpu-smoke`` runs the same code at tiny size with gloo and float32.
Exit status: 0 when every section ran or was skipped and every check holds; 1 otherwise; 2 on
bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

SECTIONS = ("environment", "memory", "matmul_peak", "layout", "te_vs_local", "moe_1b", "replay", "gpu_tests")
MIN_SECONDS = {  # what a section needs at the least (start-up of a spawned world included)
    "gpu": {"environment": 1, "memory": 60, "matmul_peak": 10, "layout": 60, "te_vs_local": 45, "moe_1b": 90, "replay": 60, "gpu_tests": 60},
    "cpu-smoke": {"environment": 1, "memory": 20, "matmul_peak": 0, "layout": 20, "te_vs_local": 0, "moe_1b": 20, "replay": 20, "gpu_tests": 0},
}  # fmt: skip
MAX_SECONDS = {"memory": 150, "layout": 150, "te_vs_local": 90, "moe_1b": 300, "replay": 120, "gpu_tests": 180}
PLAN_TOL = 0.15
"""|sao plan / measured - 1| a role's step may show (tests/test_plan_measured.py holds it on CPU)."""
LOGPROB_BYTES_MAX = 8.0
"""Peak bytes per logit beyond the logits the logprob function may take (issue 29's bound)."""
"""A spawned section is killed after this long (or when the budget runs out, whichever is first)."""
TE_ABSENT = "Transformer Engine not importable (not carried: its wheels exceed the 64 MiB carry)"
LOGPROB_TOL = {"bfloat16": 0.25, "float32": 1e-5}
"""Max |logprob - float32 reference| on action tokens a mode may show (bf16: ~3 significant digits)."""
PACKED_TOL = {"bfloat16": 0.25, "float32": 1e-4}
TE_REL_TOL = {"float32": 1e-2, "bfloat16": 5e-2}
"""Max |TE - local| logits over the largest |logit| (TE may use TF32 for float32 GEMMs)."""
RATIO_TARGET = 0.9


@dataclasses.dataclass
class Section:
    """One section's outcome: ``measured`` (``data``), ``skipped`` or ``failed`` (``reason``)."""

    status: str = "skipped"
    reason: str = ""
    seconds: float = 0.0
    data: dict = dataclasses.field(default_factory=dict)
    checks: dict = dataclasses.field(default_factory=dict)
    """name -> {"ok": bool, "value": float, "limit": str}."""


@dataclasses.dataclass
class Context:
    """What a section is given: the mode, where logs go, its time limit and earlier results."""

    mode: str
    """``gpu`` or ``cpu-smoke``."""
    log_dir: Path
    """Spawned ranks write ``<section>_rank<r>.log`` here (the console keeps the table)."""
    steps: int
    timeout_s: float = 0.0
    peak_tflops: float | None = None
    """The measured bf16 peak (``matmul_peak``), None before or without it."""

    @property
    def gpu(self) -> bool:
        return self.mode == "gpu"


class Budget:
    def __init__(self, seconds: float):
        self.total, self.start = seconds, time.monotonic()

    def left(self) -> float:
        return self.total - (time.monotonic() - self.start)


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    return parse


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {bad or text!r}; choose from {', '.join(SECTIONS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.check",
        description="One-GPU check of sao_megatron: bf16 peak, layout cases, TE vs local spec, ~1B MoE throughput.",
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "runs/gpu_check",
        help="directory for gpu_check.json (default: $OUT, else runs/gpu_check)",
    )
    parser.add_argument(
        "--budget-s",
        type=_positive(float),
        default=420.0,
        help="wall-clock budget of the whole check in seconds (default 420)",
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="no GPU: run every CPU-capable section at tiny size (gloo, float32)"
    )
    parser.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (others: skipped)",
    )
    parser.add_argument(
        "--steps",
        type=_positive(int),
        default=3,
        help="timed steps per throughput figure (default 3, after one warm-up)",
    )
    parser.add_argument("--check-args", action="store_true", help="validate the arguments and exit")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
PACKING_KEYS = ("pack_sequences", "max_tokens_per_micro_batch")


def packing_hook() -> tuple[bool, str]:
    """Whether the packed modes can run: the schema has :data:`PACKING_KEYS` and the workers read them."""
    from sao_megatron.config import ParallelConfig

    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    workers = Path(importlib.util.find_spec("sao_megatron").origin or "").parent / "workers"  # pyright: ignore[reportOptionalMemberAccess]
    source = "".join(p.read_text() for p in workers.glob("*.py"))
    for key in PACKING_KEYS:
        if key not in fields:
            return False, f"ParallelConfig has no {key} field"
        if key not in source:
            return False, f"parallel.{key} is in the schema but no worker reads it yet"
    return True, ""


def layout_modes(gpu: bool) -> dict[str, dict]:
    """Micro-batching modes of the layout cases: padded rows, packed rows, packed under a token budget."""
    return {
        "padded": {},
        "packed": {"pack": True},
        "packed_dynamic": {"pack": True, "max_tokens": 384 if gpu else 40},
    }


def environment_section(ctx: Context) -> Section:
    return Section("measured", data=environment(ctx.mode))


def environment(mode: str) -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch
    from torch.cuda import nccl

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {
        "mode": mode,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": ver("megatron-core"),
        "megatron_core_from": str(Path(importlib.util.find_spec("megatron.core").origin or "").parent),  # pyright: ignore[reportOptionalMemberAccess]
        "transformer_engine": (ver("transformer-engine") or ver("transformer_engine"))
        if importlib.util.find_spec("transformer_engine")
        else None,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "device_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        "nccl": ".".join(map(str, nccl.version())) if cuda else None,
    }


def matmul_peak_section(ctx: Context) -> Section:
    if not ctx.gpu:
        return Section(reason="skipped: no GPU")
    import torch

    from benchmarks.gpu.peak import matmul_tflops

    rate = matmul_tflops(8192, torch.bfloat16, "cuda", warmup=3, reps=20)
    torch.cuda.empty_cache()
    return Section("measured", data=dataclasses.asdict(rate))


def _spawn(case: Callable, spec: dict, ctx: Context, name: str) -> dict:
    from sao_megatron.spawn import run_world

    backend = "nccl" if ctx.gpu else "gloo"
    log_to = ctx.log_dir / f"{name}_rank{{rank}}.log"
    return run_world(case, 1, spec, backend=backend, timeout_s=ctx.timeout_s, log_to=log_to)[0]


def layout_section(ctx: Context) -> Section:
    from benchmarks.gpu import cases, workload

    gpu = ctx.gpu
    pack_ok, pack_reason = packing_hook()
    shape, modes = workload.LAYOUT_GPU if gpu else workload.LAYOUT_CPU, layout_modes(gpu)
    run = modes if pack_ok else {"padded": modes["padded"]}
    spec = {
        "model": workload.LAYOUT_GPU_MODEL if gpu else {"num_layers": 2},
        "batch": dataclasses.asdict(shape),
        "micro_batch_size": 2,
        "bf16": gpu,
        "modes": run,
    }
    data = _spawn(cases.layout_case, spec, ctx, "layout")
    for name in modes.keys() - run.keys():
        data["modes"][name] = {"skipped": pack_reason}
    checks = {}
    for name, summary in data["modes"].items():
        if "error" in summary:
            checks[f"{name}.ran"] = {"ok": False, "value": None, "limit": "no error"}
        elif "all_finite" in summary:
            checks[f"{name}.finite"] = {
                "ok": summary["all_finite"],
                "value": summary["finite"],
                "limit": "all finite",
            }
            worst, tol = summary["logprobs_vs_fp32"]["max"], LOGPROB_TOL[data["dtype"]]
            checks[f"{name}.logprobs_vs_fp32"] = {"ok": worst <= tol, "value": worst, "limit": f"<= {tol}"}
        if "logprobs_vs_padded" in summary:
            worst, tol = summary["logprobs_vs_padded"]["max"], PACKED_TOL[data["dtype"]]
            checks[f"{name}.logprobs_vs_padded"] = {"ok": worst <= tol, "value": worst, "limit": f"<= {tol}"}
    return Section("measured", data=data, checks=checks)


def memory_section(ctx: Context) -> Section:
    from benchmarks.gpu import cases, workload

    spec = {**(workload.MEMORY_GPU if ctx.gpu else workload.MEMORY_CPU), "micro_batch_size": 1, "bf16": ctx.gpu}
    data = _spawn(cases.memory_case, spec, ctx, "memory")
    ours = data["logprob_bytes_per_logit"]["ours"]
    checks = {
        "logprob_peak_per_logit": {"ok": ours <= LOGPROB_BYTES_MAX, "value": ours, "limit": f"<= {LOGPROB_BYTES_MAX}"}
    }
    for role in ("actor", "critic"):
        ratio = data[role]["plan_bytes"] / data[role]["measured_bytes"]
        data[role]["plan_over_measured"] = ratio
        checks[f"{role}.plan_over_measured"] = {
            "ok": abs(ratio - 1) <= PLAN_TOL,
            "value": ratio,
            "limit": f"within {PLAN_TOL:.0%} of 1",
        }
    return Section("measured", data=data, checks=checks)


def te_vs_local_section(ctx: Context) -> Section:
    from benchmarks.gpu import cases, workload

    if not ctx.gpu:
        return Section(reason="skipped: no GPU")
    if importlib.util.find_spec("transformer_engine") is None:
        return Section(reason=TE_ABSENT)
    spec = {"model": workload.LAYOUT_GPU_MODEL, "micro_batch_size": 2, "seq_len": 257}
    data = _spawn(cases.te_case, spec, ctx, "te_vs_local")
    checks = {}
    for dtype, d in data.items():
        rel = d["logits_max_abs_diff"] / max(d["logits_scale"], 1e-12)
        d["logits_rel_diff"] = rel
        checks[f"{dtype}.logits_rel"] = {
            "ok": d["finite"] and rel <= TE_REL_TOL[dtype],
            "value": rel,
            "limit": f"<= {TE_REL_TOL[dtype]}",
        }
    return Section("measured", data=data, checks=checks)


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def throughput_figures(m, data: dict, peak_tflops: float | None) -> dict:
    """FLOPs (``workload``), seconds (median of the timed steps), tokens/s, TFLOP/s and MFU of
    each timed pass, and the plain-Megatron / ours actor step ratio."""
    from benchmarks.gpu import workload
    from sao_megatron.config import CriticConfig

    lengths, critic = data["lengths"], CriticConfig()
    params, critic_params = workload.parameter_summary(m), workload.parameter_summary(m, critic)
    critic_matmul = critic_params["matmul_trainable"] + critic_params["matmul_frozen"]
    flops = {
        "actor_step": workload.actor_step_flops(m, lengths),
        "plain_step": workload.actor_step_flops(m, lengths),
        "critic_step": workload.critic_step_flops(m, critic, lengths),
        "logprobs": workload.forward_flops(params["matmul"], m, lengths),
        "values": workload.forward_flops(critic_matmul, m, lengths),
    }
    seconds = {
        "actor_step": _median(data["actor_step_s"]),
        "plain_step": _median(data["plain_step_s"]),
        "critic_step": _median(data["critic_step_s"]),
        "logprobs": data["logprobs_s"],
        "values": data["values_s"],
    }
    rates = {}
    for name, s in seconds.items():
        f = flops[name]
        rates[name] = {
            "seconds": s,
            "tokens_per_s": data["tokens"] / s if s else None,
            "tflops": f / s / 1e12 if s else None,
            "mfu": workload.mfu(f, s, peak_tflops) if s else None,
        }
    ours, plain = seconds["actor_step"], seconds["plain_step"]
    return {
        "model": dataclasses.asdict(m),
        "parameters": params,
        "critic_parameters": critic_params,
        "flops": flops,
        "rates": rates,
        "peak_tflops": peak_tflops,
        "plain_over_ours": plain / ours if ours and plain else None,
        "flop_formula": workload.FLOP_FORMULA,
    }


def _moe_1b_spec(ctx: Context) -> dict:
    """The 1B MoE's throughput workload on a GPU (bf16), the tiny MoE's on CPU (float32)."""
    from benchmarks.gpu import workload

    model = workload.MOE_1B if ctx.gpu else None
    shape = workload.THROUGHPUT_GPU if ctx.gpu else workload.THROUGHPUT_CPU
    return {
        "model": dataclasses.asdict(model) if model else {"num_layers": 2},
        "batch": dataclasses.asdict(shape),
        "micro_batch_size": 2,
        "bf16": ctx.gpu,
        "steps": ctx.steps,
    }


def moe_1b_section(ctx: Context) -> Section:
    from benchmarks.gpu import cases, workload

    gpu = ctx.gpu
    model = workload.MOE_1B if gpu else None
    spec = {**_moe_1b_spec(ctx), "profile": True, "deadline": time.time() + ctx.timeout_s - 15}
    data = _spawn(cases.throughput_case, spec, ctx, "moe_1b")
    m = model or cases.run_config(spec, bf16=False).model
    data.update(throughput_figures(m, data, ctx.peak_tflops))
    ratio = data["plain_over_ours"]
    checks = {
        "plain_over_ours": {
            "ok": ratio is not None and ratio >= RATIO_TARGET,
            "value": ratio,
            "limit": f">= {RATIO_TARGET}",
        }
    }
    if not gpu:  # CPU timings of a tiny model say nothing about the GPU target
        checks = {}
    return Section("measured", data=data, checks=checks)


def replay_section(ctx: Context) -> Section:
    """Routing replay's cost (``rollout.routing_replay: on``): the actor's update and logprob pass with a
    random routing replayed vs without routes, interleaved in one process on the moe_1b workload (tiny
    on CPU), and the bytes the routes add to each step's batch. Checks that replay took effect."""
    from benchmarks.gpu import cases

    data = _spawn(cases.replay_case, _moe_1b_spec(ctx), ctx, "replay")
    checks = {"replayed": {"ok": data["replayed"] == 1.0, "value": data["replayed"], "limit": "== 1"}}
    return Section("measured", data=data, checks=checks)


ROOT = Path(__file__).resolve().parents[2]


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test modules (relative to ``root``) with a test marked ``@pytest.mark.gpu``, less this check's
    own (its GPU test runs the check again)."""
    own = root / "tests" / "benchmarks" / "test_gpu_check.py"
    return sorted(
        str(p.relative_to(root))
        for p in (root / "tests").rglob("test_*.py")
        if p != own and "@pytest.mark.gpu" in p.read_text()
    )


def pytest_counts(text: str) -> dict[str, int]:
    """pytest's closing counts (``3 passed, 1 failed, 2 skipped, 1 error``) from its output; 0 when absent."""
    import re

    closing = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped|deselected)", line)]
    last = closing[-1] if closing else ""
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped", "deselected")}
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", last):
        counts["errors" if word.startswith("error") else word] = int(n)
    return counts


def gpu_tests_section(ctx: Context) -> Section:
    import subprocess

    if not ctx.gpu:
        return Section(reason="skipped: no GPU")
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfE", *files]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ctx.timeout_s)
        text, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {ctx.timeout_s:.0f} s", None
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    (ctx.log_dir / "gpu_tests.log").write_text(text)
    counts = pytest_counts(text)
    ok = rc == 0 and counts["failed"] == counts["errors"] == 0 and counts["passed"] > 0
    data = {"files": files, "returncode": rc, **counts}
    return Section("measured", data=data, checks={"passed": {"ok": ok, "value": counts["passed"], "limit": "all pass"}})


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def _after(name: str, selected: list[str], mode: str) -> float:
    later = SECTIONS[SECTIONS.index(name) + 1 :]
    return sum(MIN_SECONDS[mode][s] for s in later if s in selected)


def run_sections(args: argparse.Namespace, mode: str) -> dict[str, Section]:
    """Each selected section in order, as the budget allows (``<name>_section(ctx)`` functions)."""
    budget = Budget(args.budget_s)
    ctx = Context(mode, Path(args.out) / "logs", args.steps)
    results: dict[str, Section] = {}
    for name in SECTIONS:
        if name not in args.sections:
            results[name] = Section(reason="skipped: not in --sections")
            continue
        left, need = budget.left(), MIN_SECONDS[mode][name]
        if left < need:
            results[name] = Section(reason=f"skipped: needs ~{need} s, {max(left, 0):.0f} s left of --budget-s")
            continue
        # what is left, less the minimums of the sections after this one, bounds its run
        ctx.timeout_s = min(MAX_SECONDS.get(name, left), max(need, left - _after(name, args.sections, mode)))
        start = time.monotonic()
        print(f"[gpu-check] {name} (up to {ctx.timeout_s:.0f} s) ...", flush=True)
        try:
            section = globals()[f"{name}_section"](ctx)
        except Exception:
            section = Section("failed", reason=traceback.format_exc()[-4000:])
        section.seconds = time.monotonic() - start
        if name == "matmul_peak" and section.status == "measured":
            ctx.peak_tflops = section.data["tflops"]
        results[name] = section
    return results


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def summary_line(name: str, s: Section) -> str:
    if s.status != "measured":
        return s.reason.strip().splitlines()[-1][:150] if s.reason else ""
    d = s.data
    if name == "environment":
        return (
            f"torch {d['torch']}, {d['device']}, megatron-core {d['megatron_core']}, "
            f"TE {d['transformer_engine'] or 'absent'}"
        )
    if name == "matmul_peak":
        return f"{d['dtype']} {d['n']}^3 x{d['reps']}: {d['tflops']:.1f} TFLOP/s"
    if name == "memory":
        lp = d["logprob_bytes_per_logit"]
        return (
            f"logprobs at {d['logits_count']:.3g} logits: {lp['ours']:.2f} B/logit beyond the logits "
            f"(old {lp['old']:.2f}); step at {d['step_logits_count']:.3g} logits: "
            + ", ".join(
                f"{r} {d[r]['measured_bytes'] / 2**30:.2f} GiB measured (tensors {d[r].get('tensor_bytes', 0) / 2**30:.2f}, "
                f"held before {d[r].get('held_before', 0) / 2**30:.2f}), plan/measured {d[r]['plan_over_measured']:.2f}"
                for r in ("actor", "critic")
            )
        )
    if name == "layout":
        parts = []
        for mode, m in d["modes"].items():
            if "all_finite" in m:
                lp = m["logprobs_vs_fp32"]
                parts.append(
                    f"{mode}: {'finite' if m['all_finite'] else 'NON-FINITE'}, "
                    f"|{d['dtype']} - fp32 ref| logprob max {lp['max']:.2g} mean {lp['mean']:.2g}"
                )
            else:
                parts.append(f"{mode}: {m.get('skipped') or 'error'}")
        return "; ".join(parts)
    if name == "gpu_tests":
        return f"{d['passed']} passed, {d['failed']} failed, {d['errors']} errors, {d['skipped']} skipped ({len(d['files'])} files)"
    if name == "te_vs_local":
        return "; ".join(f"{k}: rel logits diff {v['logits_rel_diff']:.2g}" for k, v in d.items())
    if name == "replay":
        return (
            f"{d['tokens']} tok, replay/plain: update {d['update_ratio']:.3f}, logprobs {d['logprobs_ratio']:.3f}; "
            f"routes {d['route_bytes'] / 2**20:.2f} MiB of a {d['batch_bytes'] / 2**20:.2f} MiB batch "
            f"({d['bytes_per_token']} B/token), replayed {d['replayed']}"
        )
    r = d["rates"]
    return (
        f"{d['model']['name']} {_count(d['parameters']['total'])} ({_count(d['parameters']['active'])} active), {d['tokens']} tok: "
        f"actor {_fmt(r['actor_step']['seconds'])} s ({_fmt(r['actor_step']['tokens_per_s'], '.0f')} tok/s, "
        f"MFU {_fmt(r['actor_step']['mfu'], '.1%')}), plain {_fmt(r['plain_step']['seconds'])} s "
        f"(plain/ours {_fmt(d['plain_over_ours'], '.2f')}), critic {_fmt(r['critic_step']['seconds'])} s "
        f"(MFU {_fmt(r['critic_step']['mfu'], '.1%')})"
        + "".join(
            f"; {k} step profiled: GPU busy {_fmt(v['device_busy'], '.0%')} of {_fmt(v['wall_s'])} s, {v['kernels']} kernels"
            if "error" not in v
            else f"; {k} step profile failed: {v['error'][:60]}"
            for k, v in d.get("profile", {}).items()
        )
    )


def report(results: dict[str, Section], mode: str, budget_s: float, wall_s: float) -> tuple[dict, str]:
    failed_checks = [f"{n}.{c}" for n, s in results.items() for c, v in s.checks.items() if not v["ok"]]
    ok = not failed_checks and all(s.status != "failed" for s in results.values())
    doc = {
        "schema": 1,
        "mode": mode,
        "ok": ok,
        "budget_s": budget_s,
        "wall_s": wall_s,
        "failed_checks": failed_checks,
        "sections": {n: dataclasses.asdict(s) for n, s in results.items()},
    }
    lines = [
        f"GPU check ({mode}): {wall_s:.0f} s of {budget_s:.0f} s budget",
        f"{'section':<13} {'status':<9} figures",
    ]
    for name, s in results.items():
        lines.append(f"{name:<13} {s.status:<9} {summary_line(name, s)}")
    n_checks = sum(len(s.checks) for s in results.values())
    lines.append(
        f"checks: {n_checks - len(failed_checks)} of {n_checks} hold"
        + (f"; failing: {', '.join(failed_checks)}" if failed_checks else "")
    )
    return doc, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.check_args:
        return 0
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("error: no CUDA device here; on a machine without a GPU run with --cpu-smoke", file=sys.stderr)
        return 2
    mode = "cpu-smoke" if args.cpu_smoke else "gpu"
    start = time.monotonic()
    results = run_sections(args, mode)
    doc, table = report(results, mode, args.budget_s, time.monotonic() - start)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table)
    print(f"JSON: {out / 'gpu_check.json'}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
