"""``sao train --resume-if-present``: the one place that decides whether a (re)started job resumes.

A checkpoint counts only once published (:meth:`RunState.publish` renames the staging directory
after ``state.json``, written last, is in it); a half-written ``checkpoint.staging/`` never does.
"""

import json

import pytest

from sao_megatron.cli import build_parser, resume_if_present
from sao_megatron.config import ConfigError, load_config
from sao_megatron.driver.run_state import RunState


def _cfg(run_dir):
    return load_config("configs/tiny_cpu.yaml", [f"run.run_dir={run_dir}"])


def _published(run_dir, step: int) -> None:
    staging = RunState.staging_dir(run_dir)
    (staging / "actor").mkdir(parents=True)
    RunState(stage="rl", step=step).save(run_dir, staging)
    RunState.publish(run_dir)


def test_fresh_run_directory_starts_fresh(tmp_path, capsys):
    assert RunState.complete_checkpoint(tmp_path / "run") is None
    assert resume_if_present(_cfg(tmp_path / "run")) is None
    assert "no complete checkpoint" in capsys.readouterr().out


def test_published_checkpoint_is_resumed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    run = tmp_path / "run"
    _published(run, step=3)
    assert RunState.complete_checkpoint(run) == run / "checkpoint"
    assert resume_if_present(_cfg(run)) == run
    out = capsys.readouterr().out
    assert "resuming from the complete checkpoint" in out and "Slurm restart count 1" in out
    assert RunState.load(run).step == 3


def test_half_written_checkpoint_is_never_picked(tmp_path):
    run = tmp_path / "run"
    staging = RunState.staging_dir(run)
    (staging / "actor").mkdir(parents=True)  # killed while the actor was saving
    assert RunState.complete_checkpoint(run) is None
    RunState(step=9).save(run, staging)  # even a complete-looking staging dir is not published
    assert RunState.complete_checkpoint(run) is None
    assert resume_if_present(_cfg(run)) is None


def test_the_previous_checkpoint_survives_a_kill_during_the_next_save(tmp_path):
    run = tmp_path / "run"
    _published(run, step=2)
    (RunState.staging_dir(run) / "actor").mkdir(parents=True)  # the next save, interrupted
    assert RunState.complete_checkpoint(run) == run / "checkpoint"
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 2


def test_killed_between_the_renames_of_publish(tmp_path):
    """``checkpoint/`` was renamed to ``checkpoint.old/`` and the staging one not yet into place."""
    run = tmp_path / "run"
    _published(run, step=4)
    (run / "checkpoint").rename(run / "checkpoint.old")
    assert RunState.complete_checkpoint(run) == run / "checkpoint.old"
    assert resume_if_present(_cfg(run)) == run
    assert RunState.load(run).step == 4 and (run / "checkpoint" / "state.json").is_file()


def test_checkpoint_directory_without_state_is_incomplete(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint" / "actor").mkdir(parents=True)
    (run / "checkpoint.old").mkdir()
    RunState(step=1).save(run, run / "checkpoint.old")  # a stale old copy is not used while checkpoint/ exists
    assert RunState.complete_checkpoint(run) is None


def test_needs_a_run_directory():
    with pytest.raises(ConfigError, match="--resume-if-present needs run.run_dir"):
        resume_if_present(load_config("configs/tiny_cpu.yaml"))


def test_resume_and_resume_if_present_exclude_each_other(capsys):
    assert build_parser().parse_args(["train", "--resume-if-present", "cfg.yaml"]).resume_if_present
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--resume", "RUN", "--resume-if-present"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_sao_train_passes_the_decision_to_the_pipeline(tmp_path, monkeypatch):
    """The batch script's driver command, ``sao train --resume-if-present CONFIG run.run_dir=DIR``:
    a fresh start first, then (once a checkpoint is published) a resume of the same directory."""
    import sys
    import types

    from sao_megatron import cli

    run = tmp_path / "run"
    seen = []

    async def train(cfg, run_dir, resume=False):
        seen.append((run_dir, resume))
        return {"initial": {}, "final": {}}

    monkeypatch.setitem(sys.modules, "sao_megatron.pipeline", types.SimpleNamespace(train=train))
    argv = ["train", "--resume-if-present", "configs/tiny_cpu.yaml", f"run.run_dir={run}"]
    auto = ["train", "--resume", "auto", "configs/tiny_cpu.yaml", f"run.run_dir={run}"]  # the same decision
    assert cli.cmd_train(build_parser().parse_args(argv)) == 0
    assert cli.cmd_train(build_parser().parse_args(auto)) == 0
    _published(run, step=1)
    assert cli.cmd_train(build_parser().parse_args(argv)) == 0
    assert cli.cmd_train(build_parser().parse_args(auto)) == 0
    assert seen == [(run, False), (run, False), (run, True), (run, True)]
