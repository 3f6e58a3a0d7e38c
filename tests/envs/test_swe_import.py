"""``sao swe import``: SWE-bench records in the real schema, built from local git repositories.

One module fixture builds two tiny Python packages with history (one a clone with a work tree at
``MIRROR/<owner>__<name>``, one a bare mirror at ``MIRROR/<owner>/<name>.git``; a binary file, a
symbolic link, and a later commit at HEAD that the records' test patches do not apply to), writes
five good records (``FAIL_TO_PASS`` / ``PASS_TO_PASS`` JSON-encoded, as on the Hub) and six bad
ones, and runs ``sao swe import --verify`` on them once: every test reads that one run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from sao_megatron.cli import main
from sao_megatron.envs.swe.env import SWEEnv, SWETaskSet
from sao_megatron.envs.swe.tasks import git, load_tasks, snapshot_commit, unified_diff

pytestmark = pytest.mark.timeout(300)

OPS_A = """def add(a, b):
    return a + b


def mean(xs):
    return sum(xs) / (len(xs) + 1)


def clamp(x, lo, hi):
    return max(lo, x)
"""
OPS_B = (
    OPS_A.replace("(len(xs) + 1)", "len(xs)")
    + """

def median(xs):
    return xs[len(xs) // 2]
"""
)
TEST_OPS = "from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
CALC_A = {"calc/__init__.py": "", "calc/ops.py": OPS_A, "tests/test_ops.py": TEST_OPS, "README.md": "calc\n"}
CALC_B = {**CALC_A, "calc/ops.py": OPS_B}
CALC_HEAD = {
    **CALC_B,
    "tests/test_ops.py": "from calc import ops\n\n\ndef test_add():\n    assert ops.add(1, 1) == 2\n",
}

CORE = """def shout(s):
    return s.upper() + "!"


def slug(s):
    return s.lower().replace(" ", "_")


def initials(name):
    return "".join(w[0] for w in name.split(" "))
"""
TEST_CORE = "from strs.core import shout\n\n\ndef test_shout():\n    assert shout('hi') == 'HI!'\n"
STRS_A = {"strs/__init__.py": "", "strs/core.py": CORE, "tests/test_core.py": TEST_CORE}
STRS_HEAD = {**STRS_A, "tests/test_core.py": TEST_CORE.replace("'hi'", "'yo'").replace("'HI!'", "'YO!'")}


def edit(files: dict[str, str], path: str, text: str) -> str:
    """A git-style patch of ``files`` that sets ``path`` to ``text``."""
    return unified_diff(files, {**files, path: text})


def record(instance_id, repo, commit, patch, test_patch, f2p, p2p) -> dict:
    return {
        "instance_id": instance_id,
        "repo": repo,
        "base_commit": commit,
        "problem_statement": f"issue of {instance_id}\n",
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(f2p),  # JSON-encoded strings, as in the Hub's datasets
        "PASS_TO_PASS": json.dumps(p2p),
        "environment_setup_commit": commit,
        "version": "0.1",
        "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z",
    }


def commit_snapshots(root: Path, snapshots: list[dict[str, str]]) -> list[str]:
    """A repository at ``root`` whose commits hold ``snapshots`` in order; their ids."""
    root.mkdir(parents=True)
    assert git(["init", "-q"], root).returncode == 0
    (root / "calc_logo.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")  # binary: left out
    os.symlink("README.txt", root / "LINK")  # a symbolic link: left out
    ids = []
    for files in snapshots:
        for path in git(["ls-files"], root).stdout.splitlines():
            if path not in ("calc_logo.bin", "LINK"):
                (root / path).unlink()
        for path, text in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        for args in (["add", "-A"], ["commit", "-q", "-m", f"snapshot {len(ids)}"]):
            assert git(args, root).returncode == 0
        ids.append(git(["rev-parse", "HEAD"], root).stdout.strip())
    return ids


def tree_state(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*"))


GOOD = ["acme__calc-1", "acme__calc-2", "acme__calc-3", "beta__strs-1", "beta__strs-2"]
BAD = {  # instance id -> the kind of reason it is skipped for
    "beta__strs-broken": "test patch does not apply",
    "acme__calc-passes": "passes before the gold patch",
    "beta__strs-wrongfix": "fails with the gold patch",
    "acme__calc-django": "not pytest node ids",
    "ghost__none-1": "no mirror",
    "empty__repo-1": "no mirror",
    "acme__calc-1": "duplicate instance_id",
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swe_import")
    mirrors = tmp / "mirrors"
    a, b, _ = commit_snapshots(mirrors / "acme__calc", [CALC_A, CALC_B, CALC_HEAD])
    s, _ = commit_snapshots(tmp / "strs_src", [STRS_A, STRS_HEAD])
    (mirrors / "beta").mkdir()
    clone = git(["clone", "-q", "--bare", str(tmp / "strs_src"), str(mirrors / "beta" / "strs.git")], tmp)
    assert clone.returncode == 0, clone.stderr

    mean_fix = edit(CALC_A, "calc/ops.py", OPS_A.replace("(len(xs) + 1)", "len(xs)"))
    mean_test = edit(
        CALC_A,
        "tests/test_ops.py",
        TEST_OPS.replace("add\n", "add, mean\n") + "\n\ndef test_mean():\n    assert mean([1, 2, 3]) == 2\n",
    )
    clamp_fix = edit(CALC_A, "calc/ops.py", OPS_A.replace("max(lo, x)", "min(hi, max(lo, x))"))
    clamp_test = edit(
        CALC_A,
        "tests/test_clamp.py",
        "from calc.ops import clamp\n\n\ndef test_high():\n    assert clamp(9, 0, 5) == 5\n\n\n"
        "def test_low():\n    assert clamp(-1, 0, 5) == 0\n",
    )
    median_fix = edit(CALC_B, "calc/ops.py", OPS_B.replace("xs[len(xs) // 2]", "sorted(xs)[len(xs) // 2]"))
    median_test = edit(
        CALC_B,
        "tests/test_median.py",
        "from calc.ops import median\n\n\ndef test_median():\n    assert median([3, 1, 2]) == 2\n",
    )
    slug_fix = edit(STRS_A, "strs/core.py", CORE.replace('"_"', '"-"'))
    slug_test = edit(
        STRS_A,
        "tests/test_core.py",
        TEST_CORE.replace("shout\n", "shout, slug\n") + "\n\ndef test_slug():\n    assert slug('A b') == 'a-b'\n",
    )
    initials_fix = edit(STRS_A, "strs/core.py", CORE.replace('name.split(" ")', "name.split()"))
    initials_test = edit(
        STRS_A,
        "tests/test_initials.py",
        "from strs.core import initials\n\n\ndef test_spaces():\n    assert initials('a  b') == 'ab'\n",
    )
    ops, clamp_t, core = "tests/test_ops.py", "tests/test_clamp.py", "tests/test_core.py"
    rows = [
        record("acme__calc-1", "acme/calc", a, mean_fix, mean_test, [f"{ops}::test_mean"], [f"{ops}::test_add"]),
        record(
            "acme__calc-2",
            "acme/calc",
            a,
            clamp_fix,
            clamp_test,
            [f"{clamp_t}::test_high"],
            [f"{clamp_t}::test_low", f"{ops}::test_add"],
        ),
        record(
            "acme__calc-3",
            "acme/calc",
            b,
            median_fix,
            median_test,
            ["tests/test_median.py::test_median"],
            [f"{ops}::test_add"],
        ),
        record("beta__strs-1", "beta/strs", s, slug_fix, slug_test, [f"{core}::test_slug"], [f"{core}::test_shout"]),
        record(
            "beta__strs-2",
            "beta/strs",
            s,
            initials_fix,
            initials_test,
            ["tests/test_initials.py::test_spaces"],
            [f"{core}::test_shout"],
        ),
        # a test patch written against another commit (HEAD's test file): does not apply at base_commit
        record(
            "beta__strs-broken",
            "beta/strs",
            s,
            slug_fix,
            edit(STRS_HEAD, core, STRS_HEAD[core] + "\n# more\n"),
            [f"{core}::test_shout"],
            [],
        ),
        record("acme__calc-passes", "acme/calc", a, mean_fix, mean_test, [f"{ops}::test_add"], []),
        record(
            "beta__strs-wrongfix", "beta/strs", s, slug_fix, initials_test, ["tests/test_initials.py::test_spaces"], []
        ),
        record("acme__calc-django", "acme/calc", a, mean_fix, mean_test, ["test_mean (tests.test_ops.OpsTest)"], []),
        record("ghost__none-1", "ghost/none", a, mean_fix, mean_test, [f"{ops}::test_mean"], []),
    ]
    (mirrors / "empty__repo").mkdir()  # a directory that is not a git repository
    rows.append({**rows[0], "instance_id": "empty__repo-1", "repo": "empty/repo"})
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, '{"instance_id": "cut-off", "repo": ')  # a line that is not JSON
    lines.append(json.dumps(rows[0]))  # acme__calc-1 again
    records = tmp / "records.jsonl"
    records.write_text("\n".join(lines) + "\n")
    before = tree_state(mirrors)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(
            ["swe", "import", str(records), "--repos", str(mirrors), "--verify", "--out", str(tmp / "tasks.jsonl")]
        )
    return {
        "rc": rc,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
        "out": tmp / "tasks.jsonl",
        "records": records,
        "mirrors": mirrors,
        "mirror_state": before,
        "commits": {"a": a, "b": b, "s": s},
        "rows": rows,
    }


def test_five_verified_and_broken_records_skipped_with_ids(imported):
    lines = imported["stdout"].splitlines()
    assert imported["rc"] == 1, imported["stdout"] + imported["stderr"]  # some records skipped
    verified = [line.split()[1].rstrip(":") for line in lines if line.startswith("imported ") and "verified:" in line]
    assert verified == GOOD
    assert "4 files (2 left out: LINK (symbolic link), calc_logo.bin (binary))" in lines[0]
    skipped = [json.loads(line) for line in Path(f"{imported['out']}.skipped.jsonl").read_text().splitlines()]
    cut = skipped.pop(0)  # the line that is not JSON has no id: its file:line stands for it
    assert cut["instance_id"] == cut["where"] == f"{imported['records']}:4" and cut["kind"] == "bad record"
    assert {s["instance_id"]: s["kind"] for s in skipped} == BAD and len(skipped) == len(BAD)
    for s in [cut, *skipped]:  # each reported on its own line with its id
        where = "" if s is cut else f" ({s['where']})"
        assert f"skipped {s['instance_id']}{where}: {s['reason']}" in lines
    broken = next(s for s in skipped if s["instance_id"] == "beta__strs-broken")
    assert "git apply --check at base_commit" in broken["reason"]
    assert "'tests/test_ops.py::test_add' passes without the fix" in next(
        s["reason"] for s in skipped if s["instance_id"] == "acme__calc-passes"
    )
    assert "tests/test_initials.py::test_spaces failed" in next(
        s["reason"] for s in skipped if s["instance_id"] == "beta__strs-wrongfix"
    )
    summary = lines[-1]
    assert summary.startswith("imported 5, skipped 8 (") and "test patch does not apply: 1" in summary
    assert "bad record: 1" in summary and str(imported["out"]) in summary


def test_imported_file_loads_and_an_episode_resets(imported):
    tasks = {t.instance_id: t for t in load_tasks(imported["out"])}
    assert sorted(tasks) == GOOD
    rows = {json.loads(line)["instance_id"]: json.loads(line) for line in imported["out"].read_text().splitlines()}
    commits = imported["commits"]
    for name, task in tasks.items():
        row = rows[name]
        assert task.base_commit == snapshot_commit(task.files) == row["base_commit"]
        assert row["upstream_base_commit"] == row["environment_setup_commit"] and row["version"] == "0.1"
        assert isinstance(row["FAIL_TO_PASS"], list) and "hints_text" not in row
        assert "calc_logo.bin" not in task.files and "LINK" not in task.files  # binary, symbolic link
    assert rows["acme__calc-1"]["upstream_base_commit"] == commits["a"]
    assert tasks["acme__calc-1"].files == CALC_A and tasks["acme__calc-3"].files == CALC_B  # base, not HEAD
    assert tasks["beta__strs-2"].files == STRS_A and rows["beta__strs-2"]["upstream_base_commit"] == commits["s"]
    task_set = SWETaskSet(imported["out"])
    sample = task_set.get("train", 0)
    env = SWEEnv()
    try:
        env.reset(sample)
        assert env.workspace is not None
        task = sample.meta["task"]
        assert git(["rev-parse", "HEAD"], env.workspace).stdout.strip() == task.base_commit
        assert (env.workspace / "calc" / "ops.py").read_text() == task.files["calc/ops.py"]
    finally:
        env.close()


def test_mirrors_are_not_written(imported):
    assert tree_state(imported["mirrors"]) == imported["mirror_state"]


def test_parquet_records_import_the_same_rows(imported, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "records.parquet"
    pq.write_table(pa.Table.from_pylist(imported["rows"][:2]), path)
    rc = main(["swe", "import", str(path), "--repos", str(imported["mirrors"]), "--out", str(tmp_path / "t.jsonl")])
    assert rc == 0 and not (tmp_path / "t.jsonl.skipped.jsonl").exists()
    assert (tmp_path / "t.jsonl").read_text().splitlines() == imported["out"].read_text().splitlines()[:2]


def test_bad_arguments_are_one_line_errors(imported, tmp_path, capsys):
    base = ["swe", "import", str(imported["records"]), "--out", str(tmp_path / "t.jsonl")]
    assert main([*base, "--from-image", "docker://swebench/x"]) == 2
    assert "--from-image is not supported yet" in capsys.readouterr().err
    assert main([*base, "--repos", str(tmp_path / "nowhere")]) == 2
    assert f"--repos {tmp_path / 'nowhere'}: not a directory" in capsys.readouterr().err
    assert main([*base, "--repos", str(imported["mirrors"]), "--verify", "--env-kwargs", '{"max_turnz": 3}']) == 2
    assert "max_turnz" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()
