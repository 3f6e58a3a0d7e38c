"""A discrete-event model of the asynchronous RL pipeline: engines, episodes, buffer, learner, sync.

It predicts what ``benchmarks/bench_pipeline.py`` measures (learner trajectories/s and tokens/s,
the engines' generation rate, learner idle time, policy lag) for three schemes on one workload::

    sync        batch barrier: B/G prompts x G episodes start together; the learner trains once
                all B finished, syncs the weights, then the next batch starts
    async_grpo  ``max_concurrent`` episodes always in flight; a GRPO group is ready when all G
                members finished; the learner takes B trajectories (B/G whole groups) when idle
    sao         the same with G = 1: no barrier at all

Engines are continuous-batching decoders in a fluid approximation: an engine with ``n`` sequences
generating advances each of them by one token per ``step_s + per_seq_s * n`` seconds (so it
produces ``n / (step_s + per_seq_s * n)`` tokens/s), and every turn pays ``request_s`` (HTTP,
scheduling, prefill) before its first token. Tool calls take the workload's latency off the
engine. While the learner computes, engines run at ``LearnerModel.engine_speed`` of their speed
(CPU cores shared with the learner; 1 on GPUs); during a weight sync they are paused for
``sync_pause_s``. A learner step takes ``step_s + per_token_s * action tokens`` including its
sync, whose engine pause comes at its end. Trajectories whose lag (trained version - version at
their first token) exceeds ``max_lag`` are dropped when the version moves on, as the buffer does.

The calibration (``EngineModel.from_probe`` from decode rates at two batch sizes, the learner's
measured step time) comes from ``benchmarks/bench_pipeline.py``; ``tests/plan/test_simulate.py``
checks the predictions against its measured CPU configurations. Pure Python, no dependencies.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Scheme = Literal["sync", "async_grpo", "sao"]
SCHEMES: tuple[Scheme, ...] = ("sync", "async_grpo", "sao")

Shape = tuple[Sequence[int], Sequence[float]]
"""An episode: action tokens per turn, and the tool latency (seconds) after each turn but the last."""


@dataclass(frozen=True)
class EngineModel:
    """One engine's decode speed (see the module docstring)."""

    step_s: float
    per_seq_s: float
    request_s: float = 0.0
    prefill_s: float = 0.0
    """Engine time each turn's start takes exclusively (its prefill and scheduling): decoding of
    every sequence on the engine stops meanwhile."""

    def tokens_per_s(self, n: int) -> float:
        return n / (self.step_s + self.per_seq_s * n) if n else 0.0

    @classmethod
    def from_probe(cls, n1: int, rate1: float, n2: int, rate2: float, request_s: float = 0.0) -> EngineModel:
        """Fit ``step_s`` and ``per_seq_s`` to decode rates (tokens/s of the whole engine) measured at
        batch sizes ``n1`` < ``n2``: seconds per iteration are ``n / rate`` at each."""
        if not 0 < n1 < n2 or min(rate1, rate2) <= 0:
            raise ValueError(f"from_probe: need 0 < n1 < n2 and positive rates, got {n1}, {rate1}, {n2}, {rate2}")
        t1, t2 = n1 / rate1, n2 / rate2
        per_seq = max(0.0, (t2 - t1) / (n2 - n1))
        return cls(step_s=max(1e-6, t1 - per_seq * n1), per_seq_s=per_seq, request_s=request_s)


@dataclass(frozen=True)
class LearnerModel:
    """A learner step's duration, its weight-sync pause, and the engines' speed while it computes."""

    step_s: float
    per_token_s: float = 0.0
    sync_pause_s: float = 0.0
    engine_speed: float = 1.0

    def seconds(self, action_tokens: int) -> float:
        return self.step_s + self.per_token_s * action_tokens


@dataclass
class SimResult:
    """Rates over the steps after the warm-up (the window starts when step ``warmup`` ended)."""

    scheme: str
    steps: int
    window_s: float
    trajectories_per_s: float
    tokens_per_s: float
    generated_tokens_per_s: float
    learner_idle: float
    lag_hist: dict[int, float]
    dropped_stale: int
    engine_generating: float

    @property
    def lag_mean(self) -> float:
        return sum(k * v for k, v in self.lag_hist.items())

    def lag_shares(self, top: int = 3) -> list[float]:
        """Shares of the trained trajectories at lag 0, 1, ..., ``top`` - 1 and at ``top`` or more."""
        shares = [self.lag_hist.get(k, 0.0) for k in range(top)]
        return [*shares, sum(v for k, v in self.lag_hist.items() if k >= top)]

    def lag_quantile(self, q: float) -> int:
        """The smallest lag at or below which at least ``q`` of the trained trajectories are."""
        total = 0.0
        for k in sorted(self.lag_hist):
            total += self.lag_hist[k]
            if total >= q - 1e-9:
                return k
        return max(self.lag_hist, default=0)


