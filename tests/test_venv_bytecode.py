"""The venv's heavy packages import from bytecode (``make venv``'s compileall step).

This machine's environment sets ``PYTHONDONTWRITEBYTECODE=1`` and uv does not compile on install,
so without the step every Ray worker, SGLang process and spawned Megatron rank compiled its
imports from source: ``import sglang`` took 27.7 s and ``import megatron.core`` 27.1 s here, 11.7 s
and 9.6 s from bytecode, and a full ``make test`` took 62 min with engines missing their start bound.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HEAVY = ["torch", "transformers", "sglang", "megatron.core", "ray"]


@pytest.mark.parametrize("name", HEAVY)
def test_a_heavy_package_has_current_bytecode(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, name
    package = Path(spec.origin).parent
    sources = sorted(package.rglob("*.py"))
    assert sources, package
    stale = [
        src
        for src in sources
        if not (cached := Path(importlib.util.cache_from_source(str(src)))).exists()
        or cached.stat().st_mtime < src.stat().st_mtime
    ]
    # a few files may not compile (py2-era test data in some wheels); compileall warns for them
    assert len(stale) <= len(sources) // 100, (
        f"{len(stale)} of {len(sources)} modules of {name} have no current bytecode (e.g. {stale[:3]}): "
        "run `make venv` (its compileall step), or `.venv/bin/python -m compileall -q -j 0 .venv/lib`"
    )
