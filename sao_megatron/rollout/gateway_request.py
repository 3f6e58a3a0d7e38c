"""A chat-completions request body, validated field by field before anything reaches the engine.

:func:`parse_request` turns the JSON body into a :class:`ChatRequest` or raises a
:class:`RequestError`: a 4xx in the OpenAI error JSON ``{"error": {"message", "type", "code",
"param"}}`` whose ``param`` names the field (``temperature``, ``messages[2].tool_calls``, ...).
Numbers must be finite and in range (``NaN`` passes no comparison, so it is refused as such), types
exact (``true`` is not the integer 1), ``regex`` must compile, ``stream_options`` must be an object
whose ``include_usage`` is a boolean, both token limits are checked when both are given
(``max_completion_tokens`` wins). The table of cases is docs/rollout.md §7, "Errors".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the gateway refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}}


@dataclass(frozen=True)
class Sampling:
    """What the request asks of the engine; None: the run's ``rollout.loop`` setting."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    regex: str = ""
    """SGLang's extension of the API (``extra_body={"regex": ...}``): constrained decoding."""


@dataclass(frozen=True)
class ChatRequest:
    """One validated chat-completions request."""

    messages: list[dict]
    tools: list[dict]
    sampling: Sampling = field(default_factory=Sampling)
    parse_tools: bool = True
    """False under ``tool_choice: none``: the action is returned as text."""
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk with the usage."""


def declared_tools(tools: list[dict] | None) -> dict[str, dict]:
    """Tool name -> its function schema."""
    return {t["function"]["name"]: t["function"] for t in tools or ()}


def parse_request(body: dict, model: str) -> ChatRequest:
    """The :class:`ChatRequest` of a chat-completions body, or a :class:`RequestError` naming the field."""
    if "model" not in body:
        raise RequestError(400, "model is required", "missing_required_parameter", "model")
    if body["model"] != model:
        raise RequestError(
            404,
            f"the model {body['model']!r} does not exist; this gateway serves {model!r}",
            "model_not_found",
            "model",
        )
    tools = _tools(body.get("tools"))
    messages = _messages(body.get("messages"), declared_tools(tools))
    n = _number(body, "n", int, 1, None)
    if n not in (None, 1):
        raise RequestError(400, f"n={n!r}: the gateway samples one choice per request (n=1)", "invalid_value", "n")
    limits = [_number(body, key, int, 1, None) for key in ("max_completion_tokens", "max_tokens")]
    sampling = Sampling(
        max_tokens=next((x for x in limits if x is not None), None),
        temperature=_number(body, "temperature", float, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 1e-9, 1.0),
        seed=_number(body, "seed", int, -(2**63), 2**63 - 1),
        stop=tuple(_stop(body.get("stop"))),
        regex=_regex(body.get("regex")),
    )
    choice = _tool_choice(body.get("tool_choice", "auto"), tools)
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise RequestError(400, f"stream must be true or false, got {stream!r}", "invalid_type", "stream")
    return ChatRequest(
        messages, tools, sampling, choice != "none", bool(stream), _include_usage(body.get("stream_options"))
    )


def _number(body: dict, key: str, kind: type, low: float | None, high: float | None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise RequestError(
            400, f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}", "invalid_type", key
        )
    if not math.isfinite(value):
        raise RequestError(400, f"{key}={value} is not a finite number", "invalid_value", key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(400, f"{key}={value} is outside [{low}, {high}]", "invalid_value", key)
    return kind(value)


def _stop(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, "stop must be a string or a list of up to 4 non-empty strings", "invalid_value", "stop")
    return stops


def _regex(regex: Any) -> str:
    if regex is None:
        return ""
    if not isinstance(regex, str):
        raise RequestError(
            400, "regex must be a string (a regular expression the output must match)", "invalid_type", "regex"
        )
    try:
        re.compile(regex)
    except re.error as err:
        raise RequestError(400, f"regex {regex!r} does not compile: {err}", "invalid_value", "regex") from None
    return regex


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(
            400, f'stream_options must be an object such as {{"include_usage": true}}, got {options!r}',
            "invalid_type", "stream_options",
        )  # fmt: skip
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool | None):
        raise RequestError(
            400, f"stream_options.include_usage must be true or false, got {usage!r}", "invalid_type",
            "stream_options.include_usage",
        )  # fmt: skip
    return bool(usage)


def _tool_choice(choice: Any, tools: list[dict]) -> Any:
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict | None) else None
        if name not in declared_tools(tools):
            raise RequestError(
                400,
                f"tool_choice names {name!r}, not one of the declared tools",
                "invalid_value",
                "tool_choice.function.name",
            )
    elif choice not in (None, "auto", "none", "required"):
        raise RequestError(
            400, f"tool_choice={choice!r}: use auto, none, required or a function", "invalid_value", "tool_choice"
        )
    return choice


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(400, "tools must be a list of function tools", "invalid_type", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(
                400, 'each tool must be {"type": "function", "function": {...}}', "invalid_value", f"tools[{i}]"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(
                400, "a function tool needs a name", "missing_required_parameter", f"tools[{i}].function.name"
            )
        if not isinstance(fn.get("parameters", {}), dict | None):
            raise RequestError(
                400, "parameters must be a JSON schema object", "invalid_type", f"tools[{i}].function.parameters"
            )
    return tools


def _messages(messages: Any, declared: dict[str, dict]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", "invalid_value", "messages")
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise RequestError(
                400,
                f"messages[{i}].role={role!r}: use one of {', '.join(ROLES)}",
                "invalid_value",
                f"messages[{i}].role",
            )
        _content(m.get("content"), f"messages[{i}].content")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and (m["role"] != "assistant" or not isinstance(tool_calls, list)):
            raise RequestError(
                400,
                f"tool_calls must be a list, on an assistant message; got {tool_calls!r} on a {m['role']} message",
                "invalid_value",
                f"messages[{i}].tool_calls",
            )
        for j, call in enumerate(tool_calls or ()):
            calls.add(_call(call, declared, f"messages[{i}].tool_calls[{j}]"))
        if m["role"] == "tool" and m.get("tool_call_id") not in calls:
            raise RequestError(
                400,
                f"tool_call_id {m.get('tool_call_id')!r} answers no earlier tool call",
                "invalid_value",
                f"messages[{i}].tool_call_id",
            )
    return messages


def _content(content: Any, param: str) -> None:
    """A string, null, or a list of text parts (the template renders text only)."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(400, "content must be a string or a list of content parts", "invalid_type", param)
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(
                400,
                f"content part {part!r}: only text parts ({{'type': 'text', 'text': ...}}) can be rendered",
                "invalid_value",
                f"{param}[{k}]",
            )


def _call(call: Any, declared: dict[str, dict], param: str) -> str:
    """Check one assistant tool call; its id."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise RequestError(400, "each tool call needs a function", "invalid_value", param)
    if fn.get("name") not in declared:
        raise RequestError(
            400, f"a call of {fn.get('name')!r}, which tools does not declare", "unknown_tool", f"{param}.function.name"
        )
    if not isinstance(fn.get("arguments", "{}"), str | dict):
        raise RequestError(
            400,
            f"arguments must be a JSON string, got {fn.get('arguments')!r}",
            "invalid_type",
            f"{param}.function.arguments",
        )
    return str(call.get("id"))
