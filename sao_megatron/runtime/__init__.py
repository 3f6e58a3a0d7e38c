"""How the package's processes run: process-group backends (the strict NCCL-contract backend for
CPU tests, :mod:`sao_megatron.runtime.strict_nccl`)."""
