"""Run directory outputs: ``metrics.jsonl`` (one line per step), TensorBoard events, sampled
trajectories as text, and live progress in the terminal.

Metric names are ``group/name`` (``rollout/``, ``buffer/``, ``actor/``, ``critic/``, ``dis/``,
``lag/``, ``time/``, ``eval/``); values are python floats.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sao_megatron.records import Trajectory

if TYPE_CHECKING:
    from rich.progress import TaskID


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
    header = (
        f"# prompt {t.prompt_id} status={t.status} reward={t.reward:.3f} correct={t.correct} "
        f"turns={t.num_turns} action_tokens={t.num_action_tokens} {t.status_reason}"
    )
    return header + "\n" + "".join(parts) + "\n"


class RunLog:
    """Writes one run directory; safe to reopen for a resumed run (files are appended)."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        console: bool = True,
        wandb_project: str = "",
        config: dict | None = None,
    ):
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
        self.wandb = None
        if wandb_project:
            try:
                import wandb  # pyright: ignore[reportMissingImports]  # optional, not in the pinned env
            except ImportError as err:
                raise RuntimeError(
                    f"run.wandb_project={wandb_project!r} but wandb is not installed; "
                    "pip install wandb or leave run.wandb_project empty"
                ) from err
            self.wandb = wandb.init(
                project=wandb_project,
                dir=str(self.dir),
                config=config or {},
                name=self.dir.name,
                resume="allow",
                id=self.dir.name,
            )
        self.console = console
        self._progress = None
        self._tasks: dict[str, TaskID] = {}

    def set_total(self, stage: str, total: int) -> None:
        """Show a live progress bar for ``stage`` (terminals only; logs stay line-based)."""
        if not self.console or total <= 0 or not sys.stdout.isatty():
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=False,
            )
            self._progress.start()
        self._tasks[stage] = self._progress.add_task(stage, total=total)

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        record = {"step": step, "stage": stage, "time": time.time() - self.t0, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{stage}/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{stage}/{k}" if "/" not in k else k: v for k, v in metrics.items()})
        if self.console:
            line = self.line(step, stage, metrics)
            if self._progress is not None and stage in self._tasks:
                self._progress.update(self._tasks[stage], completed=step, description=line)
            else:
                print(line, flush=True)

    @staticmethod
    def line(step: int, stage: str, m: dict[str, float]) -> str:
        keys = [
            ("rollout/reward", "reward"),
            ("rollout/accuracy", "acc"),
            ("eval/accuracy", "eval_acc"),
            ("sft/nll", "nll"),
            ("critic/explained_var", "ev"),
            ("critic/value_loss", "vloss"),
            ("actor/kept_frac", "kept"),
            ("lag/mean", "lag"),
            ("time/step_s", "s/step"),
        ]
        shown = " ".join(f"{short}={m[k]:.3f}" for k, short in keys if k in m)
        return f"[{stage} {step:4d}] {shown}"

    def samples(self, step: int, trajectories: list[Trajectory], tokenizer, n: int) -> None:
        if n <= 0:
            return
        with self.samples_path.open("a") as f:
            for t in trajectories[:n]:
                f.write(f"## step {step}\n{render_trajectory(t, tokenizer)}\n")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` in file order, one per (stage, step).

    The file is append-only across resumes: a run killed after it logged a step but before that
    step's checkpoint logs it again once resumed (the first attempt's effects were lost with it).
    The last record of a (stage, step) is the one kept, in its place; the file keeps both."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = {(r.get("stage"), r.get("step")): i for i, r in enumerate(records)}
    return [r for i, r in enumerate(records) if last[(r.get("stage"), r.get("step"))] == i]
