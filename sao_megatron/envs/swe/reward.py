"""The hidden-test reward of an SWE episode: :func:`compute_reward`.

Given the agent's workspace (a repository materialised from the task, then edited) at the end
of the episode, in this order:

1. **Episode patch**: ``git diff`` of the workspace (untracked files included, ignored ones not)
   against ``base_commit``, without the files ``test_patch`` touches (step 2 replaces them, so
   the agent's edits there never count): the agent's change as it was judged, never containing
   the test patch. Saved with the trajectory.
2. **Test patch**: as the SWE-bench harness does, the files ``test_patch`` touches are first
   restored to the snapshot (the agent cannot pre-empt or weaken the hidden tests), then
   ``test_patch`` is applied with ``git apply`` on top of the agent's other changes. If it does
   not apply, the reward is 0 with that reason.
3. **Tests**: ``python -m pytest FAIL_TO_PASS PASS_TO_PASS`` in one process, through a
   :data:`Runner` (default :func:`local_runner`: a subprocess with a clean environment and a
   wall-clock limit; the sandbox's runner can replace it), and each test's outcome is read
   from pytest's ``-rA`` summary: ``passed``, ``failed``, ``error``, or ``missing`` (not
   reported: not collected, skipped, or the run ended early), all ``timeout`` on a timeout.

Rewards (``mode``):

======================  =========================================================================
``all`` (default)       1 iff every FAIL_TO_PASS and PASS_TO_PASS test passed (SWE-bench
                        "resolved"), else 0
``fail_to_pass_fraction``  passed FAIL_TO_PASS / len(FAIL_TO_PASS), but 0 when any PASS_TO_PASS
                        test did not pass (a fix that breaks working code earns nothing)
``all_tests_fraction``  passed tests / all FAIL_TO_PASS + PASS_TO_PASS tests
======================  =========================================================================

The workspace is modified (test files restored and patched, pytest run in it): call this once,
after the episode.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sao_megatron.envs.base import RewardResult
from sao_megatron.envs.swe.tasks import SWETask, git, patched_paths, trust_repository

Mode = Literal["all", "fail_to_pass_fraction", "all_tests_fraction"]
MODES: tuple[Mode, ...] = ("all", "fail_to_pass_fraction", "all_tests_fraction")
Outcome = Literal["passed", "failed", "error", "missing", "timeout"]
_REPORT = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "XFAIL": "failed", "ERROR": "error"}
_RANK = {"missing": 0, "passed": 1, "failed": 2, "error": 3}  # a test reported twice keeps the worst


@dataclass(frozen=True)
class CommandResult:
    """What a :data:`Runner` returns: exit code (None on timeout), stdout+stderr, and time."""

    returncode: int | None
    output: str
    timed_out: bool
    wall_s: float


Runner = Callable[[Sequence[str], Path, float], CommandResult]
"""``runner(argv, cwd, timeout_s)`` runs one command in the workspace and never raises on its failure."""


def local_runner(argv: Sequence[str], cwd: Path, timeout_s: float) -> CommandResult:
    """Run ``argv`` in ``cwd`` in its own session with a clean environment (no ``PYTHON*``
    variables, plugin autoload off, no bytecode written); kill the whole group at the deadline."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(cwd),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TMPDIR": tempfile.gettempdir(),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    start = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    return CommandResult(
        None if timed_out else proc.returncode,
        out.decode("utf-8", "replace"),
        timed_out,
        time.monotonic() - start,
    )


def pytest_command(tests: Sequence[str], python: str = sys.executable) -> list[str]:
    """``python -m pytest`` for the node ids, reporting every outcome (``-rA``) and no tracebacks."""
    return [python, "-m", "pytest", "-q", "-rA", "--tb=no", "-p", "no:cacheprovider", "--color=no", *tests]


def parse_outcomes(output: str, tests: Sequence[str]) -> dict[str, Outcome]:
    """Each test's outcome from pytest's ``-rA`` summary lines (``PASSED node``, ``FAILED node - ...``)."""
    outcomes: dict[str, Outcome] = dict.fromkeys(tests, "missing")
    wanted = set(tests)
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        outcome = _REPORT.get(word)
        if outcome is None:
            continue
        node = rest.split(" - ", 1)[0].strip()
        if node in wanted and _RANK[outcome] >= _RANK[outcomes[node]]:
            outcomes[node] = outcome  # type: ignore[assignment]
    return outcomes


