"""SGLang on CPU: the directory put on the engine subprocess's PYTHONPATH (CPU only).

SGLang's CPU path imports a few ops from ``sgl_kernel``, whose wheels are CUDA-only. The
``sgl_kernel`` package in this directory is a small pure-torch stand-in: it implements the one
op the CPU server actually calls for our models (``assign_req_to_token_pool_cpu``) and raises
``NotImplementedError`` naming any other op, so a new call site fails loudly instead of
silently computing something else. It is guarded by the exact SGLang version it was measured
on (:data:`SUPPORTED_SGLANG`); the launcher refuses other versions on CPU.
"""

from pathlib import Path

SUPPORTED_SGLANG = "0.5.23"
STANDIN_DIR = Path(__file__).resolve().parent
