"""Importing the algo layer pulls in no distributed / model / serving stack."""

import subprocess
import sys


def test_algo_imports_only_torch():
    code = (
        "import sys, sao_megatron.algo\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'ray', 'sglang', 'transformers'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