def episode_patch(workspace: str | Path, base_commit: str, exclude: Sequence[str] = ()) -> str:
    """``git diff`` of the workspace against ``base_commit``, untracked files included (through a
    temporary index, so the workspace's own index is left alone), leaving out the paths in
    ``exclude``. Raises RuntimeError when the workspace is not a git repository holding
    ``base_commit``."""
    pathspec = [".", *(f":(exclude,literal){path}" for path in exclude)]
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        for args in (
            ["add", "-A"],
            [
                "diff",
                "--cached",
                "--no-color",
                "--no-ext-diff",
                "--no-textconv",
                "--binary",
                base_commit,
                "--",
                *pathspec,
            ],
        ):
            out = git(args, workspace, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"git {args[0]} in {workspace} failed: {out.stderr.strip()[:300]}")
        return out.stdout


@dataclass(frozen=True)
class SWEReward:
    """The reward of one episode with everything needed to audit it."""

    reward: float
    resolved: bool
    """Every FAIL_TO_PASS and PASS_TO_PASS test passed."""
    reason: str
    """One line: ``resolved``, which tests did not pass, or why no test ran."""
    patch: str
    """The agent's change (``git diff`` against base_commit, without the test patch)."""
    outcomes: Mapping[str, Outcome] = field(default_factory=dict)
    """Outcome per test node id (empty when no test ran)."""
    wall_s: float = 0.0
    """Seconds the test command ran."""

    def as_result(self) -> RewardResult:
        details = {
            "reason": self.reason,
            "patch": self.patch,
            "outcomes": dict(self.outcomes),
            "test_wall_s": self.wall_s,
        }
        return RewardResult(self.reward, self.resolved, details)


def _restore(root: Path, task: SWETask, paths: Sequence[str]) -> None:
    """Put ``paths`` back as they are in the snapshot (removed when the snapshot lacks them)."""
    for path in paths:
        target = root / path
        if target.is_symlink():  # never write through a link the agent planted
            target.unlink()
        if path in task.files:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(task.files[path], encoding="utf-8")
        elif target.is_file():
            target.unlink()


def _score(task: SWETask, outcomes: Mapping[str, Outcome], mode: Mode) -> float:
    passed = [outcomes.get(t) == "passed" for t in task.tests]
    f2p = passed[: len(task.fail_to_pass)]
    if mode == "all":
        return float(all(passed))
    if mode == "fail_to_pass_fraction":
        p2p_ok = all(passed[len(task.fail_to_pass) :])
        return sum(f2p) / len(f2p) if p2p_ok else 0.0
    return sum(passed) / len(passed)


def compute_reward(
    workspace: str | Path,
    task: SWETask,
    *,
    mode: Mode = "all",
    timeout_s: float = 60.0,
    runner: Runner = local_runner,
    python: str = sys.executable,
) -> SWEReward:
    """The reward of the edited ``workspace`` for ``task`` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown SWE reward mode {mode!r}; use one of {', '.join(MODES)}")
    root = Path(workspace)
    test_files = patched_paths(task.test_patch)
    try:
        trust_repository(root)
        patch = episode_patch(root, task.base_commit, exclude=test_files)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:  # e.g. the agent deleted .git
        return SWEReward(0.0, False, f"no episode patch: {err}", "")
    _restore(root, task, test_files)
    applied = git(["apply", "--whitespace=nowarn", "-"], root, input=task.test_patch)
    if applied.returncode != 0:
        why = applied.stderr.strip().splitlines()[0] if applied.stderr.strip() else "git apply failed"
        return SWEReward(0.0, False, f"test patch did not apply: {why}", patch)
    run = runner(pytest_command(task.tests, python), root, timeout_s)
    if run.timed_out:
        outcomes: dict[str, Outcome] = dict.fromkeys(task.tests, "timeout")
        return SWEReward(0.0, False, f"tests timed out after {timeout_s:g}s", patch, outcomes, run.wall_s)
    outcomes = parse_outcomes(run.output, task.tests)
    bad = [f"{t} {o}" for t, o in outcomes.items() if o != "passed"]
    reason = "resolved" if not bad else f"{len(bad)} of {len(outcomes)} tests did not pass: " + "; ".join(bad[:5])
    return SWEReward(_score(task, outcomes, mode), not bad, reason, patch, outcomes, run.wall_s)
