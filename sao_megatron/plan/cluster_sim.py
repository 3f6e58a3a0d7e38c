"""``sao simulate``: the pipeline simulator at a config's cluster scale, and the best GPU split.

The engine and learner models of :mod:`sao_megatron.plan.simulate` are derived from the config
(its model's parameter counts, ``sao plan``'s engine memory, the layouts) and a GPU description::

    engine iteration  = weights per GPU / (HBM GB/s * eff)                     (step_s)
                      + n * (KV bytes of a mean context / GPUs + 2 * active FLOPs / GPUs / (peak * mfu))
    learner step      = critic values (2 N_active tokens) + max(actor update 6 N tokens,
                        K critic updates (4 N_frozen + 6 N_trained) tokens) over each role's GPUs at
                        ``peak * mfu``, + the weight sync (sync bytes / rollout.weight_sync_gb_per_s)

These are roofline-style assumptions, printed as such: no GPU has measured them for this
project. Once the GPU check (``benchmarks/gpu/run.sh``) has run, pass its measured MFU and peak
(``--mfu``, ``--peak-tflops``). The workload is a ``longtail`` episode distribution
(``--turns``, ``--tokens``, ``--tool-latency-s``, ``--sigma``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.config import SAOConfig
from sao_megatron.models.counting import parameter_counts
from sao_megatron.plan.simulate import SCHEMES, EngineModel, LearnerModel, Scheme, Shape, SimResult, simulate


@dataclass(frozen=True)
class Gpu:
    """What the models assume of one GPU (defaults: H100 SXM, dense bf16)."""

    hbm_gb_per_s: float = 3350.0
    peak_tflops: float = 989.0
    mfu: float = 0.35
    """Training MFU of actor and critic steps."""
    decode_mfu: float = 0.2
    bandwidth_eff: float = 0.6
    request_s: float = 0.05
    """Per turn: HTTP, scheduling and the prefill of the new observation."""


@dataclass(frozen=True)
class Split:
    actor_gpus: int
    critic_gpus: int
    engines: int
    gpus_per_engine: int

    @property
    def gpus(self) -> int:
        return self.actor_gpus + self.critic_gpus + self.engines * self.gpus_per_engine


def engine_model(cfg: SAOConfig, gpu: Gpu, mean_context: float) -> EngineModel:
    from sao_megatron.plan.memory import engine_memory

    e = engine_memory(cfg)
    counts = parameter_counts(cfg.model)
    bw = gpu.hbm_gb_per_s * 1e9 * gpu.bandwidth_eff
    per_seq = mean_context * e.kv_bytes_per_token / bw + 2 * counts["active"] / e.gpus_per_engine / (
        gpu.peak_tflops * 1e12 * gpu.decode_mfu
    )
    return EngineModel(step_s=e.weights / bw, per_seq_s=per_seq, request_s=gpu.request_s)


def learner_model(cfg: SAOConfig, gpu: Gpu, split: Split, tokens_per_step: float, critic: bool) -> LearnerModel:
    from sao_megatron.plan.memory import engine_memory

    n = parameter_counts(cfg.model)["active"]
    flops = gpu.peak_tflops * 1e12 * gpu.mfu
    actor = 6 * n * tokens_per_step / (split.actor_gpus * flops)
    step = actor
    if critic:
        values = 2 * n * tokens_per_step / (split.critic_gpus * flops)
        updates = (
            cfg.critic.updates_per_step * 5 * n * tokens_per_step / (split.critic_gpus * flops)
        )  # frozen attention
        step = values + max(actor, updates)
    sync = engine_memory(cfg).sync_bytes / (cfg.rollout.weight_sync_gb_per_s * 1e9)
    return LearnerModel(step_s=step + sync, sync_pause_s=sync, engine_speed=1.0)


def candidate_splits(cfg: SAOConfig, critic: bool) -> list[Split]:
    """The config's total GPUs, split between roles in steps of each role's model-parallel size
    (actor and critic keep their configured sizes' ratio; engines keep their GPUs each)."""
    a, c = cfg.actor.parallel.world_size, cfg.critic.parallel.world_size if critic else 0
    per_engine = cfg.rollout.tensor_parallel
    total = a + c + cfg.rollout.num_engines * per_engine
    a_unit = max(1, cfg.actor.parallel.world_size // max(1, cfg.actor.parallel.data_parallel))
    c_unit = max(1, cfg.critic.parallel.world_size // max(1, cfg.critic.parallel.data_parallel)) if critic else 0
    out = []
    for tenths in range(1, 10):
        learner = total * tenths // 10
        ratio = a / (a + c) if critic else 1.0
        actor = max(a_unit, int(learner * ratio) // a_unit * a_unit)
        crit = max(c_unit, (learner - actor) // c_unit * c_unit) if critic else 0
        engines = (total - actor - crit) // per_engine
        if engines >= 1:
            out.append(Split(actor, crit, engines, per_engine))
    configured = Split(a, c, cfg.rollout.num_engines, per_engine)
    return sorted(set(out) | {configured}, key=lambda s: (s.engines, s.actor_gpus))


def simulate_cluster(
    cfg: SAOConfig,
    gpu: Gpu,
    shape,
    split: Split,
    mean_tokens: float,
    mean_context: float,
    scheme: Scheme,
    steps: int,
    warmup: int,
    concurrency_per_engine: int,
) -> SimResult:
    critic = scheme == "sao"
    batch, group = cfg.algo.batch_size, 1 if scheme == "sao" else max(2, cfg.algo.group_size)
    learner = learner_model(cfg, gpu, split, batch * mean_tokens, critic)
    return simulate(
        scheme,
        engine_model(cfg, gpu, mean_context),
        learner,
        shape,  # type: ignore[arg-type]
        engines=split.engines,
        batch_size=batch,
        group_size=group,
        max_concurrent=concurrency_per_engine * split.engines,
        max_lag=cfg.algo.max_policy_lag,
        steps=steps,
        warmup=warmup,
    )


def schemes_at(
    cfg: SAOConfig,
    gpu: Gpu,
    shape,
    split: Split,
    mean_tokens: float,
    mean_context: float,
    steps: int,
    warmup: int,
    concurrency_per_engine: int,
) -> dict[str, SimResult]:
    return {
        s: simulate_cluster(cfg, gpu, shape, split, mean_tokens, mean_context, s, steps, warmup, concurrency_per_engine)
        for s in SCHEMES
    }


def shape_stats(shape, n: int = 2000) -> tuple[float, float]:
    """Mean action tokens per episode and mean context (tokens) over ``n`` episodes of ``shape``."""
    episodes: list[Shape] = [shape(i, 0) for i in range(n)]
    tokens = [sum(t) for t, _ in episodes]
    return sum(tokens) / n, sum(tokens) / n / 2 + 512  # half an episode plus a prompt, on average


def report(cfg: SAOConfig, args) -> int:
    """``sao simulate``: sync GRPO, async GRPO and SAO at the config's GPU split, then SAO at other
    splits of the same GPUs; the best one within ``args.lag_bound`` (exit 1 when none is).
    ``args``: the CLI's workload and GPU flags."""
    from sao_megatron.envs.longtail import LongTailTask

    gpu = Gpu(hbm_gb_per_s=args.hbm_gb_per_s, peak_tflops=args.peak_tflops, mfu=args.mfu)
    shape = LongTailTask(
        turns_median=args.turns,
        turns_sigma=args.sigma,
        max_turns=cfg.rollout.loop.max_turns,
        tokens_median=args.tokens,
        tokens_sigma=args.sigma,
        max_tokens=cfg.rollout.loop.max_new_tokens,
        tool_latency_s=args.tool_latency_s,
        tool_sigma=args.sigma,
        max_tool_latency_s=max(args.tool_latency_s, 600.0),
    ).shape

    mean_tokens, mean_context = shape_stats(shape)
    critic = cfg.critic.parallel.world_size
    configured = Split(cfg.actor.parallel.world_size, critic, cfg.rollout.num_engines, cfg.rollout.tensor_parallel)
    per_engine = max(1, cfg.rollout.max_concurrent // cfg.rollout.num_engines)
    print(
        f"# sao simulate: {cfg.run.name}, {configured.gpus} GPUs (assumed GPU: {gpu}); workload: lognormal "
        f"sigma {args.sigma:g}, median {args.turns:g} turns x {args.tokens:g} tokens, tools {args.tool_latency_s:g} s; "
        f"mean {mean_tokens:,.0f} action tokens per episode; {per_engine} episodes in flight per engine"
    )
    print(
        "| scheme | traj/s | tokens/s | engines generating | learner idle | lag mean | lag 0 / 1 / 2 / 3+ | stale dropped |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for scheme, r in schemes_at(
        cfg, gpu, shape, configured, mean_tokens, mean_context, args.steps, args.warmup, per_engine
    ).items():
        print(
            f"| {scheme} | {r.trajectories_per_s:.3f} | {r.tokens_per_s:,.0f} | {r.engine_generating:.2f} | "
            f"{r.learner_idle:.2f} | {r.lag_mean:.2f} | {' / '.join(f'{v:.2f}' for v in r.lag_shares())} | "
            f"{r.dropped_stale} |"
        )
    print(f"\nSAO at other splits of the same {configured.gpus} GPUs (mean lag bound {args.lag_bound:g}):")
    print("| actor GPUs | critic GPUs | engines x GPUs | traj/s | tokens/s | lag mean | lag p90 | within bound |")
    print("|---|---|---|---|---|---|---|---|")
    best = None
    for split in candidate_splits(cfg, critic=True):
        r = simulate_cluster(
            cfg, gpu, shape, split, mean_tokens, mean_context, "sao", args.steps, args.warmup, per_engine
        )
        ok = r.lag_mean <= args.lag_bound
        mark = " (configured)" if split == configured else ""
        print(
            f"| {split.actor_gpus}{mark} | {split.critic_gpus} | {split.engines} x {split.gpus_per_engine} | "
            f"{r.trajectories_per_s:.3f} | {r.tokens_per_s:,.0f} | {r.lag_mean:.2f} | {r.lag_quantile(0.9)} | "
            f"{'yes' if ok else 'no'} |"
        )
        if ok and (best is None or r.tokens_per_s > best[1].tokens_per_s):
            best = (split, r)
    if best is None:
        print(f"no split keeps the mean lag within {args.lag_bound:g}")
        return 1
    split, r = best
    print(
        f"\nbest within the bound: actor {split.actor_gpus}, critic {split.critic_gpus}, {split.engines} engines x "
        f"{split.gpus_per_engine} GPUs: {r.tokens_per_s:,.0f} tokens/s, mean lag {r.lag_mean:.2f}"
    )
    return 0
