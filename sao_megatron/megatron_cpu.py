"""Run Megatron-Core on CPU with gloo: the one place in the code base that special-cases CPU.

Megatron-Core is written for CUDA. On a machine without a GPU a handful of call sites break:
``device="cuda"`` literals, ``torch.cuda.current_device()``, CUDA streams and events, CUDA
tensor-type string checks and one local-norm assertion. Each is fixed by a small named patch
below, scoped to the Megatron module that needs it (a module-local ``torch`` stand-in maps
``device="cuda"`` to CPU and gives no-op streams), so nothing outside those modules changes.

``apply()`` is idempotent, does nothing when CUDA is available, and refuses any Megatron-Core
version other than :data:`SUPPORTED_VERSION`: the patches name exact call sites, and a silent
mismatch on another version would be worse than a loud failure.

Measured needs (megatron-core 0.19.2, torch 2.14.1; see docs/environment.md):

=========================  =================================================================
patch                      call sites
=========================  =================================================================
``current_device``         ``torch.cuda.current_device()`` is called in ~40 Megatron
                           modules (rotary embedding, router, TP mappings, p2p, DDP...);
                           without CUDA it can only raise, so it returns ``"cpu"`` instead
``cuda_device_literals``   pipeline schedules, optimizer, distributed optimizer, clip-grad,
                           DDP grad buffers, ``megatron.core.utils`` (``device="cuda"``);
                           alltoall token dispatcher (streams, events); torch_dist
                           checkpoint save (``torch.cuda.synchronize``)
``causal_mask``            ``transformer.utils.get_default_causal_mask`` (used by the local
                           softmax when no explicit mask is passed)
``alltoall_split_sizes``   ``moe_utils.maybe_move_tensor_to_cpu`` returns numpy only for
                           CUDA input; gloo's all_to_all needs python ints
``cuda_type_strings``      ``clip_grad_by_total_norm_fp32`` and
                           ``DistributedOptimizer._build_model_and_main_param_groups`` assert
                           ``tensor.type() == 'torch.cuda.FloatTensor'``
``local_norm_sp``          MoE with TP > 1 needs sequence parallelism, which the local torch
                           RMSNorm refuses; build it with SP off and tag its parameters
                           ``sequence_parallel`` as TE's norm does, so their grads are reduced
``recompute_rng``          activation recompute (full, and selective: ``CheckpointFunction``,
                           ``CheckpointWithoutOutput``) saves and restores the CUDA RNG state
                           besides the CPU one (``tensor_parallel.random``); without CUDA there
                           is none, so it reads as an empty state and restoring it does nothing
=========================  =================================================================

The CUDA RNG tracker is avoided by configuration, not by a patch: see
:func:`sao_megatron.parallel.seed_everything`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import textwrap
import types
from typing import Any, cast

import torch

SUPPORTED_VERSION = "0.19.2"

_applied = False

# Megatron modules whose module-global ``torch`` is replaced by the CPU stand-in.
_CUDA_LITERAL_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.pipeline_parallel.p2p_communication",
)


def megatron_version() -> str:
    """The installed distribution's version (``package_info`` may append the cwd's git hash)."""
    from importlib.metadata import version

    return version("megatron-core")


def needed() -> bool:
    """True when this process has no CUDA device, i.e. when :func:`apply` will patch."""
    return not torch.cuda.is_available()


def apply() -> bool:
    """Make Megatron-Core usable on CPU. Returns True when patches were (or had been) applied."""
    global _applied
    if _applied:
        return True
    if not needed():
        return False
    version = megatron_version()
    if version != SUPPORTED_VERSION:
        raise RuntimeError(
            f"sao_megatron.megatron_cpu supports megatron-core {SUPPORTED_VERSION} only, found {version}; "
            f"install megatron-core=={SUPPORTED_VERSION} (requirements/base.txt) or re-measure and update "
            "the patches in sao_megatron/megatron_cpu.py"
        )
    _patch_current_device()
    _patch_cuda_device_literals()
    _patch_causal_mask()
    _patch_alltoall_split_sizes()
    _patch_cuda_type_strings()
    _patch_local_norm_sp()
    _patch_recompute_rng()
    _applied = True
    return True


# --------------------------------------------------------------------------------------------
# A module-local ``torch`` whose CUDA device literals mean CPU and whose streams are no-ops.
# --------------------------------------------------------------------------------------------
class _NoOpEvent:
    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoOpStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _NoOpEvent:
        return _NoOpEvent()

    def synchronize(self) -> None:
        pass

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)


_NOOP_STREAM = _NoOpStream()


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by a patched Megatron module on a machine without CUDA."""

    Stream = _NoOpStream
    Event = _NoOpEvent

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def current_device(self) -> str:
        return "cpu"

    def current_stream(self, *args, **kwargs) -> _NoOpStream:
        return _NOOP_STREAM

    def stream(self, stream=None):
        return contextlib.nullcontext()

    def synchronize(self, *args, **kwargs) -> None:
        pass

    def is_current_stream_capturing(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


def _cpu_device(device):
    if device is not None and str(device).startswith("cuda"):
        return "cpu"
    return device


class _CpuTorch(types.ModuleType):
    """``torch`` for one Megatron module: factory functions map ``device="cuda"`` to CPU."""

    _FACTORIES = frozenset(
        {
            "zeros",
            "ones",
            "empty",
            "full",
            "tensor",
            "arange",
            "zeros_like",
            "ones_like",
            "empty_like",
            "full_like",
            "randn",
            "rand",
            "randint",
            "as_tensor",
        }
    )

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


def _patch_current_device() -> None:
    # Process-wide, but only in a process without CUDA, where the original can only raise.
    torch.cuda.current_device = _CpuCuda.current_device.__get__(_CpuCuda())


def _patch_cuda_device_literals() -> None:
    cpu_torch = _CpuTorch()
    for name in _CUDA_LITERAL_MODULES:
        module: Any = importlib.import_module(name)  # Any: its `torch` global is reassigned below
        if getattr(module, "torch", None) is not torch:
            raise RuntimeError(f"megatron_cpu: {name}.torch is not the torch module; re-measure the patch")
        module.torch = cpu_torch


def _patch_causal_mask() -> None:
    from megatron.core.fusions import fused_softmax

    @functools.lru_cache(maxsize=32)
    def default_causal_mask_cpu(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    fused_softmax.get_default_causal_mask = default_causal_mask_cpu


def _patch_alltoall_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _without_cuda_type_strings(fn, module):
    """Recompile ``fn`` from its source with ``'torch.cuda.XTensor'`` read as ``'torch.XTensor'``."""
    source = textwrap.dedent(inspect.getsource(fn))
    patched = source.replace("'torch.cuda.", "'torch.").replace('"torch.cuda.', '"torch.')
    if patched == source:
        raise RuntimeError(f"megatron_cpu: no CUDA type string left in {fn.__qualname__}; re-measure")
    lines = [ln for ln in patched.splitlines() if ln.strip() not in ("@staticmethod", "@classmethod")]
    namespace: dict = {}
    filename = inspect.getsourcefile(fn)
    assert filename is not None, f"megatron_cpu: no source file for {fn.__qualname__}"  # getsource found it
    exec(compile("\n".join(lines), filename, "exec"), module.__dict__, namespace)
    return namespace[fn.__name__]


def _patch_cuda_type_strings() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as optimizer_module

    clip = _without_cuda_type_strings(clip_grads.clip_grad_by_total_norm_fp32, clip_grads)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer_module.clip_grad_by_total_norm_fp32 = clip

    cls = distrib_optimizer.DistributedOptimizer
    static = inspect.getattr_static(cls, "_build_model_and_main_param_groups")
    rebuilt = _without_cuda_type_strings(static.__func__, distrib_optimizer)
    cls._build_model_and_main_param_groups = type(static)(rebuilt)


def _patch_local_norm_sp() -> None:
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            # A torch LayerNorm/RMSNorm module; Megatron annotates a forward-only protocol.
            norm = cast(torch.nn.Module, original_new(cls, config, hidden_size, eps, *args, **kwargs))
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel  # pyright: ignore[reportAttributeAccessIssue]  # Megatron's flag
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def _patch_recompute_rng() -> None:
    rng: Any = importlib.import_module("megatron.core.tensor_parallel.random")  # Any: globals reassigned
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        if not callable(getattr(rng, name, None)):
            raise RuntimeError(f"megatron_cpu: megatron.core.tensor_parallel.random.{name} is gone; re-measure")

    def no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_no_cuda_rng_state(*args, **kwargs) -> None:
        return None

    rng._get_cuda_rng_state = no_cuda_rng_state
    rng._set_cuda_rng_state = set_no_cuda_rng_state
