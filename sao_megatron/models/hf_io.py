"""HF safetensors checkpoints on disk: sliced reads, streamed sharded writes, atomic directories.

Reading (:class:`HFCheckpoint`) goes through ``safetensors.safe_open(...).get_slice``, so a rank
copies only the rows / columns it owns. ``safe_open`` memory-maps the file and the pages it
touches count towards the process's resident memory until the map is closed, so a file is
re-opened after every ``reopen_bytes`` read: resident memory stays near the shard being loaded
plus that budget, even for a single-file checkpoint.

FP8 block-scaled checkpoints (DeepSeek-V3's and Kimi-K2's official layout: ``quantization_config``
``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``, a linear weight stored as
``float8_e4m3fn`` beside a float32 ``<name>_scale_inv`` of one factor per block) are read dequantised:
``weight = fp8 * scale_inv`` per block, in float32, for exactly the slice asked for (a TP slice may
start inside a block); the ``_scale_inv`` tensors are not listed among the checkpoint's names.

Writing (:class:`ShardWriter`) knows every tensor's name, shape and dtype up front (the bridge
computes them), so each shard's header is written first and tensor bytes are streamed after it
in arrival order: memory stays at one bucket, whatever the shard size. Several writers (ranks)
may fill one checkpoint: each writes its own shards under names agreed up front
(:func:`shard_files`), and the index merges their tensor maps (:func:`write_index`). Output goes
into a staging directory next to the target that is renamed into place at the end
(:func:`staging_dir`, or :func:`open_staging` / :func:`publish_staging` / :func:`discard_staging`
when the writers are several processes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sao_megatron.models.hf_bridge import Read

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_CONFIG_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or is damaged; names the tensor and file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "BF16"

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=_DTYPES[self.dtype]).element_size()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def dtype_code(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def torch_dtype(code_or_name: str) -> torch.dtype:
    """``"BF16"`` or ``"bfloat16"`` -> ``torch.bfloat16``."""
    code = _CONFIG_DTYPES.get(code_or_name, code_or_name)
    if code not in _DTYPES:
        raise ValueError(f"unknown dtype {code_or_name!r}; use float32, bfloat16 or float16")
    return _DTYPES[code]


def config_dtype(config: dict) -> str | None:
    """safetensors dtype code named by an HF config (``dtype`` in 5.x, ``torch_dtype`` before)."""
    name = config.get("dtype") or config.get("torch_dtype")
    return _CONFIG_DTYPES.get(name) if isinstance(name, str) else None


def _open(file: Path, reason: str):
    from safetensors import safe_open

    if not file.exists():
        raise CheckpointError(f"{reason}: file {file} does not exist")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # SafetensorError is not importable as a class in all versions
        raise CheckpointError(f"{reason}: {file} is truncated or not a safetensors file ({err})") from None


SCALE_SUFFIX = "_scale_inv"
"""An FP8 weight's per-block dequantisation factors: ``<weight name>_scale_inv``."""
FP8_CODES = ("F8_E4M3",)


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """:func:`sao_megatron.config.hf.fp8_block` with the refusal as a :class:`CheckpointError`."""
    from sao_megatron.config import ConfigError
    from sao_megatron.config import hf as hf_config

    try:
        return hf_config.fp8_block(config)
    except ConfigError as err:
        raise CheckpointError(str(err)) from None


