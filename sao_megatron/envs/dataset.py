"""Prompts from JSONL or Parquet files (the ``data`` config section): :class:`DatasetTask`.

Each line of a JSONL file is one JSON object; each row of a Parquet file (``*.parquet``, read
with pyarrow) is one record, errors naming ``file:row N``. :class:`~sao_megatron.config.schema.DataConfig` maps its
fields onto a :class:`~sao_megatron.envs.base.Sample`:

================  =============================================================================
``prompt_field``  the question: a string (``prompt_format: text``), or a list of chat messages
                  ``[{"role": ..., "content": ...}, ...]`` (``prompt_format: messages``); then the
                  question is the last user turn and ``meta["messages"]`` holds the whole list
``answer_field``  ground truth (string or number) -> ``Sample.answer``
``tools_field``   optional per-sample tool specifications -> ``meta["tools"]`` (rows may lack it)
``id_field``      stable unique id -> ``prompt_id`` (``data:<id>``); default ``data:<file>:<line>``
``meta_fields``   further fields copied into ``meta`` when a row has them
================  =============================================================================

Split ``train`` reads ``data.train``, split ``heldout`` reads ``data.eval``. Every row is checked
when the task is built (and by :func:`check_data` at ``sao train`` start-up); the first problem
raises :class:`~sao_megatron.config.schema.ConfigError` in one line, ``file:line: problem; fix``.

Indices beyond a file cycle. The RL cursor only grows, so index ``i`` of ``train`` with ``n`` rows
is row ``perm_e(i % n)`` of epoch ``e = i // n``, where ``perm_e`` is a pseudo-random permutation
of ``range(n)`` keyed by ``f"sao-data:{seed}:{e}"`` (``seed`` = ``data.seed``; :func:`shuffled`):
every epoch visits every row once, in an order that differs between epochs and is the same on
every machine and after resume (it depends on nothing but the seed, the epoch and ``n``).
``heldout`` is read in file order (index ``i`` is row ``i % n``), so evaluation on the first
``k <= n`` indices covers ``k`` distinct rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sao_megatron.config.schema import ConfigError, DataConfig
from sao_megatron.envs.base import Sample, Split, Task, check_split

ROLES = ("system", "user", "assistant", "tool")
_SPLIT_KEYS: dict[str, str] = {"train": "train", "heldout": "eval"}


def _fields_hint(row: dict) -> str:
    names = sorted(row)
    return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "") if names else "none"


def _question(value: Any, d: DataConfig, where: str) -> tuple[str, list[dict] | None]:
    """The question text (and the message list) of a row's prompt field."""
    key = f"data.prompt_field={d.prompt_field!r}"
    if d.prompt_format == "text":
        if not isinstance(value, str) or not value.strip():
            kind = "a list (chat messages?)" if isinstance(value, list) else repr(value)[:40]
            raise ConfigError(
                f"{where}: {key} is {kind}, not a non-empty string; fix the row, or set "
                "data.prompt_format=messages if it holds chat messages"
            )
        return value, None
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"{where}: {key} must be a non-empty list of {{role, content}} messages "
            f"(data.prompt_format=messages), got {repr(value)[:40]}; fix the row or set "
            "data.prompt_format=text"
        )
    messages = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ConfigError(
                f"{where}: message {i} of {key} is {repr(message)[:60]}; each message needs "
                f"'role' (one of {', '.join(ROLES)}) and a string 'content'"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users or not users[-1].strip():
        raise ConfigError(f"{where}: {key} has no non-empty user message; add the question as a user turn")
    return users[-1], messages


def _answer(value: Any, d: DataConfig, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(
            f"{where}: data.answer_field={d.answer_field!r} is {repr(value)[:40]}, not a string "
            "or number; fix the row or point data.answer_field at the ground truth"
        )
    return str(value)


def _jsonl_rows(path: Path, data: bytes) -> Iterator[tuple[str, dict]]:
    """``(file:line, row)`` for every non-empty line of a JSONL file."""
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{where}: not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
                "re-encode the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{where}: bad JSON ({err.msg} at column {err.colno}); write one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise ConfigError(
                f"{where}: the row is a JSON {type(row).__name__}, not an object; write one JSON object per line"
            ) from None
        yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """``(file:row N, row)`` for every record of a Parquet file (1-based row numbers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(
            f"{path}: not a readable Parquet file ({err}); check the file or convert it to JSONL"
        ) from None
    for i, row in enumerate(table.to_pylist(), 1):
        yield f"{path}:row {i}", row


def read_rows(path: str | Path, d: DataConfig) -> list[Sample]:
    """Every row of one JSONL or Parquet file as a :class:`Sample`; raises ConfigError at the first bad row."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: data file not found; fix data.train / data.eval (relative paths are "
            "taken from the directory sao train runs in)"
        ) from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the data file ({err.strerror}); check the path") from None
    samples: list[Sample] = []
    ids: dict[str, str] = {}
    seen = {"tools": not d.tools_field, **{name: False for name in d.meta_fields}}
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path, data)
    for where, row in rows:
        for key in ("prompt_field", "answer_field", *(("id_field",) if d.id_field else ())):
            name = getattr(d, key)
            if name not in row:
                raise ConfigError(
                    f"{where}: no field {name!r} (the row has: {_fields_hint(row)}); set "
                    f"data.{key} to the row's field or add it to the row"
                )
        question, messages = _question(row[d.prompt_field], d, where)
        meta: dict[str, Any] = {"source": where.removeprefix(f"{path.parent}/")}
        if messages is not None:
            meta["messages"] = messages
        if d.tools_field and d.tools_field in row:
            meta["tools"] = row[d.tools_field]
            seen["tools"] = True
        for name in d.meta_fields:
            if name in row:
                meta[name] = row[name]
                seen[name] = True
        if d.id_field:
            key = str(row[d.id_field])
            if key in ids:
                raise ConfigError(
                    f"{where}: id {key!r} (data.id_field={d.id_field!r}) repeats {ids[key]}; ids must be unique"
                )
            place = where.rsplit(":", 1)[1]
            ids[key] = f"line {place}" if place.isdigit() else place
            prompt_id = f"data:{key}"
        else:
            prompt_id = f"data:{where.removeprefix(f'{path.parent}/')}"
        samples.append(Sample(prompt_id, question, _answer(row[d.answer_field], d, where), meta))
    if not samples:
        raise ConfigError(f"{path}: no rows (the file is empty); write one JSON object per line")
    for name, found in seen.items():
        if not found:
            key = "data.tools_field" if name == "tools" else "data.meta_fields"
            field_name = d.tools_field if name == "tools" else name
            raise ConfigError(f"{path}: no row has the field {field_name!r} named by {key}; fix the name or remove it")
    return samples


