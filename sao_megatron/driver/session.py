"""The long-lived parts of a run: role groups on Ray, SGLang engines, clients, evaluation, checkpoints."""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import replace
from pathlib import Path

from sao_megatron.config import SAOConfig
from sao_megatron.envs.registry import make_env, make_task
from sao_megatron.observe import RunLog
from sao_megatron.rollout.agent_loop import AgentLoop, AgentLoopConfig
from sao_megatron.rollout.client import EngineClient
from sao_megatron.rollout.engine import EngineProcess, EngineSpec
from sao_megatron.rollout.manager import PromptCursor, RolloutManager
from sao_megatron.spawn import free_port
from sao_megatron.tokenizer import load_tokenizer
from sao_megatron.driver.advantages import uses_critic
from sao_megatron.driver.roles import RemoteEngine, RoleGroup, init_ray, on_cluster
from sao_megatron.driver.run_state import RunState


def loop_config(cfg: SAOConfig, temperature: float | None = None) -> AgentLoopConfig:
    r = cfg.rollout
    return AgentLoopConfig(max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
                           max_response_tokens=r.max_response_tokens, max_context_tokens=r.max_context_tokens,
                           temperature=r.temperature if temperature is None else temperature, top_p=r.top_p)  # fmt: skip


class Services:
    def __init__(self, cfg: SAOConfig, run_dir: Path, log: RunLog):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.log = log
        self.tokenizer = load_tokenizer()
        self.task = make_task(cfg.rollout.env, **cfg.rollout.task_kwargs)
        self.actor: RoleGroup | None = None
        self.critic: RoleGroup | None = None
        self.engines: list[EngineProcess] = []
        self.clients: list[EngineClient] = []
        self.loops: list[AgentLoop] = []
        self.sync_port = free_port()

    @classmethod
    async def start(cls, cfg: SAOConfig, run_dir: Path, state: RunState, log: RunLog) -> Services:
        init_ray(os.environ.get("SAO_RAY_ADDRESS"))  # set by launch/slurm: join the job's Ray cluster
        svc = cls(cfg, run_dir, log)
        svc.actor = RoleGroup("actor", cfg)
        checkpoint = RunState.checkpoint_dir(run_dir)
        if state.stage != "sft" and (checkpoint / "actor").exists():
            await svc.actor.call("load", str(checkpoint / "actor"))
        if state.stage != "sft":
            await svc.ensure_critic()
        return svc

    async def ensure_critic(self) -> None:
        """Build the critic (after SFT): from the actor's weights, or from its own checkpoint."""
        if self.critic is not None or not uses_critic(self.cfg.algo):
            return
        checkpoint = RunState.checkpoint_dir(self.run_dir) / "critic"
        actor_state = None
        if self.cfg.critic.init_from_actor and not checkpoint.exists():
            actor_state = await self.actor.call("full_state")
        self.critic = RoleGroup("critic", self.cfg, actor_state)
        if checkpoint.exists():
            await self.critic.call("load", str(checkpoint))

    async def start_rollouts(self, state: RunState) -> None:
        """Export the current policy, start the engines from it and connect the weight sync."""
        hf_dir = self.run_dir / "hf" / "policy"
        await self.actor.call("export_hf", str(hf_dir))
        r = self.cfg.rollout
        specs = [EngineSpec(model_path=str(hf_dir), port=free_port(), tensor_parallel=r.tensor_parallel,
                            expert_parallel=r.expert_parallel, dtype=r.dtype, max_total_tokens=r.max_total_tokens,
                            random_seed=self.cfg.run.seed + i, log_path=str(self.run_dir / "logs" / f"engine{i}.log"))
                 for i in range(r.num_engines)]  # fmt: skip
        if on_cluster():  # on the rollout node group, via Ray (the run directory is on a shared filesystem)
            gpus = r.tensor_parallel if self.cfg.cluster.gpus_per_node else 0
            self.engines = [RemoteEngine(spec, gpus) for spec in specs]
        else:
            self.engines = [EngineProcess(spec).start() for spec in specs]
        await asyncio.gather(*(asyncio.to_thread(e.wait_healthy) for e in self.engines))
        self.sync_address = "127.0.0.1"
        if on_cluster():
            self.sync_address = await self.actor.ranks[0].node_ip.remote()
        for i, engine in enumerate(self.engines):
            client = await EngineClient(engine.url).__aenter__()
            self.clients.append(client)
            self.loops.append(
                AgentLoop(client, self.tokenizer, loop_config(self.cfg), engine_name=f"engine{i}")
            )
        await self.sync_weights(state.version)  # forms the broadcast group; labels tokens with ints

    async def sync_weights(self, version: int) -> dict:
        if self.cfg.rollout.weight_sync == "disk":
            hf_dir = self.run_dir / "hf" / "policy"
            report = await self.actor.call("export_hf", str(hf_dir))
            await asyncio.gather(
                *(c.update_weights_from_disk(str(hf_dir), str(version)) for c in self.clients)
            )
            return {"time/sync_s": report["seconds"]}
        report = await self.actor.call("sync_weights", [e.url for e in self.engines], version, self.sync_port,
                                       self.sync_address)  # fmt: skip
        return {f"time/{k}": v for k, v in report.items()}

    def manager(self, on_finished, cursor_state: dict, max_concurrent: int | None = None) -> RolloutManager:
        a = self.cfg.algo
        manager = RolloutManager(self.loops, self.task, self.cfg.rollout.env, on_finished, group_size=a.group_size,
                                 max_concurrent=max_concurrent or self.cfg.rollout.max_concurrent,
                                 env_kwargs=self.cfg.rollout.env_kwargs, cursor=PromptCursor("train", 0))  # fmt: skip
        if cursor_state:
            manager.load_state_dict(cursor_state)
        return manager

    async def evaluate(self) -> dict[str, float]:
        """Episodes on the first ``eval_prompts`` held-out prompts at ``train.eval_temperature``."""
        n = self.cfg.train.eval_prompts
        if n <= 0 or not self.loops:
            return {}
        loops = [AgentLoop(c, self.tokenizer, loop_config(self.cfg, temperature=self.cfg.train.eval_temperature), engine_name=f"eval{i}")
                 for i, c in enumerate(self.clients)]  # fmt: skip
        sem = asyncio.Semaphore(self.cfg.rollout.max_concurrent)

        async def one(i: int):
            async with sem:
                env = make_env(self.cfg.rollout.env, **self.cfg.rollout.env_kwargs)
                return await loops[i % len(loops)].run(
                    env, self.task.get("heldout", i), split="heldout", index=i
                )

        results = await asyncio.gather(*(one(i) for i in range(n)))
        ok = [t for t in results if t.status != "failed"]
        return {
            "eval/accuracy": sum(bool(t.correct) for t in results) / n,
            "eval/reward": sum(t.reward for t in results) / n,
            "eval/failed": float(n - len(ok)),
            "eval/turns": sum(t.num_turns for t in results) / n,
        }

    async def checkpoint(self, state: RunState, manager=None, buffer=None, advantages=None) -> None:
        """Write actor, critic and run state into a staging directory, then publish it."""
        staging = RunState.staging_dir(self.run_dir)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        await self.actor.call("save", str(staging / "actor"))
        if self.critic is not None:
            await self.critic.call("save", str(staging / "critic"))
        snapshot = replace(state)
        if manager is not None:
            snapshot.cursor = manager.state_dict()
        if buffer is not None:
            snapshot.buffer = buffer.state_dict()
        if advantages is not None:
            snapshot.advantages = advantages.state_dict()
        snapshot.save(self.run_dir, staging)
        RunState.publish(self.run_dir)
        state.cursor, state.buffer, state.advantages = snapshot.cursor, snapshot.buffer, snapshot.advantages

    async def shutdown(self) -> None:
        for client in self.clients:
            await client.close()
        for engine in self.engines:
            engine.stop()
        for group in (self.actor, self.critic):
            if group is not None:
                group.shutdown()
