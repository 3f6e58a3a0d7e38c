"""HF weights in and out of a sharded Megatron model (any TP / PP / EP / DP layout).

- :func:`load_hf_weights`: every rank reads only its own slices of an HF safetensors checkpoint
  (its PP stage's layers, its EP rank's experts, its TP rows or columns) straight into its
  parameters. Not a collective: ranks share nothing.
- :func:`iter_hf_weights`: a collective over the model's whole world (the default process
  group) yielding ``(hf_name, full_tensor)`` buckets. Buckets are yielded in lock-step on every
  rank; only rank ``dst`` (global rank 0 by default) receives tensors, the others get an empty
  list per bucket and must still exhaust the iterator.
- :class:`HFWeightStream` (:mod:`sao_megatron.models.hf_stream`) with ``per_stage=True`` (the
  parallel weight sync): each pipeline stage gathers its own tensors to its own sender (the
  stage's lowest global rank), stages independently of each other.
- :func:`save_hf_checkpoint`: the stream with many writers (``spread``): every rank that holds
  slices writes the HF shards of the tensors it was given, into one staging directory; rank
  ``dst`` merges the writers' tensor maps into the index and publishes the directory once all
  of them finished.

Gathering is point-to-point: for every tensor one replica's TP shards are sent to its writer,
which concatenates them with the layout rules (SwiGLU ``[gate; up]`` per rank) and splits them
into HF tensors; each sender's unacknowledged bytes are bounded (``inflight_bytes``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from sao_megatron.config import ModelConfig
from sao_megatron.models import hf_bridge as bridge
from sao_megatron.models import hf_io, hf_mtp, layout
from sao_megatron.models.hf_io import CheckpointError, TensorSpec
from sao_megatron.models.hf_stream import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_INFLIGHT_BYTES,
    HFWeightStream,
    _local_shape,
    _tp,
)

_log = logging.getLogger(__name__)
DEFAULT_SHARD_BYTES = 5 << 30
EXPORT_GB_PER_S = 0.5
"""Stated bandwidth of a whole HF export (gathers and shard writes, all writers together) from
which its default timeout is sized: ``run.export_gb_per_s``'s default."""
EXPORT_FLOOR_S = 600.0
"""The shortest default export timeout (the role worlds' own collective timeout)."""


@dataclass
class TransferStats:
    """What one rank moved: tensors, bytes and wall seconds."""

    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"tensors": self.tensors, "bytes": self.bytes, "seconds": self.seconds, **self.extra}


