"""``rollout.update_policy`` measured: the same workload under ``retract``, ``in_place`` and ``abort``
in one process, against one CPU SGLang engine serving the tiny MoE (float32), runs interleaved.

Workload (the same for every run, ``--seed``): ``--episodes`` longtail episodes (exact action lengths,
``sao_megatron/envs/longtail.py``) within the tiny config's loop limits (``configs/tiny_cpu.yaml``:
3 turns, 24 new tokens an action), ``--concurrency`` in flight (a new one starts as one ends), while
a broadcast weight sync (``WeightSync.update``, the coordinator's ``EngineControl``) pushes the next
version every ``--sync-every`` seconds until the last episode ends. Version k's weights are the tiny
model's plus k steps of one fixed Gaussian direction (``--step-std`` per element), like a learner
that moves the weights a little each step.

Per policy, over ``--rounds`` rounds (each round runs the three policies, in a rotated order, so a
drift of the machine's speed spreads over them): trajectories/s (and its ratio to ``retract`` in the
same round: the figure to compare; absolute rates move with the machine's load), syncs, engine pause
per sync (``SyncReport.paused_s``: the pause request to the resume's answer), context tokens prefilled
again per sync and generations resubmitted per sync (``EpisodeStats.prefill_recomputed``,
``resubmitted``), the share of action tokens sampled on stale KV (``Trajectory.stale_kv``) and the
DIS kept fraction: the share of action tokens inside DIS's band (``algo.dis_band``, the tiny config's
``eps_low`` / ``eps_high``) when the learner's logprobs are the engine's fresh scores under the
weights of the trajectory's newest version (a learner one step ahead of the last token: lag 0).
The scores are taken after every run, on an idle engine with a flushed cache.

    .venv/bin/python benchmarks/bench_update_policy.py --rounds 6   # docs/PERFORMANCE.md's table (~6.5 min)
    .venv/bin/python benchmarks/bench_update_policy.py --quick    # smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sao_megatron.algo.policy_loss import dis_band  # noqa: E402
from sao_megatron.config import UpdatePolicy, load_config  # noqa: E402
from sao_megatron.envs.longtail import LongTailEnv, LongTailTask  # noqa: E402
from sao_megatron.records import Trajectory  # noqa: E402
from sao_megatron.rollout.agent_loop import AgentLoop  # noqa: E402
from sao_megatron.rollout.client import EngineClient  # noqa: E402
from sao_megatron.rollout.engine import EngineProcess, EngineSpec  # noqa: E402
from sao_megatron.spawn import free_port  # noqa: E402
from sao_megatron.tokenizer import load_tokenizer  # noqa: E402
from sao_megatron.weight_sync import WeightSync  # noqa: E402

POLICIES: tuple[UpdatePolicy, ...] = ("retract", "in_place", "abort")


class Versions:
    """Version k's HF tensors: the base model plus k times one seeded Gaussian step."""

    def __init__(self, base: dict[str, torch.Tensor], step_std: float, seed: int, bucket_tensors: int = 16):
        gen = torch.Generator().manual_seed(seed)
        self.base = base
        self.step = {n: torch.randn(t.shape, generator=gen) * step_std for n, t in sorted(base.items())}
        self.bucket_tensors = bucket_tensors

    def buckets(self, k: int) -> list[list[tuple[str, torch.Tensor]]]:
        names = sorted(self.base)
        tensors = [(n, self.base[n] + k * self.step[n]) for n in names]
        return [tensors[i : i + self.bucket_tensors] for i in range(0, len(tensors), self.bucket_tensors)]


@dataclass
class Run:
    policy: UpdatePolicy
    first_version: int
    wall_s: float = 0.0
    trajectories: list[Trajectory] = field(default_factory=list)
    pauses_s: list[float] = field(default_factory=list)
    caches_kept: int = 0


