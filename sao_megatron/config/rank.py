"""What one trainer rank reads of the run's configuration: only these records cross the Ray boundary.

The driver holds the whole :class:`~sao_megatron.config.schema.SAOConfig`; each actor or critic rank
gets the sections its worker reads (the model shape, its role, the loss settings, the few rollout
settings that concern it), built by :meth:`ActorRankConfig.of` / :meth:`CriticRankConfig.of`. The
sections are the run config's own objects, not copies.
"""

from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.config.schema import (
    ActorConfig,
    AlgoConfig,
    Backend,
    CriticConfig,
    ModelConfig,
    RoutingReplayMode,
    SAOConfig,
    UpdatePolicy,
)


@dataclass(frozen=True)
class ActorRankConfig:
    model: ModelConfig
    actor: ActorConfig
    algo: AlgoConfig
    """The policy loss (``algo.policy_loss``, its clip range and aggregation)."""
    temperature: float
    """``rollout.loop.temperature``: logprobs are taken at the engines' sampling temperature."""
    engine_tp: int
    """``rollout.tensor_parallel``: ranks per engine in the weight-sync group."""
    sync_flat: bool | None
    """``rollout.weight_sync_flat`` (None: resolved by the sync's backend)."""
    sync_bucket_mb: int
    """``rollout.weight_sync_bucket_mb``."""
    sync_timeout_s: float
    """``rollout.weight_sync_timeout_s``."""
    sync_senders: int
    """``rollout.weight_sync_senders``."""
    seed: int
    """``run.seed``."""
    backend: Backend = "auto"
    """``run.backend``."""
    export_timeout_s: float = 0.0
    """``run.export_timeout_s`` (0: sized from the bytes moved and ``export_gb_per_s``)."""
    export_gb_per_s: float = 0.5
    """``run.export_gb_per_s``."""
    export_inflight_mb: int = 1024
    """``run.export_inflight_mb``."""
    update_policy: UpdatePolicy = "retract"
    """``rollout.update_policy``."""
    routing_replay: RoutingReplayMode = "off"
    """``rollout.routing_replay``: the actor's routers replay (``on``) or measure (``record``) the engine's routes."""

    @classmethod
    def of(cls, cfg: SAOConfig) -> ActorRankConfig:
        r = cfg.rollout
        return cls(
            model=cfg.model,
            actor=cfg.actor,
            algo=cfg.algo,
            temperature=r.loop.temperature,
            engine_tp=r.tensor_parallel,
            sync_flat=r.weight_sync_flat,
            sync_bucket_mb=r.weight_sync_bucket_mb,
            sync_timeout_s=r.weight_sync_timeout_s,
            sync_senders=r.weight_sync_senders,
            seed=cfg.run.seed,
            backend=cfg.run.backend,
            export_timeout_s=cfg.run.export_timeout_s,
            export_gb_per_s=cfg.run.export_gb_per_s,
            export_inflight_mb=cfg.run.export_inflight_mb,
            update_policy=r.update_policy,
            routing_replay=r.routing_replay,
        )


@dataclass(frozen=True)
class CriticRankConfig:
    model: ModelConfig
    critic: CriticConfig
    algo: AlgoConfig
    """The value loss (``algo.value_clip``, ...)."""
    seed: int
    """``run.seed``."""
    backend: Backend = "auto"
    """``run.backend``."""

    @classmethod
    def of(cls, cfg: SAOConfig) -> CriticRankConfig:
        return cls(model=cfg.model, critic=cfg.critic, algo=cfg.algo, seed=cfg.run.seed, backend=cfg.run.backend)
