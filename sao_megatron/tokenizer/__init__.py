"""The project's tiny byte-level BPE tokenizer (vocabulary 512) for the chat/tool format.

The files in ``assets/`` are produced by ``tools/train_tokenizer.py`` (deterministic; ``--check``
verifies the shipped files equal a fresh training). Ids: ``<|pad|>`` 0, ``<|endoftext|>`` 1,
``<|user|>`` 2, ``<|assistant|>`` 3, ``<|tool|>`` 4, ``<|end|>`` 5 (eos), then the 256 byte
symbols and the learned merges; the tags ``<tool>``, ``</tool>``, ``<answer>``, ``</answer>``
are the last four ids (508-511). Digits are always split into single-digit tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_DIR = Path(__file__).resolve().parent / "assets"
VOCAB_SIZE = 512


def load_tokenizer(path: str | Path | None = None) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(path or TOKENIZER_DIR)``.

    Imports transformers lazily (so importing this package is cheap).
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or TOKENIZER_DIR))