def release_free_memory() -> None:
    """Hand memory that glibc's malloc keeps after frees back to the OS (no-op elsewhere).

    Building a Megatron model on CPU initialises each weight through temporaries; calling this
    between building and loading keeps a rank's resident memory near its shard size.
    """
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def load_hf_weights(
    model: torch.nn.Module,
    m: ModelConfig,
    hf_dir: str | Path,
    *,
    reopen_bytes: int = 64 << 20,
    progress: Callable[[int], None] | None = None,
) -> TransferStats:
    """Copy this rank's slices of the HF checkpoint in ``hf_dir`` into ``model`` (``m``'s shape).

    Every tensor a rank needs is checked (present, shape, dtype against ``config.json``) before
    any parameter is written; a mismatch raises :class:`CheckpointError` naming tensor and
    file. Resident memory: the rank's parameters plus one tensor slice plus ``reopen_bytes``.
    """
    t0 = time.perf_counter()
    ckpt = hf_io.HFCheckpoint(hf_dir, reopen_bytes)
    config_file = Path(hf_dir) / "config.json"
    dtype = hf_io.config_dtype(json.loads(config_file.read_text())) if config_file.exists() else None
    fused = any(n.endswith(bridge.FUSED_GATE_UP) for n in ckpt.names())
    mtp = [n for n in ckpt.names() if bridge.is_mtp(n, m)]
    if mtp and (not dist.is_initialized() or dist.get_rank() == 0):  # a warning: shown without logging set up
        _log.warning(
            "%s: skipping %d tensors of multi-token-prediction layers (model.layers.%d and after): "
            "not part of the trained model, not loaded (sao convert and sao export carry them through unchanged)",
            hf_dir,
            len(mtp),
            m.num_layers,
        )
    jobs = []
    for local, param in layout.named_weights(layout.unwrap(model)):  # parameters and expert biases
        name = layout.global_name(model, local)
        pieces = bridge.hf_pieces(name, m, fused)
        for piece in pieces:
            kept = bridge.keeps_float32(piece.hf_name)  # float32 in a bf16 checkpoint, or as the rest
            ckpt.check(piece.hf_name, bridge.hf_shape(piece.hf_name, m), None if kept else dtype)
        tp, _ = _tp(param, local)
        shape = _local_shape(bridge.full_shape(name, m), tp)
        if shape != tuple(param.shape):
            raise ValueError(
                f"parameter '{local}' ({name}) has shape {list(param.shape)}, the model config "
                f"gives {list(shape)}; build the model from the checkpoint's config"
            )
        reads = bridge.local_reads(pieces, bridge.full_shape(name, m), tp.dim, tp.size, tp.rank, tp.glu)
        jobs.append((str(ckpt.info(reads[0].hf_name).file), local, param, reads))
    jobs.sort(key=lambda job: job[0])  # one file at a time: fewer re-opens
    stats = TransferStats()
    with torch.no_grad(), ckpt:
        for _, _, param, reads in jobs:
            row = 0
            for r in reads:
                part = ckpt.read(r)
                param[row : row + part.shape[0]].copy_(part)
                row += part.shape[0]
                del part
            stats.tensors += 1
            stats.bytes += param.numel() * param.element_size()
            if progress is not None:
                progress(param.numel() * param.element_size())
    stats.seconds = time.perf_counter() - t0
    stats.extra["bytes_read"] = ckpt.bytes_read
    return stats


