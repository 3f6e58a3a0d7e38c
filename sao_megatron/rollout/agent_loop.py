"""One multi-turn episode against an engine: token-in/token-out, behavior logprobs, versions.

Every conversation is rendered by the tokenizer's chat template (:class:`ChatFormat`)::

    prompt ids = apply_chat_template([system?, user], tools=env.tools,
                                     add_generation_prompt=True)   (action_mask: not in response)
    repeat:  action   = engine.generate(context ids)        (action_mask 1, logprob, version)
             step     = env.step(decode(action))            (every call of the action runs)
             if done: break
             outputs  = step.outputs, each cut to max_output_tokens_per_call
             obs ids  = the template's rendering of the outputs (consecutive tool messages, one
                        per call) after the action's end marker, up to the next generation
                        prompt (suffix method) (action_mask 0)
             if obs ids pass max_observation_tokens_per_episode, or do not fit the context or
                response budget: end here, without them
    until:   answer, max turns, max response tokens or max context
    (a sample whose ``meta["action_tokens"]`` lists action lengths, a synthetic benchmark workload,
    generates exactly that many tokens per turn: ``min_new_tokens`` = ``max_new_tokens``, so the
    engine masks the stop tokens until the length is reached)
    reward   = env.reward()
    env.close()                                             (always; an error there is only logged)

The environment is driven through its async methods (``areset``, ``astep``, ``areward``,
``aclose``), so the same loop runs an Env in this process or a
:class:`~sao_megatron.rollout.env_workers.RemoteEnv` on an env worker. Each of those calls may take
at most ``rollout.loop.env_step_timeout_s`` seconds: a hanging tool fails the episode
(``environment: tool timed out after Xs ...``; ``environment: reset timed out ...``,
``reward: timed out ...``) and the environment is still closed (that close bounded the same way).
The limit bites only where the call awaits: an environment whose ``astep`` blocks synchronously
(the default ``astep`` runs the sync ``step`` inline) holds the event loop, every other episode
with it, until it returns, and no timeout can interrupt it. Slow tools must be async (a subprocess,
``asyncio.to_thread``), or the environments must run on env workers (``rollout.env_workers``),
where the driver's wait is bounded whatever the worker does.

The trajectory never holds more than ``max_context_tokens`` (prompt + response) nor more than
``max_response_tokens`` (response): the sequence length the memory plan sizes for. Its
:class:`~sao_megatron.records.EpisodeStats` say why the episode ended (``end``: done,
env_max_turns, max_turns, context, response, observation_budget, failed) and count the tool
outputs, parallel turns, refused and clipped calls (``rollout/*`` metrics, docs/envs.md).

Weight syncs (``rollout.update_policy``): under ``abort`` an engine returns the requests it was
running with the tokens generated so far (finish reason ``abort``); the action continues from them
on the same engine (prompt + response + those tokens, the rest of the token budget), so the tokens
already generated keep their behavior logprobs and versions and the episode is neither lost nor run
twice. Under ``in_place`` the tokens sampled on stale KV (after a sync kept the request's cache, or
on a prefix-cache hit that may hold an older version's KV) are recorded as ``Trajectory.stale_kv``.
``EpisodeStats.resubmitted`` and ``prefill_recomputed`` count what the syncs cost the episode.

Earlier turns are never re-tokenised: the context is the exact id sequence the engine saw
plus the ids it produced. The tool format (``<tool>`` tags or native ``<tool_call>`` JSON)
follows from the template. Failures (engine errors, timeouts, a broken environment, a chat
template that breaks the suffix assumption) end the episode with ``status="failed"`` and a
reason; they never raise to the caller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from sao_megatron.config import AgentLoopConfig, UpdatePolicy
from sao_megatron.envs.base import Env, Sample, StepResult
from sao_megatron.envs.format import ChatFormat, ChatTemplateError, ToolFormat, tool_format_of
from sao_megatron.records import OBSERVATION_VERSION, EndCause, EpisodeStats, Status, Trajectory, Turn
from sao_megatron.rollout.client import EngineClient, EngineError, Generation, SamplingParams
from sao_megatron.rollout.env_workers import EnvWorkerError, environment_failure
from sao_megatron.routing import RouteShape


class EpisodeDriver(Protocol):
    """Runs an episode of an environment driven by a user's agent (``rollout.gateway.Gateway``): one
    trajectory per segment of its session. A protocol, so this module does not import the gateway,
    which imports it."""

    async def run_episode(
        self, loop: AgentLoop, env: Env, sample: Sample, *, split: str, index: int | None, submitted_at: float | None
    ) -> list[Trajectory]: ...


__all__ = ["AgentLoop", "AgentLoopConfig"]  # AgentLoopConfig: the run config's ``rollout.loop`` section

log = logging.getLogger(__name__)


@dataclass
class _Episode:
    response_ids: list[int]
    action_mask: list[int]
    behavior_logprobs: list[float]
    policy_versions: list[int]
    turns: list[Turn]
    observation_tokens: int = 0
    tool_outputs: int = 0
    parallel_turns: int = 0
    refused_calls: int = 0
    clipped_outputs: int = 0
    clipped_tokens: int = 0
    resubmitted: int = 0
    prefill_recomputed: int = 0
    stale_kv: list[Turn] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    """Routing replay: route rows of positions ``[0, routed)`` in order (``routes_missing`` spans zeros)."""
    routed: int = 0
    routes_missing: list[Turn] = field(default_factory=list)
    routes_recomputed: int = 0
    routes_invalid: int = 0

    def add_routes(self, shape: RouteShape, end: int, rows: np.ndarray | None, bad: np.ndarray | None = None) -> None:
        """Rows of positions ``[routed, end)``; None or a wrong count: recorded as missing. ``bad``
        ``[end - routed]`` bool (:meth:`RouteShape.decode`): rows unfit to replay, each run of them
        recorded as missing and counted in ``routes_invalid``."""
        n = end - self.routed
        if rows is None or len(rows) != n:
            self.routes_missing.append(Turn(self.routed, end))
            rows = shape.empty(n)
        elif bad is not None and bad.any():
            self.routes_invalid += int(bad.sum())
            edges = np.flatnonzero(np.diff(np.concatenate([[0], bad.astype(np.int8), [0]])))  # run starts, ends
            self.routes_missing += [Turn(self.routed + int(a), self.routed + int(b)) for a, b in edges.reshape(-1, 2)]
        self.routes.append(rows)
        self.routed = end

    def trajectory_routes(self, shape: RouteShape | None, positions: int) -> tuple[np.ndarray | None, list[Turn]]:
        """The episode's routes over all ``positions`` (the unrun tail, at least the last position,
        recorded as missing), or None without capture or before any generation."""
        if shape is None or not self.routes:
            return None, []
        if positions > self.routed:
            self.add_routes(shape, positions, None)
        return np.concatenate(self.routes), self.routes_missing

    def stats(self, end: EndCause) -> EpisodeStats:
        return EpisodeStats(
            end=end,
            tool_outputs=self.tool_outputs,
            parallel_turns=self.parallel_turns,
            refused_calls=self.refused_calls,
            clipped_outputs=self.clipped_outputs,
            clipped_tokens=self.clipped_tokens,
            resubmitted=self.resubmitted,
            prefill_recomputed=self.prefill_recomputed,
            routes_recomputed=self.routes_recomputed,
            routes_invalid=self.routes_invalid,
        )

    def add_action(self, action: _Action) -> None:
        start = len(self.response_ids)
        self.response_ids += action.ids
        self.action_mask += [1] * len(action.ids)
        self.behavior_logprobs += action.behavior_logprobs
        self.policy_versions += action.policy_versions
        self.turns.append(Turn(start, len(self.response_ids)))
        self.stale_kv += [Turn(start + a, start + b) for a, b in action.stale_kv]

    def add_observation(self, ids: list[int]) -> None:
        self.observation_tokens += len(ids)
        self.response_ids += ids
        self.action_mask += [0] * len(ids)
        self.behavior_logprobs += [0.0] * len(ids)
        self.policy_versions += [OBSERVATION_VERSION] * len(ids)


Episode = _Episode
"""The token record of one episode (or one gateway segment): response ids, masks, logprobs, versions."""


@dataclass
class _Action:
    """One action as generated so far: pieces from one or more ``/generate`` calls (a continuation
    after each abort), their tokens' behavior logprobs and versions, and the stale-KV spans (relative
    to the action's start)."""

    ids: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    stale_kv: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str = ""

    def extend(self, gen: Generation, versions: list[int], stale_from: int | None) -> None:
        if stale_from is not None:
            self.stale_kv.append((len(self.ids) + stale_from, len(self.ids) + len(gen.output_ids)))
        self.ids += gen.output_ids
        self.behavior_logprobs += gen.behavior_logprobs
        self.policy_versions += versions
        self.finish_reason = gen.finish_reason


