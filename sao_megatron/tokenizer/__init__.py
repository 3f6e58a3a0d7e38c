"""The project's tiny byte-level BPE tokenizer (vocabulary 512) for the chat/tool format.

The files in ``assets/`` are produced by ``tools/train_tokenizer.py`` (deterministic; ``--check``
verifies the shipped files equal a fresh training). Ids: ``<|pad|>`` 0, ``<|endoftext|>`` 1,
``<|user|>`` 2, ``<|assistant|>`` 3, ``<|tool|>`` 4, ``<|end|>`` 5 (eos), then the 256 byte
symbols and the learned merges; the tags ``<tool>``, ``</tool>``, ``<answer>``, ``</answer>``
are the last four ids (508-511). Digits are always split into single-digit tokens.

A run whose actor starts from an HF checkpoint (``actor.init_from``) uses that checkpoint's own
tokenizer and chat template instead (:func:`tokenizer_source`); this one is for the tiny default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_DIR = Path(__file__).resolve().parent / "assets"
VOCAB_SIZE = 512
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
)
"""The files of an HF checkpoint that make up its tokenizer (those present are copied on export)."""


def is_tokenizer_dir(path: str | Path | None) -> bool:
    """Whether ``path`` is a directory holding an HF tokenizer (``tokenizer.json``, ``.model`` or config)."""
    if not path:
        return False
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def tokenizer_source(init_from: str | Path | None = None) -> Path:
    """The run's tokenizer directory: ``init_from`` when it is an HF dir with a tokenizer; for a
    Megatron checkpoint from ``sao convert hf-to-mcore``, the HF files it keeps in ``hf/``; else
    the in-repo tiny tokenizer (:data:`TOKENIZER_DIR`)."""
    for candidate in (init_from, Path(init_from) / "hf" if init_from else None):
        if candidate and is_tokenizer_dir(candidate):
            return Path(candidate).resolve()
    return TOKENIZER_DIR


def tokenizer_files(source: str | Path) -> list[Path]:
    """The tokenizer files of ``source`` to copy next to exported weights (all of the in-repo assets)."""
    source = Path(source)
    if source.resolve() == TOKENIZER_DIR:
        return sorted(p for p in TOKENIZER_DIR.iterdir() if p.is_file())
    return [source / f for f in TOKENIZER_FILES if (source / f).is_file()]


def copy_tokenizer_files(init_from: str | Path | None, out_dir: str | Path) -> None:
    """Copy the run's tokenizer files (:func:`tokenizer_source` of ``init_from``) into ``out_dir``,
    next to exported weights or the engines' config."""
    import shutil

    for path in tokenizer_files(tokenizer_source(init_from or None)):
        shutil.copy(path, Path(out_dir) / path.name)


def load_tokenizer(path: str | Path | None = None, *, init_from: str | Path | None = None) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(path)``; without ``path``, the run's tokenizer
    :func:`tokenizer_source` ``(init_from)`` (the in-repo tiny one when ``init_from`` is not an
    HF directory).

    Imports transformers lazily (so importing this package is cheap).
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or tokenizer_source(init_from)))
