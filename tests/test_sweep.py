"""``sao sweep`` / ``sao compare`` with a stand-in trainer (``SAO_TRAIN``): grid, resume, statistics.

The stand-in writes a ``metrics.jsonl`` whose held-out accuracy is a function of the arm's
``algo.eps_high`` and the seed, fails once for a chosen run, and records each call."""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import textwrap

import pytest

from sao_megatron.cli import main
from sao_megatron.config import ConfigError
from sao_megatron.sweep import compare, load_sweep, run_sweep

STUB = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    run = Path(args["run.run_dir"]); seed = int(args["run.seed"]); eps = float(args.get("algo.eps_high", 5.0))
    state = run / "checkpoint" / "state.json"
    began = "final_eval=None" if state.exists() and json.loads(state.read_text())["final_eval"] is None else "fresh"
    line = f"{run.parent.name}/{run.name} {began} {'--resume-if-present' in sys.argv}\\n"
    calls = Path(os.environ["STUB_CALLS"]); calls.write_text(calls.read_text() + line if calls.exists() else line)
    if os.environ.get("STUB_FAIL") == f"{run.parent.name}/{run.name}" and not (run / "failed_once").exists():
        (run / "failed_once").write_text("x"); sys.exit(1)
    if args.get("train.steps") == "0":  # a shared start: a checkpoint and the initial evaluation
        state.parent.mkdir()
        ev = {"eval/accuracy": seed / 100}
        state.write_text(json.dumps({"stage": "rl", "initial_eval": ev, "final_eval": ev}))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "stage": "eval", **ev}) + "\\n")
        sys.exit(0)
    with (run / "metrics.jsonl").open("a") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, "stage": "rl", "rollout/reward": 0.1 * step * eps}) + "\\n")
            f.write(json.dumps({"step": step, "stage": "eval", "eval/accuracy": eps / 10 + seed / 100 + step / 1000}) + "\\n")
