"""Learner overheads: what the driver and the loss add around the models' forward/backward.

Per learner step, timed in one process (a one-rank gloo world) on the same batch:

* overhead: batch assembly (``build_batch``), skip-observation GAE (``algo.gae`` with the
  length-adaptive lambda), the DIS loss and its metrics on tensors of the model's output shape
  (forward and backward of the loss alone, ``kept_by_lag``), and the metric reduction;
* model work: the actor's update (forward, backward, optimizer step; it contains the loss above)
  and the critic's K = 2 updates.

The figure is overhead / model work, at the tiny model and at a ~100M-parameter MoE. CPU figures
(2 shared cores): the models are slow here, so the fraction is a lower bound of what a GPU shows.

    .venv/bin/python benchmarks/bench_learner_overhead.py [--quick] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = {  # name: (model overrides, trajectories, turns per trajectory, tokens per action)
    "tiny (1.9M)": ({}, 16, 6, 24),
    "~100M MoE": (
        {
            "model.hidden_size": 512,
            "model.num_layers": 8,
            "model.num_attention_heads": 8,
            "model.num_query_groups": 4,
            "model.head_dim": 64,
            "model.ffn_hidden_size": 1024,
            "model.num_experts": 8,
            "model.moe_ffn_hidden_size": 1024,
        },
        8,
        6,
        48,
    ),
}


def _trajectories(n: int, turns: int, action: int, seed: int):
    import torch

    from sao_megatron.records import Trajectory, Turn

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(6, 500, (32,), generator=g).tolist()
        resp, mask, spans = [], [], []
        for _ in range(turns):
            a = int(torch.randint(action // 2, action + 1, (1,), generator=g))
            spans.append(Turn(len(resp), len(resp) + a))
            resp += torch.randint(6, 500, (a + 16,), generator=g).tolist()
            mask += [1] * a + [0] * 16
        out.append(
            Trajectory(
                prompt_id=f"p{i}",
                prompt_ids=prompt,
                response_ids=resp,
                action_mask=mask,
                behavior_logprobs=[-2.0 if m else 0.0 for m in mask],
                policy_versions=[0 if m else -1 for m in mask],
                turns=spans,
                reward=float(i % 2),
                status="finished",
            )
        )
    return out


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def case(rank, world, overrides: dict, n: int, turns: int, action: int, reps: int) -> dict:
    import torch

    from sao_megatron import algo
    from sao_megatron.batch import build_batch
    from sao_megatron.config import load_config
    from sao_megatron.config.rank import ActorRankConfig, CriticRankConfig
    from sao_megatron.workers.actor import ActorWorker
    from sao_megatron.workers.critic import CriticWorker
    from sao_megatron.workers.metrics import reduce_metrics

    cfg = load_config(
        None,
        [f"{k}={v}" for k, v in overrides.items()]
        + ["actor.parallel.micro_batch_size=4", "critic.parallel.micro_batch_size=4"],
    )
    actor, critic = ActorWorker(ActorRankConfig.of(cfg)), CriticWorker(CriticRankConfig.of(cfg), "")
    trajectories = _trajectories(n, turns, action, seed=0)
    rows = []
    for _ in range(reps + 1):  # the first round warms up
        batch, t_build = _timed(build_batch, trajectories)
        shard = batch.shard(1)[0]
        mask = batch.action_mask > 0
        values = torch.randn(batch.tokens.shape) * mask
        t0 = time.perf_counter()
        lam = algo.length_adaptive_lambda(mask, alpha=1.5)
        adv, ret, _ = algo.gae(batch.rewards, values, mask, gamma=1.0, lam=lam, lam_critic=1.0)
        t_gae = time.perf_counter() - t0
        logprobs = (batch.behavior_logprobs + 0.01 * torch.randn(batch.tokens.shape)).requires_grad_()
        t0 = time.perf_counter()
        per_micro = []
        for s in range(0, batch.size, 4):  # the actor's micro-batches
            sl = slice(s, s + 4)
            loss, m = algo.policy_loss(
                "dis",
                logprobs[sl],
                batch.behavior_logprobs[sl],
                adv[sl],
                mask[sl],
                agg="token_mean",
                eps_low=0.3,
                eps_high=5.0,
                detach_ratio=False,
                num_tokens_global=float(mask.sum()),
            )
            loss.backward()
            kept = algo.dis_band(logprobs[sl].detach(), batch.behavior_logprobs[sl], 0.3, 5.0)
            m.update(algo.kept_by_lag(kept, torch.zeros_like(batch.policy_versions[sl]), adv[sl], mask[sl]))
            m["micro_tokens"] = float(mask[sl].sum())
            per_micro.append(m)
        reduce_metrics(per_micro, dp=False)
        t_loss = time.perf_counter() - t0
        _, t_actor = _timed(actor.update, shard, adv, 1)
        t_critic = 0.0
        for _ in range(cfg.critic.updates_per_step):
            _, t = _timed(critic.update, shard, ret, values)
            t_critic += t
        rows.append(
            {
                "build": t_build,
                "gae": t_gae,
                "loss_metrics": t_loss,
                "actor": t_actor,
                "critic": t_critic,
                "tokens": int(batch.lengths.sum()),
                "action_tokens": int(mask.sum()),
            }
        )
    params = sum(p.numel() for p in actor.role.module.parameters())
    return {"params": params, "rows": rows[1:]}


def main() -> None:
    from sao_megatron.spawn import run_world

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the tiny model only, 2 reps")
    args = ap.parse_args()
    summary = {}
    for name, (overrides, n, turns, action) in SIZES.items():
        if args.quick and name != "tiny (1.9M)":
            continue
        reps = 2 if args.quick else args.reps
        (result,) = run_world(case, 1, overrides, n, turns, action, reps, backend="gloo", timeout_s=1800)
        rows = result["rows"]
        med = {k: statistics.median(r[k] for r in rows) for k in ("build", "gae", "loss_metrics", "actor", "critic")}
        overhead = med["build"] + med["gae"] + med["loss_metrics"]
        model = med["actor"] + med["critic"]
        summary[name] = {
            **med,
            "params": result["params"],
            "tokens": rows[0]["tokens"],
            "overhead_fraction": overhead / model,
        }
        print(
            f"{name}: {result['params'] / 1e6:.1f}M params, {rows[0]['tokens']} tokens/step; median of "
            f"{len(rows)}: build {med['build'] * 1e3:.1f} ms, GAE {med['gae'] * 1e3:.1f} ms, DIS loss + "
            f"metrics {med['loss_metrics'] * 1e3:.1f} ms | actor update {med['actor']:.2f} s, critic K=2 "
            f"{med['critic']:.2f} s -> overhead {overhead / model:.2%} of model work",
            flush=True,
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
