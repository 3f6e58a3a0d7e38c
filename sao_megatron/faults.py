"""Fault injection for crash tests: ``SAO_KILL_AT=<point>[@N]`` SIGKILLs the whole run there.

    SAO_KILL_AT=checkpoint:staged sao train ...      # killed at the first checkpoint's staging
    SAO_KILL_AT=weight_sync:bucket@3 sao train ...   # ... mid-way through the third weight sync

When a process reaches :func:`kill_point` ``name`` for the N-th time (N defaults to 1; counted per
process), it writes ``SAO_KILL_AT <name> pid=<pid>`` to stderr and SIGKILLs, with no cleanup and no
chance to catch it, its own process group and, when it is not the driver itself, the driver
(``SAO_DRIVER_PID``, set by ``sao train``) with the driver's process group. That is what the
OOM killer or a node failure does to a run. ``tests/test_kill_points.py`` checks every point
in-process (it replaces :func:`_kill_run`, the SIGKILL, by a copy of the run directory: what a
SIGKILL there leaves) and resumes from each; ``tests/test_kill_resume.py`` kills a real run once.

Points (where they sit):

* ``rl:after_update``: the RL loop, after a step's learner update, weight sync and metrics record,
  before its checkpoint (``stages.StageRun.after_step``): the resumed run trains and logs the step again;
* ``checkpoint:staged``: actor, critic and ``state.json`` written to ``checkpoint.staging/``, before
  publishing (``Session.checkpoint``);
* ``checkpoint:renaming``: between the two renames of ``RunState.publish`` (``checkpoint/`` is
  ``checkpoint.old/`` and the new one not yet in place);
* ``weight_sync:bucket``: in the actor rank 0 Ray worker, after the engines answered a bucket's
  request (received and loaded it) and before the sync ends (``EngineControl.load``);
* ``rollout:generate``: after an engine's ``/generate`` answered, mid-episode
  (``EngineClient.generate``; evaluation episodes count too).

Unset (the normal case), a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
import sys

_reached: dict[str, int] = {}

DRIVER_PID = "SAO_DRIVER_PID"


def kill_point(name: str) -> None:
    """SIGKILL the run here when ``SAO_KILL_AT`` names this point (and this is its N-th visit)."""
    spec = os.environ.get("SAO_KILL_AT")
    if not spec:
        return
    point, _, nth = spec.partition("@")
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] != (int(nth) if nth else 1):
        return
    pid = os.getpid()
    sys.stderr.write(f"SAO_KILL_AT {name} pid={pid}\n")
    sys.stderr.flush()
    _kill_run(pid)


def _kill_run(pid: int) -> None:
    """SIGKILL the driver's process group (and the driver), then this process's own group."""
    own = os.getpgid(0)
    driver = int(os.environ.get(DRIVER_PID) or 0)
    if driver and driver != pid:
        try:
            group = os.getpgid(driver)
            if group != own:
                os.killpg(group, signal.SIGKILL)
            os.kill(driver, signal.SIGKILL)  # in case it is not in its group any more
        except (ProcessLookupError, PermissionError):
            pass  # gone already (or not ours: a stale pid)
    os.killpg(own, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)  # not reached: this process is in its own group
