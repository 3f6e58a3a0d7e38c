"""Where in a run's RL steps the prompt cursor crossed given prompt indices (a reward phase keyed to
the data, ``arith_tool``'s ``phase_boundaries``), for every run of a sweep's out_dir or snapshot.

Two readings per index, from each run's ``metrics.jsonl``:
- *started*: the first step by which an episode at or past the index had started. The episodes
  started when step k's batch was taken are the ones trained so far (k x batch), the ones waiting,
  the ones dropped as stale and the ones in flight (``buffer/*``, ``rollout/in_flight_at_take``;
  without the last, a lower bound on the count and so a late step).
- *trained*: the first step whose batch's mean prompt index (``rollout/prompt_index``) is at or
  past it: from there most of a batch is of the new phase (``-`` where the run predates the metric).

    .venv/bin/python tools/cursor_steps.py benchmarks/results/sweeps/adaptation --index 480 --index 960
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sao_megatron.observe import read_metrics

STARTED = ("buffer/dropped_stale", "buffer/waiting", "rollout/in_flight_at_take")


def crossings(rows: list[dict], index: int, batch_size: int | None = None) -> tuple[int | None, int | None]:
    """(first step by which an episode at or past ``index`` had started, first step whose batch's mean
    prompt index reached it); None where never, or (trained) where the metric is missing.
    ``batch_size``: trajectories a step trains, where a row lacks ``rollout/batch_size``."""
    started = trained = None
    trained_so_far = 0.0
    for r in rows:
        if r.get("stage") != "rl":
            continue
        size = r.get("rollout/batch_size", batch_size)
        if size is None:
            raise ValueError(f"step {r.get('step')}: no rollout/batch_size in the row; pass --batch-size")
        trained_so_far += size
        count = trained_so_far + sum(r.get(k, 0.0) for k in STARTED)
        if started is None and count > index:
            started = int(r["step"])
        mean = r.get("rollout/prompt_index")
        if trained is None and mean is not None and mean == mean and mean >= index:
            trained = int(r["step"])
    return started, trained


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a sweep's out_dir or its snapshot (<arm>/seed<s>/metrics.jsonl)")
    p.add_argument("--index", type=int, action="append", required=True, help="a prompt index (repeatable)")
    p.add_argument("--batch-size", type=int, help="trajectories per step, for rows without rollout/batch_size")
    args = p.parse_args()
    runs = sorted(args.dir.glob("*/seed*/metrics.jsonl"))
    if not runs:
        raise SystemExit(f"{args.dir}: no <arm>/seed<s>/metrics.jsonl under it")
    print("run | " + " | ".join(f"index {i}: started by step / trained from step" for i in args.index))
    for metrics in runs:
        rows = read_metrics(metrics.parent)  # a resumed run's repeated steps once, as sao compare reads them
        if not any(r.get("stage") == "rl" for r in rows):
            continue  # a shared start: no RL steps
        cells = []
        for index in args.index:
            started, trained = crossings(rows, index, args.batch_size)
            cells.append(f"{'-' if started is None else started} / {'-' if trained is None else trained}")
        print(f"{metrics.parent.parent.name} {metrics.parent.name} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
