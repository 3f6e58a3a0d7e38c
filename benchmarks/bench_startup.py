"""Start-up of ``sao train``: this checkout against another revision, interleaved in one run.

Each round runs the same tiny run (``train.steps=0``: start Ray, the actor and critic workers and
the engine, the initial evaluation, stop) from this checkout and from a clone of ``--baseline``
(``PYTHONPATH`` points each run, its Ray workers and its engine at its own tree), alternating
which goes first. Reported per side: seconds from launch to the initial evaluation's line and to
exit (medians over the rounds), and this checkout's over the baseline's.

    .venv/bin/python benchmarks/bench_startup.py --baseline 964d16b [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "configs/tiny_cpu.yaml",
    "model.num_layers=2",
    "algo.batch_size=4",
    "rollout.max_concurrent=8",
    "rollout.loop.max_turns=2",
    "rollout.env_kwargs={max_turns: 2}",
    "rollout.loop.max_new_tokens=16",
    "rollout.loop.max_response_tokens=64",
    "train.eval_prompts=4",
    "train.sample_trajectories=1",
    "train.sft_steps=0",
    "train.value_pretrain_steps=0",
    "cluster.cpus_per_rank=0.5",
    "train.steps=0",
]


def _run(tree: Path, run_dir: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_")}
    env["PYTHONPATH"] = str(tree)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sao_megatron.cli", "train", *RUN, f"run.run_dir={run_dir}"],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first_eval, tail = float("nan"), []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if line.startswith("[eval") and first_eval != first_eval:
            first_eval = time.perf_counter() - t0
    rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"{tree}: sao train exited {rc}:\n{''.join(tail)}")
    return {"to_first_eval_s": first_eval, "to_exit_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision to compare against (e.g. 964d16b)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(base)], check=True)
        subprocess.run(["git", "-C", str(base), "checkout", "-q", args.baseline], check=True)
        sides = {"this checkout": ROOT, f"baseline {args.baseline}": base}
        got: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                got[name].append(_run(sides[name], Path(tmp) / f"run-{r}-{len(got[name])}-{name[:4]}"))
                print(f"round {r} {name}: {json.dumps(got[name][-1])}", flush=True)
    summary = {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for name, runs in got.items()}
    this, baseline = summary.values()
    summary["ratio"] = {k: this[k] / baseline[k] for k in this}
    print("| side | to the initial evaluation (s) | to exit (s) |\n|---|---|---|")
    for name, row in summary.items():
        print(f"| {name} | {row['to_first_eval_s']:.1f} | {row['to_exit_s']:.1f} |")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
