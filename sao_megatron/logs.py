"""Console hygiene: the one place that filters known third-party warnings, and per-process log files.

Made for the places where a process starts:

- :func:`quiet_third_party` installs the filters below: ``warnings`` filters matched narrowly
  by message, category and the module the warning is attributed to, and ``logging`` filters
  that drop exact records of named third-party loggers. It is idempotent and leaves warnings
  from our own code alone (pytest turns those into errors; ``tests/conftest.py`` feeds the same
  list to pytest through :func:`filterwarnings_lines`).
- :data:`RAY_WORKER_SETUP_HOOK` runs :func:`quiet_third_party` in every Ray worker at start.
- :func:`redirect_process_output` points a worker process's fd 1 and 2 (so C-level and child
  process output too) and ``sys.stdout``/``sys.stderr`` at an append-mode, line-buffered file,
  e.g. ``<run_dir>/logs/actor_rank0.log``.

Every entry was observed on this project's stack (megatron-core 0.19.2, torch 2.14.1, CPU
without Transformer Engine or Apex) building, training and checkpointing an actor; each
says why hiding it is safe. Add an entry only for a message seen, with its exact text.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KnownWarning:
    """One ``warnings`` filter: all three must match for the warning to be hidden."""

    message: str
    """Regex matched (case-insensitively) at the start of the warning's text. No ``:`` (pytest's
    ini syntax splits on it)."""
    category: type[Warning]
    module: str
    """Regex matched at the start of the ``__name__`` of the module the warning is attributed
    to (where ``warnings.warn``'s stack level points), never ``sao_megatron``."""
    why: str


@dataclass(frozen=True)
class KnownRecord:
    """One ``logging`` record to drop: logged on exactly ``logger`` and starting with ``prefix``."""

    logger: str
    prefix: str
    why: str


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        r"Transformer Engine and Apex are not installed\. Falling back to ",
        UserWarning,
        r"megatron\.core\.",
        "import-time notice (megatron.core.optimizer, optimizer.optimizer, optimizer.clip_grads, "
        "fsdp mixed_precision) on machines without TE/Apex: the torch optimizers and local "
        "multi_tensor_* fallbacks are what the CPU path is built and tested on; a GPU install with "
        "transformer-engine never emits it",
    ),
    KnownWarning(
        r"Apex is not installed\. Falling back to Torch Norm",
        UserWarning,
        r"megatron\.core\.models\.",
        "models.backends and gpt_layer_specs: the local layer spec uses torch RMSNorm by design "
        "(megatron_cpu.local_norm_sp relies on it)",
    ),
    KnownWarning(
        r"full scope is deprecated\. Use empty cuda_graph_modules",
        UserWarning,
        r"megatron\.core\.transformer\.transformer_config",
        "TransformerConfig's own default cuda_graph_modules='full' triggers it on every config; "
        "CUDA graphs are off (cuda_graph_impl='none'), so the scope is never used",
    ),
    KnownWarning(
        r"MimoModelConfig is experimental",
        UserWarning,
        r"megatron\.core\.models\.mimo\.",
        "import-time notice of Megatron's multimodal MIMO model, which this project never builds",
    ),
    KnownWarning(
        r"`sequence_parallel` is set to `True`, but tensor model parallel size is 1\. Disabling sequence parallel",
        UserWarning,
        r"megatron\.core\.tensor_parallel\.layers\Z",
        "with TP > 1 (sequence parallelism on) the MoE experts' linears live in the expert-TP group "
        "of size 1 (SequentialMLP, expert_tensor_parallel=1), where Megatron correctly turns "
        "sequence parallelism off for them",
    ),
    KnownWarning(
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        UserWarning,
        r"megatron\.core\.optimizer\.optimizer\Z",
        "DistributedOptimizer.zero_grad reads .grad of its fp32 shard views "
        "(_zero_grad_group_helper; Megatron's comment there: 'throws grad-access warning'); their "
        "gradients live in main_grad buffers, so nothing is lost",
    ),
    KnownWarning(
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\.c10d_logger\Z",
        "Megatron's DDP grad buffers and distributed optimizer call the old names; our code does "
        "not, and the calls still work in torch 2.14",
    ),
    KnownWarning(
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
        r"(load|save) in a single process",
        UserWarning,
        r"torch\.distributed\.checkpoint\.",
        "Megatron's dist_checkpointing reads a checkpoint's common state with no_dist=True on "
        "purpose (every rank reads it locally)",
    ),
    KnownWarning(
        r"The argument order of (load|save) has been changed",
        UserWarning,
        r"torch\.distributed\.checkpoint\.",
        "Megatron's torch_dist load strategy (strategies/torch.py) passes the storage reader "
        "positionally; torch maps it to the keyword and loads correctly. Our code does not call "
        "torch.distributed.checkpoint directly",
    ),
    KnownWarning(
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        FutureWarning,
        r"torch\.distributed\.",
        "Megatron's torch_dist checkpoint format is built on ShardedTensor (save and load "
        "planners); our code creates none",
    ),
)

