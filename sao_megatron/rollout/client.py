"""Async client for SGLang's native HTTP API (token-in / token-out, with logprobs and versions).

``/generate`` may go through an ``sglang-router`` (see :class:`~sao_megatron.rollout.engine.RouterProcess`);
control calls (pause, continue, abort, weight updates) go to each engine directly because the
router does not proxy them (measured on sglang-router 0.3.2; it does proxy ``/flush_cache``,
but send that to each engine too, so that every engine is flushed).

Every response is parsed into typed records; transport errors, timeouts and non-200 answers
raise :class:`EngineError` with the endpoint, status and body, which the agent loop turns into
a per-episode status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import aiohttp

from sao_megatron.faults import kill_point

if TYPE_CHECKING:
    import torch


class EngineError(RuntimeError):
    """An engine call failed: transport error, timeout, HTTP status != 200 or a refused update.
    The message starts with the engine's URL when known (``url``), so one engine of many is named."""

    def __init__(self, endpoint: str, message: str, status: int | None = None, url: str = ""):
        super().__init__(f"{url}{endpoint}: {message}" + (f" (HTTP {status})" if status is not None else ""))
        self.endpoint = endpoint
        self.status = status
        self.url = url


@dataclass(frozen=True)
class SamplingParams:
    """SGLang ``sampling_params`` for one action."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    """Stop tokens (and EOS) are masked until this many tokens were generated."""
    regex: str = ""
    """SGLang's structured decoding: every token that would leave this regular language is masked
    (the OpenAI gateway passes an agent's ``regex``, SGLang's own extension of the API); empty: none."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            out["stop"] = list(self.stop)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.min_new_tokens:
            out["min_new_tokens"] = self.min_new_tokens
        if self.regex:
            out["regex"] = self.regex
        return out


@dataclass(frozen=True)
class Generation:
    """One ``/generate`` answer: new tokens with their behavior logprobs and weight versions."""

    output_ids: list[int]
    behavior_logprobs: list[float]
    """Per output token: log p(token | prefix) under the engine's sampling distribution."""
    weight_versions: list[str]
    """Per output token: the engine's label of the weights that produced it (a span may cross an
    update); the agent loop turns labels into integer ``policy_versions``."""
    finish_reason: str
    """``stop`` (stop token/string), ``length`` (max_new_tokens) or ``abort``."""
    prompt_tokens: int
    latency_s: float
    cached_tokens: int = 0
    """Prompt tokens whose KV the engine took from its prefix cache instead of computing it."""
    routes: str | None = None
    """With ``routes_from`` asked: SGLang's ``meta_info.routed_experts`` (base64 int32 ``[positions,
    layers, top-k]`` for positions ``[routes_from, prompt + output - 1)``; ``routing.RouteShape.decode``),
    None when the engine returned none (an aborted request, or an engine without the capture flag)."""


def expand_versions(spans: list[dict] | None, n: int, default: str) -> list[str]:
    """``[{"version": v, "start": s, "end": e}, ...]`` -> one version per output token."""
    versions = [default] * n
    for span in spans or []:
        for i in range(max(0, span["start"]), min(n, span["end"])):
            versions[i] = str(span["version"])
    return versions


