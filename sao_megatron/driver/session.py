"""The long-lived parts of a run: role groups, engines, clients, weight sync, evaluation, checkpoints.

Engine faults: an engine whose process exited, that misses three watchdog checks in a row
(``rollout.engine_check_s``), or on which an episode hit a connection error, is marked down (no
new episodes; the managers retry its failed ones elsewhere) and restarted: same index, a fresh
port, from random weights (``<run_dir>/hf/engine``; the last export ``<run_dir>/hf/policy`` with the
disk weight sync), then a weight sync of the current version to every engine (the
broadcast group re-formed with the new URL) before it is marked up again. A sync that fails
because an engine died restarts that engine and syncs again; one whose broadcast group was aborted
(:class:`~sao_megatron.weight_sync.SyncAborted`: an engine died or refused mid-broadcast, seen under
NCCL only as ``rollout.weight_sync_timeout_s`` passing) restarts every engine of the group, since
each may still hold the aborted collective (docs/training.md, "When a weight sync fails"); those
restarts run at once, so the outage is one restart, not one per engine. After
``rollout.engine_max_restarts`` restarts within ``rollout.engine_restart_window_steps`` learner steps
an engine is dropped; with none left the run stops (:class:`EnginesLost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path

from sao_megatron import algo
from sao_megatron.buffer import ReadyBuffer
from sao_megatron.config import SAOConfig
from sao_megatron.config.load import check_init_from
from sao_megatron.driver.engines import Engine, engine_model_dir, launch_engines, start_engines, wait_healthy
from sao_megatron.driver.env_pool import EnvWorkerPool
from sao_megatron.driver.estimator import AdvantageEstimator
from sao_megatron.driver.roles import ActorGroup, CriticGroup, start_ray
from sao_megatron.driver.run_state import RunState
from sao_megatron.envs.base import Task
from sao_megatron.envs.format import tool_format_of
from sao_megatron.envs.registry import make_task
from sao_megatron.records import Trajectory
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.rollout.client import EngineClient, EngineError, require_route_capture
from sao_megatron.rollout.env_workers import EnvFactory, local_env_factory
from sao_megatron.rollout.gateway import Gateway
from sao_megatron.rollout.manager import EnginesLost, EngineStates, PromptCursor, RolloutManager
from sao_megatron.routing import RouteShape
from sao_megatron.tokenizer import load_tokenizer
from sao_megatron.weight_sync import SyncAborted, sync_from_disk

log = logging.getLogger(__name__)

_CONNECTION_FAILURES = (
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientOSError",
    "Connection reset",
    "Cannot connect",
)
"""In an episode's ``engine:`` reason: the engine's server is not there (not a slow or refused call)."""

_MISSED_CHECKS = 3
"""Watchdog checks in a row an engine's ``/model_info`` may go unanswered before it is restarted."""
_SYNC_METRICS = {
    "sync_s": "time/sync_s",
    "sync_pause_s": "time/sync_pause_s",
    "sync_gb_per_s": "sync/gb_per_s",
    "sync_tensors": "sync/tensors",
    "sync_senders": "sync/senders",
    "sync_caches_kept": "sync/caches_kept",
}
"""The actor's sync timing (``ActorWorker.sync_weights``) as logged: seconds under time/, the rest under sync/."""


