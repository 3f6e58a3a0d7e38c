"""In-process stand-ins for a :class:`sao_megatron.driver.session.Session`: no Ray, Megatron or SGLang.

:class:`FakeSession` builds the REAL :class:`RolloutManager` over a :class:`ScriptedLoop` (episodes
whose duration, reward and failure depend on the prompt index) and admits into the REAL
:class:`ReadyBuffer` exactly as ``Session.manager`` does. The role handles mirror
``ActorGroup``/``CriticGroup`` and record every call. A trajectory's prompt is ``[PROMPT_TOKEN,
index]``, so the prompt index of every row of a :class:`TrainBatch` is ``batch.tokens[:, 1]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sao_megatron import algo
from sao_megatron.batch import TrainBatch
from sao_megatron.buffer import ReadyBuffer
from sao_megatron.config import SAOConfig
from sao_megatron.records import OBSERVATION_VERSION, Trajectory, Turn
from sao_megatron.rollout.manager import PromptCursor, RolloutManager
from tests.rollout.fakes import CountingTask

PROMPT_TOKEN = 1


def indices(batch: TrainBatch) -> list[int]:
    """Prompt index of each row (see the module docstring)."""
    return [int(i) for i in batch.tokens[:, 1]]


def trajectory(
    index: int,
    split: str,
    version: int,
    reward: float,
    status: str = "finished",
    submitted_at: float = 0.0,
    started_at: float = 0.0,
) -> Trajectory:
    """Two turns with an observation token between them; every action token at ``version``."""
    obs = OBSERVATION_VERSION
    return Trajectory(
        prompt_id=f"{split}-{index}",
        prompt_ids=[PROMPT_TOKEN, index],
        response_ids=[5, 6, 7, 8],
        action_mask=[1, 1, 0, 1],
        behavior_logprobs=[-0.1, -0.2, 0.0, -0.3],
        policy_versions=[version, version, obs, version],
        turns=[Turn(0, 2), Turn(3, 4)],
        reward=reward,
        status=status,  # type: ignore[arg-type]
        status_reason="engine: boom" if status == "failed" else "",
        correct=reward > 0.5,
        split=split,
        sample_index=index,
        submitted_at=submitted_at,
        started_at=started_at,
        finished_at=time.time(),
    )


@dataclass
class Episode:
    index: int
    version: int
    """Policy version when the episode started (that of all its action tokens)."""
    start: float
    end: float = 0.0
    """``time.monotonic()``."""


class ScriptedLoop:
    """Agent loop whose episode of prompt ``index`` lasts ``duration(index)`` seconds.

    ``version`` (set by :meth:`FakeSession.manager`) reads the current policy version."""

    def __init__(
        self,
        duration: Callable[[int], float] = lambda i: 0.01,
        reward: Callable[[int], float] = lambda i: (i % 997) / 997,
        failed: Callable[[int], bool] = lambda i: False,
        name: str = "engine0",
    ):
        self.duration, self.reward, self.failed = duration, reward, failed
        self.engine_name = name
        self.version: Callable[[], int] = lambda: 0
        self.running = 0
        self.max_running = 0
        self.episodes: list[Episode] = []
        self.finished: list[int] = []
        self.client = self  # the manager reads generating time from its loops' clients

    def generating_seconds(self) -> float:
        """Seconds with an episode running (a scripted episode generates for its whole duration)."""
        now, total, reach = time.monotonic(), 0.0, float("-inf")
        for start, end in sorted((e.start, e.end or now) for e in self.episodes):
            total += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return total

    async def run(self, env, sample, split="train", index=-1, submitted_at=None):
        episode = Episode(index, self.version(), time.monotonic())
        self.episodes.append(episode)
        started = time.time()
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.duration(index))
        finally:
            self.running -= 1
        episode.end = time.monotonic()
        self.finished.append(index)
        status = "failed" if self.failed(index) else "finished"
        t = trajectory(index, split, episode.version, self.reward(index), status, submitted_at or 0.0, started)
        t.prompt_id = sample.prompt_id
        return t


@dataclass
class Call:
    """One call of a fake role handle."""

    indices: list[int]
    version: int | None
    start: float
    end: float = 0.0
    step: int = 0
    """1-based learner step (number of ``critic.values`` calls so far; 0 without a critic)."""
    max_lag: int = 0
    """Actor updates: largest :func:`algo.policy_lag` of an action token against ``version``."""


class FakeActor:
    """``ActorGroup``: ``place`` and ``update`` (recorded; sleeps ``update_s``)."""

    def __init__(self, update_s: float = 0.0, steps: Callable[[], int] = lambda: 0):
        self.update_s = update_s
        self.steps = steps
        self.started: list[Call] = []
        self.updates: list[Call] = []
        """Finished updates."""
        self.on_update_start: Callable[[Call], None] = lambda c: None

    def place(self, batch: TrainBatch) -> TrainBatch:
        return batch

    async def update(self, placed: TrainBatch, advantages: torch.Tensor, version: int) -> dict[str, float]:
        assert advantages.shape == placed.tokens.shape
        lag = algo.policy_lag(version, placed.policy_versions, placed.action_mask)
        call = Call(indices(placed), version, time.monotonic(), step=self.steps(), max_lag=int(lag.max()))
        self.started.append(call)
        self.on_update_start(call)
        await asyncio.sleep(self.update_s)
        call.end = time.monotonic()
        self.updates.append(call)
        return {"loss": 0.0, "kept_frac": 1.0, "dis/ratio_mean": 1.0}


class FakeCritic:
    """``CriticGroup``: predicts 0 until it has made ``accurate_after`` updates, then the exact return
    (gamma = lam_critic = 1: the episode reward on every action token; with ``first_only``, at each
    trajectory's first action token only, 0 elsewhere)."""

    def __init__(self, accurate_after: int | None = None, update_s: float = 0.0, first_only: bool = False):
        self.accurate_after = accurate_after
        self.first_only = first_only
        self.update_s = update_s
        self.values_calls: list[Call] = []
        self.updates: list[Call] = []

    def place(self, batch: TrainBatch) -> TrainBatch:
        return batch

    async def values(self, placed: TrainBatch, size: int, width: int) -> torch.Tensor:
        assert (size, width) == tuple(placed.tokens.shape)
        self.values_calls.append(Call(indices(placed), None, time.monotonic(), step=len(self.values_calls) + 1))
        if self.accurate_after is None or len(self.updates) < self.accurate_after:
            return torch.zeros(size, width)
        exact = placed.rewards[:, None].expand(size, width).clone()
        if self.first_only:
            mask = placed.action_mask > 0
            first = torch.zeros_like(mask)
            first[torch.arange(size), mask.int().argmax(dim=-1)] = True
            exact[~first] = 0.0
        return exact

    async def update(self, placed: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        call = Call(indices(placed), None, time.monotonic(), step=len(self.values_calls))
        await asyncio.sleep(self.update_s)
        call.end = time.monotonic()
        self.updates.append(call)
        mask = placed.action_mask > 0
        return {"value_loss": float(((returns - old_values)[mask] ** 2).mean())}


@dataclass
class Admission:
    index: int
    admitted: bool
    version: int
    at: float


@dataclass
class Checkpoint:
    """What ``Session.checkpoint`` would have saved."""

    step: int
    version: int
    trained_prompts: list
    cursor: dict | None
    buffer: dict | None
    at: float


@dataclass
class FakeSession:
    cfg: SAOConfig
    loop: ScriptedLoop = field(default_factory=ScriptedLoop)
    actor: FakeActor = field(default_factory=FakeActor)
    critic: FakeCritic | None = field(default_factory=FakeCritic)
    engines: list = field(default_factory=lambda: [object()])
    tokenizer: object = None
    eval_s: float = 0.0
    on_admit: Callable[[ReadyBuffer, Admission], None] = lambda buffer, admission: None
    task: CountingTask = field(default_factory=CountingTask)
    admissions: list[Admission] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    """Exceptions raised by ``buffer.admit`` (they kill only the episode's task)."""
    syncs: list[int] = field(default_factory=list)
    evals: int = 0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    buffer: ReadyBuffer | None = None
    rollout_manager: RolloutManager | None = None
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    served_version: int = 0
    """The version the engines serve (the last synced); episodes are labelled with it."""
    eval_windows: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.critic is not None:
            critic = self.critic
            self.actor.steps = lambda: len(critic.values_calls)

    def manager(self, buffer: ReadyBuffer, version: Callable[[], int], cursor: PromptCursor) -> RolloutManager:
        """As ``Session.manager``: finished trajectories go to ``buffer.admit(t, version())`` (recorded)."""
        self.loop.version = lambda: self.served_version  # as an engine: the weights it was last synced to
        self.buffer = buffer

        def on_finished(t: Trajectory) -> bool:
            try:
                ok = buffer.admit(t, version())
            except Exception as err:  # the manager's episode task would swallow it: make tests see it
                self.errors.append(err)
                raise
            admission = Admission(t.sample_index, ok, version(), time.monotonic())
            self.admissions.append(admission)
            self.on_admit(buffer, admission)
            return ok

        c = self.cfg
        self.rollout_manager = RolloutManager(
            [self.loop],
            self.task,
            c.rollout.env,
            on_finished,  # type: ignore[list-item]
            group_size=c.algo.group_size,
            max_concurrent=c.rollout.max_concurrent,
            env_kwargs=c.rollout.env_kwargs,
            cursor=cursor,
        )
        return self.rollout_manager

    async def sync_weights(self, version: int) -> dict[str, float]:
        self.syncs.append(version)
        self.served_version = version
        return {"time/sync_s": 0.0}

    async def evaluate(self) -> dict[str, float]:
        start = time.monotonic()
        await asyncio.sleep(self.eval_s)
        self.eval_windows.append((start, time.monotonic()))
        self.evals += 1
        return {"eval/accuracy": 0.0}

    async def checkpoint(self, state, manager=None, buffer=None, advantages=None) -> None:
        """Records what would be saved; updates ``state`` like ``Session.checkpoint`` (no files)."""
        if manager is not None:
            state.cursor = manager.state_dict()
        if buffer is not None:
            state.buffer = buffer.state_dict()
        if advantages is not None:
            state.advantages = advantages.state_dict()
        self.checkpoints.append(
            Checkpoint(
                state.step,
                state.version,
                [list(x) for x in state.trained_prompts],
                state.cursor or None,
                state.buffer or None,
                time.monotonic(),
            )
        )
