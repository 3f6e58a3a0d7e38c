"""Runs at start-up in every SGLang process of a CPU engine (this directory is on their PYTHONPATH only).

SGLang 0.5.23 allocates the routed-experts capture's host buffer (``--enable-return-routed-experts``,
``state_capturer/base.py`` ``BaseHostCache``) with ``pin_memory=True``, which registers it with
``cudaHostRegister`` (``mem_cache/pool_host/common.py`` ``_cuda_host_register``): on a machine without
CUDA that raises "Found no NVIDIA driver" and the engine dies at start. Pinning only speeds up
device-to-host copies, and a CPU engine has no device, so once that module is imported its
registration becomes a no-op when CUDA is absent. Nothing changes where CUDA is present, and the
launcher runs this stand-in only on CPU and only with the SGLang version it was written for
(``SUPPORTED_SGLANG``).

With ``SAO_STRICT_NCCL=1`` (a test running the weight sync under the strict NCCL-contract backend)
it also makes ``strict_nccl`` a backend of the process, so SGLang's own ``init_custom_process_group``
joins the sync's groups with it. An engine rank's GPU is chosen inside SGLang's scheduler process,
where this shim has no hook, so engine ranks are left out of that backend's one-device-per-rank
check (``SAO_STRICT_DEVICE=none``).
"""

import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _no_register(*args, **kwargs) -> None:
    """``_cuda_host_register`` on a machine without CUDA: nothing to register."""


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        import torch

        if not torch.cuda.is_available():
            module._cuda_host_register = _no_register  # pyright: ignore[reportAttributeAccessIssue]


sys.meta_path.insert(0, _PatchAfterImport())


if os.environ.get("SAO_STRICT_NCCL") == "1":
    os.environ.setdefault("SAO_STRICT_DEVICE", "none")
    from sao_megatron.runtime import strict_nccl

    strict_nccl.register()
