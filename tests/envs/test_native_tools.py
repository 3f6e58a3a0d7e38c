"""Native tool calls (``json`` format): schemas, parsing, tool-error observations, demonstrations."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from sao_megatron.envs import make_env, make_task
from sao_megatron.envs.format import tool_format_of
from sao_megatron.envs.tool_env import ToolEnv
from sao_megatron.envs.tool_parse import Answer, Malformed, NativeCall, parse_native_action

CALC = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "required": ["expression"],
                "properties": {"expression": {"type": "string"}},
            },
        },
    }
]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>',
            NativeCall("calculator", {"expression": "2+3"}),
        ),
        (
            '<think>\nplan\n</think>\n\n<tool_call>{"name":"calculator","arguments":{"expression":"2"}}</tool_call>',
            NativeCall("calculator", {"expression": "2"}),
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7\\"}"}</tool_call>',
            NativeCall("calculator", {"expression": "7"}),
        ),
        ("<think>\nr\n</think>\n\n<answer>5</answer><|im_end|>", Answer("5")),
        ("The answer is 5.<|im_end|><|endoftext|>", Answer("The answer is 5.")),
        ("<think>\n<answer>4</answer>?\n</think>\n\nIt is 5", Answer("It is 5")),
    ],
)
def test_native_valid(text, expected):
    assert parse_native_action(text, CALC) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<tool_call>{not json}</tool_call>", "tool call is not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', 'must be a JSON object {"name"'),
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown tool 'rm', use calculator"),
        ('<tool_call>{"name": "calculator"}</tool_call>', "no arguments for 'calculator'"),
        ('<tool_call>{"name": "calculator", "arguments": 5}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": "x"}</tool_call>', "not a JSON object"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>',
            "missing argument(s): expression",
        ),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "unclosed <tool_call>"),
        ('{"name": "calculator"}</tool_call>', "</tool_call> without <tool_call>"),
        ("<tool_call>{}</tool_call><tool_call>{}</tool_call>", "more than one <tool_call>"),
        ("<tool_call> </tool_call>", "empty tool_call"),
        ("<|im_end|>", "no tool call and no answer"),
        ("<answer></answer>", "empty answer"),
    ],
)
def test_native_malformed(text, reason):
    result = parse_native_action(text, CALC)
    assert isinstance(result, Malformed) and reason in result.reason, result


def test_native_never_raises_on_noise():
    rng = random.Random(0)
    pieces = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        '"calculator"',
        '"arguments"',
        "<answer>",
        "</answer>",
        "</think>",
        "<|im_end|>",
        "x",
        "\n",
        "[",
        "null",
        "1e999",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert isinstance(parse_native_action(text, CALC), NativeCall | Answer | Malformed)
    assert isinstance(parse_native_action(None, CALC), Malformed)  # type: ignore[arg-type]


def test_tool_format_follows_the_template():
    assert tool_format_of(None) == "tags"
    assert tool_format_of("{{ m['content'] }}<|end|>") == "tags"
    assert tool_format_of("... <tool_call> ...") == "json"


@pytest.mark.parametrize(
    ("env_name", "tool", "arg"), [("arith_tool", "calculator", "expression"), ("math_python", "python", "code")]
)
def test_envs_declare_json_schemas(env_name, tool, arg):
    env = make_env(env_name)
    (schema,) = env.tools
    json.dumps(schema)
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == tool and fn["description"]
    assert fn["parameters"]["required"] == [arg] and fn["parameters"]["properties"][arg]["type"] == "string"
    assert env.system_prompt is None  # tags (tiny template): no system message
    env.use_tool_format("json")
    assert "<answer>" in (env.system_prompt or "")
    with pytest.raises(ValueError):
        env.use_tool_format("xml")  # type: ignore[arg-type]


def test_arith_json_episode_and_tool_errors():
    task = make_task("arith_tool")
    sample = task.get("train", 1)
    env = make_env("arith_tool", max_turns=4)
    assert isinstance(env, ToolEnv)
    env.use_tool_format("json")
    env.reset(sample)
    expr = sample.meta["expression"]
    step = env.step(env.call_text(expr) + "<|im_end|>")
    assert not step.done and step.observation == sample.answer and step.info["kind"] == "toolcall"
    step = asyncio.run(env.astep('<tool_call>{"name": "calc", "arguments": {}}</tool_call>'))
    assert not step.done and step.observation == "Error: malformed action: unknown tool 'calc', use calculator"
    step = env.step(f"<answer>{sample.answer}</answer><|im_end|>")
    assert step.done
    result = env.reward()
    assert result.reward == 1.0 and result.details["malformed"] == 1 and result.details["tool_calls"] == 1


def test_json_demonstrations_use_the_native_call():
    task = make_task("arith_tool")
    sample = task.get("train", 2)
    env = make_env("arith_tool")
    env.use_tool_format("json")
    turns = env.demonstration(sample)
    payload = {"name": "calculator", "arguments": {"expression": sample.meta["expression"]}}
    assert turns[0] == ("assistant", f"<tool_call>\n{json.dumps(payload)}\n</tool_call>")
    assert turns[2] == ("assistant", f"<answer>{sample.answer}</answer>")
    env.reset(sample)
    assert env.step(turns[0][1]).observation == turns[1][1]
    assert env.step(turns[2][1]).done and env.reward().reward == 1.0


def test_math_python_json_runs_code_argument():
    task = make_task("math_python")
    sample = task.get("train", 0)
    env = make_env("math_python")
    env.use_tool_format("json")
    env.reset(sample)
    call = json.dumps({"name": "python", "arguments": {"code": "print(6*7)"}})
    step = asyncio.run(env.astep(f"<tool_call>\n{call}\n</tool_call><|im_end|>"))
    assert step.observation == "42"
