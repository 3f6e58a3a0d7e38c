"""An arithmetic agent with a calculator tool, written only against the official ``openai`` client.

It knows nothing of SAO: it asks the model, runs the calculator calls the model makes, sends their
results back, and stops at the first answer without a tool call. SAO trains it unchanged
(docs/envs.md, "Train an existing agent")::

    sao train configs/openai_agent_cpu.yaml      # rollout.env=openai_agent,
                                                 # rollout.agent.entry_point=examples/arith_agent.py:run

Two ways to run it, as SAO does:

* as a function, ``run(task, base_url, api_key)`` (``rollout.agent.entry_point``); it returns None,
  so the task's own reward function grades its final answer;
* as a program (``rollout.agent.command``: ``["python", "examples/arith_agent.py"]``): the task on
  stdin, the endpoint in ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``.

Sampling settings are left to the server (``rollout.loop``): training and evaluation set them.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import sys

import openai
from openai.types.chat import ChatCompletionFunctionToolParam

CALCULATOR: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37*12+5"}},
            "required": ["expression"],
        },
    },
}
MAX_TURNS = 4

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The value of an integer expression with + - * (and unary minus), or an error message."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"Error: {err}"


async def run(task: str, base_url: str, api_key: str) -> None:
    """Solve ``task`` with the calculator; the final answer is the last message (graded by the server)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = (await client.models.list()).data[0].id
    messages: list = [{"role": "user", "content": task}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments)["expression"]  # type: ignore[union-attr]
            except (ValueError, KeyError, TypeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    return None


if __name__ == "__main__":
    asyncio.run(run(sys.stdin.read(), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))
