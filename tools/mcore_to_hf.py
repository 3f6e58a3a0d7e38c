"""Megatron distributed checkpoint -> HF safetensors checkpoint: ``sao convert mcore-to-hf``.

.venv/bin/python tools/mcore_to_hf.py MCORE_DIR OUT_DIR [--hf-template HF_DIR] [--max-shard-gb 5]
"""

import sys

from sao_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "mcore-to-hf", *sys.argv[1:]]))
