"""``sao sweep SWEEP.yaml`` (a grid of arms x seeds, resumable) and ``sao compare`` (curves and a
table with confidence intervals over seeds).

A sweep file::

    name: grpo_vs_sao                     # default: the file's stem
    config: configs/tiny_cpu.yaml         # the base of every run (path relative to the repository)
    overrides: [train.steps=40]           # applied to every run
    seeds: [1, 2, 3]
    out_dir: runs/sweeps/grpo_vs_sao      # default: runs/sweeps/<name>; relative to the repository
    metric: eval/accuracy                 # what sao compare tabulates (default; or a list)
    windows: ["11-15", "16-20"]           # optional: also each metric's mean over these RL steps
    paired_with: sao                      # optional: also each arm minus this one, seed by seed
    shared_start: []                      # optional: one SFT + value-pretraining start per seed
    arms:                                 # name -> its overrides (after the common ones)
      sao: []
      grpo_dis: [algo.advantage=grpo, algo.group_size=4]
      full_critic: {overrides: [critic.freeze_patterns=[]], shared_start: false}

Runs go to ``<out_dir>/<arm>/seed<s>`` one after the other, seed by seed (``--parallel N``: N at a
time), each a
``sao train ... run.seed=S run.run_dir=...`` (``SAO_TRAIN`` replaces the command, as in the
launchers). A run that finished leaves ``done.json`` (its exit, wall time, UTC start and end, and
the code's commit: :mod:`sao_megatron.provenance`) and is skipped by a rerun; one that was
stopped resumes from its complete checkpoint (``--resume-if-present``): a sweep killed at any
point continues where it stopped. Sweep files may share an ``out_dir``: an arm with the same name
and seed is the same run, done once (keep its overrides identical). ``sao sweep`` ends with the
comparison of its own arms in ``<out_dir>/compare_<name>/``; ``sao compare <out_dir>`` (or run
directories grouped as ``<arm>/seed<s>``) reads each run's ``metrics.jsonl`` and prints, under its
table, each arm's provenance from the runs' ``done.json``.

``shared_start`` (a list of overrides, possibly empty) makes every seed start its arms from one
run: ``<out_dir>/_start/seed<s>`` is ``sao train`` of the common overrides, these and
``train.steps=0`` (SFT, value pretraining, the initial evaluation, a checkpoint). Each arm's run
directory starts as a copy of that checkpoint and its metrics, and its ``sao train
--resume-if-present`` continues with RL under the arm's own overrides: the arms of a seed begin
from the same weights, critic and initial evaluation, and the SFT and value-pretraining keys of
an arm are not used. An arm that needs its own start (a different critic, say) says
``shared_start: false``.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sao_megatron import provenance
from sao_megatron.config import REPO_ROOT, ConfigError, load_config
from sao_megatron.observe import read_metrics


@dataclass
class Sweep:
    name: str
    config: str
    seeds: list[int]
    arms: dict[str, list[str]]
    out_dir: Path
    overrides: list[str] = field(default_factory=list)
    metrics: list[str] = field(default_factory=lambda: ["eval/accuracy"])
    windows: list[tuple[int, int]] = field(default_factory=list)
    """RL-step ranges (first, last) over which compare also averages each metric."""
    paired_with: str | None = None
    """An arm that compare also subtracts from every other arm, seed by seed."""
    shared_start: list[str] | None = None
    """Overrides of each seed's shared start (None: every run makes its own start)."""
    own_start: set[str] = field(default_factory=set)
    """Arms that make their own start even when the sweep shares one."""

    START = "_start"
    """The arm name of the shared starts (``<out_dir>/_start/seed<s>``)."""

    def runs(self) -> list[tuple[str, int, Path]]:
        return [(arm, seed, self.out_dir / arm / f"seed{seed}") for arm in self.arms for seed in self.seeds]

    def starts(self) -> list[tuple[str, int, Path]]:
        """The shared starts the runs need, one per seed (none without ``shared_start``)."""
        if self.shared_start is None or all(arm in self.own_start for arm in self.arms):
            return []
        return [(self.START, seed, self.out_dir / self.START / f"seed{seed}") for seed in self.seeds]

    def start_of(self, arm: str, seed: int) -> Path | None:
        if self.shared_start is None or arm in self.own_start or arm == self.START:
            return None
        return self.out_dir / self.START / f"seed{seed}"

    def overrides_of(self, arm: str, seed: int, run_dir: Path) -> list[str]:
        own = [*self.shared_start, "train.steps=0"] if arm == self.START else self.arms[arm]  # type: ignore[misc]
        return [*self.overrides, *own, f"run.seed={seed}", f"run.run_dir={run_dir}"]

    def command(self, arm: str, seed: int, run_dir: Path) -> list[str]:
        """``sao train --resume-if-present`` of one run (``SAO_TRAIN`` replaces ``sao train``)."""
        train = shlex.split(os.environ.get("SAO_TRAIN") or f"{shlex.quote(sys.executable)} -m sao_megatron.cli train")
        return [
            *train,
            "--resume-if-present",
            *([self.config] if self.config else []),
            *self.overrides_of(arm, seed, run_dir),
        ]