MAX_EMPTY_ABORTS = 8
"""Aborts in a row that returned no token before an action fails (under ``update_policy: abort``
each sync aborts a request at most once; more means the engine aborts it for another reason)."""


class _RewardError(Exception):
    """The environment's reward function raised (its message is the failure reason)."""


class _EnvTimeout(Exception):
    """An environment call ran past ``rollout.loop.env_step_timeout_s`` (its message is the reason)."""


async def _bounded[T](call: Awaitable[T], timeout_s: float, reason: str) -> T:
    """``await call``, cancelled after ``timeout_s``: then :class:`_EnvTimeout` with ``reason``.

    A TimeoutError the environment raises itself (e.g. its own subprocess limit) is not this
    timeout and propagates as the environment's error."""
    limit = asyncio.timeout(timeout_s)
    try:
        async with limit:
            return await call
    except TimeoutError:
        if limit.expired():
            raise _EnvTimeout(f"{reason} timed out after {timeout_s:g}s (rollout.loop.env_step_timeout_s)") from None
        raise


async def _close(env: Env, sample: Sample, timeout_s: float) -> None:
    """Release the episode's environment; a failure to do so is logged, never the episode's."""
    try:
        await _bounded(env.aclose(), timeout_s, "close")
    except Exception as err:
        log.warning("closing the environment of %s failed: %s: %s", sample.prompt_id, type(err).__name__, err)


