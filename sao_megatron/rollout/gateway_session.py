"""One gateway session: the token sequence an agent's requests build, cut into segments.

A session is one episode of a user's agent (:mod:`sao_megatron.rollout.gateway`), pinned to one
engine (the :class:`~sao_megatron.rollout.agent_loop.AgentLoop` running the episode). Token
bookkeeping, per chat-completions request::

    known = the request's messages, each normalised (:func:`normalise`)
    if the tools are the open segment's, its known messages are a prefix of these, the last of them
       is the assistant message this session returned, and no assistant message follows it:
         ids = the template's rendering of the new messages after the segment's last action
               (ChatFormat.continuation_text: after its end marker, up to the generation prompt)
         observation = ids                                       (action_mask 0)
    else (a real rewrite: a message removed or edited, compaction, a sub-agent; other tools):
         a new segment: prompt ids = apply_chat_template(messages, tools, generation prompt)
    action = engine.generate(segment prompt + response + observation)  (action_mask 1, logprob, version)
    record observation and action (only now: a request refused or failed records nothing)

Two messages are the same turn when :func:`normalise` agrees: the role, the content as text (text
parts joined, surrounding whitespace stripped; an assistant's reasoning, ``reasoning_content`` or a
``<think>`` block, dropped) and the tool calls' names and arguments (parsed JSON: key order and
spacing aside); ids and other keys are not compared. So an agent that sends the session's answers
back as the API gave them, with or without their reasoning, re-spelt or reordered, extends the
sequence; what the template then renders differently for the earlier turns (Qwen3 drops their
``<think>`` blocks once a newer user message follows) is not re-tokenised: the recorded ids are the
ones the engine saw, and the observation is only the new messages' part of the rendering. Each
segment becomes its own :class:`~sao_megatron.records.Trajectory`; the segments of a session share
its prompt id, its session id and its reward (docs/algo.md, "Gateway segments").
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from sao_megatron.envs.base import Sample
from sao_megatron.envs.format import THINK_CLOSE, THINK_OPEN, ChatFormat, escape_specials
from sao_megatron.envs.tool_parse import (
    Answer,
    NativeCall,
    Parallel,
    ToolCall,
    parse_action,
    parse_native_action,
)
from sao_megatron.records import EndCause, Status, Trajectory
from sao_megatron.rollout.agent_loop import AgentLoop, Episode
from sao_megatron.rollout.client import SamplingParams
from sao_megatron.rollout.gateway_request import ChatRequest, RequestError


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)``: the ``<think>`` block of a generated action, if any, and the text after it."""
    if THINK_CLOSE not in text:
        return None, text
    head, _, rest = text.partition(THINK_CLOSE)
    return head.replace(THINK_OPEN, "", 1).strip(), rest.strip()


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def normalise(message: dict) -> tuple:
    """What two messages must share to be the same turn: role, content without reasoning, tool calls
    (name and arguments, whatever their JSON spelling), the tool call a result answers."""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text parts, in order
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = split_reasoning(str(content or ""))[1] if message["role"] == "assistant" else str(content or "")
    calls = tuple(
        (c["function"]["name"], _canonical_arguments(c["function"].get("arguments", {})))
        for c in message.get("tool_calls") or ()
    )
    return message["role"], text.strip(), calls


@dataclass
class Segment:
    """One token sequence of a session: a prompt, then actions and observations."""

    chat: ChatFormat
    tools: list[dict]
    prompt_ids: list[int]
    ep: Episode
    known: list[tuple] = field(default_factory=list)
    """The normalised messages the sequence holds, the returned assistant messages included."""
    rendered: list[dict] = field(default_factory=list)
    """The same messages as the chat template renders them (for the next observation's suffix)."""

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ep.response_ids


@dataclass
class Step:
    """What one request adds to the session, recorded only once its action is generated: the segment it
    continues (or a new one), the observation ids of its new messages, the messages then known."""

    seg: Segment
    fresh: bool
    """A new segment (the request rewrote the history)."""
    observation: list[int]
    known: list[tuple]
    rendered: list[dict]

    @property
    def context(self) -> list[int]:
        """What the engine is sent: the segment's ids and the observation."""
        return self.seg.context + self.observation