def load_sweep(path: str | Path) -> Sweep:
    """A sweep file, checked: every arm's config must load (unknown keys and bad values fail here,
    naming the file, the arm and the key, before any run starts)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the sweep file: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping with config, seeds and arms")
    unknown = set(data) - {
        "name",
        "config",
        "overrides",
        "seeds",
        "out_dir",
        "metric",
        "arms",
        "shared_start",
        "windows",
        "paired_with",
    }
    if unknown:
        raise ConfigError(
            f"{path}: unknown keys {sorted(unknown)}; use name, config, overrides, seeds, out_dir, "
            "metric, windows, paired_with, shared_start, arms"
        )
    windows = data.get("windows") or []
    if not isinstance(windows, list):
        raise ConfigError(f'{path}: windows is a list of RL-step ranges like "11-15", got {windows!r}')
    try:
        windows = [parse_window(w) for w in windows]
    except ValueError as err:
        raise ConfigError(f"{path}: windows: {err}") from err
    arms = data.get("arms")
    if not isinstance(arms, dict) or not arms:
        raise ConfigError(f"{path}: arms must map each arm's name to its list of overrides, e.g. arms: {{sao: []}}")
    if Sweep.START in arms:
        raise ConfigError(f"{path}: {Sweep.START!r} names the shared starts; rename that arm")
    own_start, arm_overrides = set(), {}
    for arm, spec in arms.items():
        if isinstance(spec, dict):
            extra = set(spec) - {"overrides", "shared_start"}
            if extra or not isinstance(spec.get("shared_start", True), bool):
                raise ConfigError(
                    f"{path}: arm {arm!r}: a mapping holds overrides (a list) and shared_start "
                    f"(true/false), got {spec!r}"
                )
            if not spec.get("shared_start", True):
                own_start.add(str(arm))
            spec = spec.get("overrides")
        if spec is not None and not isinstance(spec, list):
            raise ConfigError(f"{path}: arm {arm!r}: overrides are a list of key=value strings, got {spec!r}")
        arm_overrides[str(arm)] = list(spec or [])
    metric = data.get("metric", "eval/accuracy")
    shared = data.get("shared_start")
    if shared is not None and not isinstance(shared, list):
        raise ConfigError(f"{path}: shared_start is a list of overrides (possibly empty), got {shared!r}")
    seeds = data.get("seeds", [1])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{path}: seeds must be a non-empty list of integers, got {seeds!r}")
    name = str(data.get("name") or path.stem)
    config = str(data.get("config", ""))
    if config and not Path(config).is_absolute() and not Path(config).exists():
        config = str(REPO_ROOT / config)  # relative to the repository, as the runs' working directory
    sweep = Sweep(
        name=name,
        config=config,
        seeds=seeds,
        arms=arm_overrides,
        out_dir=REPO_ROOT / Path(data.get("out_dir") or Path("runs") / "sweeps" / name),  # absolute stays
        overrides=[str(o) for o in data.get("overrides") or []],
        metrics=[str(m) for m in metric] if isinstance(metric, list) else [str(metric)],
        windows=windows,
        paired_with=None if data.get("paired_with") is None else str(data["paired_with"]),
        shared_start=None if shared is None else [str(o) for o in shared],
        own_start=own_start,
    )
    if sweep.paired_with is not None and sweep.paired_with not in sweep.arms:
        raise ConfigError(f"{path}: paired_with {sweep.paired_with!r} is not an arm; the arms are {sorted(sweep.arms)}")
    for arm, seed, run_dir in [*sweep.starts(), *sweep.runs()]:
        given = sweep.shared_start if arm == Sweep.START else sweep.arms[arm]
        if any(not isinstance(o, str) or "=" not in o for o in given or []):
            raise ConfigError(f"{path}: arm {arm!r}: overrides are key=value strings, got {given!r}")
        try:
            load_config(sweep.config or None, sweep.overrides_of(arm, seed, run_dir))
        except ConfigError as err:
            raise ConfigError(f"{path}: arm {arm!r}: {err}") from err
    return sweep


def _train_command() -> list[str]:
    return shlex.split(os.environ.get("SAO_TRAIN") or f"{shlex.quote(sys.executable)} -m sao_megatron.cli train")


def run_one(sweep: Sweep, arm: str, seed: int, run_dir: Path, log=print) -> dict:
    """One run of the grid, or its ``done.json`` when it finished before. Each attempt appends its
    start (UTC) and code (:func:`sao_megatron.provenance.code_version`) to ``attempts.jsonl``; the
    ``done.json`` of the one that finishes records the first attempt's start, its own end, its own
    code and every attempt (a stopped run resumed on other code shows it)."""
    done = run_dir / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    start = sweep.start_of(arm, seed)
    if start is not None and not (run_dir / "metrics.jsonl").exists():
        begin_from(start, run_dir)
    cmd = sweep.command(arm, seed, run_dir)
    log(f"[sweep {sweep.name}] {arm} seed {seed}: {shlex.join(cmd)}")
    attempt = {"started_utc": provenance.utc_now(), **provenance.code_version()}
    with (run_dir / "attempts.jsonl").open("a") as f:  # at the start: a killed attempt is on record too
        f.write(json.dumps(attempt) + "\n")
    t0 = time.time()
    with (run_dir / "sweep.log").open("a") as out:
        rc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    result = {"arm": arm, "seed": seed, "exit": rc, "wall_s": time.time() - t0}
    if rc == 0:
        attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines() if line]
        # started: the first attempt's start; the code: the attempt that finished (each attempt's is kept)
        done.write_text(
            json.dumps(
                result
                | attempt
                | {"started_utc": attempts[0]["started_utc"], "ended_utc": provenance.utc_now(), "attempts": attempts}
            )
        )
    log(
        f"[sweep {sweep.name}] {arm} seed {seed}: exit {rc} in {result['wall_s']:.0f} s"
        + ("" if rc == 0 else f"; see {run_dir / 'sweep.log'} (a rerun resumes it)")
    )
    return result


def finished_runs(sweep: Sweep) -> list[Path]:
    """This sweep's run directories that hold metrics (what ``sao compare`` of the sweep reads)."""
    return [run_dir for _, _, run_dir in sweep.runs() if (run_dir / "metrics.jsonl").exists()]


