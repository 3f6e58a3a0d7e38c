"""HF weights in and out of a sharded Megatron model (any TP / PP / EP / DP layout).

- :func:`load_hf_weights`: every rank reads only its own slices of an HF safetensors checkpoint
  (its PP stage's layers, its EP rank's experts, its TP rows or columns) straight into its
  parameters. Not a collective: ranks share nothing.
- :func:`iter_hf_weights`: a collective over the model's whole world (the default process
  group) yielding ``(hf_name, full_tensor)`` buckets. Buckets are yielded in lock-step on every
  rank; only rank ``dst`` (global rank 0 by default) receives tensors, the others get an empty
  list per bucket and must still exhaust the iterator.
- :class:`HFWeightStream` with ``per_stage=True`` (the parallel weight sync): each pipeline
  stage gathers its own tensors to its own sender (the stage's lowest global rank), stages
  independently of each other; every rank of a stage iterates that stage's buckets only.
- :func:`save_hf_checkpoint`: the same stream written as HF shards by rank ``dst``.

Gathering is point-to-point: for every tensor one replica's TP shards (lowest global rank per
TP rank, the receiver itself when it holds one) are sent to the receiver (``dst``, or its
stage's sender), which concatenates them with the layout rules (SwiGLU ``[gate; up]`` per
rank) and splits them into HF tensors.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron.config import ModelConfig
from sao_megatron.models import hf_bridge as bridge
from sao_megatron.models import hf_io, layout
from sao_megatron.models.hf_io import CheckpointError, TensorSpec

DEFAULT_BUCKET_BYTES = 512 << 20
DEFAULT_SHARD_BYTES = 5 << 30


@dataclass
class TransferStats:
    """What one rank moved: tensors, bytes and wall seconds."""

    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"tensors": self.tensors, "bytes": self.bytes, "seconds": self.seconds, **self.extra}


@dataclass(frozen=True)
class _TP:
    size: int
    rank: int
    dim: int | None
    glu: bool


def _tp(param: torch.Tensor, local_name: str) -> _TP:
    if not layout._is_tp_sharded(param):
        return _TP(1, 0, None, False)
    group = layout._tp_group_of(local_name)
    size, rank, dim = dist.get_world_size(group), dist.get_rank(group), layout.partition_dim(param)
    return _TP(size, rank, dim if size > 1 else None, layout.is_glu_fc1(local_name) and dim == 0)


def _local_shape(full: tuple[int, ...], tp: _TP) -> tuple[int, ...]:
    if tp.dim is None:
        return full
    return tuple(s // tp.size if d == tp.dim else s for d, s in enumerate(full))


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
    jobs = []
    for local, param in layout.unwrap(model).named_parameters():
        name = layout.global_name(model, local)
        pieces = bridge.hf_pieces(name, m, fused)
        for piece in pieces:
            ckpt.check(piece.hf_name, bridge.hf_shape(piece.hf_name, m), dtype)
        tp = _tp(param, local)
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
# Gathering: the HF weight stream
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Item:
    """One Megatron full-layout tensor and where its TP shards live (global ranks)."""

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    tp: _TP  # size, dim and glu; rank unused
    sources: tuple[tuple[int, tuple[int, ...]], ...]  # per TP rank: (global rank, local shape)
    dst: int  # the global rank that receives it whole
    stage: int  # the pipeline stage that holds it (0 when not gathered per stage)

    @property
    def nbytes(self) -> int:
        return hf_io._numel(self.full_shape) * torch.empty((), dtype=self.dtype).element_size()


def _order_key(name: str):
    group = (
        0
        if name.startswith("embedding.")
        else 2
        if name.startswith("decoder.final")
        else 3
        if name.startswith("output_layer")
        else 1
    )
    return group, [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class HFWeightStream:
    """Collective plan of the HF weight stream of ``model``; see :func:`iter_hf_weights`.

    ``specs`` lists every HF tensor (name, shape, dtype) in the order :meth:`buckets` yields
    them, on every rank, before any tensor moves (the shard writer needs it up front). Build
    the stream once (one ``all_gather_object`` of names) and call :meth:`buckets` at every
    weight sync: it sends the parameters' current values.

    ``per_stage``: every pipeline stage gathers its own tensors to its own sender
    (:attr:`senders`, the stage's lowest global rank), without waiting for the other stages;
    :meth:`buckets` then yields this rank's stage only, and :meth:`bucket_plan` tells every rank
    every stage's buckets. ``group``: the process group the point-to-point gathers use (all
    ranks, global ranks; default the default group), so that they can run in a thread of their
    own while the caller uses the default group.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        m: ModelConfig,
        dst: int = 0,
        dtype: torch.dtype | None = None,
        per_stage: bool = False,
        group: dist.ProcessGroup | None = None,
    ):
        self.model, self.m, self.dst, self.rank = model, m, dst, dist.get_rank()
        self.group = group
        self._params: dict[tuple[str, int], torch.Tensor] = {}
        meta = []
        for local, param in layout.unwrap(model).named_parameters():
            name = layout.global_name(model, local)
            if not bridge.is_exported(name, m):
                continue
            tp = _tp(param, local)
            self._params[(name, tp.rank)] = param
            meta.append((name, tp.size, tp.rank, tp.dim, tp.glu, tuple(param.shape), str(param.dtype)))
        params = list(self._params.values())
        self.device = params[0].device if params else torch.device("cpu")  # NCCL receives on the GPU
        stage = layout.pipeline_rank() if per_stage else 0
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (stage, meta))
        stages = [s for s, _ in everyone]
        self.stage = stage
        self.senders = [
            min(r for r, s in enumerate(stages) if s == k) if per_stage else dst for k in range(max(stages) + 1)
        ]
        self.items = self._plan(everyone)
        self.dtype = dtype
        self.specs = self._specs(self.items)
        self._bucket_plans: dict[int, list[list[list[TensorSpec]]]] = {}

    @property
    def sender(self) -> int:
        """The global rank that receives this rank's stage's tensors (``dst`` unless ``per_stage``)."""
        return self.senders[self.stage]

    def _plan(self, everyone: list) -> list[_Item]:
        found: dict[str, dict] = {}
        for rank, (stage, meta) in enumerate(everyone):
            for name, size, tp_rank, dim, glu, shape, dtype in meta:
                entry = found.setdefault(
                    name, {"tp": _TP(size, 0, dim, glu), "dtype": dtype, "src": {}, "stage": stage}
                )
                if stage != entry["stage"]:  # held by two stages: the first one sends it
                    if stage > entry["stage"]:
                        continue
                    entry.update(stage=stage, src={})
                dst = self.senders[stage]
                best = entry["src"].get(tp_rank)
                if best is None or (rank == dst) or (best[0] != dst and rank < best[0]):
                    entry["src"][tp_rank] = (rank, shape)
        produced = {hf for name in found for hf in bridge.hf_names(name, self.m)}
        missing = [n for n in bridge.expected_hf_names(self.m) if n not in produced]
        if missing:
            raise ValueError(
                f"no rank holds the source of HF tensors {missing[:3]}; is the model built from this config?"
            )
        items = []
        for name in sorted(found, key=_order_key):
            entry = found[name]
            tp: _TP = entry["tp"]
            if sorted(entry["src"]) != list(range(tp.size)):
                raise ValueError(f"'{name}': TP shards {sorted(entry['src'])} of {tp.size} found")
            sources = tuple(entry["src"][r] for r in range(tp.size))
            full = bridge.full_shape(name, self.m)
            if _local_shape(full, tp) != tuple(sources[0][1]):
                raise ValueError(
                    f"'{name}': shard shape {list(sources[0][1])} does not fit the config's "
                    f"full shape {list(full)} over TP={tp.size}"
                )
            items.append(
                _Item(
                    name,
                    full,
                    getattr(torch, entry["dtype"].split(".")[-1]),
                    tp,
                    sources,
                    self.senders[entry["stage"]],
                    entry["stage"],
                )
            )
        return items

    def bucket_plan(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[list[TensorSpec]]]:
        """Per stage, its buckets' HF tensors (name, shape, dtype) in the order :meth:`buckets`
        yields them on that stage's sender; the same on every rank."""
        if bucket_bytes not in self._bucket_plans:  # the coordinator and its own sending both ask
            self._bucket_plans[bucket_bytes] = [
                [self._specs(group) for group in self._groups(stage, bucket_bytes)]
                for stage in range(len(self.senders))
            ]
        return self._bucket_plans[bucket_bytes]

    def _specs(self, items: list[_Item]) -> list[TensorSpec]:
        """The HF tensors (name, shape, dtype) of ``items``, in order."""
        return [
            TensorSpec(hf, bridge.hf_shape(hf, self.m), self.dtype or item.dtype)
            for item in items
            for hf in bridge.hf_names(item.name, self.m)
        ]

    def _groups(self, stage: int | None, bucket_bytes: int) -> Iterator[list[_Item]]:
        group: list[_Item] = []
        size = 0
        for item in self.items:
            if stage is not None and item.stage != stage:
                continue
            if group and size + item.nbytes > bucket_bytes:
                yield group
                group, size = [], 0
            group.append(item)
            size += item.nbytes
        if group:
            yield group

    def buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield lists of ``(hf_name, full_tensor)`` of at most ``bucket_bytes`` (one larger tensor alone):
        every stage's, or with ``per_stage`` this rank's stage's. Non-empty on the receiving rank only."""
        for group in self._groups(self.stage if len(self.senders) > 1 else None, bucket_bytes):
            yield self._transfer(group)

    def _transfer(self, group: list[_Item]) -> list[tuple[str, torch.Tensor]]:
        works, received = [], {}
        for item in group:
            for tp_rank, (src, shape) in enumerate(item.sources):
                if self.rank == item.dst and src == item.dst:
                    received[(item.name, tp_rank)] = self._params[(item.name, tp_rank)].detach()
                elif self.rank == item.dst:
                    buf = torch.empty(shape, dtype=item.dtype, device=self.device)
                    works.append(dist.irecv(buf, src, group=self.group))
                    received[(item.name, tp_rank)] = buf
                elif self.rank == src:
                    param = self._params[(item.name, tp_rank)].detach().contiguous()
                    works.append(dist.isend(param, item.dst, group=self.group))
        for work in works:
            work.wait()
        out = []
        for item in group:
            if self.rank != item.dst:
                continue
            shards = [received[(item.name, r)] for r in range(item.tp.size)]
            full = _concat_tp(shards, item.tp)
            for hf, tensor in bridge.to_hf(item.name, full, self.m):
                out.append((hf, tensor if self.dtype is None else tensor.to(self.dtype)))
        return out