def parse_generation(body: dict, latency_s: float = 0.0) -> Generation:
    meta = body.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError("/generate", "response has no meta_info.output_token_logprobs; send return_logprob=true")
    output_ids = [int(e[1]) for e in entries]
    if body.get("output_ids") is not None and list(body["output_ids"]) != output_ids:
        raise EngineError("/generate", "output_ids disagree with output_token_logprobs")
    reason = meta.get("finish_reason") or {}
    return Generation(
        output_ids=output_ids,
        behavior_logprobs=[float(e[0]) for e in entries],
        weight_versions=expand_versions(meta.get("weight_versions"), len(output_ids), str(meta.get("weight_version"))),
        finish_reason=str(reason.get("type", "unknown")) if isinstance(reason, dict) else str(reason),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        latency_s=latency_s,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        routes=meta.get("routed_experts"),
    )


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer`` (base64 string) under the ``file_system`` sharing strategy.

    The strategy is switched only while pickling (it decides how storages are shared) and then
    restored, so the rest of the process keeps its own setting.
    """
    import torch.multiprocessing as mp
    from sglang.srt.utils import MultiprocessingSerializer

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        # Unannotated in SGLang: bytes, or the base64 str with output_str=True.
        return cast(str, MultiprocessingSerializer.serialize(named_tensors, output_str=True))
    finally:
        mp.set_sharing_strategy(previous)


_NOT_FLUSHED = "cache was not flushed"


API_KEY_ENV = "SAO_ENGINE_API_KEY"
"""The run's engine API key: the driver draws one per run (``driver/roles.py:init_ray``) and hands it
to every Ray worker; engines get it on stdin (``rollout.engine_main``: on no command line) and refuse
any other request but health and metrics (SGLang's own rule), and every :class:`EngineClient` sends it."""


def run_api_key() -> str:
    """The run's engine API key: :data:`API_KEY_ENV` in this process's environment, drawn (32 random
    bytes, hex) and put there on first use."""
    import secrets

    return os.environ.setdefault(API_KEY_ENV, secrets.token_hex(32))


class EngineClient:
    """Calls one engine (or a router for ``/generate``). Use as ``async with EngineClient(url):``."""

    FLUSH_RETRY_S = 10.0
    """How long a cache flush (or a disk/tensor weight load, which flushes) is repeated while the engine
    refuses it."""

    KEEPALIVE_S = 2.0
    """An idle connection is reused only this long. SGLang's server closes idle ones after 5 s
    (``SGLANG_TIMEOUT_KEEP_ALIVE``); aiohttp's default of 15 s let a request go out on a
    connection the server was closing that instant, which failed as ``ServerDisconnectedError``
    (and marked a healthy engine down)."""

    def __init__(self, url: str, timeout_s: float = 600.0, max_connections: int = 1024, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        """Sent as ``Authorization: Bearer`` on every call; by default the run's key (:data:`API_KEY_ENV`)."""
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._generating = 0  # /generate calls in flight
        self._paused = False
        self._clock_since = 0.0
        self._generating_s = 0.0
        self.cache_version: int | None = None
        """The oldest weight version whose KV the engine's prefix cache may hold, as whoever syncs the
        engine knows it: a sync that flushed the cache sets its version; one that kept it
        (``rollout.update_policy: in_place`` with requests running) leaves it. None: no sync yet."""

    def _clock(self, generating: int | None = None, paused: bool | None = None) -> None:
        """Account generating time: seconds with a ``/generate`` call in flight while not paused."""
        now = time.monotonic()
        if self._generating and not self._paused:
            self._generating_s += now - self._clock_since
        self._clock_since = now
        if generating is not None:
            self._generating += generating
        if paused is not None:
            self._paused = paused

    def generating_seconds(self) -> float:
        """Seconds so far in which this engine had a ``/generate`` call in flight and was not paused
        for a weight update (its generation utilisation's numerator; tool time and sync pauses are
        not in it, unlike an episode's occupancy)."""
        self._clock()
        return self._generating_s

    async def __aenter__(self) -> EngineClient:
        connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=self.KEEPALIVE_S)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), headers=headers
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self, method: str, endpoint: str, payload: dict | None = None, timeout_s: float | None = None
    ) -> Any:
        """The parsed JSON answer: ``{}`` when empty, ``{"text": ...}`` when not JSON."""
        if self._session is None:
            raise EngineError(endpoint, "client is not open; use 'async with EngineClient(url)'", url=self.url)
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._session.request(method, self.url + endpoint, json=payload, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineError(endpoint, text[:500], resp.status, url=self.url)
        except TimeoutError as err:
            raise EngineError(endpoint, f"timed out after {timeout.total:.0f} s", url=self.url) from err
        except aiohttp.ClientError as err:
            raise EngineError(endpoint, f"{type(err).__name__}: {err}", url=self.url) from err
        if not text:
            return {}
        try:
            return json.loads(text)
        except ValueError:  # a few control endpoints answer plain text (e.g. /flush_cache)
            return {"text": text}

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        timeout_s: float | None = None,
        routes_from: int | None = None,
    ) -> Generation:
        """Sample from ``input_ids``; ``routes_from``: also return the routed experts of positions
        ``[routes_from, len(input_ids) + new tokens - 1)`` (an engine started with
        ``--enable-return-routed-experts``; ``Generation.routes``)."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling.to_json(),
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if routes_from is not None:
            payload["return_routed_experts"] = True
            payload["routed_experts_start_len"] = routes_from
        if rid is not None:
            payload["rid"] = rid
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self._clock(generating=1)
        try:
            body = await self._call("POST", "/generate", payload, timeout_s)
        finally:
            self._clock(generating=-1)
        kill_point("rollout:generate")  # mid-episode: a turn generated, its episode not finished
        return parse_generation(body, loop.time() - t0)

    async def score(self, input_ids: list[int], start: int) -> list[float]:
        """Prefill logprobs of ``input_ids[start:]`` given their prefixes (no sampling)."""
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": max(0, start - 1),
        }
        body = await self._call("POST", "/generate", payload)
        entries = body["meta_info"]["input_token_logprobs"]
        values = [e[0] for e in entries]
        return [float(v) for v in values[-(len(input_ids) - start) :]] if len(input_ids) > start else []

    # ---- control calls (send to each engine directly) ---------------------------------------
    async def health(self) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=5)
            return True
        except EngineError:
            return False

    async def server_info(self, timeout_s: float | None = 30.0) -> dict:
        """The server's resolved arguments (SGLang ``/server_info``)."""
        return await self._call("GET", "/server_info", timeout_s=timeout_s)

    async def model_info(self, timeout_s: float | None = None) -> dict:
        return await self._call("GET", "/model_info", timeout_s=timeout_s)

    async def weight_version(self, timeout_s: float | None = 10.0) -> str:
        """The engine's label of the weights it serves (the label ``/generate`` tags tokens with);
        ``/model_info`` answers even while generation is paused, unlike ``/health``."""
        return str((await self.model_info(timeout_s)).get("weight_version"))

    async def flush_cache(self, retry_s: float | None = None) -> None:
        """Drop the engine's prefix cache. Refused (HTTP 400) while requests sit in its batch, which a
        request the engine has just answered may still do for a moment: a refusal is repeated for up to
        ``retry_s`` (default ``FLUSH_RETRY_S``; 0: once), then raised. Through a router the refusal is
        HTTP 206 (``partial_success``: a worker answered 400), retried the same way: the router's
        health checks are such requests (SGLang's ``/health`` runs a one-token generation)."""
        await self._while_refused(
            lambda: self._call("POST", "/flush_cache"), lambda err: err.status in (400, 206), retry_s
        )

    async def pause(self, mode: str = "retract") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode '{mode}': use abort, retract or in_place")
        self._clock(paused=True)
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        try:
            await self._call("POST", "/continue_generation", {})
        finally:
            self._clock(paused=False)

    async def abort(self, rid: str | None = None) -> None:
        await self._call("POST", "/abort_request", {"rid": rid or "", "abort_all": rid is None})

    async def _update(self, endpoint: str, payload: dict, timeout_s: float | None = None) -> dict:
        body = await self._call("POST", endpoint, payload, timeout_s)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(endpoint, str(body.get("message", "refused")), url=self.url)
        return body

    async def _load_update(self, endpoint: str, payload: dict, timeout_s: float | None = None) -> dict:
        """A weight load that flushes the cache, repeated while the flush is refused for running requests.

        The engine refuses the flush (HTTP 400, "cache was not flushed because requests are still
        running") when a request is still in its batch, including one whose answer the caller has
        already received (seen right after a ``/generate`` returned); the weights are then loaded
        but the version is not recorded. Loading again is idempotent, so the call is repeated for
        up to ``FLUSH_RETRY_S`` (requests that really keep running still fail it).
        """
        return await self._while_refused(
            lambda: self._update(endpoint, payload, timeout_s), lambda err: _NOT_FLUSHED in str(err)
        )

    async def _while_refused(
        self, call: Callable[[], Awaitable[Any]], refused: Callable[[EngineError], bool], retry_s: float | None = None
    ) -> Any:
        """``call()``, repeated every 0.2 s while it fails with a flush refusal (``refused(err)``) for up to
        ``retry_s`` (default ``FLUSH_RETRY_S``), then that refusal raised."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.FLUSH_RETRY_S if retry_s is None else retry_s)
        while True:
            try:
                return await call()
            except EngineError as err:
                if not refused(err) or loop.time() >= deadline:
                    raise
            await asyncio.sleep(0.2)

    async def update_weights_from_disk(self, model_path: str, version: str) -> dict:
        return await self._load_update(
            "/update_weights_from_disk", {"model_path": model_path, "weight_version": version, "flush_cache": True}
        )

    async def begin_weight_update(self) -> None:
        await self._update("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._update("/end_weight_update", {})

    @contextlib.asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[EngineClient]:
        """``/begin_weight_update`` ... ``/end_weight_update`` around the body.

        If the body raises, the session is still ended (an error from that is suppressed so the
        body's error propagates).
        """
        await self.begin_weight_update()
        try:
            yield self
        except BaseException:
            with contextlib.suppress(EngineError):
                await self.end_weight_update()
            raise
        await self.end_weight_update()

    async def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        version: str,
        flush_cache: bool = True,
        tp_size: int = 1,
        timeout_s: float | None = None,
    ) -> dict:
        """Load ``named_tensors`` (HF names, full unsharded tensors) into a same-host engine.

        Must run inside :meth:`weight_update_session` (the engine answers HTTP 400 otherwise);
        several calls (buckets) may share one session. Only metadata travels over HTTP: the
        (CPU; CUDA tensors would travel as CUDA IPC handles, not measured here) tensors' storages
        are moved into shared memory with ``torch.multiprocessing``'s
        ``file_system`` strategy (the engine process dies on the default ``file_descriptor``
        handles) and the engine maps them, so the engine must run on this host. The tensors stay
        referenced until the engine has answered (it copies them into its parameters).
        ``tp_size`` copies of the payload are sent, one per engine TP rank.
        """
        tensors = [(str(name), tensor) for name, tensor in named_tensors]
        # Serialization copies every storage into shared memory: off the event loop.
        blob = await asyncio.to_thread(serialize_named_tensors, tensors)
        payload = {
            "serialized_named_tensors": [blob] * tp_size,
            "weight_version": str(version),
            "flush_cache": flush_cache,
        }
        if not flush_cache:
            return await self._update("/update_weights_from_tensor", payload, timeout_s)
        return await self._load_update("/update_weights_from_tensor", payload, timeout_s)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> dict:
        return await self._update(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: str | None,
        flush_cache: bool = True,
        flat: bool = False,
    ) -> dict:
        """Receive one bucket over ``group_name``'s broadcast: tensor by tensor, or (``flat``) as one
        byte buffer holding the tensors back to back (SGLang's ``flattened_bucket`` format)."""
        return await self._update(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "weight_version": version,
                "flush_cache": flush_cache,
                "load_format": "flattened_bucket" if flat else None,
            },
        )

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        return await self._update("/destroy_weights_update_group", {"group_name": group_name})


async def require_route_capture(clients: Sequence[EngineClient], setting: str) -> None:
    """Every engine returns routed experts (``--enable-return-routed-experts``), as
    ``rollout.routing_replay`` (``setting``) needs; else :class:`~sao_megatron.config.ConfigError` in one
    line naming the engine. Our launcher always passes the flag; this catches an engine started another
    way (or an SGLang that dropped it) before any episode records no routes."""
    from sao_megatron.config import ConfigError

    for client in clients:
        info = await client.server_info()
        if not info.get("enable_return_routed_experts"):
            raise ConfigError(
                f"rollout.routing_replay={setting}: the engine at {client.url} does not return routed experts "
                "(started without --enable-return-routed-experts); start it with the flag or set "
                "rollout.routing_replay=off"
            )