def wall_time(sweep: Sweep) -> tuple[float, int]:
    """Seconds the finished runs of this sweep took (its arms and the starts they used), and how
    many runs: the comparison's cost on this machine, whichever sweep file ran a shared run."""
    runs = [r for r in sweep.runs() if (r[2] / "done.json").exists()]
    starts = {sweep.start_of(arm, seed) for arm, seed, _ in runs} - {None}
    done = [json.loads((d / "done.json").read_text()) for d in [r[2] for r in runs] + sorted(starts)]  # type: ignore[list-item]
    return sum(d.get("wall_s", 0.0) for d in done), len(done)


def begin_from(start: Path, run_dir: Path) -> None:
    """A run directory that continues a finished shared start: its checkpoint (RL not begun, the
    final evaluation forgotten) and its metrics (SFT, value pretraining, the initial evaluation)."""
    from sao_megatron.driver.run_state import RunState

    checkpoint = RunState.complete_checkpoint(start)
    if not (start / "done.json").exists() or checkpoint is None:
        raise RuntimeError(f"the shared start {start} did not finish (see {start / 'sweep.log'})")
    shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    shutil.copytree(checkpoint, RunState.checkpoint_dir(run_dir))
    state = RunState.load(run_dir)
    state.final_eval = None
    state.save(run_dir)
    shutil.copyfile(start / "metrics.jsonl", run_dir / "metrics.jsonl.tmp")
    (run_dir / "metrics.jsonl.tmp").replace(run_dir / "metrics.jsonl")  # last: marks the copy complete