class Session:
    """Everything a stage needs, started once per ``sao train``."""

    env_pool: EnvWorkerPool | None = None
    """The env workers holding the episodes' environments (``rollout.env_workers`` > 0), once
    :meth:`start_rollouts` ran; None: environments run in this process."""
    sync_recoveries: int = 0
    """Failed weight syncs recovered by restarting engines and syncing again (``sync/recovered``)."""
    gateway: Gateway | None = None
    """The OpenAI-compatible gateway the episodes of ``rollout.env=openai_agent`` run through (one per
    run, made in ``__init__``); None for every other environment."""

    def __init__(self, cfg: SAOConfig, run_dir: Path, actor: ActorGroup, state: RunState):
        self.cfg = cfg
        self.state = state
        """The run's state; its ``version`` is the trained policy version (one owner: the loop records it)."""
        self.run_dir = Path(run_dir)
        self.tokenizer = load_tokenizer(init_from=getattr(cfg.actor, "init_from", "") or None)
        self.task: Task = make_task(cfg.rollout.env, dataset=cfg.data, **cfg.rollout.task_kwargs)
        self.actor = actor
        self.critic: CriticGroup | None = None
        self.engines: list[Engine] = []
        self._engines_ready: asyncio.Task | None = None
        """Set when the engines were launched with the roles (:meth:`start`): done once all are healthy."""
        self.clients: list[EngineClient] = []
        self.loops: list[AgentLoop] = []
        if cfg.rollout.env == "openai_agent":
            self.gateway = Gateway(cfg.rollout.gateway, cfg.rollout.agent)
        self.sync_address: str | list[str] = "127.0.0.1"
        self.engine_states = EngineStates(0)
        """Which engines take episodes, and the engine-fault counters (set by :meth:`start_rollouts`)."""
        self.weights_lock = asyncio.Lock()
        """Held from an actor update to the engines' sync of its weights (the learner step), and by
        an engine's restart and its sync: a restart never labels new weights with the old version."""
        self.served_version = 0
        """The policy version the engines serve (the last synced; behind ``state.version`` between delayed syncs)."""
        self._watchdog: asyncio.Task | None = None
        self._recovering: dict[int, asyncio.Task] = {}
        self._restart_steps: dict[int, list[int]] = {}
        """Per engine, the learner step (``state.step``) of each of its restarts: the restart budget."""
        self._policy_exported = False  # <run_dir>/hf/policy holds the actor's current weights

    @classmethod
    async def start(cls, cfg: SAOConfig, run_dir: Path, state: RunState) -> Session:
        """The actor world, restored from the run's checkpoint after SFT; the critic too. With the
        broadcast weight sync the engines are launched first and load while the roles start
        (:meth:`start_rollouts` waits for them)."""
        check_init_from(cfg)  # a missing checkpoint fails here, before any process starts
        start_ray(cfg)  # on one node: Ray gets only the trainers' GPUs, the engines the rest
        engines, ready = [], None
        if cfg.rollout.weight_sync == "distributed":
            # The engines load while the roles start: random weights now, the actor's by the first
            # weight sync (start_rollouts), before any episode.
            engines = launch_engines(cfg, engine_model_dir(cfg, run_dir), run_dir, load_format="dummy")
            ready = asyncio.create_task(wait_healthy(engines))
        try:
            actor = ActorGroup(cfg, run_dir)
            await actor.started()
        except BaseException:
            await _stop_engines(engines, ready)
            raise
        session = cls(cfg, run_dir, actor, state)
        session.engines, session._engines_ready = engines, ready
        try:
            checkpoint = RunState.checkpoint_dir(run_dir)
            if state.stage != "sft":
                if (checkpoint / "actor").exists():
                    await actor.load(checkpoint / "actor")
                await session.ensure_critic()
        except BaseException:
            await session.shutdown()
            raise
        return session

    async def ensure_critic(self) -> None:
        """Build the critic (after SFT). Its trunk comes from, first match: the run's critic
        checkpoint (resume), ``critic.init_from``, the actor's weights (``critic.init_from_actor``):
        ``actor.init_from`` itself while the actor has not trained (no SFT steps, no actor
        checkpoint: nothing is exported), else the actor's current weights exported as an HF
        checkpoint (the engines start from the same export); else a random initialisation. Every
        critic rank reads only its own slices of the source."""
        if self.critic is not None or not algo.uses_critic(self.cfg.algo.advantage):
            return
        checkpoint = RunState.checkpoint_dir(self.run_dir) / "critic"
        source = ""
        if checkpoint.exists():
            pass  # loaded below; reading an initial checkpoint first would be wasted
        elif self.cfg.critic.init_from:
            source = self.cfg.critic.init_from
        elif self.cfg.critic.init_from_actor and self._actor_is_init_from():
            source = self.cfg.actor.init_from  # what the actor holds: sliced into the critic's layout
        elif self.cfg.critic.init_from_actor:
            source = str(await self._export_policy())
        self.critic = CriticGroup(self.cfg, self.run_dir, source)
        await self.critic.started()
        if checkpoint.exists():
            await self.critic.load(checkpoint)

    def _actor_is_init_from(self) -> bool:
        """The actor's weights are still ``actor.init_from``'s: it was set, no SFT step ran and no
        actor checkpoint was loaded (the run's first critic, at 750B-A40B a 1.48 TB export saved)."""
        actor_checkpoint = RunState.checkpoint_dir(self.run_dir) / "actor"
        return bool(self.cfg.actor.init_from) and self.cfg.train.sft_steps == 0 and not actor_checkpoint.exists()

    async def _export_policy(self) -> Path:
        """The actor's current weights as an HF checkpoint in ``<run_dir>/hf/policy``; exported once
        for the critic and the engines' start (the actor does not train in between)."""
        hf_dir = self.run_dir / "hf" / "policy"
        if not self._policy_exported:
            await self.actor.export_hf(hf_dir)
            self._policy_exported = True
        return hf_dir

    async def start_rollouts(self, version: int) -> None:
        """Start the env workers (``rollout.env_workers`` > 0); wait for the engines launched by
        :meth:`start`, or (disk weight sync) export the current policy and start the engines from it;
        connect the weight sync and sync the actor's weights."""
        r = self.cfg.rollout
        if r.env_workers > 0 and self.env_pool is None:  # first: placement errors come before engine syncs
            group = r.env_node_group if self.cfg.cluster.ray_address else None
            self.env_pool = await EnvWorkerPool.start(
                r.env_workers, r.env_worker_episodes, r.env_worker_cpus, group, self.cfg.cluster.placement_timeout_s
            )
        if self._engines_ready is not None:
            await self._engines_ready  # stopped them all and raises when one never became healthy
        else:
            self.engines = await start_engines(self.cfg, await self._export_policy(), self.run_dir)
        self._policy_exported = False  # the actor trains from here on: later exports are fresh
        if self.cfg.cluster.ray_address:  # engines dial each pipeline stage's sender on its node
            self.sync_address = await self.actor.node_ips()
        for i, engine in enumerate(self.engines):
            client = await EngineClient(engine.url).__aenter__()
            self.clients.append(client)
            if self.cfg.rollout.routing_replay != "off":
                await require_route_capture([client], self.cfg.rollout.routing_replay)
            self.loops.append(
                AgentLoop(
                    client,
                    self.tokenizer,
                    self.cfg.rollout.loop,
                    engine_name=f"engine{i}",
                    update_policy=self.cfg.rollout.update_policy,
                    routes=RouteShape.of(self.cfg.model) if self.cfg.rollout.routing_replay != "off" else None,
                    gateway=self.gateway,
                )
            )
        self.engine_states = EngineStates(len(self.engines), on_failure=self._episode_failed)
        async with self.weights_lock:
            await self.sync_weights(version)  # forms the broadcast group; labels tokens with ints
        self._watchdog = asyncio.create_task(self._watch())

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Engines serve the actor's current weights under ``version``; timing metrics and
        ``sync/recovered`` (failed syncs recovered since the run started). The caller holds
        :attr:`weights_lock`. An engine that died (before or during the sync) is restarted and the
        sync repeated; after an aborted broadcast group every engine of it is; engines serving
        ``version`` afterwards are marked up."""
        states = self.engine_states
        while True:
            try:
                metrics = await self._sync_once(version)
                break
            except Exception as err:
                if isinstance(err, SyncAborted):  # each engine of the group may hold the aborted collective
                    lost = states.live()
                else:
                    lost = [i for i in states.live() if not await self._responsive(i)]
                if not lost:
                    raise
                log.warning(
                    "weight sync to version %d failed (%s: %s); restarting engine(s) %s",
                    version,
                    type(err).__name__,
                    str(err)[:300],
                    lost,
                )
                self.sync_recoveries += 1
                await self._restart_all(lost)
        metrics["sync/recovered"] = float(self.sync_recoveries)
        self.served_version = version
        for i in states.live():
            try:
                label = await self.clients[i].weight_version()
            except EngineError as err:  # died right after the sync: restarted (and synced) in the background
                states.mark_down(i)
                self._recover(i, str(err))
                continue
            if label != str(version):
                raise RuntimeError(f"engine{i} serves weights labelled {label!r} after the sync of version {version}")
            self.loops[i].client = self.clients[i]  # a restarted engine's: episodes reach it from now on
            if not metrics.get("sync/caches_kept"):  # every cache flushed: it holds KV of this version only
                self.clients[i].cache_version = version
            states.mark_up(i)
        return metrics

    async def _sync_once(self, version: int) -> dict[str, float]:
        live = self.engine_states.live()
        if self.cfg.rollout.weight_sync == "disk":
            hf_dir = self.run_dir / "hf" / "policy"
            return await sync_from_disk(self.actor.export_hf, hf_dir, [self.clients[i] for i in live], version)
        urls = [self.engines[i].url for i in live]
        report = await self.actor.sync_weights(urls, version, self.sync_address)
        return {_SYNC_METRICS[k]: v for k, v in report.items()}

    # ---- engine faults ----------------------------------------------------------------------
    async def _responsive(self, i: int) -> bool:
        """Engine ``i``'s process runs and its HTTP server answers."""
        if not await asyncio.to_thread(self.engines[i].alive):
            return False
        try:
            await self.clients[i].model_info(timeout_s=5.0)
            return True
        except EngineError:
            return False

    def _episode_failed(self, i: int, reason: str) -> None:
        """An episode on engine ``i`` failed because of it: a connection failure (the server is not
        there) marks it down at once, before the episode's retry picks an engine; a check follows."""
        if i in self._recovering or not self.engine_states.up[i]:
            return
        if any(k in reason for k in _CONNECTION_FAILURES):
            self.engine_states.mark_down(i)
        self._recover(i, reason)

    def _recover(self, i: int, why: str) -> None:
        """Check engine ``i`` in the background, restarting it if it is dead (once at a time)."""
        if i not in self._recovering:
            task = asyncio.create_task(self._check_and_restart(i, why))
            self._recovering[i] = task
            task.add_done_callback(lambda t, i=i: self._recovered(i, t))

    def _recovered(self, i: int, task: asyncio.Task) -> None:
        self._recovering.pop(i, None)
        if not task.cancelled() and task.exception() is not None:
            err = task.exception()
            log.error("restarting engine%d failed: %s: %s", i, type(err).__name__, err)
            if self.engine_states.error is None and not isinstance(err, EnginesLost):
                self.engine_states.drop(i, f"its restart failed: {type(err).__name__}: {err}")

    async def _check_and_restart(self, i: int, why: str) -> None:
        states = self.engine_states
        async with self.weights_lock:
            if i in states.dropped:
                return
            if await self._responsive(i):
                if not states.up[i]:  # a passing failure: it still serves the synced version
                    if await self.clients[i].weight_version() == str(self.served_version):
                        states.mark_up(i)
                    else:
                        await self.sync_weights(self.state.version)
                return
            log.warning("engine%d is down (%s); restarting it", i, why[:300])
            await self._restart(i)
            if i not in states.dropped:
                await self.sync_weights(self.state.version)  # the actor's, before it takes episodes

    async def _restart_all(self, engines: list[int]) -> None:
        """:meth:`_restart` every one of ``engines`` at once and wait for all; then raise the first
        error, if any (each engine's failure is handled in its own restart, as one at a time). No
        order among them is needed: each engine has its own GPUs (its own placement group on a
        cluster) and its own fresh port (two probes that meet on one port are retried by the server's
        start, as at the run's start), its stop comes before its start inside :meth:`_restart` (it
        frees that engine's GPUs), and episodes reach none of them before the sync that follows marks
        them up. The launches are
        synchronous calls on the event loop (a process spawn, a Ray placement) and so still one
        after another; the health waits, the model load and warm-up of each server, overlap."""
        results = await asyncio.gather(*(self._restart(i) for i in engines), return_exceptions=True)
        for err in results:
            if isinstance(err, BaseException):
                raise err

    def _recent_restarts(self, i: int) -> int:
        """Engine ``i``'s restarts within the last ``rollout.engine_restart_window_steps`` learner
        steps (0: the whole run); older ones are forgotten."""
        window, step = self.cfg.rollout.engine_restart_window_steps, self.state.step
        steps = self._restart_steps.setdefault(i, [])
        if window:
            steps[:] = [s for s in steps if step - s < window]
        return len(steps)

    async def _restart(self, i: int) -> None:
        """Replace engine ``i`` by a fresh server (same index, a new port), not yet synced nor up; or
        drop it after ``rollout.engine_max_restarts`` restarts within the last
        ``rollout.engine_restart_window_steps`` learner steps. The caller holds :attr:`weights_lock`.
        The server starts as at :meth:`start`: random weights (``<run_dir>/hf/engine``) with the
        broadcast weight sync, else the last export (``<run_dir>/hf/policy``)."""
        from sao_megatron.driver.engines import start_engines

        if self.cfg.rollout.weight_sync == "distributed":
            source, load_format = self.run_dir / "hf" / "engine", "dummy"
        else:
            source, load_format = self.run_dir / "hf" / "policy", "auto"

        states, limit = self.engine_states, self.cfg.rollout.engine_max_restarts
        window = self.cfg.rollout.engine_restart_window_steps
        states.mark_down(i)
        await asyncio.to_thread(self.engines[i].stop)  # what is left of it (SGLang's subprocesses)
        await self.clients[i].close()
        while True:
            if (recent := self._recent_restarts(i)) >= limit:
                within = f"within {window} step(s)" if window else "in this run"
                why = (
                    f"dead after {recent} restart(s) {within} (rollout.engine_max_restarts={limit} "
                    f"per rollout.engine_restart_window_steps={window})"
                )
                log.error("engine%d dropped: %s", i, why)
                states.drop(i, why)
                if states.error is not None:
                    raise EnginesLost(
                        f"{states.error}; the run cannot continue without engines. See the engine logs in "
                        f"{self.run_dir / 'logs'}, or raise rollout.engine_max_restarts or lower "
                        "rollout.engine_restart_window_steps"
                    )
                return
            states.restarts[i] += 1  # since the process started: the metric and the restart's log name
            self._restart_steps[i].append(self.state.step)
            try:
                (engine,) = await start_engines(
                    self.cfg, source, self.run_dir, [i], restart=states.restarts[i], load_format=load_format
                )
                break
            except Exception as err:
                log.warning("restart %d of engine%d failed: %s", states.restarts[i], i, err)
        self.engines[i] = engine
        # Its agent loop keeps the closed client until the sync: an episode still in flight there fails
        # (and is retried) rather than continue on weights of another version.
        self.clients[i] = await EngineClient(engine.url).__aenter__()
        log.warning(
            "engine%d restarted (%d of rollout.engine_max_restarts=%d within rollout.engine_restart_window_steps=%d) at %s",
            i,
            self._recent_restarts(i),
            limit,
            window,
            engine.url,
        )

    async def _watch(self) -> None:
        """The watchdog: every ``rollout.engine_check_s``, each engine that is up must have a running
        process and answer ``/model_info`` (at most ``_MISSED_CHECKS`` misses in a row)."""
        missed = [0] * len(self.engines)
        while True:
            await asyncio.sleep(self.cfg.rollout.engine_check_s)
            for i in self.engine_states.live():
                if i in self._recovering or not self.engine_states.up[i]:
                    missed[i] = 0
                    continue
                if not await asyncio.to_thread(self.engines[i].alive):
                    self.engine_states.mark_down(i)
                    self._recover(i, "its process exited")
                    continue
                missed[i] = 0 if await self._responsive(i) else missed[i] + 1
                if missed[i] >= _MISSED_CHECKS:
                    self.engine_states.mark_down(i)
                    self._recover(i, f"no answer to {missed[i]} health checks in a row")

    def env_factory(self) -> EnvFactory:
        """Where every episode's environment lives, for the manager and evaluation alike: on the env
        workers when there are any, else in this process."""
        r = self.cfg.rollout
        if self.env_pool is not None:
            tool_format = tool_format_of(getattr(self.tokenizer, "chat_template", None))  # the agent loops'
            return self.env_pool.factory(r.env, r.env_kwargs, tool_format)
        if r.env_workers > 0:
            raise RuntimeError("rollout.env_workers > 0 but the env workers are not started (start_rollouts)")
        return local_env_factory(r.env, r.env_kwargs)

    def manager(self, buffer: ReadyBuffer, version: Callable[[], int], cursor: PromptCursor) -> RolloutManager:
        """Episodes from ``cursor`` on the engines; finished ones go to ``buffer`` at the current version."""
        return RolloutManager(
            self.loops,
            self.task,
            self.cfg.rollout.env,
            lambda t: buffer.admit(t, version()),
            group_size=self.cfg.algo.group_size,
            max_concurrent=self.cfg.rollout.max_concurrent,
            env_kwargs=self.cfg.rollout.env_kwargs,
            cursor=cursor,
            max_failed_fraction=self.cfg.rollout.max_failed_fraction,
            failure_window=self.cfg.rollout.failure_window,
            env_factory=self.env_factory(),
            engines=self.engine_states,
            episode_max_retries=self.cfg.rollout.episode_max_retries,
            retry_from=self.cfg.rollout.episode_retry_from,
        )

    async def evaluate(self) -> dict[str, float]:
        """The paper's two held-out figures on the first ``train.eval_prompts`` held-out prompts
        (at most the held-out set's size):

        * ``eval/accuracy``: one episode per prompt at ``train.eval_temperature`` (0: greedy pass@1),
          with ``eval/reward``, ``eval/failed`` (episodes) and ``eval/turns`` of the same episodes;
        * ``eval/mean_accuracy@k``: ``k = train.eval_samples`` episodes per prompt at
          ``train.eval_sample_temperature``, mean accuracy over all of them (paper: k=16 at 1.0),
          with ``eval/pass@k`` (share of prompts with a correct sample) and ``eval/sampled_failed``;
          with k >= 2, ``eval/between_prompt_share``: the share of those episodes' reward variance
          that lies between prompts (:func:`algo.between_prompt_share`).

        Each accuracy comes with its standard error over the prompts (``_se``: binomial for the
        greedy one, the per-prompt means' for the sampled one): the noise of the evaluation set.

        Failed episodes count as wrong. All episodes run concurrently (``rollout.max_concurrent``),
        under ``train.eval_max_turns`` when set.
        """
        t = self.cfg.train
        size = self.task.size("heldout")
        n = t.eval_prompts if size is None else min(t.eval_prompts, size)
        clients = [self.clients[i] for i in self.engine_states.live()]  # a restarting engine's client is new
        if n <= 0 or not clients:
            return {}
        k = t.eval_samples
        loop_cfg = self.cfg.rollout.loop
        loop_cfg = dataclasses.replace(loop_cfg, max_turns=t.eval_max_turns or loop_cfg.max_turns)
        settings = [dataclasses.replace(loop_cfg, temperature=t.eval_temperature)]
        if k > 0:
            settings.append(dataclasses.replace(loop_cfg, temperature=t.eval_sample_temperature))
        policy = self.cfg.rollout.update_policy
        loops = [
            [
                AgentLoop(c, self.tokenizer, s, engine_name=f"eval{i}", update_policy=policy, gateway=self.gateway)
                for i, c in enumerate(clients)
            ]
            for s in settings
        ]
        sem = asyncio.Semaphore(self.cfg.rollout.max_concurrent)
        samples = [self.task.get("heldout", i) for i in range(n)]
        make_env = self.env_factory()

        async def one(kind: int, i: int, j: int) -> Trajectory:
            async with sem:
                env = await make_env()
                loop = loops[kind][(i * (k + 1) + j) % len(clients)]
                return await loop.run(env, samples[i], split="heldout", index=i)

        jobs = [(0, i, 0) for i in range(n)] + [(1, i, j) for i in range(n) for j in range(k)]
        results = await asyncio.gather(*(one(*job) for job in jobs))
        first, rest = results[:n], results[n:]
        accuracy = sum(bool(r.correct) for r in first) / n
        metrics = {
            "eval/accuracy": accuracy,
            "eval/accuracy_se": math.sqrt(accuracy * (1 - accuracy) / n),  # binomial, over the n prompts
            "eval/reward": sum(r.reward for r in first) / n,
            "eval/failed": float(sum(r.status == "failed" for r in first)),
            "eval/turns": sum(r.num_turns for r in first) / n,
        }
        if k > 0:
            per_prompt = [[bool(r.correct) for r in rest[i * k : (i + 1) * k]] for i in range(n)]
            means = [sum(p) / k for p in per_prompt]
            metrics[f"eval/mean_accuracy@{k}"] = sum(means) / n
            metrics[f"eval/mean_accuracy@{k}_se"] = statistics.stdev(means) / math.sqrt(n) if n > 1 else 0.0
            metrics[f"eval/pass@{k}"] = sum(map(any, per_prompt)) / n
            metrics["eval/sampled_failed"] = float(sum(r.status == "failed" for r in rest))
            if k >= 2:
                rewards = [[r.reward for r in rest[i * k : (i + 1) * k]] for i in range(n)]
                metrics["eval/between_prompt_share"] = algo.between_prompt_share(rewards)
        return metrics

    async def checkpoint(
        self,
        state: RunState,
        manager: RolloutManager | None = None,
        buffer: ReadyBuffer | None = None,
        advantages: AdvantageEstimator | None = None,
    ) -> None:
        """Write actor, critic and run state into a staging directory, then publish it."""
        staging = RunState.staging_dir(self.run_dir)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        await self.actor.save(staging / "actor")
        if self.critic is not None:
            await self.critic.save(staging / "critic")
        if manager is not None:
            state.cursor = manager.state_dict()
        if buffer is not None:
            state.buffer = buffer.state_dict()
        if advantages is not None:
            state.advantages = advantages.state_dict()
        state.save(self.run_dir, staging)
        RunState.publish(self.run_dir)

    async def shutdown(self) -> None:
        for task in [self._watchdog, *self._recovering.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self.gateway is not None:
            await self.gateway.close()
        for client in self.clients:
            await client.close()
        await _stop_engines(self.engines, self._engines_ready)
        if self.env_pool is not None:
            self.env_pool.shutdown()
            self.env_pool = None
        for group in (self.actor, self.critic):
            if group is not None:
                group.shutdown()


async def _stop_engines(engines: list[Engine], ready: asyncio.Task | None) -> None:
    """Stop ``engines``, healthy or still starting (``ready``: their health wait, given up here)."""
    if ready is not None:
        if not ready.done():
            ready.cancel()
        with contextlib.suppress(BaseException):  # its error, if any, was raised where it was awaited
            await ready
    for engine in engines:
        engine.stop()
