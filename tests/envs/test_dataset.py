"""JSONL prompt files (``data`` config section): field mapping, row checks, cycling, a math_python run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sao_megatron.config import ConfigError, load_config
from sao_megatron.config.schema import DataConfig
from sao_megatron.envs import Split, make_env, make_task
from sao_megatron.envs.dataset import DatasetTask, check_data, read_rows
from sao_megatron.envs.sandbox import SandboxLimits

FAST = SandboxLimits(wall_s=5.0, cpu_s=5, memory_bytes=256 << 20)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def data(tmp_path: Path, train: list, eval_rows: list | None = None, **kw) -> DataConfig:
    ev = write_jsonl(tmp_path / "eval.jsonl", eval_rows) if eval_rows is not None else None
    return DataConfig(train=str(write_jsonl(tmp_path / "train.jsonl", train)), eval=str(ev or ""), **kw)


def test_text_mapping_ids_tools_and_meta(tmp_path: Path) -> None:
    rows = [
        {"q": "What is 2+2?", "gt": 4, "uid": "a", "tools": [{"name": "python"}], "level": 1, "x": 0},
        {"q": "What is 3*3?", "gt": "9", "uid": "b", "level": 2},
    ]
    d = data(
        tmp_path,
        rows,
        rows[:1],
        prompt_field="q",
        answer_field="gt",
        id_field="uid",
        tools_field="tools",
        meta_fields=["level"],
    )
    task = DatasetTask(d)
    assert task.size("train") == 2 and task.size("heldout") == 1
    by_id = {task.get("train", i).prompt_id: task.get("train", i) for i in range(2)}
    a, b = by_id["data:a"], by_id["data:b"]
    assert (a.question, a.answer, a.meta["tools"], a.meta["level"]) == (
        "What is 2+2?",
        "4",
        [{"name": "python"}],
        1,
    )
    assert "tools" not in b.meta and b.meta["level"] == 2 and "x" not in a.meta
    assert a.meta["source"] == "train.jsonl:1"
    assert task.get("heldout", 0).prompt_id == "data:a"


def test_messages_mapping_and_default_ids(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is 6*7?"},
    ]
    d = data(tmp_path, ["", {"messages": messages, "answer": "42"}], prompt_field="messages", prompt_format="messages")
    sample = DatasetTask(d).get("train", 0)
    assert sample.question == "What is 6*7?" and sample.answer == "42"
    assert sample.meta["messages"] == messages
    assert sample.prompt_id == "data:train.jsonl:2"  # blank lines are skipped but counted


@pytest.mark.parametrize(
    ("rows", "kw", "line", "needle"),
    [
        (
            [{"prompt": "p", "answer": "1"}, {"prompt": "p"}],
            {},
            2,
            "no field 'answer' (the row has: prompt); set data.answer_field",
        ),
        (
            [{"question": "p", "answer": "1"}],
            {},
            1,
            "no field 'prompt' (the row has: answer, question); set data.prompt_field",
        ),
        (
            [{"prompt": "p", "answer": "1"}, '{"prompt": "p", "answer": 1'],
            {},
            2,
            "bad JSON (Expecting ',' delimiter at column 28); write one JSON object per line",
        ),
        (['["p", 1]'], {}, 1, "the row is a JSON list, not an object"),
        ([{"prompt": ["a"], "answer": "1"}], {}, 1, "set data.prompt_format=messages"),
        ([{"prompt": "p", "answer": None}], {}, 1, "data.answer_field='answer' is None, not a string or number"),
        (
            [{"prompt": [{"role": "bot", "content": "x"}], "answer": "1"}],
            {"prompt_format": "messages"},
            1,
            "message 0 of data.prompt_field='prompt'",
        ),
        (
            [{"prompt": [{"role": "system", "content": "x"}], "answer": "1"}],
            {"prompt_format": "messages"},
            1,
            "no non-empty user message",
        ),
        (
            [{"prompt": "p", "answer": "1", "id": 3}, {"prompt": "q", "answer": "2", "id": 3}],
            {"id_field": "id"},
            2,
            "id '3' (data.id_field='id') repeats line 1",
        ),
    ],
)
def test_row_errors_name_file_line_and_fix(tmp_path: Path, rows, kw, line, needle) -> None:
    d = data(tmp_path, rows, **kw)
    with pytest.raises(ConfigError) as err:
        check_data(d)
    message = str(err.value)
    assert message.startswith(f"{d.train}:{line}: "), message
    assert needle in message and "\n" not in message


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ConfigError, match=rf"^{bad}:2: not UTF-8 \(byte 0xe9 at column 16\); re-encode"):
        check_data(DataConfig(train=str(bad)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match=rf"^{empty}: no rows \(the file is empty\)"):
        check_data(DataConfig(train=str(empty)))
    with pytest.raises(ConfigError, match="data file not found"):
        check_data(DataConfig(train=str(tmp_path / "missing.jsonl")))
    d = data(tmp_path, [{"prompt": "p", "answer": "1"}], tools_field="tool_specs")
    with pytest.raises(ConfigError, match="no row has the field 'tool_specs' named by data.tools_field"):
        check_data(d)
    d = data(tmp_path, [{"prompt": "p", "answer": "1"}], [{"prompt": "q", "answer": "2"}])
    assert check_data(d) == {"train": 1, "heldout": 1}


def test_config_section_checks(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "1"}])
    with pytest.raises(ConfigError, match="data.eval is empty; set data.eval=FILE"):
        load_config(None, [f"data.train={f}"])
    cfg = load_config(None, [f"data.train={f}", "train.eval_prompts=0", "data.prompt_format=messages"])
    assert cfg.data.train == str(f) and cfg.data.prompt_format == "messages"
    with pytest.raises(ConfigError, match="needs data.train"):
        load_config(None, [f"data.eval={f}"])
    with pytest.raises(ConfigError, match="data.prompt_format: 'chat' is not one of 'text', 'messages'"):
        load_config(None, ["data.prompt_format=chat"])


def test_cycling_is_a_deterministic_shuffle_per_epoch(tmp_path: Path) -> None:
    n = 7
    d = data(
        tmp_path,
        [{"prompt": f"q{i}", "answer": str(i)} for i in range(n)],
        [{"prompt": f"h{i}", "answer": str(i)} for i in range(3)],
        seed=5,
    )
    task = DatasetTask(d)
    order = [task.get("train", i).answer for i in range(4 * n)]
    epochs = [order[e * n : (e + 1) * n] for e in range(4)]
    assert all(sorted(e) == sorted(str(i) for i in range(n)) for e in epochs)  # each epoch: every row once
    assert len({tuple(e) for e in epochs}) > 1  # orders differ between epochs
    again = DatasetTask(d)  # a fresh process (resume) sees the same order, from any index on
    assert [again.get("train", i).answer for i in reversed(range(4 * n))] == order[::-1]
    other = DatasetTask(DataConfig(**{**d.__dict__, "seed": 6}))
    assert [other.get("train", i).answer for i in range(4 * n)] != order
    assert [task.get("heldout", i).answer for i in range(6)] == ["0", "1", "2", "0", "1", "2"]  # file order
    with pytest.raises(ValueError, match="index must be >= 0"):
        task.get("train", -1)


def test_make_task_uses_the_files_only_when_set(tmp_path: Path) -> None:
    assert not isinstance(make_task("arith_tool", dataset=DataConfig()), DatasetTask)
    d = data(tmp_path, [{"prompt": "What is 2+3?", "answer": "5"}], eval_rows=None)
    task = make_task("arith_tool", dataset=d, max_operands=3)  # task kwargs do not apply to files
    assert isinstance(task, DatasetTask) and task.get("train", 10).question == "What is 2+3?"
    with pytest.raises(ValueError, match="set data.eval"):
        task.get("heldout", 0)


def test_math_python_run_on_a_tiny_jsonl(tmp_path: Path) -> None:
    rows = [
        {"id": "m1", "problem": "What is 2**10?", "solution": "print(2**10)", "final": "1024"},
        {
            "id": "m2",
            "problem": "What is 1/4 + 1/4?",
            "solution": "from fractions import Fraction as F\nprint(F(1, 4) + F(1, 4))",
            "final": "1/2",
        },
    ]
    train = write_jsonl(tmp_path / "math.jsonl", rows)
    heldout = write_jsonl(tmp_path / "math_eval.jsonl", rows[1:])
    cfg = load_config(
        None,
        [
            "rollout.env=math_python",
            f"data.train={train}",
            f"data.eval={heldout}",
            "data.prompt_field=problem",
            "data.answer_field=final",
            "data.id_field=id",
            "data.meta_fields=[solution]",
        ],
    )
    assert check_data(cfg.data) == {"train": 2, "heldout": 1}
    task = make_task(cfg.rollout.env, dataset=cfg.data, **cfg.rollout.task_kwargs)
    cases: list[tuple[Split, int]] = [("train", 0), ("train", 1), ("train", 2), ("heldout", 0)]
    for split, index in cases:
        sample = task.get(split, index)
        env = make_env("math_python", limits=FAST)
        demo = env.demonstration(sample)  # runs the row's solution in the sandbox
        assert env.reset(sample) == sample.question
        step = env.step(demo[0][1])
        assert not step.done and step.observation == sample.answer
        assert env.step(demo[2][1]).done
        assert env.reward().reward == 1.0, (split, index, sample)
    env = make_env("math_python", limits=FAST)
    env.reset(task.get("heldout", 0))
    assert env.step("<answer>3/4</answer>").done and env.reward().reward == 0.0


def test_sao_train_rejects_a_bad_row_before_starting_anything(tmp_path: Path, capsys) -> None:
    from sao_megatron.cli import main

    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "1"}, {"prompt": "q"}])
    assert main(["train", f"data.train={train}", "train.eval_prompts=0", f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: {train}:2: no field 'answer'") and "\n" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]  # nothing started: no run directory


def test_shuffle_is_a_permutation_computed_per_index() -> None:
    import time

    from sao_megatron.envs.dataset import shuffled

    for n in (1, 2, 3, 5, 64, 100, 1000, 1025):
        order = [shuffled(i, n, b"k") for i in range(n)]
        assert sorted(order) == list(range(n)), n
    assert [shuffled(i, 100, b"a") for i in range(100)] != [shuffled(i, 100, b"b") for i in range(100)]
    assert [shuffled(i, 100, b"a") for i in range(100)] != list(range(100))
    t0 = time.perf_counter()
    picks = [shuffled(i * 7919, 10**7, b"big") for i in range(1000)]  # random access into 10M rows
    assert time.perf_counter() - t0 < 1.0 and len(set(picks)) == 1000
    with pytest.raises(ValueError, match="outside range"):
        shuffled(5, 5, b"k")


def test_parquet_rows_map_like_jsonl_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"problem": "What is 2+3?", "final": 5, "topic": "add"},
        {"problem": "What is 7*6?", "final": 42},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = DataConfig(
        train=str(tmp_path / "train.parquet"), prompt_field="problem", answer_field="final", meta_fields=["topic"]
    )
    from_parquet = read_rows(tmp_path / "train.parquet", d)
    from_jsonl = read_rows(tmp_path / "train.jsonl", d)
    assert [(s.question, s.answer) for s in from_parquet] == [(s.question, s.answer) for s in from_jsonl]
    assert from_parquet[0].prompt_id == "data:train.parquet:row 1" and from_parquet[0].meta["topic"] == "add"
    pq.write_table(pa.Table.from_pylist([{"problem": "q"}]), tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet:row 1: no field 'final'"):
        read_rows(tmp_path / "bad.parquet", d)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        read_rows(tmp_path / "broken.parquet", d)