@dataclass
class _Episode:
    shape: Shape
    group: int
    turn: int = 0
    version: int = -1  # at its first token
    engine: int = -1
    target: float = 0.0  # the engine's virtual progress at which this turn's tokens are done
    finished_at: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(self.shape[0])


@dataclass
class _Engine:
    """Sequences generating on one engine: all advance by the same virtual progress ``v``."""

    active: list[tuple[float, int, _Episode]] = field(default_factory=list)  # heap of (target, seq, ep)
    v: float = 0.0
    at: float = 0.0
    busy_s: float = 0.0  # seconds with a sequence generating or a prefill running, not paused
    load: int = 0  # episodes assigned (generating or in a tool call)
    stall_until: float = 0.0  # prefills queued up to here: no decoding before


class Simulator:
    """One run of a scheme; see :func:`simulate`."""

    def __init__(
        self,
        scheme: Scheme,
        engine: EngineModel,
        engines: int,
        learner: LearnerModel,
        shape: Callable[[int, int], Shape],
        batch_size: int,
        group_size: int,
        max_concurrent: int,
        max_lag: int | None,
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}: use one of {SCHEMES}")
        if scheme == "sao" and group_size != 1:
            raise ValueError("scheme 'sao' runs single rollouts: group_size must be 1")
        if batch_size % group_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {group_size}")
        self.scheme, self.model, self.learner, self.shape = scheme, engine, learner, shape
        self.batch_size, self.group_size, self.max_lag = batch_size, group_size, max_lag
        self.max_concurrent = batch_size if scheme == "sync" else max_concurrent
        self.engines = [_Engine() for _ in range(engines)]
        self.t = 0.0
        self.version = 0
        self.speed = 1.0  # engine speed factor (learner computing)
        self.paused = False
        self.events: list[tuple[float, int, str, object]] = []  # (time, seq, kind, payload)
        self.seq = itertools.count()
        self.next_prompt = 0
        self.in_flight = 0
        self.groups: dict[int, list[_Episode]] = {}
        self.ready: deque[list[_Episode]] = deque()  # complete groups, in completion order
        self.learning = False
        self.barrier_open = True  # sync scheme: the next batch may be submitted
        self.log: list[tuple[float, int, int, list[int]]] = []  # (end time, trajectories, tokens, lags)
        self.idle_since: float | None = 0.0
        self.idle: list[tuple[float, float]] = []
        self.dropped = 0
        self.generated: list[tuple[float, int]] = []
        self.started = False

    # ---- engines ----------------------------------------------------------------------------
    def _rate(self, e: _Engine) -> float:
        """Virtual progress (tokens per sequence) per second of engine ``e`` now."""
        if self.paused or not e.active:
            return 0.0
        return self.speed / (self.model.step_s + self.model.per_seq_s * len(e.active))

    def _advance(self, e: _Engine) -> None:
        if self.t > e.at:
            stalled = max(0.0, min(self.t, e.stall_until) - e.at)
            decoding = max(0.0, self.t - max(e.at, e.stall_until))
            rate = self._rate(e)
            e.v += rate * decoding
            e.busy_s += stalled + (decoding if rate > 0 else 0.0)
        e.at = self.t

    def _advance_all(self) -> None:
        for e in self.engines:
            self._advance(e)

    def _schedule(self, i: int) -> None:
        """(Re)schedule engine ``i``'s next turn completion (older entries are ignored when popped)."""
        e = self.engines[i]
        rate = self._rate(e)
        if rate > 0:
            target = e.active[0][0]
            start = max(self.t, e.stall_until)
            self._push(start + max(0.0, target - e.v) / rate, "turn", (i, target, e.active[0][1]))

    def _schedule_all(self) -> None:
        for i in range(len(self.engines)):
            self._schedule(i)

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, payload))

    # ---- episodes ---------------------------------------------------------------------------
    def _submit(self) -> None:
        if self.scheme == "sync":
            if not self.barrier_open:
                return
            self.barrier_open = False
            count = self.batch_size // self.group_size
        else:
            count = (self.max_concurrent - self.in_flight) // self.group_size
        for _ in range(count):
            index = self.next_prompt
            self.next_prompt += 1
            for member in range(self.group_size):
                ep = _Episode(self.shape(index, member), index)
                ep.engine = min(range(len(self.engines)), key=lambda k: self.engines[k].load)
                self.engines[ep.engine].load += 1
                self.in_flight += 1
                self.groups.setdefault(index, []).append(ep)
                self._push(self.t + self.model.request_s, "start_turn", ep)

    def _start_turn(self, ep: _Episode) -> None:
        i = ep.engine
        e = self.engines[i]
        self._advance(e)
        if ep.turn == 0:
            ep.version = self.version
        e.stall_until = max(self.t, e.stall_until) + self.model.prefill_s / self.speed
        ep.target = e.v + ep.shape[0][ep.turn]
        heapq.heappush(e.active, (ep.target, next(self.seq), ep))
        self._schedule(i)

    def _turn_done(self, i: int, target: float, seq: int) -> None:
        e = self.engines[i]
        if not e.active or e.active[0][1] != seq:
            return  # a stale schedule entry: that turn is done
        self._advance(e)
        if e.v < target - 1e-6:
            return  # a stale schedule entry: the engine slowed since; a later one is queued
        _, _, ep = heapq.heappop(e.active)
        self.generated.append((self.t, ep.shape[0][ep.turn]))
        ep.turn += 1
        if ep.turn < len(ep.shape[0]):
            self._push(self.t + ep.shape[1][ep.turn - 1] + self.model.request_s, "start_turn", ep)
        else:
            ep.finished_at = self.t
            e.load -= 1
            self.in_flight -= 1
            members = self.groups[ep.group]
            if all(m.finished_at for m in members) and len(members) == self.group_size:
                del self.groups[ep.group]
                if self._fresh(members):
                    self.ready.append(members)
                else:  # too stale on arrival: the buffer drops the group
                    self.dropped += len(members)
            self._submit()
            self._maybe_learn()
        self._schedule(i)

    def _fresh(self, group: list[_Episode]) -> bool:
        """Would the next step train every member within ``max_lag``?"""
        return self.max_lag is None or all(self.version - ep.version <= self.max_lag for ep in group)

    # ---- learner ----------------------------------------------------------------------------
    def _maybe_learn(self) -> None:
        if self.learning:
            return
        needed = self.batch_size // self.group_size
        if len(self.ready) < needed:
            return
        batch = [self.ready.popleft() for _ in range(needed)]
        trajectories = [ep for group in batch for ep in group]
        self.learning = True
        if self.idle_since is not None:
            self.idle.append((self.idle_since, self.t))
            self.idle_since = None
        tokens = sum(ep.tokens for ep in trajectories)
        self._advance_all()
        self.speed = self.learner.engine_speed
        self._schedule_all()
        compute = max(0.0, self.learner.seconds(tokens) - self.learner.sync_pause_s)
        lags = [self.version - ep.version for ep in trajectories]
        self._push(self.t + compute, "computed", (len(trajectories), tokens, lags))

    def _computed(self, payload: tuple[int, int, list[int]]) -> None:
        self._advance_all()
        self.speed, self.paused = 1.0, True
        self._push(self.t + self.learner.sync_pause_s, "synced", payload)

    def _synced(self, payload: tuple[int, int, list[int]]) -> None:
        self._advance_all()
        self.paused = False
        self.version += 1
        n, tokens, lags = payload
        self.log.append((self.t, n, tokens, lags))
        self.learning = False
        self.idle_since = self.t
        keep = deque()  # the buffer drops what the next step would train too stale
        for group in self.ready:
            if self._fresh(group):
                keep.append(group)
            else:
                self.dropped += len(group)
        self.ready = keep
        self._schedule_all()
        if self.scheme == "sync":
            self.barrier_open = True
            self._submit()
        self._maybe_learn()

    def run(self, steps: int, warmup: int) -> SimResult:
        """Until ``steps`` learner steps are done; rates over those after ``warmup``."""
        if steps <= warmup:
            raise ValueError(f"steps ({steps}) must exceed warmup ({warmup})")
        self.run_steps(steps)
        return self._result(warmup)

    def run_steps(self, steps: int) -> None:
        """Until ``steps`` learner steps are done."""
        self._start()
        while len(self.log) < steps:
            self._next()

    def run_for(self, seconds: float) -> None:
        """Simulated time moves on by ``seconds``."""
        self._start()
        end = self.t + seconds
        while self.events and self.events[0][0] <= end:
            self._next()
        self.t = end

    def _start(self) -> None:
        if not self.started:
            self.started = True
            self._submit()

    def _next(self) -> None:
        if not self.events:
            raise RuntimeError("simulation stalled: no event pending (max_concurrent < group_size?)")
        at, _, kind, payload = heapq.heappop(self.events)
        self.t = at
        if kind == "turn":
            self._turn_done(*payload)  # type: ignore[misc]
        elif kind == "start_turn":
            self._start_turn(payload)  # type: ignore[arg-type]
        elif kind == "computed":
            self._computed(payload)  # type: ignore[arg-type]
        else:
            self._synced(payload)  # type: ignore[arg-type]

    def _result(self, warmup: int) -> SimResult:
        start, window = self.log[warmup - 1][0] if warmup else 0.0, self.log[warmup:]
        end = window[-1][0]
        wall = end - start
        idle = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.idle)
        lags = [lag for _, _, _, ls in window for lag in ls]
        hist = {k: lags.count(k) / len(lags) for k in sorted(set(lags))}
        self._advance_all()
        busy = statistics.fmean(e.busy_s for e in self.engines) / self.t if self.t else 0.0
        return SimResult(
            scheme=self.scheme,
            steps=len(window),
            window_s=wall,
            trajectories_per_s=sum(n for _, n, _, _ in window) / wall,
            tokens_per_s=sum(tok for _, _, tok, _ in window) / wall,
            generated_tokens_per_s=sum(n for t, n in self.generated if start < t <= end) / wall,
            learner_idle=idle / wall,
            lag_hist=hist,
            dropped_stale=self.dropped,
            engine_generating=busy,
        )


