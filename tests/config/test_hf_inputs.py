"""Bad Hugging Face inputs fail at ``sao train`` start-up, before any process or run directory,
in one line naming the file or key and the fix: an ``actor.init_from`` without tokenizer files, a
tokenizer larger than the embedding, a chat template that cannot render the tools the run
declares. (Unsupported architectures: ``tests/config/test_init_from.py``; dataset rows missing
a mapped field or not UTF-8: ``tests/envs/test_dataset.py``.)
"""

from __future__ import annotations

import json
import shutil

import pytest

from sao_megatron.cli import _tools_from, main
from sao_megatron.config import ConfigError, load_config
from sao_megatron.config import hf as hf_config
from sao_megatron.config.load import check_init_tokenizer
from sao_megatron.config.tokenizer_files import chat_template_source, check_hf_tokenizer, tokenizer_size
from sao_megatron.tokenizer import TOKENIZER_DIR
from tests.config.test_init_from import EMPTY_SAFETENSORS

TOOLS_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
PLAIN_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"


def _hf_dir(path, tokenizer: str | None = "tiny", template: str | None = None, size: int | None = None):
    """An HF dir of the tiny_moe shape (vocab 512; weights only present as a file name) with the
    in-repo tiny tokenizer (``tiny``), a synthetic one of ``size`` ids, or none."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config.hf_config_from_model(load_config().model)))
    (path / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)  # a valid header, no tensors
    if tokenizer == "tiny":
        for f in TOKENIZER_DIR.iterdir():
            shutil.copy(f, path / f.name)
    elif tokenizer == "synthetic":
        vocab = {f"t{i}": i for i in range((size or 100) - 1)}
        (path / "tokenizer.json").write_text(
            json.dumps(
                {
                    "model": {"type": "BPE", "vocab": vocab},
                    "added_tokens": [{"id": (size or 100) - 1, "content": "<|im_end|>", "special": True}],
                }
            )
        )
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return path


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def _train(tmp_path, *overrides) -> tuple[int, str]:
    out = tmp_path / "out"
    return main(["train", *overrides, f"run.output_dir={out}"]), str(out)


def test_tiny_tokenizer_dir_passes(tmp_path):
    hf = _hf_dir(tmp_path / "ckpt")
    cfg = load_config(None, [f"actor.init_from={hf}"])
    check_init_tokenizer(cfg, _tools_from(cfg))  # arith_tool declares tools; the tiny tags template is exempt
    assert _tools_from(cfg) == "rollout.env=arith_tool"
    assert tokenizer_size(hf) == 512 and "<|tool|>" in (chat_template_source(hf) or "")


def test_missing_tokenizer_files_fail_before_anything_starts(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "ckpt", tokenizer=None)
    cfg = load_config(None, [f"actor.init_from={hf}"])
    with pytest.raises(ConfigError) as err:
        check_init_tokenizer(cfg)
    message = _one_line(err)
    assert message.startswith(f"actor.init_from={hf}: the checkpoint has no tokenizer")
    assert "tokenizer.json and tokenizer_config.json" in message and "save_pretrained" in message
    rc, out = _train(tmp_path, f"actor.init_from={hf}")
    err_text = capsys.readouterr().err.strip()
    assert rc == 2 and err_text == f"config error: {message}"
    assert not (tmp_path / "out").exists(), "a run directory was made"
    (hf / "tokenizer.json").write_text("{}")  # tokenizer.json alone: still no tokenizer_config.json
    with pytest.raises(ConfigError, match="has no tokenizer"):
        check_init_tokenizer(cfg)


def test_a_tokenizer_larger_than_the_embedding_fails(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "ckpt", tokenizer="synthetic", template=TOOLS_TEMPLATE, size=600)
    cfg = load_config(None, [f"actor.init_from={hf}"])
    assert cfg.model.vocab_size == 512
    with pytest.raises(ConfigError) as err:
        check_init_tokenizer(cfg)
    message = _one_line(err)
    assert f"{hf / 'tokenizer.json'} has 600 token ids but config.json's vocab_size is 512" in message
    assert "resize the embeddings to >= 600" in message
    rc, _ = _train(tmp_path, f"actor.init_from={hf}")
    assert rc == 2 and "has 600 token ids" in capsys.readouterr().err and not (tmp_path / "out").exists()
    check_hf_tokenizer(hf, 600)  # equal sizes are fine


def test_the_real_qwen3_tokenizer_size_read_from_json_matches_transformers(qwen3_tokenizer_dir):
    from sao_megatron.tokenizer import load_tokenizer

    assert tokenizer_size(qwen3_tokenizer_dir) == len(load_tokenizer(qwen3_tokenizer_dir)) == 151669
    assert "tools" in (chat_template_source(qwen3_tokenizer_dir) or "")
    check_hf_tokenizer(qwen3_tokenizer_dir, 151936, "rollout.env=math_python")
    with pytest.raises(ConfigError, match="has 151669 token ids but config.json's vocab_size is 151000"):
        check_hf_tokenizer(qwen3_tokenizer_dir, 151000)


def test_a_template_without_tools_fails_when_the_run_declares_tools(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "ckpt", tokenizer="synthetic", template=PLAIN_TEMPLATE, size=500)
    cfg = load_config(None, [f"actor.init_from={hf}", "rollout.env=math_python"])
    assert _tools_from(cfg) == "rollout.env=math_python"
    with pytest.raises(ConfigError) as err:
        check_init_tokenizer(cfg, _tools_from(cfg))
    message = _one_line(err)
    assert f"the chat template in {hf / 'tokenizer_config.json'} does not render tools" in message
    assert "rollout.env=math_python declares tools" in message
    rc, _ = _train(tmp_path, f"actor.init_from={hf}", "rollout.env=math_python")
    assert rc == 2 and "does not render tools" in capsys.readouterr().err and not (tmp_path / "out").exists()
    check_init_tokenizer(cfg)  # nothing declares tools: the same template is fine
    # a template with tool support passes
    good = _hf_dir(tmp_path / "good", tokenizer="synthetic", template=TOOLS_TEMPLATE, size=500)
    check_init_tokenizer(load_config(None, [f"actor.init_from={good}"]), "rollout.env=math_python")


def test_a_tokenizer_without_any_chat_template_fails(tmp_path):
    hf = _hf_dir(tmp_path / "ckpt", tokenizer="synthetic", template=None, size=500)
    with pytest.raises(ConfigError) as err:
        check_init_tokenizer(load_config(None, [f"actor.init_from={hf}"]))
    assert "has no chat_template" in _one_line(err)
    (hf / "chat_template.jinja").write_text(TOOLS_TEMPLATE)  # the template in its own file counts
    check_init_tokenizer(load_config(None, [f"actor.init_from={hf}"]), "rollout.env=math_python")


def test_unreadable_tokenizer_files_fail_in_one_line(tmp_path):
    hf = _hf_dir(tmp_path / "ckpt", tokenizer="synthetic", template=TOOLS_TEMPLATE, size=500)
    (hf / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError) as err:
        check_init_tokenizer(load_config(None, [f"actor.init_from={hf}"]))
    assert "cannot read its tokenizer files (JSONDecodeError" in _one_line(err)


def test_dataset_tools_count_as_declared_tools(tmp_path):
    rows = tmp_path / "t.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "answer": "1", "tools": []}) + "\n")
    cfg = load_config(None, [f"data.train={rows}", "train.eval_prompts=0", "data.tools_field=tools"])
    assert _tools_from(cfg) == "data.tools_field=tools"
