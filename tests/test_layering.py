"""Layering: the pure layers import no Megatron, Ray, SGLang or transformers."""

import subprocess
import sys

import pytest

HEAVY = ("megatron", "ray", "sglang", "transformers", "sao_megatron.megatron_cpu")


@pytest.mark.parametrize("module", ["sao_megatron.algo", "sao_megatron.config", "sao_megatron.envs"])
def test_pure_modules_import_nothing_heavy(module):
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {('megatron', 'ray', 'sglang', 'transformers')!r} "
        f"or m == 'sao_megatron.megatron_cpu'); print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} pulled in {out.stdout.strip()}"


def test_algo_sources_do_not_mention_heavy_packages():
    from pathlib import Path

    import sao_megatron.algo as algo

    for path in Path(algo.__file__).parent.rglob("*.py"):
        text = path.read_text()
        for name in ("megatron", "ray", "sglang", "transformers"):
            assert f"import {name}" not in text and f"from {name}" not in text, f"{path} imports {name}"
    assert HEAVY