KNOWN_RECORDS: tuple[KnownRecord, ...] = (
    KnownRecord(
        "megatron.core.models.gpt.gpt_model",
        "GPTModel IS DEPRECATED.",
        "logged on every GPTModel construction (actor, critic, every rank); the project builds "
        "GPTModel on purpose (models/builder.py); a migration is a code change, not a run-time event",
    ),
    KnownRecord(
        "megatron.core.distributed.distributed_data_parallel",
        "DistributedDataParallel: full_param_layout not provided",
        "DDP then computes the same layout itself (DistributedOptimizer.compute_full_param_layout), "
        "as Megatron's own callers without a precomputed layout do",
    ),
    KnownRecord(
        "megatron.core.dist_checkpointing.strategies.torch",
        "MCore's async save is deprecated",
        "logged on every torch_dist save; our saves are synchronous, the async strategy is "
        "Megatron's default name only",
    ),
    KnownRecord(
        "ray._private.worker",
        "Started a local Ray instance.",
        "ray.init's INFO line for a local instance (the run directory line already says where the "
        "run is); joining a cluster still logs 'Connected to Ray cluster.'",
    ),
    KnownRecord(
        "torch.utils.cpp_extension",
        "No CUDA runtime is found",
        "logged when Megatron imports torch.utils.cpp_extension on a machine without CUDA (the CPU "
        "path); nothing here compiles CUDA extensions",
    ),
)

QUIET_LOGGERS: dict[str, int] = {
    # megatron.core has ~200 INFO-level log calls (set-up, optimizer, checkpoint details) on
    # module loggers; they stay silent only while nothing configures logging at INFO (a user's
    # basicConfig would print them on every rank). Its warnings and errors still show.
    "megatron": logging.WARNING,
}


class _DropKnown(logging.Filter):
    """Drops records of one logger whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not message.startswith(self.prefixes)


def _install_record_filters() -> None:
    by_logger: dict[str, tuple[str, ...]] = {}
    for rec in KNOWN_RECORDS:
        by_logger[rec.logger] = (*by_logger.get(rec.logger, ()), rec.prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(prefixes))


def quiet_third_party() -> None:
    """Hide the known third-party notices listed in this module (idempotent, cheap).

    Call it first thing in a process, before Megatron is imported: several notices fire at
    import time. Warnings from any other module, ours included, are untouched.
    """
    for w in KNOWN_WARNINGS:
        # filterwarnings drops an identical existing entry before inserting, so repeats are no-ops.
        warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
    _install_record_filters()
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


RAY_WORKER_SETUP_HOOK = "sao_megatron.logs.quiet_third_party"
"""For ``ray.init(runtime_env={"worker_process_setup_hook": RAY_WORKER_SETUP_HOOK})``: every Ray
worker runs it at start, before it deserializes an actor's arguments. That matters: once Megatron
is imported, pickled CPU tensors reference ``megatron.core.safe_globals.safe_load_from_bytes``,
so e.g. the critic's ``actor_state`` argument imports Megatron, with its import-time notices,
before ``RankActor.__init__`` can call :func:`quiet_third_party`."""


def filterwarnings_lines() -> list[str]:
    """``KNOWN_WARNINGS`` as pytest ``filterwarnings`` ini lines (``ignore:MESSAGE:CATEGORY:MODULE``)."""
    lines = []
    for w in KNOWN_WARNINGS:
        if ":" in w.message or ":" in w.module:
            raise ValueError(f"{w.message!r}: pytest's filterwarnings syntax cannot hold ':'")
        lines.append(f"ignore:{w.message}:{w.category.__name__}:{w.module}")
    return lines


def redirect_process_output(path: str | os.PathLike) -> Path:
    """Send this process's stdout and stderr to ``path`` from now on; returns the path.

    Redirects file descriptors 1 and 2 (``os.dup2``), so output of C/C++ code, of handlers that
    hold the old ``sys.stderr`` and of child processes lands there too, and replaces
    ``sys.stdout``/``sys.stderr`` with line-buffered writers on them. The file is opened in append
    mode (a restarted rank adds to its log) and gets one header line per call; the parent
    directory is created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    print(f"---- pid {os.getpid()} writing here from {time.strftime('%Y-%m-%d %H:%M:%S')} ----", flush=True)
    return path
