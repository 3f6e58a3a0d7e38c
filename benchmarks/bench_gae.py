"""Benchmark skip-observation GAE: vectorised vs reference loop vs verl's ``compute_gae_advantage_return``.

Workload: B trajectories x T tokens (default 128 x 32768), each row = prompt (observation) followed by
50 turns of (action span, observation span) with random span lengths filling the row; scalar terminal
reward on the last action token; values random. Inputs float64 by default (so "equal results" means
equal up to float64 rounding); ``--dtype float32`` feeds float32 to everyone (ours still computes in
float64 internally and returns float32; verl then computes in float32).

Rows timed:
* ours, lam == lam_critic (one recurrence: the same work as verl);
* ours, decoupled lam_critic = 1.0 (two recurrences, the SAO default);
* ours, length-adaptive lambda (alpha = 1.5) with lam_critic = 1.0;
* ``gae_reference`` (python loop) timed on the first ``--ref-rows`` rows and scaled to the full batch;
* verl (optional, installed with ``pip install --no-deps --target`` into a throwaway dir at run time;
  never vendored). verl always whitens the advantages: we compare our advantages after the same
  masked whitening (``masked_whiten``, unbiased variance, eps 1e-8) and its returns directly, on action
  tokens (verl's outputs on observation tokens carry values we define as 0).

tokens/s counts every position of the [B, T] layout (action + observation tokens).

    .venv/bin/python benchmarks/bench_gae.py            # full size
    .venv/bin/python benchmarks/bench_gae.py --quick    # smoke size
    .venv/bin/python benchmarks/bench_gae.py --no-peer  # skip verl
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from sao_megatron.algo import gae, gae_reference, length_adaptive_lambda, masked_whiten

PEER_DIR = "/tmp/sao_bench_peer"
PEER_PKGS = [
    "verl==0.9.1",
    "tensordict",
    "omegaconf",
    "antlr4-python3-runtime==4.9.3",
    "cloudpickle",
    "orjson",
    "pyvers",
    "codetiming",
]


def make_batch(b: int, t: int, turns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of [prompt obs, (action, obs) x turns] with random span lengths summing to t."""
    g = torch.Generator().manual_seed(seed)
    n_spans = 1 + 2 * turns
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        cuts = torch.randperm(t - 1, generator=g)[: n_spans - 1] + 1  # span starts, random lengths
        span = torch.zeros(t, dtype=torch.long)
        span[cuts] = 1
        span_id = span.cumsum(0)  # 0 = prompt, odd = action, even = observation
        mask[i] = span_id % 2 == 1
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    rewards = (torch.rand(b, generator=g) > 0.5).to(torch.float64)
    return rewards, values, mask


def time_interleaved(fns: dict[str, Callable[[], Any]], repeat: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Best-of-``repeat`` wall time per callable; the callables run round-robin (same machine state)."""
    best = dict.fromkeys(fns, float("inf"))
    out: dict[str, Any] = {}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best, out


def load_peer() -> Callable[..., Any]:
    if not os.path.isdir(os.path.join(PEER_DIR, "verl")):
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", PEER_DIR, *PEER_PKGS]
        print("installing peer:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    sys.path.insert(0, PEER_DIR)
    mod = importlib.import_module("verl.trainer.ppo.core_algos")
    return mod.compute_gae_advantage_return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small size for a smoke run (8 x 4096, 10 turns)")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--ref-rows", type=int, default=4, help="rows timed for the reference loop")
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--gamma", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5, help="best of N, implementations interleaved")
    ap.add_argument("--no-peer", action="store_true", help="skip verl")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64", help="input dtype")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every implementation")
    args = ap.parse_args()
    # One thread by default: on a shared, oversubscribed machine OpenMP thread teams stall unpredictably,
    # and all three implementations then run on one core, which keeps the ratios comparable.
    torch.set_num_threads(args.threads)
    if args.quick:
        args.rows, args.tokens, args.turns, args.ref_rows, args.repeat = 8, 4096, 10, 2, 2
    b, t, r = args.rows, args.tokens, args.ref_rows
    rewards, values, mask = make_batch(b, t, args.turns, seed=0)
    dtype = getattr(torch, args.dtype)
    rewards, values = rewards.to(dtype), values.to(dtype)
    print(
        f"# GAE bench: {b} x {t} tokens, {args.turns} turns/row, {int(mask.sum())} action tokens, "
        f"gamma={args.gamma}, lam={args.lam}, {args.dtype}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, best of {args.repeat}",
        flush=True,
    )
    kw = {"gamma": args.gamma, "lam": args.lam}
    lam_ada = length_adaptive_lambda(mask, 1.5)
    fns: dict[str, Callable[[], Any]] = {
        "same": lambda: gae(rewards, values, mask, lam_critic=args.lam, **kw),
        "dec": lambda: gae(rewards, values, mask, lam_critic=1.0, **kw),
        "ada": lambda: gae(rewards, values, mask, gamma=args.gamma, lam=length_adaptive_lambda(mask, 1.5)),
        "ref": lambda: gae_reference(rewards[:r], values[:r], mask[:r], lam_critic=args.lam, **kw),
    }
    if not args.no_peer:
        verl_gae = load_peer()
        rew_tok = torch.zeros_like(values)
        last = t - 1 - mask.flip(1).to(torch.int8).argmax(1)  # last action token of each row
        rew_tok[torch.arange(b), last] = rewards
        fmask = mask.to(dtype)
        fns["verl"] = lambda: verl_gae(rew_tok, values, fmask, args.gamma, args.lam)
    sec, out = time_interleaved(fns, args.repeat)

    adv, ret, _ = out["same"]
    adv_ref, ret_ref, _ = out["ref"]
    adv_ada_ref, _, _ = gae_reference(rewards[:r], values[:r], mask[:r], gamma=args.gamma, lam=lam_ada[:r])
    m = mask[:r]
    d_ref = max((adv[:r] - adv_ref)[m].abs().max().item(), (ret[:r] - ret_ref)[m].abs().max().item())
    d_ada = (out["ada"][0][:r] - adv_ada_ref)[m].abs().max().item()
    t_ref = sec["ref"] * b / r
    rows = [
        ("ours vectorised, lam_critic = lam", sec["same"], f"{d_ref:.1e} (ref, {r} rows)"),
        ("ours vectorised, lam_critic = 1.0", sec["dec"], "-"),
        ("ours vectorised, adaptive lam (alpha 1.5)", sec["ada"], f"{d_ada:.1e} (ref, {r} rows)"),
        (f"reference loop ({r} rows timed, x{b / r:g})", t_ref, "0 (oracle)"),
    ]
    if not args.no_peer:
        adv_v, ret_v = out["verl"]
        white = masked_whiten(adv, mask)
        d_v = max((adv_v - white)[mask].abs().max().item(), (ret_v - ret)[mask].abs().max().item())
        rows.append(("verl 0.9.1 compute_gae_advantage_return", sec["verl"], f"{d_v:.1e} (whitened adv, returns)"))

    print("\n| impl | seconds (full batch) | tokens/s | speedup vs reference | max abs diff vs ours |")
    print("|---|---|---|---|---|")
    for name, s, diff in rows:
        print(f"| {name} | {s:.3f} | {b * t / s:.3g} | {t_ref / s:.1f}x | {diff} |")
    if not args.no_peer:
        print(f"\nours (lam_critic = lam) is {sec['verl'] / sec['same']:.1f}x faster than verl at equal results")


if __name__ == "__main__":
    main()
