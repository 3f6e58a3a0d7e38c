"""Routing replay's cost in the actor on CPU, side by side in one process (``benchmarks.gpu.cases.replay_case``).

    .venv/bin/python -m benchmarks.bench_replay [--rows 32] [--steps 10] [--experts 8 --topk 2]

The tiny MoE (4 layers) on a ragged batch shaped like ``make run``'s (32 trajectories of 60-200
tokens, 3 turns), one rank: seconds per actor update and per logprob pass with a random routing
replayed vs without routes, interleaved step by step so drift on a shared machine hits both alike;
the ratios of the medians, and the bytes the routes add to the batch the driver ships each step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from benchmarks.gpu import cases
from benchmarks.gpu.workload import BatchShape
from sao_megatron.spawn import run_world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    args = parser.parse_args()
    spec = {
        "model": {"num_experts": args.experts, "moe_router_topk": args.topk},
        "batch": dataclasses.asdict(BatchShape(rows=args.rows, min_len=60, max_len=200, turns=3, vocab=512)),
        "micro_batch_size": 8,
        "bf16": False,
        "steps": args.steps,
    }
    out = run_world(cases.replay_case, 1, spec, backend="gloo", timeout_s=3600)[0]
    for kind in ("update_s", "logprobs_s"):
        out[kind] = {k: statistics.median(v) for k, v in out[kind].items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
