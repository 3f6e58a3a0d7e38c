"""Download the wheels the GPU check needs that the device image lacks, into ``benchmarks/gpu/wheels/``.

    .venv/bin/python benchmarks/gpu/carry.py          # or: make gpu-wheels
    .venv/bin/python benchmarks/gpu/carry.py --list   # print the carry list only

The check's import closure (``benchmarks.gpu.check`` -> ``sao_megatron.workers``, ``spawn``,
``models``, ``plan.params``, ``config``) needs these distributions: torch, numpy, packaging
(megatron-core's own requirements), pyyaml (``sao_megatron.config``), psutil, and megatron-core.
It never imports ray, sglang, transformers or safetensors. The device image (Python 3.12, CUDA
torch) already holds torch, numpy, packaging, pyyaml and psutil (:data:`IMAGE_HAS`), so the carry
is megatron-core alone, pinned to this venv's version (``megatron_cpu.SUPPORTED_VERSION``
is the version the code is measured against). ``run.sh`` checks the closure imports before the
check starts and names what is missing. Transformer Engine is not carried: its wheels are far
over the 64 MiB that travels with the working tree.

Wheels are fetched for CPython 3.12 on manylinux x86-64 (``pip download --only-binary=:all:
--no-deps``); a ``requirements.txt`` beside them pins exactly what ``run.sh`` installs.
Fails when the total exceeds :data:`LIMIT_BYTES`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

WHEEL_DIR = Path(__file__).resolve().parent / "wheels"
LIMIT_BYTES = 64 << 20
"""What travels with the working tree to the device machine, the repository included."""
NEEDS = ("torch", "numpy", "packaging", "pyyaml", "psutil", "megatron-core")
"""Distributions the check imports (directly or through megatron-core's requirements)."""
IMAGE_HAS = frozenset({"torch", "numpy", "packaging", "pyyaml", "psutil"})
"""Already in the device image (its package list, read 2026-11-17)."""
NEVER = frozenset({"ray", "sglang", "transformers", "transformer-engine"})
"""Must not be carried: too large, and the check does not import them."""
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)
IMPORT_NAMES = {"pyyaml": "yaml", "megatron-core": "megatron.core"}
"""Module to import for a distribution whose import name differs (run.sh's closure check)."""


def carry_list() -> list[str]:
    """``name==version`` of each distribution to carry, at this environment's versions."""
    out = []
    for name in NEEDS:
        if name in IMAGE_HAS:
            continue
        assert name not in NEVER, name
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            raise SystemExit(f"error: {name} is not installed here; run `make venv` first") from None
    return out


def import_names() -> list[str]:
    """Modules ``run.sh`` imports to prove the closure is present before the check starts."""
    return [IMPORT_NAMES.get(name, name) for name in NEEDS]


def missing_imports() -> list[str]:
    """The closure's modules this interpreter cannot find (``importlib.util.find_spec``)."""
    from importlib.util import find_spec

    out = []
    for module in import_names():
        try:
            found = find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package is absent
            found = False
        if not found:
            out.append(module)
    return out


def download(pins: list[str], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()  # one version of each: two would stop the install there
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)
    (dest / "requirements.txt").write_text("".join(p + "\n" for p in pins))
    return sorted(dest.glob("*.whl"))


def carry_size(wheels: list[Path]) -> tuple[int, bool]:
    """Total bytes of ``wheels`` and whether it fits :data:`LIMIT_BYTES`."""
    total = sum(w.stat().st_size for w in wheels)
    return total, total <= LIMIT_BYTES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu/carry.py", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dest", type=Path, default=WHEEL_DIR, help=f"wheel directory (default {WHEEL_DIR})")
    parser.add_argument(
        "--list", action="store_true", help="print the carry list and the import closure, download nothing"
    )
    parser.add_argument(
        "--check-imports",
        action="store_true",
        help="exit 1 naming each module of the check's closure this interpreter lacks",
    )
    args = parser.parse_args(argv)
    if args.check_imports:
        if missing := missing_imports():
            print(f"missing: {' '.join(missing)}", file=sys.stderr)
            return 1
        return 0
    pins = carry_list()
    if args.list:
        print("carry:", " ".join(pins))
        print("imports:", " ".join(import_names()))
        return 0
    wheels = download(pins, args.dest)
    total, fits = carry_size(wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"{total / 2**20:8.2f} MiB  total ({len(wheels)} wheels, limit {LIMIT_BYTES >> 20} MiB)")
    if not fits:
        print(f"error: the carry is {total / 2**20:.1f} MiB, over {LIMIT_BYTES >> 20} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
