"""HF safetensors checkpoint -> Megatron distributed checkpoint: ``sao convert hf-to-mcore``.

.venv/bin/python tools/hf_to_mcore.py HF_DIR OUT_DIR [--tp N --pp N --ep N --world N]
"""

import sys

from sao_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-mcore", *sys.argv[1:]]))