async def one_run(
    client: EngineClient, sync: WeightSync, versions: Versions, policy: UpdatePolicy, first: int, args
) -> Run:
    """Reset the engine to step 0 (labelled ``first``), then the workload with a sync every ``sync_every`` s."""
    cfg = load_config()
    sync.policy = "retract"
    await sync.update(versions.buckets(0), version=first)  # idle: the cache is flushed
    client.cache_version = first
    sync.policy = policy
    run = Run(policy, first)
    loop = AgentLoop(client, load_tokenizer(), cfg.rollout.loop, update_policy=policy)
    task = LongTailTask(
        turns_median=args.turns_median,
        max_turns=cfg.rollout.loop.max_turns,
        tokens_median=args.tokens_median,
        tokens_sigma=0.5,
        max_tokens=cfg.rollout.loop.max_new_tokens,
        tool_latency_s=args.tool_latency_s,
        tool_sigma=0.5,
        seed=args.seed,
    )
    slots = asyncio.Semaphore(args.concurrency)

    async def episode(i: int) -> Trajectory:
        async with slots:
            return await loop.run(LongTailEnv(seed=args.seed), task.get("train", i), index=i)

    t0 = time.perf_counter()
    episodes = asyncio.ensure_future(asyncio.gather(*(episode(i) for i in range(args.episodes))))
    k = 0
    while not episodes.done():
        await asyncio.wait([episodes], timeout=args.sync_every)
        if episodes.done():
            break
        k += 1
        report = await sync.update(versions.buckets(k), version=first + k)
        run.pauses_s.append(report.paused_s)
        run.caches_kept += report.caches_kept
        if not report.caches_kept:
            client.cache_version = first + k
    run.trajectories = episodes.result()
    run.wall_s = time.perf_counter() - t0
    return run


async def fresh_scores(client: EngineClient, sync: WeightSync, versions: Versions, runs: list[Run]) -> dict:
    """``(run index, trajectory index) -> logprobs`` of its response under its newest version's weights."""
    by_step: dict[int, list[tuple[int, int, Trajectory]]] = defaultdict(list)
    for r, run in enumerate(runs):
        for i, t in enumerate(run.trajectories):
            if t.num_action_tokens:  # a failed episode may have none
                by_step[t.max_version - run.first_version].append((r, i, t))
    scores: dict[tuple[int, int], list[float]] = {}
    slots = asyncio.Semaphore(32)
    sync.policy = "retract"
    for step, items in sorted(by_step.items()):
        await sync.update(versions.buckets(step), version=10_000 + step)  # idle: flushed once

        async def score(t: Trajectory) -> list[float]:
            async with slots:
                return await client.score(t.prompt_ids + t.response_ids, len(t.prompt_ids))

        got = await asyncio.gather(*(score(t) for _, _, t in items))
        scores.update({(r, i): s for (r, i, _), s in zip(items, got, strict=True)})
    return scores


def summarise(runs: list[Run], scores: dict, eps_low: float, eps_high: float) -> dict[str, dict[str, float]]:
    per_policy: dict[str, dict[str, list[float]]] = {p: defaultdict(list) for p in POLICIES}
    for r, run in enumerate(runs):
        trajs = run.trajectories
        syncs = max(1, len(run.pauses_s))
        actions = sum(t.num_action_tokens for t in trajs)
        kept = stale_kept = stale = 0
        for i, t in enumerate(trajs):
            if not t.num_action_tokens:
                continue
            mask = torch.tensor(t.action_mask, dtype=torch.bool)
            band = dis_band(torch.tensor(scores[(r, i)]), torch.tensor(t.behavior_logprobs), eps_low, eps_high)
            stale_mask = torch.zeros_like(mask)
            for span in t.stale_kv:
                stale_mask[span.start : span.end] = True
            kept += int((band & mask).sum())
            stale += int(stale_mask.sum())
            stale_kept += int((band & stale_mask).sum())
        m = per_policy[run.policy]
        m["trajectories_per_s"].append(len(trajs) / run.wall_s)
        m["syncs"].append(float(len(run.pauses_s)))
        m["pause_s_per_sync"].append(statistics.fmean(run.pauses_s) if run.pauses_s else 0.0)
        m["recomputed_per_sync"].append(sum(t.stats.prefill_recomputed for t in trajs) / syncs)
        m["resubmitted_per_sync"].append(sum(t.stats.resubmitted for t in trajs) / syncs)
        m["stale_kv_frac"].append(stale / actions)
        m["dis_kept_frac"].append(kept / actions)
        m["dis_kept_frac_stale"].append(stale_kept / stale if stale else float("nan"))
        m["failed"].append(float(sum(t.status == "failed" for t in trajs)))
        m["episodes"].append(float(len(trajs)))
    rounds = len(per_policy["retract"]["trajectories_per_s"])
    out: dict[str, dict[str, float]] = {}
    for p in POLICIES:
        m = per_policy[p]
        out[p] = {k: statistics.fmean(v) for k, v in m.items()}
        ratios = [m["trajectories_per_s"][j] / per_policy["retract"]["trajectories_per_s"][j] for j in range(rounds)]
        out[p]["throughput_vs_retract"] = statistics.median(ratios)
        out[p]["throughput_vs_retract_min"], out[p]["throughput_vs_retract_max"] = min(ratios), max(ratios)
    return out