def _concat_tp(shards: list[torch.Tensor], tp: _TP) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    if tp.glu:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    assert tp.dim is not None, "several TP shards of a parameter that is not TP-sharded"
    return torch.cat(shards, dim=tp.dim)


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


def save_hf_checkpoint(
    model: torch.nn.Module,
    m: ModelConfig,
    out_dir: str | Path,
    *,
    template: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    dst: int = 0,
) -> TransferStats:
    """Collective: write ``model`` as an HF checkpoint into ``out_dir`` (rank ``dst`` writes).

    ``config.json``, ``generation_config.json`` and tokenizer files are copied from
    ``template`` (an HF directory) when given, else ``config.json`` is generated from ``m``.
    ``dtype`` defaults to the template's ``dtype`` / ``torch_dtype``, else the parameters'.
    Everything is written into a staging directory next to ``out_dir`` and renamed at the end;
    on failure nothing appears at ``out_dir``.
    """
    from sao_megatron.config import hf as hf_config

    t0 = time.perf_counter()
    template_cfg = hf_config.read_hf_config(template) if template is not None else None
    error = None
    if dist.get_rank() == dst:
        error = _export_precheck(m, Path(out_dir), template_cfg, overwrite)
    flag = [error]
    dist.broadcast_object_list(flag, src=dst)
    if flag[0]:
        raise ValueError(flag[0])
    template_dtype = hf_io.config_dtype(template_cfg) if template_cfg is not None else None
    if dtype is None and template_dtype:
        dtype = hf_io.torch_dtype(template_dtype)
    stream = HFWeightStream(model, m, dst=dst, dtype=dtype)
    stats = TransferStats()
    if dist.get_rank() != dst:
        for _ in stream.buckets(bucket_bytes):
            pass
        stats.seconds = time.perf_counter() - t0
        return stats
    with hf_io.staging_dir(out_dir, overwrite) as stage:
        writer = hf_io.ShardWriter(stage, stream.specs, max_shard_bytes)
        try:
            for bucket in stream.buckets(bucket_bytes):
                for name, tensor in bucket:
                    writer.write(name, tensor)
                    stats.tensors += 1
                    stats.bytes += tensor.numel() * tensor.element_size()
                    if progress is not None:
                        progress(tensor.numel() * tensor.element_size())
            writer.finish()
        finally:
            writer.abort()
        out_dtype = dtype or stream.specs[0].dtype
        dtype_name = str(out_dtype).removeprefix("torch.")
        if template is not None:
            assert template_cfg is not None  # read above from the same template
            hf_io.copy_non_weight_files(template, stage, skip=("config.json",))
            config = dict(template_cfg)
            config["dtype"] = dtype_name
            config.pop("torch_dtype", None)
        else:
            config = hf_config.hf_config_from_model(m, dtype_name)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        stats.extra["shards"] = len(writer.files)
    stats.seconds = time.perf_counter() - t0
    return stats


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
    "iter_hf_weights",
    "load_hf_weights",
    "save_hf_checkpoint",
]
