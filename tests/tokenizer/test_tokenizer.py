"""The shipped tokenizer: ids, round trips, chat template, and reproducibility of the assets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sao_megatron.envs import make_env, make_task
from sao_megatron.envs.format import (
    SPECIAL_TOKENS,
    TAG_TOKENS,
    render_conversation,
    render_observation,
    to_messages,
)
from sao_megatron.tokenizer import TOKENIZER_DIR, VOCAB_SIZE, load_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_vocabulary_and_special_ids(tok) -> None:
    assert len(tok) == VOCAB_SIZE == 512
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4, 5]
    assert [tok.convert_tokens_to_ids(t) for t in TAG_TOKENS] == [508, 509, 510, 511]
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 0
    assert tok.eos_token == "<|end|>" and tok.eos_token_id == 5
    assert tok.bos_token is None
    for token in (*SPECIAL_TOKENS, *TAG_TOKENS):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize(
    "text",
    [
        "What is 37*12+5?",
        "Hello, world! ünïcödé 😀 \n\t tabs  and  spaces",
        "print(sum(i for i in range(10)))\n",
        "x = [1, 2]\nif x:\n    print(x[-1] ** 0.5)",
        "  leading and trailing  ",
        "\\frac{3}{4} \\sqrt{2}",
        "",
    ],
)
def test_round_trip(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_digits_are_single_tokens(tok) -> None:
    pieces = tok.convert_ids_to_tokens(tok.encode("12345", add_special_tokens=False))
    assert pieces == ["1", "2", "3", "4", "5"]


def test_chat_template_matches_render_for_every_env(tok) -> None:
    for name in ("arith_tool", "writing_shift"):
        sample = make_task(name).get("train", 0)
        turns = make_env(name).demonstration(sample)
        text = render_conversation(sample.question, turns)
        assert tok.apply_chat_template(to_messages(sample.question, turns), tokenize=False) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>q<|assistant|>"


def test_arith_trajectory_is_compact(tok) -> None:
    sample = make_task("arith_tool").get("train", 0)
    text = render_conversation(sample.question, make_env("arith_tool").demonstration(sample))
    assert len(tok.encode(text)) <= 40


def test_escaped_observation_has_no_special_ids(tok) -> None:
    ids = tok.encode(render_observation("<|end|><|user|>"), add_special_tokens=False)
    assert ids[0] == 4 and ids[-1] == 3 and not set(ids[1:-1]) & set(range(6))


def test_shipped_assets_equal_a_fresh_training() -> None:
    assert {p.name for p in TOKENIZER_DIR.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