class HFCheckpoint:
    """An HF checkpoint directory: ``model.safetensors.index.json`` + shards, or one ``model.safetensors``."""

    def __init__(self, directory: str | Path, reopen_bytes: int = 64 << 20):
        self.directory = Path(directory)
        self.reopen_bytes = reopen_bytes
        config = self.directory / "config.json"
        self.fp8_block = fp8_block_size(json.loads(config.read_text())) if config.exists() else None
        """FP8 block-scaled weights: their block ``(rows, cols)``; None for an unquantised checkpoint."""
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.exists():
            self.source = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: not a safetensors index ({err!r})") from None
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.exists():
            self.source = single
            with _open(single, "cannot read the checkpoint") as f:
                self.files = {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        else:
            raise CheckpointError(f"{self.directory} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
        self._infos: dict[str, TensorInfo] = {}
        self._handle = None
        self._handle_file: Path | None = None
        self._handle_bytes = 0
        self.bytes_read = 0

    def names(self) -> list[str]:
        """Tensor names, without FP8 weights' scale tensors (a weight is read dequantised)."""
        return [n for n in self.files if not (n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in self.files)]

    def _file_of(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.source} has no tensor '{name}'")
        return self.files[name]

    def info(self, name: str) -> TensorInfo:
        """Shape and dtype from the file header (reads no tensor data)."""
        file = self._file_of(name)
        if name not in self._infos:
            with _open(file, f"cannot read tensor '{name}'") as f:
                for key in f.keys():  # noqa: SIM118
                    sl = f.get_slice(key)
                    self._infos[key] = TensorInfo(key, file, tuple(sl.get_shape()), sl.get_dtype())
            if name not in self._infos:
                raise CheckpointError(f"tensor '{name}' is mapped to {file} by {self.source} but is not in that file")
        return self._infos[name]

    def check(self, name: str, shape: tuple[int, ...], dtype: str | None) -> TensorInfo:
        """Raise :class:`CheckpointError` unless ``name`` exists with this shape (and dtype)."""
        info = self.info(name)
        if info.shape != tuple(shape):
            raise CheckpointError(
                f"tensor '{name}' in {info.file} has shape {list(info.shape)}, the model config expects {list(shape)}"
            )
        if info.dtype in FP8_CODES:
            self._check_fp8(info)
            return info
        if info.dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(f"tensor '{name}' in {info.file} has dtype {info.dtype}; expected a float dtype")
        if dtype is not None and info.dtype != dtype:
            raise CheckpointError(f"tensor '{name}' in {info.file} has dtype {info.dtype}, config.json says {dtype}")
        return info

    def _check_fp8(self, info: TensorInfo) -> None:
        scale = info.name + SCALE_SUFFIX
        if self.fp8_block is None or scale not in self.files:
            raise CheckpointError(
                f"tensor '{info.name}' in {info.file} is {info.dtype} but the checkpoint has no "
                f"{'quantization_config in config.json' if self.fp8_block is None else repr(scale)}: "
                "only block-scaled FP8 (DeepSeek's layout) is read"
            )
        blocks = tuple(-(-n // b) for n, b in zip(info.shape[-2:], self.fp8_block, strict=True))
        expected = (*info.shape[:-2], *blocks)
        got = self.info(scale).shape
        if got != expected:
            raise CheckpointError(
                f"tensor '{scale}' has shape {list(got)}; {list(info.shape)} in {list(self.fp8_block)} blocks needs {list(expected)}"
            )

    def _dequantise(self, r: Read, fp8: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """``fp8`` (the slice ``r`` of an FP8 weight of ``shape``) times its blocks' factors, float32."""
        assert self.fp8_block is not None, "checked by check()"
        block_rows, block_cols = self.fp8_block
        cols = r.cols if r.cols is not None else (0, shape[-1])
        first_row, first_col = r.start // block_rows, cols[0] // block_cols
        index: tuple = (
            slice(first_row, (r.stop - 1) // block_rows + 1),
            slice(first_col, (cols[1] - 1) // block_cols + 1),
        )
        if r.expert is not None:
            index = (r.expert, *index)
        scale_name = r.hf_name + SCALE_SUFFIX
        handle = self._handle_for(self.info(scale_name).file)
        try:
            scale = handle.get_slice(scale_name)[index].float()
        except Exception as err:
            raise CheckpointError(f"reading tensor '{scale_name}' failed ({err})") from None
        scale = scale.repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
        row0, col0 = r.start - first_row * block_rows, cols[0] - first_col * block_cols
        scale = scale[..., row0 : row0 + fp8.shape[-2], col0 : col0 + fp8.shape[-1]]
        return fp8.float() * scale

    def _handle_for(self, file: Path):
        if self._handle is not None and (self._handle_file != file or self._handle_bytes >= self.reopen_bytes):
            self.close()
        if self._handle is None:
            self._handle = _open(file, "cannot read the checkpoint").__enter__()
            self._handle_file, self._handle_bytes = file, 0
        return self._handle

    def read(self, r: Read) -> torch.Tensor:
        """One slice: rows ``[r.start, r.stop)`` (and ``r.cols``) of ``r.hf_name``."""
        info = self.info(r.hf_name)
        handle = self._handle_for(info.file)
        index: tuple = (slice(r.start, r.stop),)
        if r.cols is not None:
            index += (slice(*r.cols),)
        if r.expert is not None:
            index = (r.expert, *index)
        try:
            tensor = handle.get_slice(r.hf_name)[index]
        except Exception as err:
            raise CheckpointError(f"reading tensor '{r.hf_name}' from {info.file} failed ({err})") from None
        # Mapped pages touched: whole rows of the tensor, whatever the column range.
        row_elems = info.shape[-1] if len(info.shape) > 1 else 1
        self._handle_bytes += row_elems * (r.stop - r.start) * tensor.element_size()
        self.bytes_read += tensor.numel() * tensor.element_size()
        if info.dtype in FP8_CODES:
            self._check_fp8(info)
            return self._dequantise(r, tensor, info.shape)
        return tensor

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._handle_file = None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most ``max_shard_bytes`` (a larger tensor gets a shard alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


def _header(specs: Sequence[TensorSpec]) -> bytes:
    entries: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        entries[s.name] = {
            "dtype": dtype_code(s.dtype),
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def shard_files(n: int, first: int = 0, total: int | None = None) -> list[str]:
    """Names of ``n`` shards numbered from ``first`` among ``total`` (default ``n``), as
    ``save_pretrained`` names them: ``model-0000i-of-0000N.safetensors``, or ``model.safetensors``
    for a checkpoint of one file."""
    total = n if total is None else total
    if total == 1:
        return [SINGLE_FILE] * n
    return [f"model-{first + i + 1:05d}-of-{total:05d}.safetensors" for i in range(n)]


def write_index(directory: str | Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: every tensor's file (the writers' maps merged) and the bytes."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class ShardWriter:
    """Stream tensors, in the order of ``specs``, into HF safetensors shards under ``directory``.

    File names follow ``save_pretrained``: one ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``. ``files``: the
    names of this writer's shards when it is one of several (:func:`shard_files`, one per
    planned shard); the index is then written by whoever merges the writers' :attr:`weight_map`.
    """

    def __init__(
        self,
        directory: str | Path,
        specs: Sequence[TensorSpec],
        max_shard_bytes: int,
        files: Sequence[str] | None = None,
    ):
        self.directory = Path(directory)
        self.shards = plan_shards(specs, max_shard_bytes)
        self.index = files is None
        self.files = shard_files(len(self.shards)) if files is None else list(files)
        if len(self.files) != len(self.shards):
            raise ValueError(f"{len(self.files)} file names for {len(self.shards)} planned shards")
        self._queue = [(i, s) for i, shard in enumerate(self.shards) for s in shard]
        self._pos = 0
        self._fh = None
        self.bytes_written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._queue):
            raise ValueError(f"unexpected tensor '{name}': all planned tensors are written")
        shard, spec = self._queue[self._pos]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"tensor '{name}' {list(tensor.shape)} {tensor.dtype} arrived where "
                f"'{spec.name}' {list(spec.shape)} {spec.dtype} was planned"
            )
        if self._fh is None:
            self._fh = open(self.directory / self.files[shard], "wb")  # noqa: SIM115 (closed at shard end)
            self._fh.write(_header(self.shards[shard]))
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._fh.write(memoryview(data))
        self.bytes_written += spec.nbytes
        self._pos += 1
        if self._pos == len(self._queue) or self._queue[self._pos][0] != shard:
            self._fh.close()
            self._fh = None

    def finish(self) -> None:
        if self._pos != len(self._queue):
            raise ValueError(
                f"only {self._pos} of {len(self._queue)} planned tensors were written; "
                f"next missing: '{self._queue[self._pos][1].name}'"
            )
        if self.index and len(self.files) > 1:
            write_index(self.directory, self.weight_map, self.bytes_written)

    @property
    def weight_map(self) -> dict[str, str]:
        """Every planned tensor's file name."""
        return {s.name: self.files[i] for i, s in self._queue}

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def copy_non_weight_files(src: str | Path, dst: str | Path, skip: Sequence[str] = ()) -> list[str]:
    """Copy config, generation config and tokenizer files (top-level, not weights) from ``src``."""
    copied = []
    for path in sorted(Path(src).iterdir()):
        if not path.is_file() or path.name in skip or path.name == INDEX_FILE or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        shutil.copy2(path, Path(dst) / path.name)
        copied.append(path.name)
    return copied


def open_staging(target: str | Path, overwrite: bool = False) -> Path:
    """A fresh directory next to ``target`` (``.<name>.partial-<pid>``) for :func:`publish_staging`.

    An existing non-empty ``target`` is refused unless ``overwrite``."""
    target = Path(target)
    if target.exists() and not overwrite and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty; choose another directory or overwrite")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def publish_staging(staging: Path, target: str | Path) -> None:
    """Rename a finished staging directory to ``target``, replacing what was there."""
    target = Path(target)
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def discard_staging(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def staging_dir(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """A fresh directory next to ``target``, renamed to ``target`` only if the block succeeds.

    On error the staging directory is removed and ``target`` is untouched. An existing
    ``target`` is refused unless ``overwrite``, in which case it is replaced after success.
    """
    staging = open_staging(target, overwrite)
    try:
        yield staging
    except BaseException:
        discard_staging(staging)
        raise
    publish_staging(staging, target)


TIMEOUT_SAFETY = 3.0
"""A whole-model transfer's timeout is this many times its expected duration (:func:`transfer_timeout_s`)."""


def transfer_timeout_s(nbytes: int, gb_per_s: float, floor_s: float) -> float:
    """How long a whole-model transfer (export, conversion, weight-sync gather) may take before it
    counts as hung: ``max(floor_s, TIMEOUT_SAFETY x nbytes / (gb_per_s x 1e9))``."""
    return max(floor_s, TIMEOUT_SAFETY * nbytes / (gb_per_s * 1e9))
