"""Write the bundled SWE task set, ``sao_megatron/envs/data/swe/tasks.jsonl``, deterministically.

Each task is a tiny Python repository with one real bug, an issue text describing the symptom,
the hidden reference fix (``patch``), and the tests that judge it (``test_patch``), in the
SWE-bench instance schema (see :mod:`sao_megatron.envs.swe.tasks`). The tasks are data, one
directory each under ``tools/swe_tasks/`` (their order in the output: ``tools/swe_tasks/index.yaml``)::

    tools/swe_tasks/<name>/repo/...     the buggy snapshot as real files (its existing tests pass
                                        before and after the fix)
    tools/swe_tasks/<name>/task.yaml    kind:       the kind of bug (the record's ``bug_kind``)
                                        problem:    the issue text
                                        test_file:  the snapshot's test file the new tests go into
                                        new_tests:  appended to it by the test patch; every
                                                    ``def test_*`` in it is FAIL_TO_PASS
                                        fix:        the reference fix, exact text replacements
                                                    ``{path, old, new}`` (``old`` occurs once)
                                        breaks:     a *breaking* edit applied on top of the fix:
                                                    a PASS_TO_PASS test fails while the fix still
                                                    stands (the reward tests check that breaking
                                                    working code earns 0)

FAIL_TO_PASS are the new tests, PASS_TO_PASS every test already in the repository. Every snapshot
also gets ``.gitignore`` and ``pytest.ini`` (:data:`COMMON`). The snapshots are excluded from ruff
(``pyproject.toml``) and lie outside pytest's ``testpaths``: they are the tasks' code, bugs included.

Usage::

    python tools/make_swe_tasks.py                 # (re)write the shipped file
    python tools/make_swe_tasks.py --check         # exit 1 if the shipped file differs
    python tools/make_swe_tasks.py --verify        # also run every task's tests (about 1 s a task)
    python tools/make_swe_tasks.py --out DIR --parquet   # write elsewhere, plus tasks.parquet

``--verify`` materialises each task, applies ``test_patch`` and checks that FAIL_TO_PASS fail and
PASS_TO_PASS pass, then applies ``patch`` and checks all pass, then the breaking edit and checks
that a PASS_TO_PASS test fails while FAIL_TO_PASS still pass.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sao_megatron.envs.swe.reward import local_runner, parse_outcomes, pytest_command  # noqa: E402
from sao_megatron.envs.swe.tasks import (  # noqa: E402
    DATA_PATH,
    SWETask,
    git,
    materialise,
    parse_task,
    snapshot_commit,
    unified_diff,
)

TASKS_DIR = Path(__file__).resolve().parent / "swe_tasks"
OWNER = "sao-tasks"
COMMON = {
    ".gitignore": "__pycache__/\n*.pyc\n.pytest_cache/\n",
    "pytest.ini": "[pytest]\ntestpaths = tests\n",
}
Edit = tuple[str, str, str]  # (path, old text, new text): old must occur exactly once


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str
    problem: str
    files: dict[str, str]
    """Source files and the existing tests (all pass before and after the fix)."""
    test_file: str
    new_tests: str
    """Appended to ``test_file`` by the test patch; every ``def test_*`` in it is FAIL_TO_PASS."""
    fix: list[Edit]
    breaks: list[Edit]
    """Applied after ``fix``: makes a PASS_TO_PASS test fail, FAIL_TO_PASS still pass."""

    @property
    def instance_id(self) -> str:
        return f"{OWNER}__{self.name}-1"


def edit(files: dict[str, str], edits: list[Edit]) -> dict[str, str]:
    out = dict(files)
    for path, old, new in edits:
        if out[path].count(old) != 1:
            raise ValueError(f"edit of {path}: {old!r} occurs {out[path].count(old)} times, not once")
        out[path] = out[path].replace(old, new)
    return out


def _tests_in(text: str) -> list[str]:
    return re.findall(r"^def (test_\w+)", text, flags=re.M)


def snapshots(spec: Spec) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(base snapshot, snapshot with the test patch, snapshot with test patch + fix)."""
    base = dict(sorted({**COMMON, **spec.files}.items()))
    with_tests = dict(base)
    with_tests[spec.test_file] = base.get(spec.test_file, "") + "\n\n" + spec.new_tests
    return base, with_tests, edit(with_tests, spec.fix)


def record(spec: Spec) -> dict:
    base, with_tests, fixed = snapshots(spec)
    f2p = [f"{spec.test_file}::{t}" for t in _tests_in(spec.new_tests)]
    p2p = [f"{path}::{t}" for path, text in base.items() if path.startswith("tests/") for t in _tests_in(text)]
    return {
        "instance_id": spec.instance_id,
        "repo": f"{OWNER}/{spec.name}",
        "base_commit": snapshot_commit(base),
        "problem_statement": textwrap.dedent(spec.problem).strip() + "\n",
        "patch": unified_diff(with_tests, fixed),
        "test_patch": unified_diff(base, with_tests),
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "bug_kind": spec.kind,
        "files": base,
    }


def breaking_patch(spec: Spec) -> str:
    """Reference fix plus the breaking edit, as one patch against the base snapshot."""
    base, _, fixed = snapshots(spec)
    agent = edit(fixed, spec.breaks)
    agent[spec.test_file] = base[spec.test_file]  # the agent's change; the test patch comes later
    return unified_diff(base, agent)


# --------------------------------------------------------------------------------------------
# The tasks, read from tools/swe_tasks/. Each repository is a package plus tests/; issue texts
# describe symptoms only.
# --------------------------------------------------------------------------------------------

