"""Padding on a long-tail agentic batch: the old layout (every row padded to the batch's longest,
DP by stride) against token-balanced shards with a token budget, padded or packed.

Lengths are lognormal (median 600 tokens, sigma 1.2), clipped to 1..8192, as agentic
trajectories are; the layout is DP 4 with TP 2 (sequence parallel) x CP 2, so micro-batch
lengths divide by 8 and packed sequences by 4. The padding fraction is the share of the tokens
the model computes that are padding, on the worst DP replica (the step waits for it).

    .venv/bin/python benchmarks/bench_padding.py [--batch 256] [--seeds 5] [--budget 8192]
"""

from __future__ import annotations

import argparse
import json
import math
import random

from sao_megatron.batch import MicroBatching, balanced_split


def lognormal_lengths(n: int, seed: int, high: int = 8192) -> list[int]:
    rng = random.Random(seed)
    return [min(high, max(1, round(rng.lognormvariate(math.log(600), 1.2)))) for _ in range(n)]


def worst(lengths: list[int], groups: list[list[int]], how: MicroBatching) -> tuple[float, int, int]:
    """(padding fraction, computed tokens, micro-batches) of the DP replica computing the most."""
    rows = [[lengths[i] for i in g] for g in groups]
    costs = [sum(how.cost([r[i] for i in b]) for b in how.plan(r)) for r in rows]
    k = max(range(len(rows)), key=lambda k: costs[k])
    return how.padding_fraction(rows[k]), costs[k], len(how.plan(rows[k]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    ap.add_argument("--dp", type=int, default=4)
    args = ap.parse_args()
    tp_cp, cp2 = 8, 4
    arms = {
        "rows padded to the batch's longest, DP by stride": ("stride", MicroBatching(rows=args.batch, multiple=tp_cp)),
        "old path: 4 rows per micro-batch, DP by stride (before)": ("stride", MicroBatching(rows=4, multiple=tp_cp)),
        "old path: 1 row per micro-batch, DP by stride": ("stride", MicroBatching(rows=1, multiple=tp_cp)),
        "padded, token budget, DP by tokens": ("tokens", MicroBatching(max_tokens=args.budget, multiple=tp_cp)),
        "packed, token budget, DP by tokens (after)": (
            "tokens",
            MicroBatching(max_tokens=args.budget, multiple=tp_cp, segment_multiple=cp2, pack=True),
        ),
    }
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in arms}
    for seed in range(args.seeds):
        lengths = lognormal_lengths(args.batch, seed)
        for name, (split, how) in arms.items():
            if split == "stride":
                groups = [list(range(d, len(lengths), args.dp)) for d in range(args.dp)]
            else:
                groups = balanced_split(lengths, args.dp)
            results[name].append(worst(lengths, groups, how))
    base = sum(c for _, c, _ in results[next(iter(arms))]) / args.seeds
    print(f"{args.batch} lognormal lengths (1..8192), DP {args.dp}, TP2+SP x CP2, {args.seeds} seeds; worst replica")
    print(f"{'layout':58s} {'padding':>8s} {'tokens computed':>22s} {'micro-batches':>14s}")
    summary = {}
    for name, rs in results.items():
        pad = sum(p for p, _, _ in rs) / len(rs)
        cost = sum(c for _, c, _ in rs) / len(rs)
        micro = sum(m for _, _, m in rs) / len(rs)
        summary[name] = {
            "padding_fraction": pad,
            "tokens_computed": cost,
            "vs_longest": cost / base,
            "micro_batches": micro,
        }
        print(f"{name:58s} {pad:8.1%} {cost:12.0f} ({cost / base:.2f}x) {micro:14.1f}")
    print(json.dumps({"batch": args.batch, "seeds": args.seeds, "budget": args.budget, "dp": args.dp, "arms": summary}))


if __name__ == "__main__":
    main()