# --------------------------------------------------------------------------------------------
# Gathering and writing
# --------------------------------------------------------------------------------------------
def iter_hf_weights(
    model: torch.nn.Module,
    model_cfg: ModelConfig,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dst: int = 0,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(hf_name, full_tensor)`` of a sharded model, for weight sync and export.

    Collective: every rank of the model's world (the default process group) must call it and
    exhaust it. Buckets come in lock-step on all ranks; rank ``dst`` (default global rank 0)
    gets the tensors (full, on the parameters' device, ``dtype`` or the parameters' dtype),
    every other rank an empty list per bucket. Tensors that ``dst`` holds whole may be views
    of its live parameters: copy before modifying them. Each bucket holds at most ``bucket_bytes`` of Megatron tensors (a
    single larger tensor comes alone). Names and tensors are those of the on-disk HF
    checkpoint (per-expert names; no ``lm_head`` when embeddings are tied).
    """
    yield from HFWeightStream(model, model_cfg, dst=dst, dtype=dtype).buckets(bucket_bytes)


def hf_bytes(m: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of ``m``'s HF checkpoint in ``dtype``."""
    return sum(hf_io._numel(bridge.hf_shape(n, m)) for n in bridge.expected_hf_names(m)) * dtype.itemsize


def save_hf_checkpoint(
    model: torch.nn.Module,
    m: ModelConfig,
    out_dir: str | Path,
    *,
    template: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    progress_total: Callable[[int], None] | None = None,
    dst: int = 0,
    timeout_s: float = 0.0,
    gb_per_s: float = EXPORT_GB_PER_S,
    timeout_key: str = "run.export_timeout_s",
    mtp_from: str | Path | None = None,
) -> TransferStats:
    """Collective: write ``model`` as an HF checkpoint into ``out_dir``; every rank writes shards.

    Each tensor is written by one of the ranks holding a shard of it (``HFWeightStream`` with
    ``spread``; with TP = 1 by the rank holding it, nothing moves), into shard files named up
    front from the whole plan (``model-0000i-of-0000N.safetensors``, unique across writers).
    Rank ``dst`` checks the target, opens the staging directory next to ``out_dir`` (which must
    be on a file system every rank sees), merges the writers' tensor maps into
    ``model.safetensors.index.json``, writes the configs and renames the directory into place
    only after every writer reported success; on any rank's failure nothing appears at
    ``out_dir`` and every rank raises. A writer that fails (e.g. disk full) keeps taking part in
    the transfers until the end, so the others do not hang.

    ``config.json``, ``generation_config.json`` and tokenizer files are copied from
    ``template`` (an HF directory) when given, else ``config.json`` is generated from ``m``.
    ``dtype`` defaults to the template's ``dtype`` / ``torch_dtype``, else the parameters'.
    ``progress(nbytes)`` follows this rank's writes, ``progress_total`` gets their total first.
    ``mtp_from``: a directory whose multi-token-prediction tensors (:func:`hf_mtp.find`) rank ``dst``
    copies into the export, one at a time in ``dtype``, as ``model-mtp-*.safetensors`` listed in the
    index; ``config.json``'s ``num_nextn_predict_layers`` says how many layers were written (0: none).
    ``stats.extra["mtp_tensors"]`` counts them.

    Transfers and collectives run on a process group of their own whose timeout is
    ``timeout_s``, or when 0 ``hf_io.transfer_timeout_s(bytes, gb_per_s, EXPORT_FLOOR_S)``; a
    gloo wait past it raises ``TimeoutError`` naming ``timeout_key`` (NCCL's watchdog aborts
    the process instead, logging the timeout).
    """
    from sao_megatron.config import hf as hf_config

    t0 = time.perf_counter()
    template_cfg = hf_config.read_hf_config(template) if template is not None else None
    template_dtype = hf_io.config_dtype(template_cfg) if template_cfg is not None else None
    if dtype is None and template_dtype:
        dtype = hf_io.torch_dtype(template_dtype)
    out_dtype = dtype or next(model.parameters()).dtype
    timeout = timeout_s or hf_io.transfer_timeout_s(hf_bytes(m, out_dtype), gb_per_s, EXPORT_FLOOR_S)
    group = cast(dist.ProcessGroup, dist.new_group(timeout=timedelta(seconds=timeout)))  # every rank is a member
    settings = _ExportSettings(
        template,
        template_cfg,
        dtype,
        out_dtype,
        max_shard_bytes,
        bucket_bytes,
        inflight_bytes,
        overwrite,
        dst,
        str(mtp_from) if mtp_from is not None else None,
    )
    try:
        with _timeout_named(f"HF export to {out_dir}", timeout_key, timeout, t0):
            stats = _save(model, m, Path(out_dir), group, settings, progress, progress_total)
    except _Agreed as agreed:  # raised by every rank at the same point: the group is idle
        dist.destroy_process_group(group)
        raise agreed.error from None
    dist.destroy_process_group(group)  # not after a failed transfer (above): a peer may still be inside it
    stats.seconds = time.perf_counter() - t0
    return stats


class _Agreed(Exception):
    """A failure every rank of the export learnt from the same collective, raising ``error``."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class _ExportSettings:
    template: str | Path | None
    template_cfg: dict | None
    dtype: torch.dtype | None
    out_dtype: torch.dtype
    max_shard_bytes: int
    bucket_bytes: int
    inflight_bytes: int
    overwrite: bool
    dst: int
    mtp_from: str | None


@contextlib.contextmanager
def _timeout_named(what: str, key: str, timeout_s: float, t0: float) -> Iterator[None]:
    """A gloo timeout inside the block becomes a ``TimeoutError`` naming the config key that sets it."""
    try:
        yield
    except RuntimeError as err:  # torch's DistBackendError / gloo errors
        text = str(err)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            raise
        first = text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__
        raise TimeoutError(
            f"{what}: a transfer waited past {key}={timeout_s:g} s (after {time.perf_counter() - t0:.0f} s); "
            f"raise {key} if the export is that slow, else a rank died or hangs: see the other ranks' logs ({first})"
        ) from None


def _save(
    model: torch.nn.Module,
    m: ModelConfig,
    out_dir: Path,
    group: dist.ProcessGroup,
    s: _ExportSettings,
    progress: Callable[[int], None] | None,
    progress_total: Callable[[int], None] | None,
) -> TransferStats:
    """The collective body of :func:`save_hf_checkpoint`; a failure every rank learns together
    raises :class:`_Agreed`."""
    rank = dist.get_rank()
    box: list = [None, None]
    if rank == s.dst:
        box[0] = _export_precheck(m, out_dir, s.template_cfg, s.overwrite)
        if box[0] is None:
            try:
                box[1] = str(hf_io.open_staging(out_dir, s.overwrite))
            except OSError as err:
                box[0] = f"cannot create a staging directory next to {out_dir}: {err}"
    dist.broadcast_object_list(box, src=s.dst, group=group)
    if box[0]:
        raise _Agreed(ValueError(box[0]))
    staging = Path(box[1])
    try:
        stream = HFWeightStream(
            model, m, dst=s.dst, dtype=s.dtype, group=group, spread=True, inflight_bytes=s.inflight_bytes
        )
        files, first = {}, 0
        shards = {w: len(hf_io.plan_shards(stream.writer_specs(w), s.max_shard_bytes)) for w in stream.writers}
        for w in stream.writers:
            files[w] = hf_io.shard_files(shards[w], first, sum(shards.values()))
            first += shards[w]
        mine = stream.writer_specs(rank) if rank in files else []
        if progress_total is not None:
            progress_total(sum(spec.nbytes for spec in mine))
        report = _write_shards(stream, s, staging, mine, files.get(rank, []), progress)
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report, group=group)
        outcome: list = [_publish(reports, staging, out_dir, m, s) if rank == s.dst else None]
        dist.broadcast_object_list(outcome, src=s.dst, group=group)
    except BaseException:
        if rank == s.dst:
            hf_io.discard_staging(staging)
        raise
    error, mtp_tensors = outcome[0]
    if error:
        raise _Agreed(RuntimeError(f"HF export to {out_dir} failed, nothing was written: {error}"))
    stats = TransferStats(sum(r[3] for r in reports), sum(r[2] for r in reports))
    stats.extra.update(
        shards=sum(shards.values()), writers=len(stream.writers), written_bytes=report[2], mtp_tensors=mtp_tensors
    )
    return stats


def _write_shards(
    stream: HFWeightStream,
    s: _ExportSettings,
    staging: Path,
    specs: list[TensorSpec],
    files: list[str],
    progress: Callable[[int], None] | None,
) -> tuple[str | None, dict[str, str], int, int]:
    """This rank's part of the stream, its own buckets written by a thread (the next bucket is
    gathered meanwhile): ``(error or None, tensor -> file, bytes, tensors)``. Never raises on a
    write error: the rank keeps draining the stream (its peers are inside the transfers)."""
    rank = dist.get_rank()
    writer = hf_io.ShardWriter(staging, specs, s.max_shard_bytes, files=files) if specs else None
    error: str | None = None
    nbytes = tensors = 0

    def outcome(future: Future | None) -> str | None:
        try:
            if future is not None:
                future.result()
            return None
        except Exception as err:
            return f"rank {rank}: {type(err).__name__}: {err}"

    def write(bucket: list[tuple[str, torch.Tensor]]) -> None:
        assert writer is not None
        for name, tensor in bucket:
            writer.write(name, tensor)

    with ThreadPoolExecutor(1, thread_name_prefix="hf-export-writer") as pool:
        pending: Future | None = None
        for bucket in stream.buckets(s.bucket_bytes):
            if not bucket:
                continue
            error = error or outcome(pending)
            pending = None
            if error is None and writer is not None:
                pending = pool.submit(write, bucket)
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                nbytes, tensors = nbytes + size, tensors + len(bucket)
                if progress is not None:
                    progress(size)
        error = error or outcome(pending)
    if writer is not None:
        if error is None:
            try:
                writer.finish()
            except Exception as err:
                error = f"rank {rank}: {type(err).__name__}: {err}"
        writer.abort()
    return error, writer.weight_map if writer is not None else {}, nbytes, tensors


def _publish(reports: list, staging: Path, out_dir: Path, m: ModelConfig, s: _ExportSettings) -> tuple[str | None, int]:
    """On rank ``dst`` once every writer reported: the MTP tensors, the merged index, the configs,
    the rename; or the staging directory removed. Why it failed (or None) and the MTP tensors written."""
    from sao_megatron.config import hf as hf_config

    try:
        errors = [error for error, _, _, _ in reports if error]
        if errors:
            return "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more ranks)" if len(errors) > 3 else ""), 0
        weight_map: dict[str, str] = {}
        for _, written, _, _ in reports:
            weight_map.update(written)
        expected = set(bridge.expected_hf_names(m))
        if set(weight_map) != expected or sum(len(w) for _, w, _, _ in reports) != len(expected):
            return f"the writers wrote {len(weight_map)} distinct HF tensors, the model has {len(expected)}", 0
        total_size = sum(nbytes for _, _, nbytes, _ in reports)
        mtp = hf_mtp.find(s.mtp_from, m) if s.mtp_from is not None else None
        if mtp is not None:
            specs = mtp.specs(s.out_dtype)
            files = hf_mtp.export_files(len(hf_io.plan_shards(specs, s.max_shard_bytes)))
            weight_map.update(mtp.write_shards(staging, specs, s.max_shard_bytes, files))
            total_size += sum(spec.nbytes for spec in specs)
        if len(set(weight_map.values())) > 1:
            hf_io.write_index(staging, weight_map, total_size)
        dtype_name = str(s.out_dtype).removeprefix("torch.")
        if s.template is not None:
            assert s.template_cfg is not None  # read from the same template
            hf_io.copy_non_weight_files(s.template, staging, skip=("config.json",))
            config = dict(s.template_cfg)
            config["dtype"] = dtype_name
            config.pop("torch_dtype", None)
            # an FP8 template (DeepSeek's layout) was read dequantised: what is written is plain dtype_name
            config.pop("quantization_config", None)
        else:
            config = hf_config.hf_config_from_model(m, dtype_name)
        if "num_nextn_predict_layers" in config or mtp is not None:  # GLM, DeepSeek: the MTP layers written
            config["num_nextn_predict_layers"] = mtp.layers if mtp is not None else 0
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        hf_io.publish_staging(staging, out_dir)
        return None, len(mtp.names) if mtp is not None else 0
    except Exception as err:
        return f"rank {dist.get_rank()} publishing {out_dir}: {type(err).__name__}: {err}", 0
    finally:
        if staging.exists():
            hf_io.discard_staging(staging)


def _export_precheck(m: ModelConfig, out_dir: Path, template_cfg: dict | None, overwrite: bool) -> str | None:
    from sao_megatron.config import ConfigError
    from sao_megatron.config import hf as hf_config
    from sao_megatron.config.shape import same_shape

    if out_dir.exists() and not overwrite and any(out_dir.iterdir()):
        return f"{out_dir} exists and is not empty; choose another directory or overwrite"
    if template_cfg is not None:
        try:
            diff = same_shape(hf_config.model_config_from_hf(template_cfg), m)
        except ConfigError as err:
            return f"HF template config: {err}"
        if diff:
            return f"HF template config.json disagrees with the model config on {diff}"
    return None


__all__ = [
    "CheckpointError",
    "HFWeightStream",
    "TransferStats",
    "hf_bytes",
    "iter_hf_weights",
    "load_hf_weights",
    "save_hf_checkpoint",
]