def run_sweep(sweep: Sweep, parallel: int = 1, only: list[str] | None = None, log=print) -> list[dict]:
    """Every (arm, seed) not done yet, after the shared starts they need; a failed run does not stop
    the others (an arm whose start failed fails too). Seed by seed: a sweep stopped part way has its
    first seeds' arms all done, which a paired comparison can already read. Returns their results."""
    todo = sorted((r for r in sweep.runs() if not only or r[0] in only), key=lambda r: r[1])
    seeds = {seed for arm, seed, _ in todo if sweep.start_of(arm, seed) is not None}
    starts = [r for r in sweep.starts() if r[1] in seeds]

    def one(run: tuple[str, int, Path]) -> dict:
        try:
            return run_one(sweep, *run, log=log)
        except RuntimeError as err:  # its shared start failed
            log(f"[sweep {sweep.name}] {run[0]} seed {run[1]}: {err}")
            return {"arm": run[0], "seed": run[1], "exit": -1, "wall_s": 0.0}

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        begun = list(pool.map(one, starts))
        return begun + list(pool.map(one, todo))


# ---- compare ---------------------------------------------------------------------------------
T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Two-sided 95% Student-t quantiles by degrees of freedom (1.96 beyond)."""


@dataclass
class ArmStats:
    arm: str
    values: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def stderr(self) -> float:
        n = len(self.values)
        return statistics.stdev(self.values) / math.sqrt(n) if n > 1 else float("nan")

    @property
    def ci95(self) -> float:
        """Half-width of the 95% confidence interval of the mean (Student t)."""
        n = len(self.values)
        return T95.get(n - 1, 1.96) * self.stderr if n > 1 else float("nan")


def group_runs(paths: list[Path]) -> dict[str, list[Path]]:
    """Run directories by arm: a sweep's out_dir (``<arm>/seed<s>/metrics.jsonl``), an arm's
    directory (``seed<s>/metrics.jsonl``), or run directories (their parent's name is the arm when
    it is ``seed<s>``, else their own name)."""
    out: dict[str, list[Path]] = {}
    for path in paths:
        found = sorted(p.parent for p in path.glob("*/seed*/metrics.jsonl") if not p.parent.parent.name.startswith("_"))
        if not found:
            found = sorted(p.parent for p in path.glob("seed*/metrics.jsonl"))
        if not found and (path / "metrics.jsonl").exists():
            found = [path]
        if not found:
            raise ValueError(f"{path}: no metrics.jsonl in it, in its seed<s>/ or in its <arm>/seed<s>/ directories")
        for run in found:
            arm = run.parent.name if run.name.startswith("seed") else run.name
            out.setdefault(arm, []).append(run)
    return out


def _number(value: object) -> bool:
    """A finite number: a metric undefined at a step (NaN, e.g. explained variance of constant
    returns) is left out rather than poisoning a mean."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def own_records(records: list[dict], metric: str) -> list[dict]:
    """The records of a run that speak for it on ``metric``: every record for ``eval/*`` (the shared
    start's initial evaluation is each arm's first point), else the run's RL steps when it has any. An
    arm's run directory begins with its shared start's SFT and value-pretraining records (``begin_from``):
    a metric the arm never logs in RL (a critic's, for a baseline without one) must stay empty, not
    show the start's figure."""
    if metric.startswith("eval/") or not any(r.get("stage") == "rl" for r in records):
        return records
    return [r for r in records if r.get("stage") == "rl"]


def final_value(records: list[dict], metric: str) -> float | None:
    """The metric's last value in the run (:func:`own_records`; the final evaluation for ``eval/*``)."""
    values = [r[metric] for r in own_records(records, metric) if _number(r.get(metric))]
    return float(values[-1]) if values else None


def gain(records: list[dict], metric: str) -> float | None:
    """The metric's last value minus its first (an evaluation's end of RL minus its start)."""
    values = [r[metric] for r in records if _number(r.get(metric))]
    return float(values[-1] - values[0]) if len(values) > 1 else None


