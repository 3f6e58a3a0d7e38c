"""Train the project's byte-level BPE tokenizer and write it to ``sao_megatron/tokenizer/assets/``.

The corpus is generated in-process and deterministically from the environments: arith_tool
demonstrations (two difficulty levels), the math_python problems with their solutions, and
writing_shift example responses in every style. Special and tag tokens are cut out of the
corpus before training so no merges are spent on them; they are added as whole tokens.

Usage::

    python tools/train_tokenizer.py            # (re)write the shipped files
    python tools/train_tokenizer.py --check    # exit 1 if the shipped files differ from a fresh run
    python tools/train_tokenizer.py --out DIR  # write elsewhere
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers starts its thread pool

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sao_megatron.envs.arith_tool import ArithTask, ArithToolEnv  # noqa: E402
from sao_megatron.envs.format import (  # noqa: E402
    CHAT_TEMPLATE,
    END,
    PAD,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    final_answer,
    render_conversation,
    tool_call,
)
from sao_megatron.envs.math_python import MathPythonTask  # noqa: E402
from sao_megatron.envs.writing_shift import STYLES, WritingTask, example_response  # noqa: E402
from sao_megatron.tokenizer import TOKENIZER_DIR, VOCAB_SIZE  # noqa: E402


def conversations() -> list[str]:
    """Rendered trajectories that make up the corpus, in a fixed order."""
    texts = []
    env = ArithToolEnv()
    for task in (ArithTask(), ArithTask(min_operands=2, max_operands=4, max_digits=3)):
        texts += [render_conversation((s := task.get("train", i)).question, env.demonstration(s)) for i in range(1500)]
    math_task = MathPythonTask()
    for i in range(math_task.size("train")):
        s = math_task.get("train", i)
        turns = [
            ("assistant", tool_call(s.meta["solution"])),
            ("tool", s.answer),
            ("assistant", final_answer(s.answer)),
        ]
        texts.append(render_conversation(s.question, turns))
    writing = WritingTask()
    for i in range(300):
        s = writing.get("train", i)
        texts += [render_conversation(s.question, [("assistant", example_response(s, st))]) for st in STYLES]
    return texts


def corpus() -> list[str]:
    """Plain-text segments of :func:`conversations` with special and tag tokens cut out."""
    pattern = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *TAG_TOKENS)))
    return [seg for text in conversations() for seg in pattern.split(text) if seg]


def train():  # -> transformers PreTrainedTokenizerFast
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TAG_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    data = corpus()
    tok.train_from_iterator(data, trainer=trainer, length=len(data))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAG_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {tok.get_vocab_size()} ids, expected {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (END, PAD)],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        train().save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            (out_dir / name).write_bytes((Path(tmp) / name).read_bytes())


def check(shipped: Path) -> bool:
    """True when a fresh training reproduces the shipped files byte for byte."""
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp))
        fresh = sorted(os.listdir(tmp))
        have = sorted(p.name for p in shipped.iterdir() if p.is_file()) if shipped.is_dir() else []
        if fresh != have:
            print(f"file sets differ: fresh {fresh} vs shipped {have}")
            return False
        bad = [n for n in fresh if not filecmp.cmp(Path(tmp, n), shipped / n, shallow=False)]
        if bad:
            print(f"differs from a fresh training: {bad}; run `python tools/train_tokenizer.py`")
        return not bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the shipped files with a fresh training")
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR, help="output directory")
    args = parser.parse_args(argv)
    if args.check:
        ok = check(args.out)
        print("tokenizer assets are up to date" if ok else "tokenizer assets are STALE")
        return 0 if ok else 1
    write(args.out)
    print(f"wrote {sorted(p.name for p in args.out.iterdir())} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