def _version(label: str) -> int:
    try:
        return int(label)
    except ValueError:
        return 0  # the engine's initial weights ("default") are version 0


Reroute = Callable[[str], Awaitable["AgentLoop | None"]]
"""``reroute(reason)`` -> the loop to generate the failed turn again on, or None to give up."""


class AgentLoop:
    """Runs episodes of one environment class against one engine client."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        cfg: AgentLoopConfig,
        engine_name: str = "",
        update_policy: UpdatePolicy = "retract",
        routes: RouteShape | None = None,
        gateway: EpisodeDriver | None = None,
    ):
        """``update_policy``: ``rollout.update_policy``, what the weight syncs do to the requests;
        ``routes``: capture the engine's routes of every position (``rollout.routing_replay``), this shape;
        ``gateway``: where episodes of an environment driven by a user's agent (``rollout.env=openai_agent``)
        open their session."""
        self.client = client
        self.gateway = gateway
        self.routes = routes
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.engine_name = engine_name or client.url
        self.update_policy = update_policy
        self.tool_format: ToolFormat = tool_format_of(getattr(tokenizer, "chat_template", None))

    def chat_format(self, env: Env) -> ChatFormat:
        """The episode's renderer: this tokenizer's template with ``env``'s tools and system prompt.

        Also tells ``env`` the tool format the template implies and ``rollout.loop.max_calls_per_turn``.
        """
        env.use_tool_format(self.tool_format)
        env.limit_calls_per_turn(self.cfg.max_calls_per_turn)
        return ChatFormat(
            self.tokenizer, tools=env.tools, system=env.system_prompt, enable_thinking=self.cfg.enable_thinking
        )

    async def run(
        self,
        env: Env,
        sample: Sample,
        split: str = "train",
        index: int | None = None,
        submitted_at: float | None = None,
        reroute: Reroute | None = None,
    ) -> Trajectory:
        """One episode. ``reroute(reason)``, when given, is asked for another loop (engine) when a
        generation fails because of the engine: the failed turn is generated again there, with the
        same environment and tokens so far; None from it ends the episode as failed. An episode of
        a user's agent (:meth:`run_segments`) gives its last segment here."""
        if getattr(env, "external_agent", False):
            return (await self.run_segments(env, sample, split, index, submitted_at))[-1]
        started = time.time()
        on: list[AgentLoop] = [self]  # the loop whose engine generates the next turn
        prompt_ids: list[int] = []
        ep = _Episode([], [], [], [], [])
        status, reason, end = "finished", "", "failed"
        try:
            chat = self.chat_format(env)
            question = await _bounded(env.areset(sample), self.cfg.env_step_timeout_s, "environment: reset")
            prompt_ids = chat.prompt_ids(question)
            status, reason, end = await self._turns(
                env, sample, chat, chat.prompt_messages(question), prompt_ids, ep, on, reroute
            )
            try:
                result = await _bounded(env.areward(), self.cfg.env_step_timeout_s, "reward:")
            except EnvWorkerError:
                raise  # the worker is gone, not the reward function: an environment failure
            except _EnvTimeout as err:
                raise _RewardError(str(err)) from err
            except Exception as err:
                raise _RewardError(f"reward: {type(err).__name__}: {err}") from err
            reward, correct, details = result.reward, result.correct, dict(result.details)
            if not math.isfinite(reward):
                status, reason, reward = "failed", f"reward: non-finite reward {reward}", 0.0
        except (_RewardError, _EnvTimeout) as err:
            status, reason, reward, correct, details = "failed", str(err), 0.0, None, {}
        except EngineError as err:
            status, reason, reward, correct, details = "failed", f"engine: {err}", 0.0, None, {}
        except ChatTemplateError as err:  # the template breaks the suffix method: fail loudly
            status, reason, reward, correct, details = "failed", f"chat template: {err}", 0.0, None, {}
        except Exception as err:  # a broken environment (or its worker) must not stop the manager
            status, reason, reward, correct, details = "failed", environment_failure(err), 0.0, None, {}
        finally:
            await _close(env, sample, self.cfg.env_step_timeout_s)
        routes, missing = ep.trajectory_routes(self.routes, len(prompt_ids) + len(ep.response_ids))
        return Trajectory(
            prompt_id=sample.prompt_id,
            prompt_ids=prompt_ids,
            response_ids=ep.response_ids,
            action_mask=ep.action_mask,
            behavior_logprobs=ep.behavior_logprobs,
            policy_versions=ep.policy_versions,
            turns=ep.turns,
            reward=float(reward),
            status=status,
            status_reason=reason,
            correct=correct,
            reward_details=details,
            split=split,
            sample_index=index,
            submitted_at=submitted_at if submitted_at is not None else started,
            started_at=started,
            finished_at=time.time(),
            engine=on[0].engine_name,
            stats=ep.stats("failed" if status == "failed" else end),
            stale_kv=ep.stale_kv,
            routes=routes,
            routes_missing=missing,
        )

    async def run_segments(
        self,
        env: Env,
        sample: Sample,
        split: str = "train",
        index: int | None = None,
        submitted_at: float | None = None,
        reroute: Reroute | None = None,
    ) -> list[Trajectory]:
        """One episode as a list of trajectories: an environment driven by a user's agent through the
        gateway (``env.external_agent``) gives one per segment of its session (at least one, a failed
        one when nothing was generated); any other environment one (:meth:`run`)."""
        if not getattr(env, "external_agent", False):
            return [await self.run(env, sample, split, index, submitted_at, reroute)]
        if self.gateway is None:
            raise RuntimeError(f"environment {type(env).__name__} runs a user's agent but this loop has no gateway")
        return await self.gateway.run_episode(self, env, sample, split=split, index=index, submitted_at=submitted_at)

    async def generate(self, context: list[int], sampling: SamplingParams, ep: _Episode) -> _Action | str:
        """One action from ``context`` on this loop's engine, recorded as the agent loop records its own
        (behavior logprobs, versions, abort continuations, routes); or why it failed."""
        return await self._generate(context, sampling, ep, [self], None)

    async def _turns(
        self,
        env: Env,
        sample: Sample,
        chat: ChatFormat,
        messages: list[dict],
        prompt_ids: list[int],
        ep: _Episode,
        on: list[AgentLoop],
        reroute: Reroute | None,
    ) -> tuple[Status, str, EndCause]:
        cfg = self.cfg
        stop_ids = set(chat.stop_token_ids)
        fixed = sample.meta.get("action_tokens")  # a synthetic workload's exact action lengths
        for turn in range(cfg.max_turns):
            context_left = cfg.max_context_tokens - len(prompt_ids) - len(ep.response_ids)
            budget = min(cfg.max_new_tokens, cfg.max_response_tokens - len(ep.response_ids), context_left)
            if budget <= 0:
                return "truncated", "token budget exhausted", "context" if context_left <= 0 else "response"
            exact = min(budget, int(fixed[turn])) if fixed is not None and turn < len(fixed) else 0
            sampling = SamplingParams(
                max_new_tokens=exact or budget,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                stop_token_ids=chat.stop_token_ids,
                min_new_tokens=exact,
            )
            action = await self._generate(prompt_ids + ep.response_ids, sampling, ep, on, reroute)
            if isinstance(action, str):
                return "failed", action, "failed"
            if not action.ids:
                return "failed", "engine returned no tokens", "failed"
            ep.add_action(action)
            action_text = self.tokenizer.decode(action.ids, skip_special_tokens=False)
            step = await _bounded(env.astep(action_text), cfg.env_step_timeout_s, "environment: tool")
            ep.refused_calls += step.refused_calls
            if step.done:
                return "finished", "", "env_max_turns" if step.info.get("truncated") else "done"
            if action.finish_reason == "length" and action.ids[-1] not in stop_ids and len(ep.turns) >= cfg.max_turns:
                return "truncated", "action cut at max_new_tokens", "max_turns"
            messages.append(chat.assistant_message(action_text))
            ended = self._observe(chat, messages, step, ep, len(prompt_ids))
            if ended is not None:
                return "truncated", *ended
        return "truncated", f"max_turns={cfg.max_turns} reached without an answer", "max_turns"

    async def _generate(
        self, context: list[int], sampling: SamplingParams, ep: _Episode, on: list[AgentLoop], reroute: Reroute | None
    ) -> _Action | str:
        """One action on ``on[0]``'s engine (again on another after an engine fault, ``reroute``); or
        why it failed. Under ``update_policy: abort`` an aborted generation (the sync's) continues
        from its tokens on the same engine: prompt + response + the action so far, the rest of the
        token budget."""
        action = _Action()
        empty_aborts = 0
        while True:
            client = on[0].client
            asked = dataclasses.replace(
                sampling,
                max_new_tokens=sampling.max_new_tokens - len(action.ids),
                min_new_tokens=max(0, sampling.min_new_tokens - len(action.ids)),
            )
            # routes_from only when capturing: a client (or fake) that predates capture still fits
            generate = (
                client.generate if self.routes is None else functools.partial(client.generate, routes_from=ep.routed)
            )
            try:
                gen = await generate(context + action.ids, asked, timeout_s=self.cfg.generate_timeout_s)
            except EngineError as err:
                if reroute is None:
                    raise
                failure = f"engine: {err}"
            else:
                versions = [_version(v) for v in gen.weight_versions]
                if gen.finish_reason != "abort" or self.update_policy == "abort":  # else: its tokens are dropped
                    self._count_recomputed(ep, len(context) + len(action.ids), versions)
                    action.extend(gen, versions, self._stale_from(gen, versions, client))
                if gen.finish_reason != "abort":
                    if self.routes is not None:
                        self._take_routes(ep, gen, len(context) + len(action.ids) - 1, len(action.ids), versions)
                    return action
                empty_aborts = 0 if gen.output_ids else empty_aborts + 1
                if self.update_policy == "abort" and empty_aborts < MAX_EMPTY_ABORTS:
                    if len(action.ids) >= sampling.max_new_tokens:  # aborted as its budget ran out
                        action.finish_reason = "length"
                        return action
                    ep.resubmitted += 1
                    ep.prefill_recomputed += len(context) + len(action.ids)  # the continuation's context
                    continue
                failure = "generation aborted by the engine"
            nxt = await reroute(failure) if reroute is not None else None
            if nxt is None:
                return failure
            on[0] = nxt

    def _take_routes(self, ep: _Episode, gen: Generation, end: int, action_tokens: int, versions: list[int]) -> None:
        """Keep the final request's routes, positions up to ``end`` (an aborted piece's are dropped: the
        continuation computed its context again and returns routes for all of it). Tokens sampled
        before a sync recomputed the context (earlier pieces; under ``retract`` those before a version
        change) are counted in ``routes_recomputed``."""
        assert self.routes is not None
        earlier = action_tokens - len(gen.output_ids)  # from aborted pieces
        if self.update_policy == "retract":
            earlier += next((i for i in range(len(versions) - 1, 0, -1) if versions[i] != versions[i - 1]), 0)
        ep.routes_recomputed += earlier
        rows = bad = None
        if gen.routes is not None:
            try:
                rows, bad = self.routes.decode(gen.routes)
            except ValueError as err:
                log.warning("engine %s: %s; positions %d-%d recorded as missing", self.engine_name, err, ep.routed, end)
        if bad is not None and bad.any():
            log.warning(
                "engine %s: %d of positions %d-%d route an expert twice or outside [0, %d); recorded as missing",
                self.engine_name,
                int(bad.sum()),
                ep.routed,
                end,
                self.routes.num_experts,
            )
        ep.add_routes(self.routes, end, rows, bad)

    def _count_recomputed(self, ep: _Episode, context_tokens: int, versions: list[int]) -> None:
        """Under ``retract``, a version change inside a generation is a sync that retracted the request
        with ``context_tokens`` + the tokens generated by then, all prefilled again after the flush."""
        if self.update_policy == "retract":
            ep.prefill_recomputed += sum(
                context_tokens + i for i in range(1, len(versions)) if versions[i] != versions[i - 1]
            )

    def _stale_from(self, gen: Generation, versions: list[int], client: EngineClient) -> int | None:
        """Under ``in_place``: the first of ``gen``'s tokens sampled on stale KV, or None. A version
        change inside the generation is a sync that kept the request's KV (every later token attends
        to it); a prefix-cache hit (``cached_tokens``) sampled at a version newer than the oldest one
        the engine's cache may hold (``client.cache_version``) may have reused an older version's KV
        (an upper bound: the engine does not say which version computed a cached prefix)."""
        if self.update_policy != "in_place" or not versions:
            return None
        if gen.cached_tokens and client.cache_version is not None and versions[0] > client.cache_version:
            return 0
        return next((i for i in range(1, len(versions)) if versions[i] != versions[i - 1]), None)

    def _observe(
        self, chat: ChatFormat, messages: list[dict], step: StepResult, ep: _Episode, prompt_tokens: int
    ) -> tuple[str, EndCause] | None:
        """Add the step's outputs as one observation (the template's rendering of one ``tool``
        message per output); or, when the observation would pass the episode's observation budget
        or not fit the context or response budget, leave it out and say why the episode ends."""
        cfg = self.cfg
        outputs = [self._clip(chat, output, ep) for output in step.outputs or ("",)]
        ids = chat.observation_ids(messages, outputs)
        budget = cfg.max_observation_tokens_per_episode
        if budget and ep.observation_tokens + len(ids) > budget:
            return (
                f"observation budget: {ep.observation_tokens} + {len(ids)} tokens would pass "
                f"max_observation_tokens_per_episode={budget}",
                "observation_budget",
            )
        if prompt_tokens + len(ep.response_ids) + len(ids) > cfg.max_context_tokens:
            return f"token budget exhausted: a {len(ids)}-token observation does not fit max_context_tokens", "context"
        if len(ep.response_ids) + len(ids) > cfg.max_response_tokens:
            return (
                f"token budget exhausted: a {len(ids)}-token observation does not fit max_response_tokens",
                "response",
            )
        ep.add_observation(ids)
        ep.tool_outputs += len(outputs)
        ep.parallel_turns += len(outputs) > 1
        messages.extend(chat.tool_messages(outputs))
        return None

    def _clip(self, chat: ChatFormat, output: str, ep: _Episode) -> str:
        """``output`` cut to ``max_output_tokens_per_call`` tokens (of the output text alone)."""
        limit = self.cfg.max_output_tokens_per_call
        if not limit:
            return output
        ids = chat.encode(output)
        if len(ids) <= limit:
            return output
        ep.clipped_outputs += 1
        ep.clipped_tokens += len(ids) - limit
        return chat.tokenizer.decode(ids[:limit]) + f"...[{len(ids) - limit} tokens clipped]"