def check_data(d: DataConfig) -> dict[str, int]:
    """Read and check every configured file (``sao train`` start-up): rows per split; ConfigError."""
    if not d.train:
        return {}
    return {split: len(read_rows(getattr(d, key), d)) for split, key in _SPLIT_KEYS.items() if getattr(d, key)}


def shuffled(i: int, n: int, key: bytes) -> int:
    """Position ``i`` of a pseudo-random permutation of ``range(n)`` chosen by ``key``, in O(1):
    a 4-round Feistel network keyed BLAKE2b over the smallest even-bit domain holding ``n``,
    walking the cycle until the value falls below ``n`` (fewer than 4 steps on average). Any
    index is computed without materialising the permutation (SFT draws random indices)."""
    if not 0 <= i < n:
        raise ValueError(f"position {i} outside range({n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for round_ in range(4):
            digest = hashlib.blake2b(right.to_bytes(8, "little") + bytes([round_]), key=key[:64], digest_size=8)
            left, right = right, left ^ (int.from_bytes(digest.digest(), "little") & mask)
        x = (left << half) | right
        if x < n:
            return x


class DatasetTask(Task):
    """``data.train`` / ``data.eval`` as the ``train`` / ``heldout`` splits (see the module docstring)."""

    def __init__(self, data: DataConfig) -> None:
        if not data.train:
            raise ValueError("DatasetTask needs data.train (a JSONL file)")
        self.data = data
        self._rows: dict[str, list[Sample]] = {
            split: read_rows(getattr(data, key), data) for split, key in _SPLIT_KEYS.items() if getattr(data, key)
        }

    def size(self, split: Split) -> int:
        return len(self._split(split))

    def _split(self, split: Split) -> list[Sample]:
        rows = self._rows.get(check_split(split))
        if rows is None:
            raise ValueError(f"split {split!r} has no file: set data.{_SPLIT_KEYS[split]}")
        return rows

    def position(self, epoch: int, offset: int) -> int:
        """Row of the ``offset``-th training index of ``epoch`` (see :func:`shuffled`)."""
        return shuffled(offset, len(self._rows["train"]), f"sao-data:{self.data.seed}:{epoch}".encode())

    def get(self, split: Split, index: int) -> Sample:
        rows = self._split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        n = len(rows)
        if split == "heldout":
            return rows[index % n]
        return rows[self.position(index // n, index % n)]
