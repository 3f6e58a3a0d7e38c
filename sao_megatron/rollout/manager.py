"""The rollout manager: keeps many episodes in flight and streams finished trajectories out.

Prompts come from a :class:`PromptCursor` (a resumable position in a task split); each prompt
is submitted ``group_size`` times (1 for SAO) under one ``group_id``. Up to
``max_concurrent`` episodes run at once on asyncio, spread over the engines (least loaded
first). Every finished trajectory, failed or not, goes to ``on_finished`` as soon as it
finishes: there is no batch barrier here.

Engine faults: an episode that failed because of its engine (an ``engine:`` reason, or aborted)
is reported to the :class:`EngineStates` (the session restarts a dead engine) and run again on
an engine that is up, up to ``episode_max_retries`` times; only then is it a failed episode.
``retry_from="scratch"`` runs the whole episode again with a fresh environment; ``"turn"`` keeps
the environment and the tokens so far and generates the failed turn again on the other engine. New episodes go only to engines marked up, and wait while none is.

Flow control (:meth:`allow`): the learner may cap how many fresh episodes have started, so the
engines run at most a few batches ahead of it instead of generating what the lag bound will
drop (``algo.max_batches_ahead``); without a cap the engines always generate.

Checkpointing: :meth:`state_dict` records the cursor and the submissions still in flight.
Resuming re-submits those first (their partial work is discarded, never trained), so no prompt
is lost; prompts handed to the learner are never in flight again, so none is trained twice.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sao_megatron.envs.base import Split, Task
from sao_megatron.records import Trajectory
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.env_workers import EnvFactory, environment_failure, local_env_factory


@dataclass
class PromptCursor:
    """Next prompt index of a split; the whole data-order state of a run."""

    split: Split = "train"
    next_index: int = 0

    def advance(self) -> int:
        index = self.next_index
        self.next_index += 1
        return index


@dataclass(frozen=True)
class Submission:
    """One episode to run: prompt ``index`` of ``split``, member ``group_index`` of its group."""

    split: Split
    index: int
    group_index: int
    submitted_at: float

    @property
    def group_id(self) -> str:
        return f"{self.split}:{self.index}"


@dataclass
class ManagerStats:
    submitted: int = 0
    finished: int = 0
    failed: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0
    per_engine: dict[str, int] = field(default_factory=dict)


class TooManyFailures(RuntimeError):
    """More than ``max_failed_fraction`` of the last ``failure_window`` episodes failed."""


class EnginesLost(RuntimeError):
    """Every engine was dropped (each restarted ``rollout.engine_max_restarts`` times): no episode can run."""


def engine_failure(traj: Trajectory) -> bool:
    """The episode failed because of its engine (an error calling it, or a generation it aborted),
    not because of the environment, the reward or the task: worth running again elsewhere."""
    return traj.status == "failed" and traj.status_reason.startswith(("engine:", "generation aborted"))


class EngineStates:
    """Which engines (by index) take new episodes: shared by the session, which marks an engine down
    when it dies and up once it serves the current weights again, and the managers, which route new
    episodes to engines that are up and report the engine failures of their episodes.

    Also the engine-fault counters (since this process started): restarts per engine, engines
    dropped, episodes retried."""

    def __init__(self, n: int, on_failure: Callable[[int, str], object] | None = None):
        """``on_failure(index, reason)``: an episode on engine ``index`` failed because of it."""
        self.up = [True] * n
        self.dropped: set[int] = set()
        self.restarts = [0] * n
        self.episode_retries = 0
        self.error: EnginesLost | None = None
        self.on_failure = on_failure
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def mark_down(self, i: int) -> None:
        self.up[i] = False

    def mark_up(self, i: int) -> None:
        if i not in self.dropped:
            self.up[i] = True
            self._notify()

    def drop(self, i: int, why: str) -> None:
        """Engine ``i`` is gone for good; with none left every waiting episode raises :class:`EnginesLost`."""
        self.up[i] = False
        self.dropped.add(i)
        if len(self.dropped) == len(self.up):
            self.error = EnginesLost(f"every engine was dropped; the last, engine{i}: {why}")
        self._notify()

    def live(self) -> list[int]:
        """Engines not dropped (up, or down for a restart)."""
        return [i for i in range(len(self.up)) if i not in self.dropped]

    async def wait_up(self) -> list[int]:
        """The engines up now; waits while none is. Raises :class:`EnginesLost` once all are dropped."""
        while True:
            if self.error is not None:
                raise self.error
            ready = [i for i, up in enumerate(self.up) if up]
            if ready:
                return ready
            await self._changed.wait()

    def report(self, i: int, reason: str) -> None:
        if self.on_failure is not None:
            self.on_failure(i, reason)

    def metrics(self) -> dict[str, float]:
        """``rollout/engine_restarts``, ``rollout/engine_dropped``, ``rollout/episode_retries``: counts
        since this process started (like ``buffer/dropped_*``, not per step)."""
        return {
            "rollout/engine_restarts": float(sum(self.restarts)),
            "rollout/engine_dropped": float(len(self.dropped)),
            "rollout/episode_retries": float(self.episode_retries),
        }


class RolloutManager:
    def __init__(
        self,
        loops: list[AgentLoop],
        task: Task,
        env_name: str,
        on_finished: Callable[[Trajectory], object],
        group_size: int = 1,
        max_concurrent: int = 64,
        env_kwargs: dict | None = None,
        cursor: PromptCursor | None = None,
        max_failed_fraction: float = 1.0,
        failure_window: int = 100,
        env_factory: EnvFactory | None = None,
        engines: EngineStates | None = None,
        episode_max_retries: int = 0,
        retry_from: str = "scratch",
    ):
        """Failed episodes (a reason in ``status_reason``) are handed on like any other and never
        stop the run, unless more than ``max_failed_fraction`` of the last ``failure_window``
        failed: then :meth:`run` raises :class:`TooManyFailures` naming the commonest reasons.

        Each episode's Env comes from ``env_factory`` (e.g. an env worker pool's); by default it is
        ``make_env(env_name, **env_kwargs)`` in this process.

        ``engines`` says which loops (by index) are up; by default all, always. An episode failed
        by its engine is run again up to ``episode_max_retries`` times (see the module docstring)."""
        if not loops:
            raise ValueError("RolloutManager needs at least one engine (AgentLoop)")
        self.loops = loops
        self.gateway = getattr(loops[0], "gateway", None)
        """The loops' OpenAI-compatible gateway (``rollout.env=openai_agent``), for its metrics; or None."""
        self.task = task
        self.env_name = env_name
        self.env_kwargs = env_kwargs or {}
        self.env_factory = env_factory or local_env_factory(env_name, self.env_kwargs)
        self.on_finished = on_finished
        self.group_size = group_size
        self.max_concurrent = max_concurrent
        self.cursor = cursor or PromptCursor()
        self.stats = ManagerStats()
        self._pending: list[Submission] = []
        self._in_flight: dict[Submission, asyncio.Task] = {}
        self._handed: set[Submission] = set()  # handed on; their task ends at the next loop turn
        self._load = [0] * len(loops)
        self._busy_since = [0.0] * len(loops)
        self._paused = asyncio.Event()
        self._paused.set()
        self._allowed: int | None = None
        """Fresh episodes (not resubmissions) that may have started; None: no cap (:meth:`allow`)."""
        self._started = 0
        self._room = asyncio.Event()
        self._error: BaseException | None = None
        self.max_failed_fraction = max_failed_fraction
        self._recent: deque[str] = deque(maxlen=failure_window)  # "" or the failure's reason
        self.engines = engines or EngineStates(len(loops))
        if len(self.engines.up) != len(loops):
            raise ValueError(f"EngineStates of {len(self.engines.up)} engines for {len(loops)} loops")
        self.episode_max_retries = episode_max_retries
        if retry_from not in ("scratch", "turn"):
            raise ValueError(f"retry_from={retry_from!r}: use 'scratch' or 'turn'")
        self.retry_from = retry_from

    # ---- submissions ------------------------------------------------------------------------
    def _next_submissions(self) -> list[Submission]:
        self._started += self.group_size
        index = self.cursor.advance()
        now = time.time()
        return [Submission(self.cursor.split, index, g, now) for g in range(self.group_size)]

    async def _pick_loop(self) -> int:
        """The least loaded engine that is up (waits while none is)."""
        return min(await self.engines.wait_up(), key=lambda i: self._load[i])

    def _busy(self, i: int, delta: int) -> None:
        """Track per-engine busy time (at least one episode in flight) for utilisation."""
        now = time.monotonic()
        if self._load[i] == 0 and delta > 0:
            self._busy_since[i] = now
        self._load[i] += delta
        if self._load[i] == 0:
            self.stats.busy_s += now - self._busy_since[i]

    def generating_seconds(self) -> float:
        """Engine-seconds with a ``/generate`` call in flight outside weight-update pauses, up to now."""
        return sum(loop.client.generating_seconds() for loop in self.loops)

    def busy_seconds(self) -> float:
        """Engine-seconds with at least one episode in flight (tool calls and pauses included), up to now."""
        now = time.monotonic()
        return self.stats.busy_s + sum(now - self._busy_since[i] for i in range(len(self.loops)) if self._load[i])

    async def _episode(self, sub: Submission) -> None:
        retries = [0]  # shared with the turn-level reroute of _attempt
        while True:
            i = await self._pick_loop()
            segments = await self._attempt(sub, i, retries)  # several: a gateway session's segments
            traj = segments[-1]
            loop = self.loops[self._engine_index(traj, i)]
            if not engine_failure(traj):
                break
            self.engines.report(self._engine_index(traj, i), traj.status_reason)
            if retries[0] >= self.episode_max_retries:
                break
            retries[0] += 1
            self.engines.episode_retries += 1
        self._handed.add(sub)  # from here a checkpoint holds it as finished, never as one to re-run
        for k, traj in enumerate(segments):
            # a later segment of a gateway session is a trajectory of its own for the buffer (same prompt id)
            traj.group_id = sub.group_id if k == 0 else f"{sub.group_id}/segment{k}"
            traj.reward_details = {**traj.reward_details, "group_index": sub.group_index}
            self.stats.finished += 1
            self.stats.failed += traj.status == "failed"
            self.stats.generated_tokens += traj.num_action_tokens
            self.stats.per_engine[loop.engine_name] = self.stats.per_engine.get(loop.engine_name, 0) + 1
            self._count_failure(traj)
            self.on_finished(traj)

    def _engine_index(self, traj: Trajectory, default: int) -> int:
        """The loop whose engine ran the episode's last turn (it may have moved: ``retry_from="turn"``)."""
        names = [loop.engine_name for loop in self.loops]
        return names.index(traj.engine) if traj.engine in names else default

    async def _attempt(self, sub: Submission, i: int, retries: list[int]) -> list[Trajectory]:
        """One run of ``sub`` from scratch (its own environment), starting on loop ``i``; with
        ``retry_from="turn"`` an engine failure moves it to another engine, mid-episode. One
        trajectory, or one per segment of an episode a user's agent drove through the gateway."""

        async def reroute(reason: str) -> AgentLoop | None:
            nonlocal i
            self.engines.report(i, reason)
            if retries[0] >= self.episode_max_retries:
                return None
            retries[0] += 1
            self.engines.episode_retries += 1
            self._busy(i, -1)
            i = await self._pick_loop()
            self._busy(i, +1)
            return self.loops[i]

        self._busy(i, +1)
        try:
            try:
                sample = self.task.get(sub.split, sub.index)
                if sub.group_index:
                    sample = self.task.member(sample, sub.group_index)
            except Exception as err:  # a bad record must not stop the run: a failed episode
                return [_failed(sub, f"task: {type(err).__name__}: {err}")]
            try:
                env = await self.env_factory()
            except Exception as err:
                return [_failed(sub, environment_failure(err), sample.prompt_id)]
            if getattr(env, "external_agent", False):
                return await self.loops[i].run_segments(
                    env, sample, split=sub.split, index=sub.index, submitted_at=sub.submitted_at
                )
            traj = await self.loops[i].run(
                env,
                sample,
                split=sub.split,
                index=sub.index,
                submitted_at=sub.submitted_at,
                **({"reroute": reroute} if self.retry_from == "turn" else {}),
            )
            return [traj]
        finally:
            self._busy(i, -1)

    def _count_failure(self, traj: Trajectory) -> None:
        self._recent.append(traj.status_reason or "unknown" if traj.status == "failed" else "")
        if len(self._recent) < (self._recent.maxlen or 0) or self._error is not None:
            return
        failed = [r for r in self._recent if r]
        if len(failed) > self.max_failed_fraction * len(self._recent):
            common = Counter(r.split(":")[0] for r in failed).most_common(3)
            example = failed[-1][:200]
            self._error = TooManyFailures(
                f"{len(failed)} of the last {len(self._recent)} episodes failed (rollout.max_failed_fraction="
                f"{self.max_failed_fraction}); commonest causes {common}; latest: {example!r}. Fix the cause "
                "(see the run's logs/ and the failed trajectories), or raise rollout.max_failed_fraction"
            )

    def _launch(self, sub: Submission) -> None:
        task = asyncio.create_task(self._episode(sub))
        self._in_flight[sub] = task
        task.add_done_callback(lambda t, s=sub: self._finished(s, t))
        self.stats.submitted += 1

    def _finished(self, sub: Submission, task: asyncio.Task) -> None:
        self._in_flight.pop(sub, None)
        self._handed.discard(sub)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()  # a bug, not an episode failure (those are trajectories): surface it

    # ---- control ----------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop submitting new episodes (in-flight ones continue)."""
        self._paused.clear()

    def resume(self) -> None:
        self._paused.set()

    def allow(self, episodes: int | None) -> None:
        """Start new prompts only while at most ``episodes`` fresh episodes have started in this
        manager (resubmissions of a resumed run do not count); None lifts the cap."""
        self._allowed = episodes
        self._room.set()

    def _capped(self) -> bool:
        return self._allowed is not None and self._started + self.group_size > self._allowed

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def run(self, stop: asyncio.Event, max_prompts: int | None = None) -> None:
        """Keep ``max_concurrent`` episodes in flight until ``stop`` is set, or until ``max_prompts``
        prompts were submitted and have all finished. Waits on events, never polls."""
        # A resumed manager's first run starts with the checkpoint's unfinished submissions pending
        # (load_state_dict): they are prompts of this run, as they were of the interrupted one.
        prompts = len({(s.split, s.index) for s in self._pending})
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                if isinstance(self._error, (TooManyFailures, EnginesLost)):
                    raise self._error
                if self._error is not None:
                    raise RuntimeError(f"an episode raised: {self._error!r}") from self._error
                if not self._paused.is_set():
                    resumed = asyncio.ensure_future(self._paused.wait())
                    await asyncio.wait([stopping, resumed], return_when=asyncio.FIRST_COMPLETED)
                    resumed.cancel()
                    continue
                exhausted = not self._pending and max_prompts is not None and prompts >= max_prompts
                if exhausted and not self._in_flight:
                    return
                if exhausted or len(self._in_flight) + self.group_size > self.max_concurrent:
                    await asyncio.wait([stopping, *self._in_flight.values()], return_when=asyncio.FIRST_COMPLETED)
                    continue
                if not self._pending and self._capped():  # the learner is far enough behind
                    self._room.clear()
                    room = asyncio.ensure_future(self._room.wait())
                    await asyncio.wait([stopping, room, *self._in_flight.values()], return_when=asyncio.FIRST_COMPLETED)
                    room.cancel()
                    continue
                if not self._pending:
                    self._pending = self._next_submissions()
                    prompts += 1
                for sub in self._pending:
                    self._launch(sub)
                self._pending = []
        finally:
            stopping.cancel()

    async def drain(self, cancel: bool = False) -> None:
        """Wait for (or cancel) the episodes still in flight."""
        tasks = list(self._in_flight.values())
        if cancel:
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def state_dict(self) -> dict:
        """Cursor plus every submission not yet finished (to be re-run on resume)."""
        running = [s for s in self._in_flight if s not in self._handed]
        unfinished = sorted({(s.split, s.index, s.group_index) for s in [*running, *self._pending]})
        return {
            "split": self.cursor.split,
            "next_index": self.cursor.next_index,
            "resubmit": [list(x) for x in unfinished],
        }

    def load_state_dict(self, state: dict) -> None:
        self.cursor = PromptCursor(state["split"], state["next_index"])
        now = time.time()
        self._pending = [Submission(split, index, g, now) for split, index, g in state["resubmit"]]


def _failed(sub: Submission, reason: str, prompt_id: str = "") -> Trajectory:
    """A failed episode that never reached an engine (its task record or environment broke)."""
    now = time.time()
    return Trajectory(
        prompt_id=prompt_id or sub.group_id,
        prompt_ids=[],
        response_ids=[],
        action_mask=[],
        behavior_logprobs=[],
        policy_versions=[],
        turns=[],
        reward=0.0,
        status="failed",
        status_reason=reason,
        split=sub.split,
        sample_index=sub.index,
        submitted_at=sub.submitted_at,
        started_at=now,
        finished_at=now,
    )
