"""``sao train`` start-up checks of an HF checkpoint's weight files, from their headers alone.

A truncated or corrupt safetensors file, or an index naming a missing shard or a tensor its shard
lacks, fails before any process starts, in one line naming the config key, the file and the fix
(torch and safetensors are not imported; no tensor data is read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sao_megatron.config.schema import ConfigError

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_SINGLE = "model.safetensors"
_SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors format's own limit


def safetensors_header(file: Path, key: str) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file's size (no tensor data is
    read); a one-line ConfigError naming ``key`` and the file when it is truncated or corrupt."""
    fix = "re-download or re-copy the checkpoint"
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(size - 8, _SAFETENSORS_MAX_HEADER):
                raise ConfigError(
                    f"{key}: {file} is truncated or not a safetensors file ({size} bytes, header length {n}); {fix}"
                )
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as err:
        raise ConfigError(f"{key}: cannot read {file} ({err.strerror}); check the checkpoint's files") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{key}: {file} has a corrupt safetensors header (not JSON); {fix}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{key}: {file} has a corrupt safetensors header (not a JSON object); {fix}")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ConfigError(
                f"{key}: {file} has a corrupt safetensors header (tensor '{name}' has no data_offsets); {fix}"
            )
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ConfigError(f"{key}: {file} is truncated ({size} bytes; its header needs {8 + n + end}); {fix}")
    return header


def check_hf_weights(path: str | Path, key: str) -> None:
    """``sao train`` start-up: the safetensors files of HF checkpoint ``path`` are complete, as far
    as their headers and sizes tell (every shard the index names is present, holds the tensors
    mapped to it and is not truncated). Reads headers only; torch and safetensors are not imported."""
    p = Path(path).expanduser()
    index = p / _SAFETENSORS_INDEX
    if not index.is_file():
        single = p / _SAFETENSORS_SINGLE
        if not single.is_file():
            raise ConfigError(
                f"{key}={path} has neither {_SAFETENSORS_INDEX} nor {_SAFETENSORS_SINGLE}; "
                "save the checkpoint with save_pretrained (the loader reads only those)"
            )
        safetensors_header(single, key)
        return
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(
            f"{key}: {index} is not a safetensors index (JSON with a 'weight_map' of tensor -> "
            "shard file); re-download or re-save the checkpoint"
        ) from None
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(shard, []).append(tensor)
    for shard, tensors in sorted(shards.items()):
        file = p / shard
        if not file.is_file():
            raise ConfigError(
                f"{key}: {index} maps '{tensors[0]}' to the shard {shard}, which is missing "
                f"from {p}; copy the whole checkpoint directory"
            )
        header = safetensors_header(file, key)
        absent = [t for t in tensors if t not in header]
        if absent:
            raise ConfigError(
                f"{key}: {index} maps '{absent[0]}' to {shard}, which does not hold it; "
                "re-download or re-save the checkpoint"
            )