@dataclass
class Reply:
    """One completion: the assistant message and why it ended."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    def message(self) -> dict:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class GatewaySession:
    """The segments of one agent episode on ``loop``'s engine; :meth:`complete` serves one request."""

    def __init__(self, session_id: str, loop: AgentLoop, sample: Sample):
        self.id = session_id
        self.key = secrets.token_hex(16)
        """The session's bearer token: an agent can reach its own session only."""
        self.loop = loop
        self.sample = sample
        self.segments: list[Segment] = []
        self.closed = False
        self.reward: float | None = None
        self.reward_details: dict[str, Any] = {}
        self.final_answer: str | None = None
        """The content of the last assistant message returned (the env's reward function grades it)."""
        self.requests = 0
        self.started = time.time()
        self.lock = asyncio.Lock()
        """One request at a time: a session is one sequence."""
        self.engine_error = ""
        """The last engine failure a request met (the episode then fails as an engine failure)."""
        self.truncated = ""
        """Why a request was refused for the token budget (the episode then ends truncated, as the agent
        loop's do at its limits, whatever the agent does next)."""

    # -- token bookkeeping ----------------------------------------------------------------------
    def _template_message(self, message: dict, index: int, chat: ChatFormat) -> dict:
        """An OpenAI message as the checkpoint's chat template reads it (user text escaped; ``developer``
        as ``system`` where the template renders only the latter), or a 400 naming a role it cannot render."""
        role = message["role"]
        if role in ("system", "developer") and not chat.renders(role, index == 0):
            if role == "developer" and chat.renders("system", index == 0):
                role = "system"
            else:
                where = "first in the conversation" if index == 0 else "after other turns"
                raise RequestError(
                    400,
                    f"messages[{index}].role={role!r}: the checkpoint's chat template does not render a {role} "
                    f"message {where}; put its text into a user message",
                    "unsupported_role",
                    f"messages[{index}].role",
                )
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        content = str(content or "")
        if role != "assistant":
            return {"role": role, "content": escape_specials(content)}
        calls = message.get("tool_calls") or []
        if chat.tool_format == "tags":  # the tiny template knows no tool_calls: the calls are tags in the text
            body = "".join(f"<tool>{_first_argument(c)}</tool>" for c in calls)
            return {"role": "assistant", "content": content + body}
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c["function"]["name"], "arguments": _arguments_of(c)}}
                for c in calls
            ]
        return out

    def _step(self, messages: list[dict], tools: list[dict]) -> Step:
        """The segment the request continues (its new messages as an observation), or a new one; nothing
        is recorded yet."""
        known = [normalise(m) for m in messages]
        seg = self.segments[-1] if self.segments else None
        if (
            seg is not None
            and seg.tools == tools
            and len(known) > len(seg.known)
            and known[: len(seg.known)] == seg.known
            and seg.known[-1][0] == "assistant"
            and all(k[0] != "assistant" for k in known[len(seg.known) :])
        ):
            start = len(seg.known)
            new = [self._template_message(m, start + j, seg.chat) for j, m in enumerate(messages[start:])]
            ids = seg.chat.encode(seg.chat.continuation_text(seg.rendered, new))
            return Step(seg, False, ids, known, [*seg.rendered, *new])
        chat = ChatFormat(self.loop.tokenizer, tools=tools, enable_thinking=self.loop.cfg.enable_thinking)
        rendered = [self._template_message(m, i, chat) for i, m in enumerate(messages)]
        fresh = Segment(chat, tools, chat.messages_ids(rendered), Episode([], [], [], [], []))
        return Step(fresh, True, [], known, rendered)

    async def complete(self, request: ChatRequest) -> Reply:
        """Serve one request: extend or open a segment, generate one action, parse its calls; the request's
        messages and action are recorded only once the action is generated (a refused or failed request
        leaves the session as it was, so its retry continues the same segment).

        ``request.sampling.max_tokens`` None: ``rollout.loop.max_new_tokens``; likewise temperature and
        top_p. A context beyond ``rollout.loop.max_context_tokens`` (or a segment beyond
        ``max_response_tokens``) is refused (400 ``context_length_exceeded``)."""
        cfg = self.loop.cfg
        self.requests += 1
        step = self._step(request.messages, request.tools)
        seg, context, ask = step.seg, step.context, request.sampling
        response = len(seg.ep.response_ids) + len(step.observation)
        room = min(cfg.max_context_tokens - len(context), cfg.max_response_tokens - response)
        if room <= 0:
            error = RequestError(
                400,
                f"the conversation is {len(context)} tokens, beyond rollout.loop.max_context_tokens="
                f"{cfg.max_context_tokens} (or the segment's max_response_tokens={cfg.max_response_tokens})",
                "context_length_exceeded",
                "messages",
            )
            self.truncated = f"token budget exhausted: {error.message}"
            raise error
        params = SamplingParams(
            max_new_tokens=min(ask.max_tokens or cfg.max_new_tokens, room),
            temperature=cfg.temperature if ask.temperature is None else ask.temperature,
            top_p=cfg.top_p if ask.top_p is None else ask.top_p,
            stop_token_ids=seg.chat.stop_token_ids,
            stop=ask.stop,
            seed=ask.seed,
            regex=ask.regex,
        )
        action = await self.loop.generate(context, params, seg.ep)
        if isinstance(action, str):
            self.engine_error = action
            raise RequestError(502, f"the engine failed: {action}", "engine_error", kind="server_error")
        text = seg.chat.action_content(self.loop.tokenizer.decode(action.ids, skip_special_tokens=False))
        reasoning, content, calls = self._parse(text, seg, request.parse_tools)
        cut = action.finish_reason == "length" and (not action.ids or action.ids[-1] not in seg.chat.stop_token_ids)
        reply = Reply(
            content=content,
            reasoning=reasoning,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else ("length" if cut else "stop"),
            prompt_tokens=len(context),
            completion_tokens=len(action.ids),
        )
        if step.fresh:
            self.segments.append(seg)
        elif step.observation:
            seg.ep.add_observation(step.observation)
        seg.ep.add_action(action)
        seg.known = [*step.known, normalise(reply.message())]
        seg.rendered = [*step.rendered, seg.chat.assistant_message(text)]
        self.final_answer = content
        return reply

    def _parse(self, text: str, seg: Segment, parse_tools: bool) -> tuple[str | None, str | None, list[dict]]:
        """``(reasoning, content, tool_calls)`` of a generated action in the template's native format.
        An action whose calls do not parse (bad JSON, an undeclared tool) is returned as text."""
        reasoning, rest = split_reasoning(text)
        if seg.chat.tool_format == "tags" and isinstance(answer := parse_action(rest), Answer):
            return reasoning, answer.text, []  # the tiny template's <answer> tags are its end-of-episode format
        if not (parse_tools and seg.tools):
            return reasoning, rest, []
        if seg.chat.tool_format == "json":
            parsed = parse_native_action(rest, seg.tools)
            calls = parsed.calls if isinstance(parsed, Parallel) else (parsed,)
            if all(isinstance(c, NativeCall) for c in calls):
                out = [_openai_call(c.name, c.arguments) for c in calls if isinstance(c, NativeCall)]
                return reasoning, rest.split("<tool_call>")[0].strip() or None, out
            return reasoning, rest, []
        parsed = parse_action(rest)
        calls = parsed.calls if isinstance(parsed, Parallel) else (parsed,)
        if all(isinstance(c, ToolCall) for c in calls):
            fn = seg.tools[0].get("function", seg.tools[0])
            param = next(iter((fn.get("parameters") or {}).get("properties") or {"code": None}))
            out = [_openai_call(fn["name"], {param: c.code}) for c in calls if isinstance(c, ToolCall)]
            return reasoning, rest.split("<tool>")[0].strip() or None, out
        return reasoning, rest, []

    # -- the episode's records ------------------------------------------------------------------
    def trajectories(
        self, status: Status, reason: str, reward: float, correct: bool | None, details: dict, **common: Any
    ) -> list[Trajectory]:
        """One trajectory per segment with an action: trailing observation tokens (sent after the
        segment's last action, before a rewrite) are cut, since nothing was generated from them."""
        segments = [s for s in self.segments if any(s.ep.action_mask)]
        out = []
        for k, seg in enumerate(segments):
            ep = seg.ep
            end = max(i for i, m in enumerate(ep.action_mask) if m) + 1
            end_cause: EndCause = "failed" if status == "failed" else ("context" if status == "truncated" else "done")
            routes, missing = ep.trajectory_routes(self.loop.routes, len(seg.prompt_ids) + end)
            out.append(
                Trajectory(
                    prompt_id=self.sample.prompt_id,
                    prompt_ids=seg.prompt_ids,
                    response_ids=ep.response_ids[:end],
                    action_mask=ep.action_mask[:end],
                    behavior_logprobs=ep.behavior_logprobs[:end],
                    policy_versions=ep.policy_versions[:end],
                    turns=ep.turns,
                    reward=float(reward),
                    status=status,
                    status_reason=reason,
                    correct=correct,
                    reward_details={**details, "session": self.id, "segment": k, "session_segments": len(segments)},
                    stats=ep.stats(end_cause),
                    stale_kv=ep.stale_kv,
                    engine=self.loop.engine_name,
                    routes=routes,
                    routes_missing=missing,
                    **common,
                )
            )
        return out


def _openai_call(name: str, arguments: dict) -> dict:
    return {
        "id": f"call_{secrets.token_hex(8)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _arguments_of(call: dict) -> Any:
    arguments = call["function"].get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _first_argument(call: dict) -> str:
    """The tiny template's ``<tool>`` body of a call: its only argument's value."""
    arguments = _arguments_of(call)
    if isinstance(arguments, dict) and arguments:
        return str(next(iter(arguments.values())))
    return str(arguments)
