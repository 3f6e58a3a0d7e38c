"""The type checker sees into a loss: a misspelt micro-batch field is a pyright error.

A loss function of the role's ``LossFn`` shape reads a field of the real ``MicroBatch``; pyright
runs with the project's settings (``pyproject.toml``) on a copy that spells the field right and
one that misspells it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LOSS = """
import torch

from sao_megatron.batch import MicroBatch
from sao_megatron.workers.role import LossFn


def loss_fn(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    assert mb.{field} is not None
    return (output * mb.{field}).sum(), {{}}


checked: LossFn = loss_fn
"""


def _pyright() -> str:
    found = Path(sys.executable).parent / "pyright"
    if found.exists():
        return str(found)
    which = shutil.which("pyright")
    if which is None:
        pytest.skip("pyright is not installed next to this Python or on PATH")
    return which


def test_a_misspelt_micro_batch_field_is_a_pyright_error(tmp_path):
    (tmp_path / "right.py").write_text(LOSS.format(field="advantages"))
    (tmp_path / "wrong.py").write_text(LOSS.format(field="advantagez"))
    out = subprocess.run(
        [_pyright(), "-p", str(ROOT), "--outputjson", str(tmp_path / "right.py"), str(tmp_path / "wrong.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"},
        timeout=300,
    )
    report = json.loads(out.stdout)
    assert report["summary"]["filesAnalyzed"] == 2, report
    errors = {
        name: [
            d["message"]
            for d in report["generalDiagnostics"]
            if Path(d["file"]).name == name and d["severity"] == "error"
        ]
        for name in ("right.py", "wrong.py")
    }
    assert errors["right.py"] == [], errors
    assert errors["wrong.py"] and all("advantagez" in m for m in errors["wrong.py"]), errors
