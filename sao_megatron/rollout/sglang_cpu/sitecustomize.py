"""Runs at start-up in every SGLang process of a CPU engine (this directory is on their PYTHONPATH only).

SGLang 0.5.23 allocates the routed-experts capture's host buffer (``--enable-return-routed-experts``,
``state_capturer/base.py`` ``BaseHostCache``) with ``pin_memory=True``, which registers it with
``cudaHostRegister`` (``mem_cache/pool_host/common.py`` ``_cuda_host_register``): on a machine without
CUDA that raises "Found no NVIDIA driver" and the engine dies at start. Pinning only speeds up
device-to-host copies, and a CPU engine has no device, so once that module is imported its
registration becomes a no-op when CUDA is absent. Nothing changes where CUDA is present, and the
launcher runs this stand-in only on CPU and only with the SGLang version it was written for
(``SUPPORTED_SGLANG``).
"""

import importlib.abc
import importlib.machinery
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
