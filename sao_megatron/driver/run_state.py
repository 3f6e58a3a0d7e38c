"""Everything besides model/optimizer tensors that a resumed run needs, in one JSON file.

``<run_dir>/checkpoint/`` holds ``state.json`` (this), ``actor/`` and ``critic/`` (Megatron
distributed checkpoints with optimizer, schedule and RNG). A checkpoint is written into a
staging directory and renamed into place, so a run killed while saving keeps the previous one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sao_megatron.faults import kill_point


@dataclass
class RunState:
    stage: str = "sft"
    """``sft`` -> ``value_pretrain`` -> ``rl``: the next stage to run."""
    step: int = 0
    """RL learner steps done."""
    version: int = 0
    """Policy version (actor optimizer steps in RL)."""
    cursor: dict = field(default_factory=dict)
    """Rollout manager state: split, next prompt index, submissions to re-run."""
    buffer: dict = field(default_factory=dict)
    """Ready buffer: waiting trajectories, handed-out ids, counters."""
    advantages: dict = field(default_factory=dict)
    """Running-mean baseline states."""
    initial_eval: dict | None = None
    final_eval: dict | None = None
    trained_prompts: list = field(default_factory=list)
    """(step, split, index, group member) of every trajectory trained, in order."""

    @staticmethod
    def checkpoint_dir(run_dir: Path) -> Path:
        return Path(run_dir) / "checkpoint"

    @staticmethod
    def staging_dir(run_dir: Path) -> Path:
        return Path(run_dir) / "checkpoint.staging"

    def save(self, run_dir: Path, directory: Path | None = None) -> None:
        directory = directory or self.checkpoint_dir(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(directory / "state.json")

    @classmethod
    def complete_checkpoint(cls, run_dir: Path) -> Path | None:
        """The run's latest complete checkpoint directory, or None.

        Complete means published: ``checkpoint/state.json`` (written last into the staging
        directory, after the actor and critic saves returned), or ``checkpoint.old/state.json``
        when a run died between the two renames of :meth:`publish` (:meth:`load` restores it).
        ``checkpoint.staging/`` is never complete, whatever it holds."""
        old, final = Path(run_dir) / "checkpoint.old", cls.checkpoint_dir(run_dir)
        if final.exists():
            return final if (final / "state.json").is_file() else None
        return old if (old / "state.json").is_file() else None

    @classmethod
    def load(cls, run_dir: Path) -> RunState:
        old, final = Path(run_dir) / "checkpoint.old", cls.checkpoint_dir(run_dir)
        if not final.exists() and old.exists():  # killed between the two renames of publish()
            old.rename(final)
        path = final / "state.json"
        if not path.exists():
            raise FileNotFoundError(f"no checkpoint to resume in {run_dir} (missing {path})")
        return cls(**json.loads(path.read_text()))

    @classmethod
    def publish(cls, run_dir: Path) -> None:
        """Atomically replace ``checkpoint/`` by the completed ``checkpoint.staging/``."""
        kill_point("checkpoint:staged")  # the staging directory is complete, nothing published yet
        staging, final = cls.staging_dir(run_dir), cls.checkpoint_dir(run_dir)
        old = Path(run_dir) / "checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
            kill_point("checkpoint:renaming")  # no checkpoint/, the previous one is checkpoint.old/
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