KEYS = ("kind", "problem", "test_file", "new_tests", "fix", "breaks")
SKIP = {"__pycache__", ".pytest_cache"}  # left behind by running a snapshot's tests in place


def _edits(name: str, key: str, items: list[dict]) -> list[Edit]:
    if not isinstance(items, list) or any(not isinstance(e, dict) or set(e) != {"path", "old", "new"} for e in items):
        raise ValueError(f"{name}/task.yaml: `{key}` must be a list of {{path, old, new}} mappings")
    return [(e["path"], e["old"], e["new"]) for e in items]


def load_spec(directory: Path) -> Spec:
    """One task from ``directory`` (``task.yaml`` and the snapshot under ``repo/``)."""
    name = directory.name
    meta = yaml.safe_load((directory / "task.yaml").read_text(encoding="utf-8"))
    if not isinstance(meta, dict) or set(meta) != set(KEYS):
        got = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{name}/task.yaml: expected the keys {list(KEYS)}, got {got}")
    repo = directory / "repo"
    paths = [p for p in sorted(repo.rglob("*")) if p.is_file() and not SKIP & set(p.relative_to(repo).parts)]
    files = {p.relative_to(repo).as_posix(): p.read_bytes().decode("utf-8") for p in paths}
    if not files:
        raise ValueError(f"{name}: no snapshot under {repo}")
    fix, breaks = (_edits(name, key, meta[key]) for key in ("fix", "breaks"))
    return Spec(name, meta["kind"], meta["problem"], files, meta["test_file"], meta["new_tests"], fix, breaks)


def load_specs(root: Path = TASKS_DIR) -> list[Spec]:
    """Every task, in the order of ``root/index.yaml``; a task directory missing from it is an error."""
    order = yaml.safe_load((root / "index.yaml").read_text(encoding="utf-8"))
    present = sorted(p.name for p in root.iterdir() if (p / "task.yaml").is_file())
    if sorted(order) != present:
        raise ValueError(f"{root}/index.yaml lists {sorted(order)}, the task directories are {present}")
    return [load_spec(root / name) for name in order]


SPECS: list[Spec] = load_specs()


def build(specs: list[Spec] = SPECS) -> str:
    """The JSONL text of the task set (one record per line, in SPECS order)."""
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError("task names repeat")
    lines = []
    for spec in specs:
        if spec.test_file not in spec.files or any(path.startswith("tests/") for path, _, _ in spec.fix):
            raise ValueError(f"{spec.name}: the test file must exist and the fix must not touch tests/")
        rec = record(spec)
        parse_task(rec, spec.name)  # the loader's checks, at generation time
        lines.append(json.dumps(rec, ensure_ascii=False, sort_keys=False) + "\n")
    return "".join(lines)


def verify_task(task: SWETask, spec: Spec, timeout_s: float = 60.0) -> list[str]:
    """Problems with one task (empty when it is sound): see the module docstring."""
    problems = []
    stages = [("base", ""), ("fixed", task.patch), ("broken", breaking_patch(spec))]
    for stage, patch in stages:
        with tempfile.TemporaryDirectory() as tmp:
            root = materialise(task, Path(tmp) / "repo")
            for p in (patch, task.test_patch):
                if p and git(["apply", "-"], root, input=p).returncode != 0:
                    problems.append(f"{stage}: a patch does not apply")
            run = local_runner(pytest_command(task.tests), root, timeout_s)
            out = parse_outcomes(run.output, task.tests)
        f2p = [out[t] == "passed" for t in task.fail_to_pass]
        p2p = [out[t] == "passed" for t in task.pass_to_pass]
        if stage == "base" and (any(f2p) or not all(p2p)):
            problems.append(f"base: FAIL_TO_PASS must fail and PASS_TO_PASS pass, got {out}")
        if stage == "fixed" and not (all(f2p) and all(p2p)):
            problems.append(f"fixed: every test must pass, got {out}")
        if stage == "broken" and not (all(f2p) and not all(p2p)):
            problems.append(f"broken: FAIL_TO_PASS must pass and a PASS_TO_PASS test fail, got {out}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_PATH.parent, help="directory for tasks.jsonl")
    parser.add_argument("--check", action="store_true", help="exit 1 if the shipped file differs")
    parser.add_argument("--verify", action="store_true", help="run every task's tests (see the docstring)")
    parser.add_argument("--parquet", action="store_true", help="also write tasks.parquet (needs pyarrow)")
    args = parser.parse_args()
    text = build()
    target = args.out / "tasks.jsonl"
    if args.check:
        same = target.is_file() and target.read_text(encoding="utf-8") == text
        print(f"{target}: {'up to date' if same else 'differs from the generator; rerun tools/make_swe_tasks.py'}")
        if not same:
            return 1
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        print(f"wrote {len(SPECS)} tasks to {target}")
        if args.parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            rows = [json.loads(line) for line in text.splitlines()]
            for row in rows:  # Parquet wants one schema: the snapshot as a JSON string is not it
                row["files"] = [{"path": k, "content": v} for k, v in row["files"].items()]
            pq.write_table(pa.Table.from_pylist(rows), args.out / "tasks.parquet")
    if args.verify:
        failed = 0
        for spec, line in zip(SPECS, text.splitlines(), strict=True):
            task = parse_task(json.loads(line), spec.name)
            problems = verify_task(task, spec)
            failed += bool(problems)
            print(f"{task.instance_id:40s} {'ok' if not problems else 'FAIL: ' + '; '.join(problems)}")
        print(f"verified {len(SPECS) - failed}/{len(SPECS)} tasks")
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
