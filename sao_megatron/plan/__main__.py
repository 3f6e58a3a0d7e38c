"""``python -m sao_megatron.plan SPEC RESULT``: the meta-device build's child process."""

import sys

from sao_megatron.plan.meta import _meta_build_main

if __name__ == "__main__":
    _meta_build_main(sys.argv[1], sys.argv[2])
