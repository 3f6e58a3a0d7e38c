"""Copy a sweep's results into the repository: each run's ``metrics.jsonl`` reduced to the metrics
docs/RESULTS.md reads (evaluations, reward, lengths, lag, DIS kept fractions, critic fit, timing,
the buffer and what the lag bound selected)
and its ``done.json`` as it is (exit, wall time, UTC start and end, code commit), under
``DEST/<arm>/seed<s>/``. ``sao compare`` runs on the copy as on the original, provenance included,
so every table in docs/RESULTS.md can be recomputed from the repository.

    .venv/bin/python tools/sweep_snapshot.py runs/sweeps/arith benchmarks/results/sweeps/arith
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

KEEP = (
    "eval/",
    "rollout/reward",
    "rollout/accuracy",
    "rollout/response_tokens",
    "rollout/action_tokens",
    "rollout/turns",
    "rollout/truncated",
    "rollout/prompt_index",
    "rollout/batch_size",
    "rollout/in_flight_at_take",
    "lag/",
    "dis/kept_frac/lag",
    "actor/kept_frac",
    "actor/entropy",
    "actor/kl_k3",
    "critic/explained_var",
    "critic/loss",
    "time/",
    "buffer/",
    "select/",
    "actor/stale_masked",
    "rollout/stale_kv_tokens",
    "policy_version",
    "sft/",
)


def snapshot(src: Path, dest: Path) -> tuple[int, float]:
    """Copy every run of ``src``; (runs copied, the sum of their wall times in seconds)."""
    copied, wall_s = 0, 0.0
    for metrics in sorted(src.glob("*/seed*/metrics.jsonl")):
        run = metrics.parent
        out = dest / run.parent.name / run.name
        out.mkdir(parents=True, exist_ok=True)
        with metrics.open() as f, (out / "metrics.jsonl").open("w") as g:
            for line in f:
                r = json.loads(line)
                kept = {k: v for k, v in r.items() if k in ("step", "stage", "time") or k.startswith(KEEP)}
                kept = {k: v for k, v in kept.items() if "/adv_" not in k and not k.endswith("/weight")}
                g.write(json.dumps(kept) + "\n")
        if (run / "done.json").exists():
            shutil.copyfile(run / "done.json", out / "done.json")
            wall_s += float(json.loads((run / "done.json").read_text()).get("wall_s", 0.0))
        copied += 1
    return copied, wall_s


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("src", type=Path, help="a sweep's out_dir")
    p.add_argument("dest", type=Path)
    args = p.parse_args()
    copied, wall_s = snapshot(args.src, args.dest)
    print(f"{copied} runs copied to {args.dest}; together they took {wall_s / 60:.1f} min")


if __name__ == "__main__":
    main()