def simulate(
    scheme: Scheme,
    engine: EngineModel,
    learner: LearnerModel,
    shape: Callable[[int, int], Shape],
    *,
    engines: int = 1,
    batch_size: int,
    group_size: int = 1,
    max_concurrent: int,
    max_lag: int | None = 4,
    steps: int = 50,
    warmup: int = 5,
) -> SimResult:
    """Simulate ``steps`` learner steps of ``scheme``; rates over the steps after ``warmup``.

    ``shape(i, g)``: the episode of member ``g`` of prompt ``i``'s group (``g`` = 0 for single rollouts)."""
    sim = Simulator(scheme, engine, engines, learner, shape, batch_size, group_size, max_concurrent, max_lag)
    return sim.run(steps, warmup)


def capacity(
    engine: EngineModel,
    shape: Callable[[int, int], Shape],
    *,
    engines: int = 1,
    max_concurrent: int,
    seconds: float = 600.0,
) -> float:
    """Generated tokens/s of the engines alone with ``max_concurrent`` episodes always in flight (no
    learner, no sync), over ``seconds`` after the first ``max_concurrent`` episodes finished."""
    free = LearnerModel(step_s=0.0)
    sim = Simulator("sao", engine, engines, free, shape, 1, 1, max_concurrent, None)
    sim.run_steps(max_concurrent)  # warm-up: the first wave of episodes (each a one-trajectory step)
    start = sim.t
    sim.run_for(seconds)
    return sum(n for t, n in sim.generated if start < t <= sim.t) / seconds


def fit_prefill_s(
    engine: EngineModel,
    shape: Callable[[int, int], Shape],
    measured: float,
    *,
    engines: int = 1,
    max_concurrent: int,
    seconds: float = 600.0,
) -> EngineModel:
    """``engine`` with the per-turn engine time (``prefill_s``) at which :func:`capacity` equals the
    ``measured`` tokens/s on the same workload: what starting a turn costs the engine beyond
    decoding (prefill, scheduling, and on a shared CPU the agent loop's own work), which a decode
    probe alone does not see. Bisection over [0, 1] s; ``engine`` unchanged when its decode model
    alone does not exceed ``measured``. Every bisection step replays the same episodes, so each
    ``shape(i, g)`` is drawn once (a pure function of ``(i, g)``, as :func:`simulate` takes it)."""
    shape = functools.cache(shape)

    def rate(prefill_s: float) -> float:
        model = dataclasses.replace(engine, prefill_s=prefill_s)
        return capacity(model, shape, engines=engines, max_concurrent=max_concurrent, seconds=seconds)

    lo, hi = 0.0, 1.0
    if rate(lo) <= measured:
        return engine
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > measured else (lo, mid)
    return dataclasses.replace(engine, prefill_s=(lo + hi) / 2)