def parse_window(text: object) -> tuple[int, int]:
    """``"11-15"`` -> (11, 15): RL steps 11 to 15, both included."""
    first, sep, last = str(text).partition("-")
    try:
        window = (int(first), int(last if sep else first))
    except ValueError:
        window = (0, 0)
    if window[0] < 1 or window[1] < window[0]:
        raise ValueError(f"{text!r} is not a range of RL steps like 11-15 (first >= 1, last >= first)")
    return window


def window_mean(records: list[dict], metric: str, window: tuple[int, int]) -> float | None:
    """The metric's mean over the RL steps ``window`` (first, last), both included."""
    values = [
        float(r[metric])
        for r in records
        if r.get("stage") == "rl" and window[0] <= r.get("step", 0) <= window[1] and _number(r.get(metric))
    ]
    return statistics.fmean(values) if values else None


RECOVERY_SHARE = 0.9
RECOVERY_SPAN = 3
"""Recovery after a switch: the first step whose trailing mean over ``RECOVERY_SPAN`` steps, all at
or after the switch, reaches ``RECOVERY_SHARE`` of the mean over the ``RECOVERY_SPAN`` steps before it."""


def recovery_steps(records: list[dict], metric: str, switch: int, until: int | None = None) -> float | None:
    """RL steps from ``switch`` (the first step of a new reward) until the metric recovers (see
    ``RECOVERY_SHARE``): ``t - switch + 1`` for the recovering step ``t``, so at least
    ``RECOVERY_SPAN``. The phase ends before ``until`` (the next switch) or at the run's last step;
    a run that does not recover within it counts one step past its end (censored; the caller says
    so). None when the steps before the switch are missing."""
    by_step = {int(r["step"]): float(r[metric]) for r in records if r.get("stage") == "rl" and _number(r.get(metric))}
    before = [by_step.get(s) for s in range(switch - RECOVERY_SPAN, switch)]
    if any(v is None for v in before) or not by_step:
        return None
    target = RECOVERY_SHARE * statistics.fmean(v for v in before if v is not None)
    last = max(by_step) if until is None else min(max(by_step), until - 1)
    for t in range(switch + RECOVERY_SPAN - 1, last + 1):
        span = [by_step.get(s) for s in range(t - RECOVERY_SPAN + 1, t + 1)]
        if all(v is not None for v in span) and statistics.fmean(v for v in span if v is not None) >= target:
            return float(t - switch + 1)
    return float(last - switch + 2)


def compare_rows(
    groups: dict[str, list[Path]],
    records: dict[str, list[list[dict]]],
    metrics: list[str],
    windows: Sequence[tuple[int, int]] = (),
    paired_with: str | None = None,
    recoveries: Sequence[int] = (),
) -> list[tuple[str, ArmStats]]:
    """The rows of :func:`compare`'s table as (label, the arm's values over its runs), in its order;
    ``records`` holds each run's metrics, by arm, in the order of ``groups``. A row without values
    is left out."""
    if paired_with is not None and paired_with not in groups:
        raise ValueError(f"paired with {paired_with!r}: no such arm; the arms are {sorted(groups)}")
    out: list[tuple[str, ArmStats]] = []

    def row(label: str, arm: str, values: list[float]) -> None:
        if values:
            out.append((label, ArmStats(arm, values)))

    rows = [(m, m, final_value) for m in metrics]
    rows += [(f"{m} gain", m, gain) for m in metrics if m.startswith("eval/")]
    rows += [
        (f"{m} steps {a}-{b}", m, lambda r, m, w=(a, b): window_mean(r, m, w)) for m in metrics for a, b in windows
    ]
    switches = sorted(set(recoveries))
    ends = {s: switches[i + 1] if i + 1 < len(switches) else None for i, s in enumerate(switches)}  # the next switch
    rows += [
        (
            f"{m} steps to recover {RECOVERY_SHARE:.0%} after step {s}",
            m,
            lambda r, m, s=s: recovery_steps(r, m, s, ends[s]),
        )
        for m in metrics
        for s in switches
    ]
    for label, metric, reduce in rows:
        for arm, runs in records.items():
            row(label, arm, [v for v in (reduce(r, metric) for r in runs) if v is not None])
        if paired_with is None:
            continue
        base = {
            run.name: reduce(recs, metric) for run, recs in zip(groups[paired_with], records[paired_with], strict=True)
        }
        for arm in (a for a in groups if a != paired_with):
            pairs = [
                (reduce(recs, metric), base.get(run.name)) for run, recs in zip(groups[arm], records[arm], strict=True)
            ]
            row(
                f"{label} minus {paired_with}, paired",
                arm,
                [x - y for x, y in pairs if x is not None and y is not None],
            )
    return out


