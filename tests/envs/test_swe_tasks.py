"""SWE tasks: the record schema, the generator's determinism, materialised repositories, and the
hidden-test reward on every shipped task (reference fix -> 1, untouched -> 0, a fix that breaks
a PASS_TO_PASS test -> 0). One pytest process per task and stage; the repositories are tiny."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sao_megatron.config.schema import ConfigError
from sao_megatron.envs.swe.reward import CommandResult, compute_reward, episode_patch, parse_outcomes
from sao_megatron.envs.swe.tasks import (
    DATA_PATH,
    REQUIRED,
    SWETask,
    git,
    load_tasks,
    materialise,
    patched_paths,
    snapshot_commit,
    unified_diff,
)

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "tools" / "make_swe_tasks.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_swe_tasks", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
TASKS = load_tasks()
SPECS = {spec.instance_id: spec for spec in gen.SPECS}


def apply(root: Path, patch: str) -> None:
    out = git(["apply", "-"], root, input=patch)
    assert out.returncode == 0, out.stderr


# ---- the shipped set ------------------------------------------------------------------------


def test_shipped_file_is_the_generators_output():
    assert DATA_PATH.read_text(encoding="utf-8") == gen.build(), "rerun python tools/make_swe_tasks.py"


def test_generator_cli_writes_the_shipped_file_parquet_and_checks(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(GENERATOR), "--out", str(out)]
    subprocess.run([*cmd, "--parquet"], check=True, capture_output=True, timeout=120)
    assert (out / "tasks.jsonl").read_bytes() == DATA_PATH.read_bytes()
    from_parquet = load_tasks(out / "tasks.parquet")
    assert [dataclasses.replace(t, source="") for t in from_parquet] == [
        dataclasses.replace(t, source="") for t in TASKS
    ]
    (out / "tasks.jsonl").write_text(DATA_PATH.read_text(encoding="utf-8").replace("pager", "pages"))
    check = subprocess.run([*cmd, "--check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and "differs from the generator" in check.stdout


def test_task_set_is_large_varied_and_well_formed():
    assert len(TASKS) >= 30
    assert len({t.instance_id for t in TASKS}) == len(TASKS)
    assert len({t.bug_kind for t in TASKS}) >= 15
    multi = [t for t in TASKS if len(patched_paths(t.patch)) >= 2]
    assert len(multi) >= 5, [t.instance_id for t in multi]
    for t in TASKS:
        assert t.fail_to_pass and t.pass_to_pass, t.instance_id
        assert not set(t.fail_to_pass) & set(t.pass_to_pass)
        assert all(not p.startswith("tests/") for p in patched_paths(t.patch)), "the fix must not touch tests"
        assert all(p.startswith("tests/") for p in patched_paths(t.test_patch))
        assert t.base_commit == snapshot_commit(t.files)
        added = [line[1:].strip() for line in t.patch.splitlines() if line.startswith("+") and line[1:].strip()]
        leaked = [line for line in added if len(line) > 12 and line in t.problem_statement]
        assert not leaked, f"{t.instance_id}: the issue text gives the fix away: {leaked}"


# ---- schema errors --------------------------------------------------------------------------


def _record() -> dict:
    return json.loads(DATA_PATH.read_text(encoding="utf-8").splitlines()[0])


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), "utf-8")
    return path


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_key_names_file_line_and_key(tmp_path, key):
    bad = _record()
    del bad[key]
    path = _write(tmp_path / "t.jsonl", [_record(), bad])
    with pytest.raises(ConfigError, match=rf"t\.jsonl:2: no field '{key}'"):
        load_tasks(path)


def test_bad_json_line(tmp_path):
    path = _write(tmp_path / "t.jsonl", [_record(), '{"instance_id": '])
    with pytest.raises(ConfigError, match=r"t\.jsonl:2: bad JSON"):
        load_tasks(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base_commit": "0" * 40}, "is not the commit of the files snapshot"),
        ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS is a string but not a JSON list"),
        ({"PASS_TO_PASS": [1]}, "PASS_TO_PASS must be a list"),
        ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
        ({"files": {"../evil.py": "x"}}, "relative path inside the repository"),
        ({"patch": ""}, "patch must be a non-empty string"),
        ({"PASS_TO_PASS": _record()["FAIL_TO_PASS"][:1]}, "is in both FAIL_TO_PASS and PASS_TO_PASS"),
    ],
)
def test_invalid_fields(tmp_path, change, message):
    path = _write(tmp_path / "t.jsonl", [{**_record(), **change}])
    with pytest.raises(ConfigError, match=rf"t\.jsonl:1: .*{message}"):
        load_tasks(path)


def test_hub_style_json_string_lists_and_duplicate_ids(tmp_path):
    row = _record()
    hub = {
        **row,
        "FAIL_TO_PASS": json.dumps(row["FAIL_TO_PASS"]),
        "PASS_TO_PASS": json.dumps(row["PASS_TO_PASS"]),
    }
    (task,) = load_tasks(_write(tmp_path / "hub.jsonl", [hub]))
    assert task.fail_to_pass == tuple(row["FAIL_TO_PASS"])
    with pytest.raises(ConfigError, match=r"dup\.jsonl:2: instance_id .* repeats .*dup\.jsonl:1"):
        load_tasks(_write(tmp_path / "dup.jsonl", [row, row]))


# ---- repositories and patches ---------------------------------------------------------------


def test_materialise_gives_base_commit_and_clean_tree(tmp_path):
    task = TASKS[0]
    root = materialise(task, tmp_path / "repo")
    assert git(["rev-parse", "HEAD"], root).stdout.strip() == task.base_commit
    assert git(["status", "--porcelain"], root).stdout == ""
    assert episode_patch(root, task.base_commit) == ""
    with pytest.raises(FileExistsError):
        materialise(task, root)


def test_unified_diff_applies_with_git(tmp_path):
    before = {"a.py": "x = 1\ny = 2\n", "gone.py": "bye\n", "d/keep.txt": "same\n", "tail.txt": "no newline"}
    after = {
        "a.py": "x = 1\ny = 3\n",
        "d/keep.txt": "same\n",
        "d/new.txt": "hello\n",
        "tail.txt": "no newline!",
    }
    task = SWETask("t", "o/r", snapshot_commit(before), "p", "x", "x", ("a",), (), before)
    root = materialise(task, tmp_path / "repo")
    apply(root, unified_diff(before, after))
    files = {
        p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts
    }
    assert files == after


def test_parse_outcomes_reads_the_rA_summary():
    output = (
        "..F\n=== short test summary info ===\n"
        "PASSED tests/t.py::test_a\nPASSED tests/t.py::test_b\nERROR tests/t.py::test_b - teardown boom\n"
        "FAILED tests/t.py::test_c - assert 1 == 2\nPASSED tests/t.py::test_cc\n"
    )
    got = parse_outcomes(
        output, ["tests/t.py::test_a", "tests/t.py::test_b", "tests/t.py::test_c", "tests/t.py::test_d"]
    )
    assert got == {
        "tests/t.py::test_a": "passed",
        "tests/t.py::test_b": "error",
        "tests/t.py::test_c": "failed",
        "tests/t.py::test_d": "missing",
    }


# ---- the reward -----------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS, ids=[t.instance_id for t in TASKS])
def test_reward_reference_untouched_and_broken(tmp_path, task):
    """The scripted checks of the acceptance, at the reward level, on every shipped task."""
    root = materialise(task, tmp_path / "repo")
    untouched = compute_reward(root, task)
    assert (untouched.reward, untouched.resolved, untouched.patch) == (0.0, False, "")
    assert all(untouched.outcomes[t] != "passed" for t in task.fail_to_pass), untouched.outcomes
    assert all(untouched.outcomes[t] == "passed" for t in task.pass_to_pass), untouched.outcomes

    apply(root, task.patch)  # on top of the applied test patch: reward restores the test files first
    fixed = compute_reward(root, task)
    assert (fixed.reward, fixed.resolved, fixed.reason) == (1.0, True, "resolved"), fixed.outcomes
    assert patched_paths(fixed.patch) == patched_paths(task.patch)  # the agent's change, no test patch

    broken_root = materialise(task, tmp_path / "broken")
    apply(broken_root, gen.breaking_patch(SPECS[task.instance_id]))
    broken = compute_reward(broken_root, task, mode="all_tests_fraction")
    assert broken.resolved is False
    assert all(broken.outcomes[t] == "passed" for t in task.fail_to_pass), broken.outcomes
    assert any(broken.outcomes[t] != "passed" for t in task.pass_to_pass), broken.outcomes
    n_pass = sum(o == "passed" for o in broken.outcomes.values())
    assert broken.reward == n_pass / len(task.tests) < 1.0


def _fake_runner(output: str, calls: list):
    def runner(argv, cwd, timeout_s):
        calls.append((list(argv), cwd, timeout_s))
        return CommandResult(1, output, False, 0.1)

    return runner


def test_partial_credit_modes_and_swappable_runner(tmp_path):
    task = next(t for t in TASKS if len(t.fail_to_pass) == 2)
    f2p, p2p = task.fail_to_pass, task.pass_to_pass
    output = "\n".join([f"PASSED {f2p[0]}", f"FAILED {f2p[1]} - nope", *(f"PASSED {t}" for t in p2p)])
    calls: list = []
    rewards = {}
    for mode in ("all", "fail_to_pass_fraction", "all_tests_fraction"):
        root = materialise(task, tmp_path / mode)
        rewards[mode] = compute_reward(root, task, mode=mode, runner=_fake_runner(output, calls), timeout_s=7)
    assert rewards["all"].reward == 0.0
    assert rewards["fail_to_pass_fraction"].reward == 0.5
    assert rewards["all_tests_fraction"].reward == (len(task.tests) - 1) / len(task.tests)
    argv, cwd, timeout_s = calls[0]
    assert argv[1:4] == ["-m", "pytest", "-q"] and argv[-len(task.tests) :] == list(task.tests)
    assert (cwd, timeout_s) == (tmp_path / "all", 7)
    # a failing PASS_TO_PASS test zeroes the FAIL_TO_PASS fraction
    output = "\n".join([*(f"PASSED {t}" for t in f2p), f"FAILED {p2p[0]}"])
    root = materialise(task, tmp_path / "p2p")
    result = compute_reward(root, task, mode="fail_to_pass_fraction", runner=_fake_runner(output, []))
    assert result.reward == 0.0 and "did not pass" in result.reason
    with pytest.raises(ValueError, match="unknown SWE reward mode"):
        compute_reward(root, task, mode="most")  # type: ignore[arg-type]


def test_agent_cannot_weaken_the_hidden_tests(tmp_path):
    task = TASKS[0]
    root = materialise(task, tmp_path / "repo")
    test_file = patched_paths(task.test_patch)[0]
    (root / test_file).write_text("def test_page_count_rounds_up():\n    pass\n")  # agent rewrites the tests
    (root / "notes.md").write_text("untracked\n")
    result = compute_reward(root, task)
    assert result.reward == 0.0 and all(result.outcomes[t] != "passed" for t in task.fail_to_pass)
    assert "new file mode" in result.patch and "b/notes.md" in result.patch
    assert test_file not in result.patch  # replaced before the tests ran: not part of the judged change


def test_test_patch_that_does_not_apply_gives_zero(tmp_path):
    task = TASKS[0]
    root = materialise(task, tmp_path / "repo")
    stale = dataclasses.replace(
        task, test_patch=task.test_patch.replace(" def test_page_count_exact", " def test_other")
    )
    result = compute_reward(root, stale)
    assert (result.reward, dict(result.outcomes)) == (0.0, {})
    assert result.reason.startswith("test patch did not apply")


def test_hanging_tests_time_out(tmp_path):
    task = TASKS[0]
    root = materialise(task, tmp_path / "repo")
    package = next(p for p in task.files if p.endswith("__init__.py"))
    (root / package).write_text("import time\ntime.sleep(60)\n")
    result = compute_reward(root, task, timeout_s=1.5)
    assert result.reward == 0.0 and result.reason == "tests timed out after 1.5s"
    assert set(result.outcomes.values()) == {"timeout"} and result.wall_s < 30  # not the 60-s sleep
    assert result.as_result().details["reason"] == result.reason


def test_deleted_repository_gives_zero(tmp_path):
    task = TASKS[0]
    root = materialise(task, tmp_path / "repo")
    apply(root, task.patch)
    shutil.rmtree(root / ".git")
    result = compute_reward(root, task)
    assert result.reward == 0.0 and result.reason.startswith("no episode patch")
