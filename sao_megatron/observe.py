"""Run directory outputs: ``metrics.jsonl`` (one line per step), TensorBoard events, sampled
trajectories as text, and live progress in the terminal.

Metric names are ``group/name`` (``rollout/``, ``buffer/``, ``actor/``, ``critic/``, ``dis/``,
``lag/``, ``time/``, ``eval/``); values are python floats.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from sao_megatron.records import Trajectory


def render_trajectory(t: Trajectory, tokenizer) -> str:
    """Text with action spans marked ``[[A v=<version>]]...[[/A]]`` and the reward."""
    parts = [tokenizer.decode(t.prompt_ids)]
    i = 0
    for turn in t.turns:
        if turn.start > i:
            parts.append(tokenizer.decode(t.response_ids[i : turn.start]))
        versions = sorted({v for v in t.policy_versions[turn.start : turn.end]})
        parts.append(
            f"[[A v={','.join(map(str, versions))}]]{tokenizer.decode(t.response_ids[turn.start : turn.end])}[[/A]]"
        )
        i = turn.end
    if i < len(t.response_ids):
        parts.append(tokenizer.decode(t.response_ids[i:]))
    header = (f"# prompt {t.prompt_id} status={t.status} reward={t.reward:.3f} correct={t.correct} "
              f"turns={t.num_turns} action_tokens={t.num_action_tokens} {t.status_reason}")  # fmt: skip
    return header + "\n" + "".join(parts) + "\n"


class RunLog:
    """Writes one run directory; safe to reopen for a resumed run (files are appended)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, console: bool = True):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "trajectories.txt"
        self.t0 = time.time()
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tb"))
            except ImportError:
                self.tb = None
        self.console = console

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        record = {"step": step, "stage": stage, "time": time.time() - self.t0, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{stage}/{key}", value, step)
        if self.console:
            print(self.line(step, stage, metrics), flush=True)

    @staticmethod
    def line(step: int, stage: str, m: dict[str, float]) -> str:
        keys = [("rollout/reward", "reward"), ("rollout/accuracy", "acc"), ("eval/accuracy", "eval_acc"),
                ("sft/nll", "nll"), ("critic/explained_var", "ev"), ("critic/value_loss", "vloss"),
                ("actor/kept_frac", "kept"), ("lag/mean", "lag"), ("time/step_s", "s/step")]  # fmt: skip
        shown = " ".join(f"{short}={m[k]:.3f}" for k, short in keys if k in m)
        return f"[{stage} {step:4d}] {shown}"

    def samples(self, step: int, trajectories: list[Trajectory], tokenizer, n: int) -> None:
        if n <= 0:
            return
        with self.samples_path.open("a") as f:
            for t in trajectories[:n]:
                f.write(f"## step {step}\n{render_trajectory(t, tokenizer)}\n")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