def _done(run: Path) -> dict | None:
    done = run / "done.json"
    return json.loads(done.read_text()) if done.exists() else None


def run_provenance(groups: dict[str, list[Path]]) -> dict[str, list[dict | None]]:
    """Each compared run's ``done.json`` by arm (None where it has none), and under ``_start`` those of
    the shared starts beside them (``<out_dir>/_start/seed<s>`` of a run ``<out_dir>/<arm>/seed<s>``)."""
    out: dict[str, list[dict | None]] = {arm: [_done(r) for r in runs] for arm, runs in groups.items()}
    starts = sorted(
        {r.parent.parent / Sweep.START / r.name for runs in groups.values() for r in runs if r.name.startswith("seed")}
    )
    if found := [_done(s) for s in starts if (s / "metrics.jsonl").exists()]:
        out[Sweep.START] = found
    return out


def compare(
    paths: list[Path],
    metrics: list[str],
    out_dir: Path | None = None,
    windows: Sequence[tuple[int, int]] = (),
    paired_with: str | None = None,
    recoveries: Sequence[int] = (),
) -> str:
    """A markdown table (per arm and metric: mean +- standard error and the 95% interval over its
    runs, and n; for ``eval/*`` metrics also the gain, last minus first evaluation; for each of
    ``windows`` the metric's mean over those RL steps; with ``paired_with`` an arm, each of these
    per run minus that arm's, run by run of the same name, i.e. seed by seed; for each step of
    ``recoveries``, where the reward switched, :func:`recovery_steps` within its phase, which ends at
    the next of them: :func:`compare_rows`), then the runs' provenance (UTC start and end, code
    commit: :func:`sao_megatron.provenance.summary`) and, with ``out_dir``, one
    PNG per metric of the arms' mean curves with a +-1 standard-error band."""
    groups = group_runs(paths)
    records = {arm: [read_metrics(r) for r in runs] for arm, runs in groups.items()}
    lines = ["| metric | arm | n | mean +- s.e. | 95% CI |", "|---|---|---|---|---|"]
    for label, s in compare_rows(groups, records, metrics, windows, paired_with, recoveries):
        ci = f"[{s.mean - s.ci95:.4g}, {s.mean + s.ci95:.4g}]" if len(s.values) > 1 else "-"
        lines.append(f"| {label} | {s.arm} | {len(s.values)} | {s.mean:.4g} +- {s.stderr:.2g} | {ci} |")
    table = "\n".join(lines) + "\n\n" + provenance.summary(run_provenance(groups))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        plots = [_plot(records, metric, out_dir) for metric in metrics]
        body = table + "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots if p) + "\n"
        (out_dir / "compare.md").write_text(body)
    return table


def _curve(runs: list[list[dict]], metric: str) -> tuple[list[int], list[float], list[float]]:
    by_step: dict[int, list[float]] = {}
    for records in runs:
        for r in records:
            if _number(r.get(metric)) and r.get("stage") in ("rl", "eval"):
                by_step.setdefault(int(r["step"]), []).append(float(r[metric]))
    steps = sorted(by_step)
    means = [statistics.fmean(by_step[s]) for s in steps]
    errs = [ArmStats("", by_step[s]).stderr if len(by_step[s]) > 1 else 0.0 for s in steps]
    return steps, means, errs


def _plot(records: dict[str, list[list[dict]]], metric: str, out_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    drawn = False
    for arm, runs in records.items():
        steps, means, errs = _curve(runs, metric)
        if not steps:
            continue
        drawn = True
        ax.plot(steps, means, marker="." if len(steps) < 40 else None, label=f"{arm} (n={len(runs)})")
        ax.fill_between(
            steps,
            [m - e for m, e in zip(means, errs, strict=True)],
            [m + e for m, e in zip(means, errs, strict=True)],
            alpha=0.2,
        )
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(f"{metric} (mean +- 1 s.e. over seeds)")
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"{metric.replace('/', '_')}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
