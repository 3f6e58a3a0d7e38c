"""Native tool calls (``json`` format): schemas, parsing (parallel calls included), tool-error
observations, the calls of one action run in order or concurrently, demonstrations."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from sao_megatron.envs import make_env, make_task
from sao_megatron.envs.base import Sample
from sao_megatron.envs.format import tool_format_of
from sao_megatron.envs.tool_env import ToolEnv
from sao_megatron.envs.tool_parse import Answer, Malformed, NativeCall, Parallel, parse_native_action

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


C1 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
C2 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'


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
        (
            f"<think>\ntwo\n</think>\n\n{C1}\n{C2}<|im_end|>",
            Parallel(
                (NativeCall("calculator", {"expression": "1+1"}), NativeCall("calculator", {"expression": "2*3"}))
            ),
        ),
        (  # per-call errors: each bad block is Malformed in place, the others stay calls
            f'{C1}\n<tool_call>{{not json}}</tool_call>\n<tool_call>{{"name": "rm", "arguments": {{}}}}</tool_call>\n'
            f"<tool_call> </tool_call>\n{C2}",
            Parallel(
                (
                    NativeCall("calculator", {"expression": "1+1"}),
                    Malformed(
                        "tool call is not valid JSON: Expecting property name enclosed in double quotes: "
                        "line 1 column 2 (char 1)"
                    ),
                    Malformed("unknown tool 'rm', use calculator"),
                    Malformed("empty tool_call"),
                    NativeCall("calculator", {"expression": "2*3"}),
                )
            ),
        ),
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
        (f"{C1} and {C2}", "text between </tool_call> and <tool_call>"),
        (f"{C1}\n{C2} extra", "text after </tool_call>"),
        (f"{C1}\n<tool_call>{{", "unclosed <tool_call>"),
        (f"{C1}\n{C2}\n<answer>3</answer>", "text after </tool_call>"),
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
        result = parse_native_action(text, CALC)
        assert isinstance(result, NativeCall | Answer | Malformed) or (
            isinstance(result, Parallel)
            and len(result.calls) >= 2
            and all(isinstance(c, NativeCall | Malformed) for c in result.calls)
        )
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


def parallel_env(env_name="arith_tool", max_calls=8, **kwargs):
    env = make_env(env_name, max_turns=4, **kwargs)
    assert isinstance(env, ToolEnv)
    env.use_tool_format("json")
    env.limit_calls_per_turn(max_calls)
    env.reset(make_task(env_name).get("train", 1))
    return env


def calc(expr):
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'


def test_parallel_calls_get_one_output_each_in_order():
    """Three calls, one malformed: three outputs in call order, the bad one an error; every later
    call past max_calls_per_turn an error output too, counted in refused_calls."""
    env = parallel_env(max_calls=3)
    action = "\n".join(
        [calc("2+3"), '<tool_call>{"name": "calculator"}</tool_call>', calc("4*5"), calc("1"), calc("2")]
    )
    step = asyncio.run(env.astep(action + "<|im_end|>"))
    assert not step.done and step.info["kind"] == "parallel"
    assert step.observation == (
        "5",
        "Error: malformed action: no arguments for 'calculator'",
        "20",
        "Error: call 4 not run: at most 3 tool calls per turn",
        "Error: call 5 not run: at most 3 tool calls per turn",
    )
    assert step.outputs == step.observation and step.refused_calls == 2
    assert (env.tool_calls, env.malformed) == (2, 1)
    single = env.step(calc("6*7"))  # one call: a plain string, as before parallel calls
    assert single.observation == "42" and single.outputs == ("42",) and single.refused_calls == 0


def test_one_call_per_turn_refuses_the_rest():
    env = parallel_env(max_calls=1)
    step = env.step(f"{calc('1+1')}{calc('2+2')}")
    assert step.observation == ("2", "Error: call 2 not run: at most 1 tool call per turn") and step.refused_calls == 1
    with pytest.raises(ValueError, match="max_calls_per_turn must be an integer >= 1"):
        env.limit_calls_per_turn(0)


class SlowCalc(ToolEnv):
    """A calculator whose async calls take 0.1 s each and record how many overlap."""

    task_class = type(make_task("arith_tool"))
    tool_name = "calculator"
    tool_argument = "expression"
    calls_independent = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.running = self.most = 0
        self.order: list[str] = []

    def run_tool(self, code):
        return code

    async def arun_tool(self, code):
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.1 if code == "slow" else 0.0)
        self.order.append(code)
        self.running -= 1
        return code

    def check(self, answer, sample):
        return False


@pytest.mark.parametrize("concurrent", [False, True])
def test_calls_run_in_order_or_concurrently_as_env_kwargs_allow(concurrent):
    env = SlowCalc(concurrent_calls=concurrent)
    env.use_tool_format("json")
    env.limit_calls_per_turn(4)
    env.reset(Sample("p", "q", "a"))
    step = asyncio.run(env.astep(calc("slow") + calc("fast") + calc("slow")))
    assert step.observation == ("slow", "fast", "slow")  # outputs in call order either way
    if concurrent:
        assert env.most == 3 and env.order == ["fast", "slow", "slow"]
    else:
        assert env.most == 1 and env.order == ["slow", "fast", "slow"]


def test_concurrent_calls_need_independent_calls():
    class Stateful(SlowCalc):
        calls_independent = False

    with pytest.raises(ValueError, match="concurrent_calls=true, but Stateful's tool calls share state"):
        Stateful(concurrent_calls=True)
    assert make_env("math_python", concurrent_calls=True).concurrent_calls  # type: ignore[attr-defined]