""")


@pytest.fixture
def sweep_file(tmp_path, monkeypatch):
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB)
    monkeypatch.setenv("SAO_TRAIN", f"{sys.executable} {stub}")
    monkeypatch.setenv("STUB_CALLS", str(tmp_path / "calls.txt"))
    path = tmp_path / "mini.yaml"
    path.write_text(
        textwrap.dedent(f"""
        config: configs/tiny_cpu.yaml
        overrides: [train.steps=2]
        seeds: [1, 2, 3]
        out_dir: {tmp_path / "out"}
        arms:
          low: [algo.eps_high=1.0]
          high: [algo.eps_high=4.0]
    """)
    )
    return path


def test_a_sweep_runs_its_grid_resumes_a_failed_run_and_compares(sweep_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STUB_FAIL", "high/seed2")
    assert main(["sweep", str(sweep_file)]) == 1  # one run failed; the others went on
    assert "failed: high seed 2" in capsys.readouterr().err
    calls = (tmp_path / "calls.txt").read_text().split("\n")
    # seed by seed: a sweep stopped part way has whole seeds to pair
    assert [c.split()[0] for c in calls if c] == [f"{a}/seed{s}" for s in (1, 2, 3) for a in ("low", "high")]
    assert all(c.endswith("fresh True") for c in calls if c)  # every run may resume its own checkpoint

    assert main(["sweep", str(sweep_file)]) == 0  # only the failed run again
    calls = [c for c in (tmp_path / "calls.txt").read_text().split("\n") if c]
    assert len(calls) == 7 and calls[-1].startswith("high/seed2")
    out = capsys.readouterr().out
    rows = {line.split("|")[2].strip(): line for line in out.splitlines() if line.startswith("| eval/accuracy |")}
    # final eval/accuracy of arm a, seed s: eps/10 + s/100 + 0.002
    for arm, eps in (("low", 1.0), ("high", 4.0)):
        values = [eps / 10 + s / 100 + 0.002 for s in (1, 2, 3)]
        mean, se = statistics.fmean(values), statistics.stdev(values) / math.sqrt(3)
        assert f"| 3 | {mean:.4g} +- {se:.2g} | [{mean - 4.303 * se:.4g}, {mean + 4.303 * se:.4g}] |" in rows[arm]
    assert "| eval/accuracy gain | low | 3 | 0.001 +- 0 |" in out  # last minus first evaluation
    assert (tmp_path / "out" / "compare_mini" / "eval_accuracy.png").stat().st_size > 0

    assert (
        main(
            [
                "compare",
                str(tmp_path / "out" / "low" / "seed1"),
                str(tmp_path / "out" / "low" / "seed2"),
                "--metric",
                "rollout/reward",
                "--out",
                str(tmp_path / "cmp"),
            ]
        )
        == 0
    )
    assert "| rollout/reward | low | 2 | 0.2 +- 0 |" in capsys.readouterr().out
    assert (tmp_path / "cmp" / "compare.md").exists() and (tmp_path / "cmp" / "rollout_reward.png").exists()


def test_arms_of_a_seed_begin_from_one_shared_start_unless_they_opt_out(tmp_path, monkeypatch, capsys):
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB)
    monkeypatch.setenv("SAO_TRAIN", f"{sys.executable} {stub}")
    monkeypatch.setenv("STUB_CALLS", str(tmp_path / "calls.txt"))
    monkeypatch.setenv("STUB_FAIL", "_start/seed1")
    path = tmp_path / "shared.yaml"
    path.write_text(
        textwrap.dedent(f"""
        config: configs/tiny_cpu.yaml
        seeds: [1, 2]
        out_dir: {tmp_path / "out"}
        shared_start: [train.sft_steps=3]
        arms:
          low: [algo.eps_high=1.0]
          high: [algo.eps_high=4.0]
          own: {{overrides: [algo.eps_high=2.0], shared_start: false}}
    """)
    )
    sweep = load_sweep(path)
    assert [r[:2] for r in sweep.starts()] == [("_start", 1), ("_start", 2)]
    assert "train.sft_steps=3" in sweep.command("_start", 1, tmp_path / "x") and "train.steps=0" in sweep.command(
        "_start", 1, tmp_path / "x"
    )
    assert main(["sweep", str(path)]) == 1  # seed 1's start failed: its shared arms fail, the rest runs
    calls = [c for c in (tmp_path / "calls.txt").read_text().split("\n") if c]
    assert calls[:2] == ["_start/seed1 fresh True", "_start/seed2 fresh True"]  # starts first
    assert sorted(calls[2:]) == [
        "high/seed2 final_eval=None True",
        "low/seed2 final_eval=None True",
        "own/seed1 fresh True",
        "own/seed2 fresh True",
    ]
    assert "shared start" in capsys.readouterr().out

    assert main(["sweep", str(path)]) == 0  # the start again, then the arms that waited for it
    calls = [c for c in (tmp_path / "calls.txt").read_text().split("\n") if c][6:]
    assert calls[0] == "_start/seed1 fresh True"
    assert sorted(calls[1:]) == ["high/seed1 final_eval=None True", "low/seed1 final_eval=None True"]
    out = capsys.readouterr().out
    assert "| eval/accuracy | own | 2 |" in out
    assert not [line for line in out.splitlines() if line.startswith("| eval/") and "| _start |" in line]
    assert "| _start | 2 of 2 |" in out  # the starts are not compared, but their provenance is printed
    # a shared arm's curve begins at its start's evaluation: seed s's start is s/100, its last eps/10 + s/100 + 0.002
    assert "| eval/accuracy gain | low | 2 | 0.102 +- 0 |" in out
    assert "shared: 8 finished runs (arms and their starts) took" in out  # 3 arms x 2 seeds + 2 starts
    # the sum of the runs' times is not this command's wall time (runs in parallel, runs reused): both shown
    assert re.search(r"min of run time, one after another; this command ran \d+\.\d min \(--parallel 1\)", out)
    assert (tmp_path / "out" / "low" / "seed1" / "checkpoint" / "state.json").exists()


def test_dry_run_lists_every_run_and_its_state(sweep_file, capsys):
    run_sweep(load_sweep(sweep_file), only=["low"], log=lambda line: None)
    assert main(["sweep", str(sweep_file), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    assert sum("(done)" in line for line in lines) == 3 and all("run.seed=" in line for line in lines)


@pytest.mark.parametrize(
    "body, message",
    [
        ("arms: {}", "arms must map each arm's name"),
        ("seeds: [a]\narms: {x: []}", "seeds must be a non-empty list of integers"),
        ("arms: {x: [algo.eps_hihg=1]}", "arm 'x': override 'algo.eps_hihg=1': unknown config key 'algo.eps_hihg'"),
        ("arm: {x: []}", "unknown keys ['arm']"),
        ("arms: {_start: []}", "'_start' names the shared starts"),
        ("arms: {x: {overrides: [], share: 1}}", "arm 'x': a mapping holds overrides"),
        ("shared_start: a=1\narms: {x: []}", "shared_start is a list of overrides"),
        ("windows: [3-1]\narms: {x: []}", "windows: '3-1' is not a range of RL steps"),
        ("windows: 1-5\narms: {x: []}", "windows is a list of RL-step ranges"),
        ("paired_with: y\narms: {x: []}", "paired_with 'y' is not an arm; the arms are ['x']"),
    ],
)
def test_bad_sweep_files_fail_before_any_run_naming_the_file_and_arm(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        load_sweep(path)
    assert str(path) in str(err.value)


def test_compare_refuses_a_directory_without_runs(tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        compare([tmp_path], ["eval/accuracy"])


def test_every_committed_experiment_file_loads():
    from sao_megatron.config import REPO_ROOT

    files = sorted((REPO_ROOT / "configs" / "experiments").glob("*.yaml"))
    assert files
    for path in files:
        sweep = load_sweep(path)
        assert sweep.arms and sweep.seeds, path


def test_sweeps_sharing_an_out_dir_run_a_common_arm_once_and_compare_only_their_arms(sweep_file, tmp_path, capsys):
    assert main(["sweep", str(sweep_file)]) == 0  # arms low and high
    other = tmp_path / "other.yaml"
    other.write_text(sweep_file.read_text().replace("high: [algo.eps_high=4.0]", "mid: [algo.eps_high=2.0]"))
    capsys.readouterr()
    assert main(["sweep", str(other)]) == 0
    calls = [c.split()[0] for c in (tmp_path / "calls.txt").read_text().split("\n") if c]
    assert calls[6:] == ["mid/seed1", "mid/seed2", "mid/seed3"]  # low was done by the first sweep
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| eval/accuracy |")]
    assert [r.split("|")[2].strip() for r in rows] == ["low", "mid"]
    assert (tmp_path / "out" / "compare_other" / "eval_accuracy.png").exists()


def test_windows_average_a_metric_over_rl_steps_per_run_then_over_seeds(sweep_file, tmp_path, capsys):
    sweep_file.write_text(
        sweep_file.read_text() + 'metric: rollout/reward\nwindows: ["2-2", "1-2"]\npaired_with: low\n'
    )
    assert main(["sweep", str(sweep_file)]) == 0
    rows = {
        tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[4].strip()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| rollout/reward")
    }
    # the stand-in's reward at step k is 0.1 * k * eps_high, the same for every seed (s.e. 0)
    assert rows[("rollout/reward steps 2-2", "low")] == "0.2 +- 0"
    assert rows[("rollout/reward steps 1-2", "low")] == "0.15 +- 0"
    assert rows[("rollout/reward steps 1-2", "high")] == "0.6 +- 0"
    assert rows[("rollout/reward minus low, paired", "high")].startswith("0.6 +- ")  # 0.2 * (4 - 1)
    assert rows[("rollout/reward steps 1-2 minus low, paired", "high")].startswith("0.45 +- ")

    out = tmp_path / "out"
    assert main(["compare", str(out), "--metric", "rollout/reward", "--window", "1-1"]) == 0
    assert "| rollout/reward steps 1-1 | high | 3 | 0.4 +- 0 |" in capsys.readouterr().out
    arm_dirs = [
        str(out / "low"),
        str(out / "high" / "seed1"),
        str(out / "high" / "seed2"),
    ]  # an arm's dir, runs
    assert main(["compare", *arm_dirs, "--metric", "rollout/reward"]) == 0
    assert "| rollout/reward | low | 3 |" in (text := capsys.readouterr().out) and "| high | 2 |" in text
    # paired by seed: the stand-in's final accuracy is eps_high / 10 + seed / 100 + 0.002
    assert main(["compare", str(out), "--paired-with", "low", "--metric", "eval/accuracy"]) == 0
    text = capsys.readouterr().out
    assert "| eval/accuracy minus low, paired | high | 3 | 0.3 +- " in text and "| low | 3 | 0 +-" not in text
    assert main(["compare", str(out), "--paired-with", "lo"]) == 2
    assert "paired with 'lo': no such arm; the arms are ['high', 'low']" in capsys.readouterr().err
    with (out / "low" / "seed1" / "metrics.jsonl").open("a") as f:  # NaN (JSON NaN): left out
        f.write('{"step": 3, "stage": "rl", "rollout/reward": NaN}\n')
    assert main(["compare", str(out), "--metric", "rollout/reward", "--window", "1-3"]) == 0
    assert "| rollout/reward steps 1-3 | low | 3 | 0.15 +- 0 |" in capsys.readouterr().out
    assert main(["compare", str(out), "--window", "x"]) == 2
    assert "'x' is not a range of RL steps" in capsys.readouterr().err


def test_a_snapshot_keeps_what_compare_reads_and_sums_the_runs_wall_time(sweep_file, tmp_path, capsys):
    import importlib.util

    from sao_megatron.config import REPO_ROOT

    spec = importlib.util.spec_from_file_location("sweep_snapshot", REPO_ROOT / "tools" / "sweep_snapshot.py")
    assert spec and spec.loader
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert main(["sweep", str(sweep_file)]) == 0
    original = capsys.readouterr().out
    out = tmp_path / "out"
    (out / "low" / "seed1" / "big.bin").write_bytes(b"x")  # not copied
    with (out / "low" / "seed1" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "stage": "rl", "actor/grad_norm": 1.0}\n')  # a metric compare never reads
    copied, wall_s = tool.snapshot(out, tmp_path / "copy")
    walls = [json.loads(p.read_text())["wall_s"] for p in out.glob("*/seed*/done.json")]
    assert copied == 6 and wall_s == pytest.approx(sum(walls))
    assert not (tmp_path / "copy" / "low" / "seed1" / "big.bin").exists()
    assert "grad_norm" not in (tmp_path / "copy" / "low" / "seed1" / "metrics.jsonl").read_text()
    assert main(["compare", str(tmp_path / "copy")]) == 0
    table = {line for line in capsys.readouterr().out.splitlines() if line.startswith("| eval/accuracy |")}
    assert len(table) == 2 and table == {line for line in original.splitlines() if line.startswith("| eval/accuracy |")}
    # the reduced metrics keep each run's provenance: compare prints the same starts, ends and commits
    assert main(["compare", str(tmp_path / "copy")]) == 0
    copied_rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| low | 3 of 3 |")]
    assert copied_rows and copied_rows == [
        line for line in original.splitlines() if line.startswith("| low | 3 of 3 |")
    ]


def test_compare_leaves_empty_a_metric_an_arm_never_logged_in_its_rl_steps(tmp_path, capsys):
    """Both arms begin from one shared start whose value pretraining logged the critic's explained
    variance (0.19, copied into each arm's metrics); only the arm with a critic logs it in RL."""
    start = [
        {"step": 1, "stage": "value_pretrain", "critic/explained_var": 0.19, "rollout/reward": 0.3},
        {"step": 0, "stage": "eval", "eval/accuracy": 0.5},
    ]
    for arm, rl in (("sao", {"critic/explained_var": 0.6}), ("grpo_dis", {})):
        for seed in (1, 2):
            run = tmp_path / arm / f"seed{seed}"
            run.mkdir(parents=True)
            steps = [
                {"step": 1, "stage": "rl", "rollout/reward": 0.4, **rl},
                {"step": 1, "stage": "eval", "eval/accuracy": 0.7},
            ]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in start + steps))
    metrics = ["--metric", "critic/explained_var", "--metric", "rollout/reward", "--metric", "eval/accuracy"]
    assert main(["compare", str(tmp_path), *metrics, "--paired-with", "sao"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(c.strip() for c in line.split("|")[1:3]) for line in out.splitlines() if line.startswith("| ")}
    assert ("critic/explained_var", "sao") in rows
    assert not {r for r in rows if r[0].startswith("critic/") and r[1] == "grpo_dis"}  # no 0.19 row, paired or not
    assert {("rollout/reward", "grpo_dis"), ("eval/accuracy gain", "grpo_dis")} <= rows  # its own metrics stay


def test_recovery_counts_the_steps_until_a_trailing_mean_regains_90_percent(tmp_path, capsys):
    # reward 0.8 on steps 1-5; the switch at step 6 drops it to 0; then it climbs back. Target
    # 0.9 * 0.8 = 0.72; trailing means of 3 steps from step 8 on.
    curves = {
        "fast": [0.8] * 5 + [0.0, 0.6, 0.7, 0.8, 0.8, 0.8],  # steps 7-9: 0.7 < 0.72; 8-10: 0.767: t = 10, 5 steps
        "slow": [0.8] * 5 + [0.0, 0.1, 0.2, 0.3, 0.4, 0.5],  # never: one step past the end, 11 - 6 + 2 = 7
    }
    for arm, rewards in curves.items():
        for seed in (1, 2):
            run = tmp_path / arm / f"seed{seed}"
            run.mkdir(parents=True)
            records = [{"step": i + 1, "stage": "rl", "rollout/reward": r} for i, r in enumerate(rewards)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert (
        main(["compare", str(tmp_path), "--metric", "rollout/reward", "--recovery", "6", "--paired-with", "fast"]) == 0
    )
    out = capsys.readouterr().out
    assert "| rollout/reward steps to recover 90% after step 6 | fast | 2 | 5 +- 0 |" in out
    assert "| rollout/reward steps to recover 90% after step 6 | slow | 2 | 7 +- 0 |" in out
    assert "| rollout/reward steps to recover 90% after step 6 minus fast, paired | slow | 2 | 2 +- 0 |" in out
    # a switch with no steps before it in the runs: no row
    assert main(["compare", str(tmp_path), "--metric", "rollout/reward", "--recovery", "2"]) == 0
    assert "after step 2" not in capsys.readouterr().out
    # a second switch at step 11 ends the first one's phase at step 10: "fast" still recovers there
    # (5 steps); "slow" is censored one past the phase, 10 - 6 + 2 = 6, not one past the run (7)
    assert main(["compare", str(tmp_path), "--metric", "rollout/reward", "--recovery", "11", "--recovery", "6"]) == 0
    out = capsys.readouterr().out
    assert "| rollout/reward steps to recover 90% after step 6 | fast | 2 | 5 +- 0 |" in out
    assert "| rollout/reward steps to recover 90% after step 6 | slow | 2 | 6 +- 0 |" in out
    # ... and at step 10, "fast" has not recovered by step 9 either: censored at 9 - 6 + 2 = 5
    assert main(["compare", str(tmp_path), "--metric", "rollout/reward", "--recovery", "6", "--recovery", "10"]) == 0
    out = capsys.readouterr().out
    assert "| rollout/reward steps to recover 90% after step 6 | slow | 2 | 5 +- 0 |" in out


def test_cursor_steps_finds_where_the_prompt_cursor_crossed_an_index():
    """Batches of 4; step k's take saw 4k trained plus waiting, dropped and in-flight episodes
    started. Index 9 is first started by step 2 (8 + 1 + 0 + 1 = 10 > 9); the batch mean first
    reaches it at step 3. Without rollout/batch_size the tool needs --batch-size."""
    import importlib.util

    from sao_megatron.config import REPO_ROOT

    spec = importlib.util.spec_from_file_location("cursor_steps", REPO_ROOT / "tools" / "cursor_steps.py")
    assert spec and spec.loader
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    counts = {"buffer/waiting": 1.0, "buffer/dropped_stale": 0.0, "rollout/in_flight_at_take": 1.0}
    rows = [
        {"step": 1, "stage": "value_pretrain", "rollout/batch_size": 4.0, "buffer/waiting": 99.0},
        {"step": 1, "stage": "rl", "rollout/batch_size": 4.0, **counts, "rollout/prompt_index": 1.5},
        {"step": 2, "stage": "rl", "rollout/batch_size": 4.0, **counts, "rollout/prompt_index": 6.0},
        {"step": 3, "stage": "rl", "rollout/batch_size": 4.0, **counts, "rollout/prompt_index": 9.5},
    ]
    assert tool.crossings(rows, 9) == (2, 3)
    assert tool.crossings(rows, 100) == (None, None)
    bare = [{k: v for k, v in r.items() if k not in ("rollout/batch_size", "rollout/prompt_index")} for r in rows]
    assert tool.crossings(bare, 9, batch_size=4) == (2, None)
    with pytest.raises(ValueError, match="pass --batch-size"):
        tool.crossings(bare, 9)


def _git(cwd, *args):
    import subprocess

    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(cwd), *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_done_json_records_utc_start_end_and_the_code_commit_and_compare_prints_them(
    sweep_file, tmp_path, monkeypatch, capsys
):
    from datetime import datetime

    from sao_megatron import provenance

    monkeypatch.setenv("STUB_FAIL", "high/seed2")  # fails once, then resumes: two attempts
    assert main(["sweep", str(sweep_file)]) == 1
    assert main(["sweep", str(sweep_file)]) == 0
    head = _git(provenance.PACKAGE_DIR, "rev-parse", "HEAD")
    out = tmp_path / "out"
    for done_path in out.glob("*/seed*/done.json"):
        done = json.loads(done_path.read_text())
        started, ended = (datetime.fromisoformat(done[k]) for k in ("started_utc", "ended_utc"))
        assert started.utcoffset() is not None and started.utcoffset().total_seconds() == 0  # UTC, offset written
        assert started <= ended and (ended - started).total_seconds() >= done["wall_s"] - 1
        assert done["commit"] == head and isinstance(done["dirty"], bool)
    resumed = json.loads((out / "high" / "seed2" / "done.json").read_text())
    assert len(resumed["attempts"]) == 2 and resumed["started_utc"] == resumed["attempts"][0]["started_utc"]
    assert resumed["started_utc"] <= resumed["attempts"][1]["started_utc"]

    # compare: per arm, the runs recording provenance, the first start, the last end and the code
    (out / "low" / "seed3" / "done.json").write_text('{"arm": "low", "seed": 3, "exit": 0, "wall_s": 1.0}')
    capsys.readouterr()
    assert main(["compare", str(out)]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if " of " in line}
    dones = [json.loads((out / "high" / f"seed{s}" / "done.json").read_text()) for s in (1, 2, 3)]
    first, last = min(d["started_utc"] for d in dones), max(d["ended_utc"] for d in dones)
    code = head[:7] + (" dirty" if dones[0]["dirty"] else "")
    assert rows["high"] == f"| high | 3 of 3 | {first} | {last} | {code} x3 |"
    assert rows["low"].startswith("| low | 2 of 3 |")  # a done.json from before provenance is not counted
    (out / "low" / "seed1" / "done.json").unlink()
    (out / "low" / "seed2" / "done.json").unlink()
    assert main(["compare", str(out)]) == 0
    assert "| low | 0 of 3 | - | - | not recorded (done.json written before provenance was recorded) |" in (
        capsys.readouterr().out
    )


def test_code_version_reads_head_and_tracked_changes_and_says_when_there_is_no_checkout(tmp_path):
    from sao_megatron import provenance

    plain = tmp_path / "plain"
    plain.mkdir()
    version = provenance.code_version(plain)
    assert version["commit"] is None and version["dirty"] is None
    assert version["no_commit"].startswith(f"not a git checkout: {plain}")
    assert provenance.describe(version).startswith("not a git checkout")

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-q", "-m", "a")
    head = _git(repo, "rev-parse", "HEAD")
    assert provenance.code_version(repo) == {"commit": head, "dirty": False}
    (repo / "new.py").write_text("")  # untracked: not counted
    assert provenance.code_version(repo)["dirty"] is False
    (repo / "a.py").write_text("x = 2\n")
    assert provenance.code_version(repo) == {"commit": head, "dirty": True}
    assert provenance.describe({"commit": head, "dirty": True}) == f"{head[:7]} dirty"