def table(summary: dict[str, dict[str, float]]) -> str:
    rows = [
        "| policy | trajectories/s | vs retract (median, min-max) | syncs/run | engine pause/sync (s) "
        "| prefill recomputed/sync (tokens) | resubmitted/sync | stale-KV tokens | DIS kept | DIS kept on stale |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, s in summary.items():
        stale_kept = "-" if s["dis_kept_frac_stale"] != s["dis_kept_frac_stale"] else f"{s['dis_kept_frac_stale']:.4f}"
        rows.append(
            f"| `{p}` | {s['trajectories_per_s']:.2f} | {s['throughput_vs_retract']:.3f} "
            f"({s['throughput_vs_retract_min']:.3f}-{s['throughput_vs_retract_max']:.3f}) | {s['syncs']:.1f} "
            f"| {s['pause_s_per_sync']:.3f} | {s['recomputed_per_sync']:.0f} | {s['resubmitted_per_sync']:.1f} "
            f"| {s['stale_kv_frac']:.4f} | {s['dis_kept_frac']:.4f} | {stale_kept} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=160, help="episodes per run")
    ap.add_argument("--concurrency", type=int, default=48, help="episodes in flight")
    ap.add_argument("--sync-every", type=float, default=1.0, help="seconds between syncs")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the three policies")
    ap.add_argument("--step-std", type=float, default=1e-3, help="per-element std of one version's weight step")
    ap.add_argument("--turns-median", type=float, default=3.0)
    ap.add_argument("--tokens-median", type=float, default=16.0)
    ap.add_argument("--tool-latency-s", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-threads", type=int, default=1, help="the engine's OMP_NUM_THREADS (tiny_cpu.yaml: 1)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--quick", action="store_true", help="smoke size")
    args = ap.parse_args()
    if args.quick:
        args.episodes, args.concurrency, args.rounds = 24, 12, 1

    from safetensors.torch import load_file

    from tests.rollout.engine_fixtures import make_tiny_hf

    cfg = load_config()
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="bench-update-policy-") as tmp:
        model = make_tiny_hf(Path(tmp) / "tiny", seed=args.seed)
        versions = Versions(load_file(str(model / "model.safetensors")), args.step_std, args.seed)
        spec = EngineSpec(
            model_path=str(model),
            port=free_port(),
            dtype=cfg.rollout.dtype,
            max_total_tokens=cfg.rollout.max_total_tokens,
            log_path=str(Path(tmp) / "engine.log"),
            env={"OMP_NUM_THREADS": str(args.engine_threads)},
        )
        t0 = time.perf_counter()
        with EngineProcess(spec) as engine:
            print(f"engine up in {time.perf_counter() - t0:.1f} s", flush=True)

            async def go() -> tuple[list[Run], dict]:
                sync = WeightSync([engine.url], backend="gloo", group_name="bench_update_policy")
                await sync.connect()
                runs: list[Run] = []
                try:
                    async with EngineClient(engine.url) as client:
                        for r in range(args.rounds):
                            for p in POLICIES[r % 3 :] + POLICIES[: r % 3]:
                                run = await one_run(client, sync, versions, p, 1000 * (len(runs) + 1), args)
                                runs.append(run)
                                print(
                                    f"  round {r} {p:8s}: {len(run.trajectories)} episodes in {run.wall_s:.2f} s, "
                                    f"{len(run.pauses_s)} syncs, pause {statistics.fmean(run.pauses_s or [0]):.3f} s",
                                    flush=True,
                                )
                        scores = await fresh_scores(client, sync, versions, runs)
                finally:
                    await sync.close()
                return runs, scores

            runs, scores = asyncio.run(go())
    summary = summarise(runs, scores, cfg.algo.eps_low, cfg.algo.eps_high)
    print(f"\n{command}  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n")
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "args": vars(args), "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
