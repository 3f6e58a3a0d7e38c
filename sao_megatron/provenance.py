"""When a run ran and on which code: UTC times and the git commit of the package's checkout.

A sweep's ``done.json`` carries these fields (:func:`sao_megatron.sweep.run_one`), the reduced
metrics keep that file as it is (``tools/sweep_snapshot.py``), and ``sao compare`` prints them
(:func:`summary`), so a registration's commit time can be checked against the first run's start.

Fields: ``started_utc`` and ``ended_utc`` (ISO 8601, UTC offset written out), ``commit`` (the
full hash of HEAD, or None outside a git checkout), ``dirty`` (tracked files differ from HEAD;
untracked files are not counted; None outside a checkout) and, outside a checkout,
``no_commit``: why there is no commit, instead of a failure.
"""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
FIELDS = ("started_utc", "ended_utc", "commit", "dirty")
"""What a ``done.json`` written since provenance was recorded holds besides the run's result."""


def utc_now() -> str:
    """The time now, e.g. ``2026-12-07T05:51:00+00:00``."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def code_version(path: Path = PACKAGE_DIR) -> dict:
    """``{"commit": HEAD, "dirty": bool}`` of the git checkout holding ``path`` (default: this
    package's), or ``{"commit": None, "dirty": None, "no_commit": why}`` when there is none (not a
    checkout, git missing): a run never fails for want of a commit."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, check=True, timeout=60
        ).stdout

    try:
        commit = git("rev-parse", "--verify", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError) as err:
        why = getattr(err, "stderr", None) or str(err)
        return {"commit": None, "dirty": None, "no_commit": f"not a git checkout: {path} ({why.strip()})"}
    return {"commit": commit, "dirty": dirty}


def describe(done: dict) -> str:
    """One run's code as a reader wants it: ``3bb43db`` / ``3bb43db dirty`` / why none."""
    if done.get("commit"):
        return done["commit"][:7] + (" dirty" if done.get("dirty") else "")
    return str(done.get("no_commit") or "no commit recorded")


def summary(runs: dict[str, list[dict | None]]) -> str:
    """A markdown table, one row per arm: how many of its runs record provenance, the first start and
    the last end among them (UTC) and the code of each (``sha xN``); ``runs`` maps an arm to each run's
    ``done.json`` (None where the run has none: it did not finish under ``sao sweep``)."""
    lines = ["| provenance | runs recording it | first start (UTC) | last end (UTC) | code |", "|---|---|---|---|---|"]
    for arm, dones in runs.items():
        recorded = [d for d in dones if d is not None and all(k in d for k in FIELDS)]
        if not recorded:
            missing = sum(d is None for d in dones)
            why = "no done.json" if missing == len(dones) else "done.json written before provenance was recorded"
            lines.append(f"| {arm} | 0 of {len(dones)} | - | - | not recorded ({why}) |")
            continue
        codes: dict[str, int] = {}
        for d in recorded:
            codes[describe(d)] = codes.get(describe(d), 0) + 1
        code = ", ".join(f"{c} x{n}" for c, n in codes.items())
        first = min(d["started_utc"] for d in recorded)
        last = max(d["ended_utc"] for d in recorded)
        lines.append(f"| {arm} | {len(recorded)} of {len(dones)} | {first} | {last} | {code} |")
    return "\n".join(lines) + "\n"
