"""``sao swe import``: real SWE-bench records (a repository mirror + ``base_commit``) as this
project's task file (:mod:`~sao_megatron.envs.swe.tasks`, records with a ``files`` snapshot).

A real record (SWE-bench, SWE-bench Verified, SWE-Gym, ...) carries ``instance_id``, ``repo``
(``owner/name``), ``base_commit``, ``problem_statement``, ``patch``, ``test_patch``,
``FAIL_TO_PASS`` / ``PASS_TO_PASS`` (lists, or JSON-encoded strings of lists),
``environment_setup_commit`` and ``version``, but not the repository. For each record, in order:

1. **Mirror**: the first directory of ``MIRROR_DIR/<owner>__<name>``,
   ``MIRROR_DIR/<owner>__<name>.git``, ``MIRROR_DIR/<owner>/<name>``, ``MIRROR_DIR/<owner>/<name>.git``
   (a bare mirror, e.g. ``git clone --mirror``, or a clone with a work tree).
2. **Snapshot** at ``base_commit``, read from the mirror's object store (``git ls-tree -r`` and
   ``git cat-file --batch``: no checkout, index or work tree, so the mirror is never written):
   every UTF-8 text file. Binary files, symbolic links and submodules are left out (the
   snapshot is text) and counted; executable bits are not kept.
3. **Task row**: the record's fields with ``files``; ``base_commit`` becomes the snapshot's own
   commit id (what :func:`~sao_megatron.envs.swe.tasks.materialise` creates), the mirror's commit
   is kept as ``upstream_base_commit``, ``environment_setup_commit`` and ``version`` are kept.
4. **Checks**: every FAIL_TO_PASS / PASS_TO_PASS id is a pytest node id (``path::name``) of a
   file in the snapshot or in ``test_patch`` (the env runs pytest; SWE-bench's Django and SymPy
   records name tests for other runners); materialised, ``test_patch`` and ``patch`` each apply.
5. ``verify=True``: through :class:`~sao_megatron.envs.swe.env.SWEEnv`, the sandbox and reward
   that train on the task: judged as materialised, no FAIL_TO_PASS test may pass; with the gold
   ``patch`` applied, every FAIL_TO_PASS and PASS_TO_PASS test must pass (reward 1).

A record that fails a step is skipped with its instance id and the reason; the others go on.
Imported rows stream into the task file (written under a temporary name, renamed at the end);
skipped records go to ``<out>.skipped.jsonl`` (id, where, kind, reason), so nothing is lost.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sao_megatron.config.schema import ConfigError
from sao_megatron.envs.base import Sample
from sao_megatron.envs.swe.tasks import (
    REQUIRED,
    SWETask,
    git,
    git_bytes,
    materialise,
    parse_task,
    patched_paths,
    snapshot_commit,
)

RECORD_FIELDS = tuple(f for f in REQUIRED if f != "files")  # a task row's fields but its snapshot
KEPT_FIELDS = ("environment_setup_commit", "version")
_REPO = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")
_COMMIT = re.compile(r"[0-9a-fA-F]{7,64}")
_TEXT_MODES = (b"100644", b"100755")


class RecordError(Exception):
    """One record cannot be imported: ``kind`` (a short category for the summary) and the detail."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass
class ImportReport:
    """What :func:`import_records` did: ids imported, ``(id, where, kind, reason)`` skipped."""

    out: Path
    imported: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str, str]] = field(default_factory=list)

    @property
    def skipped_path(self) -> Path:
        return self.out.with_name(self.out.name + ".skipped.jsonl")

    def summary(self) -> str:
        """One line: counts, the reasons by kind, and where the task file and the skipped list are."""
        line = f"imported {len(self.imported)}, skipped {len(self.skipped)}"
        if self.skipped:
            kinds = Counter(kind for _, _, kind, _ in self.skipped)
            line += " (" + ", ".join(f"{kind}: {n}" for kind, n in kinds.most_common()) + ")"
            line += f"; skipped records and reasons: {self.skipped_path}"
        written = f"tasks: {self.out}" if self.imported else "no task file written (nothing imported)"
        return f"{line}; {written}"


def find_mirror(mirrors: Path, repo: str) -> Path:
    """The mirror directory of ``repo`` (``owner/name``) under ``mirrors``; see the module docstring."""
    if not _REPO.fullmatch(repo) or any(part in (".", "..") for part in repo.split("/")):
        raise RecordError("bad record", f"repo {repo!r} is not 'owner/name'")
    owner, name = repo.split("/")
    for candidate in (
        mirrors / f"{owner}__{name}",
        mirrors / f"{owner}__{name}.git",
        mirrors / owner / name,
        mirrors / owner / f"{name}.git",
    ):
        if candidate.is_dir():
            return candidate
    raise RecordError(
        "no mirror",
        f"no mirror of {repo} in {mirrors} (looked for {owner}__{name}[.git] and {owner}/{name}[.git]); "
        f"clone it: git clone --mirror https://github.com/{repo} {mirrors}/{owner}__{name}.git",
    )


def read_snapshot(mirror: Path, commit: str) -> tuple[dict[str, str], list[str]]:
    """``({path: text}, left out)`` of the tree of ``commit`` in ``mirror``, read without writing."""
    if not _COMMIT.fullmatch(commit):
        raise RecordError("bad record", f"base_commit {commit!r} is not a hexadecimal commit id")
    resolved = git(["rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], mirror)
    if "not a git repository" in resolved.stderr:
        raise RecordError("no mirror", f"{mirror} is not a git repository; clone the mirror there")
    if resolved.returncode != 0:
        raise RecordError(
            "commit not in mirror",
            f"base_commit {commit} is not a commit of {mirror}; update the mirror (git -C {mirror} fetch)",
        )
    listing = git_bytes(["ls-tree", "-r", "-z", "--full-tree", resolved.stdout.strip()], mirror)
    if listing.returncode != 0:
        raise RecordError("commit not in mirror", f"git ls-tree {commit} in {mirror}: {listing.stderr.decode()[:200]}")
    paths: list[str] = []
    oids: list[bytes] = []
    left_out: list[str] = []
    for entry in filter(None, listing.stdout.split(b"\0")):
        meta, _, raw_path = entry.partition(b"\t")
        mode, kind, oid = meta.split()
        try:
            path = raw_path.decode("utf-8")
        except UnicodeDecodeError:
            left_out.append(f"{raw_path.decode('utf-8', 'replace')} (path not UTF-8)")
            continue
        if kind != b"blob" or mode not in _TEXT_MODES:
            left_out.append(f"{path} ({'submodule' if kind == b'commit' else 'symbolic link'})")
            continue
        paths.append(path)
        oids.append(oid)
    blobs = git_bytes(["cat-file", "--batch"], mirror, input=b"".join(oid + b"\n" for oid in oids))
    if blobs.returncode != 0:
        raise RecordError("commit not in mirror", f"git cat-file in {mirror}: {blobs.stderr.decode()[:200]}")
    files: dict[str, str] = {}
    data, pos = blobs.stdout, 0
    for path in paths:
        end = data.index(b"\n", pos)
        header = data[pos:end].split()  # <oid> blob <size>
        if len(header) != 3:
            raise RecordError("commit not in mirror", f"{path}: object {header[0].decode()} missing from {mirror}")
        size = int(header[2])
        content = data[end + 1 : end + 1 + size]
        pos = end + 2 + size
        try:
            if b"\0" in content:
                raise UnicodeDecodeError("utf-8", content, 0, 1, "NUL byte")
            files[path] = content.decode("utf-8")
        except UnicodeDecodeError:
            left_out.append(f"{path} (binary)")
    return files, left_out


def task_row(record: Mapping[str, Any], mirrors: Path, where: str) -> tuple[dict[str, Any], SWETask, list[str]]:
    """The task-file row of one real record, its :class:`SWETask` and the paths left out."""
    missing = [key for key in RECORD_FIELDS if key not in record]
    if missing:
        raise RecordError("bad record", f"no field {missing[0]!r}; a SWE-bench record needs {', '.join(RECORD_FIELDS)}")
    for key in ("repo", "base_commit"):
        if not isinstance(record[key], str):
            raise RecordError("bad record", f"{key} must be a string, got {repr(record[key])[:60]}")
    files, left_out = read_snapshot(find_mirror(mirrors, record["repo"]), record["base_commit"])
    row = {key: record[key] for key in RECORD_FIELDS}
    row["base_commit"] = snapshot_commit(files)
    row["upstream_base_commit"] = record["base_commit"]
    row.update({key: str(record[key]) for key in KEPT_FIELDS if record.get(key) is not None})
    row["files"] = files
    try:
        task = parse_task(row, where)
    except ConfigError as err:
        raise RecordError("bad record", str(err).removeprefix(f"{where}: ")) from None
    row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = list(task.fail_to_pass), list(task.pass_to_pass)
    known = set(files) | set(patched_paths(task.test_patch))
    for key, ids in (("FAIL_TO_PASS", task.fail_to_pass), ("PASS_TO_PASS", task.pass_to_pass)):
        for node in ids:
            if node.split("::", 1)[0] not in known:
                raise RecordError(
                    "not pytest node ids",
                    f"{key} {node!r} names no file of the repository or of test_patch; the swe env runs "
                    "pytest node ids (path/to/test_file.py::test_name)",
                )
    return row, task, left_out


def check_patches(task: SWETask) -> None:
    """``test_patch`` and ``patch`` each apply to the materialised snapshot."""
    with tempfile.TemporaryDirectory(prefix="sao_swe_import_") as tmp:
        root = materialise(task, Path(tmp) / "repo")
        for kind, patch in (("test patch does not apply", task.test_patch), ("gold patch does not apply", task.patch)):
            out = git(["apply", "--check", "-"], root, input=patch)
            if out.returncode != 0:
                first = (out.stderr.strip().splitlines() or ["git apply failed"])[0]
                raise RecordError(kind, f"git apply --check at base_commit: {first}")


def make_verifier(env_kwargs: Mapping[str, Any]) -> Callable[[SWETask], str]:
    """``verify(task) -> note``: the task judged in :class:`SWEEnv` (``env_kwargs``) without and
    with the gold patch; raises :class:`RecordError` when FAIL_TO_PASS / PASS_TO_PASS disagree."""
    from sao_megatron.envs.swe.env import SWEEnv  # the shell sandbox: only when verifying

    try:
        SWEEnv(**env_kwargs).close()
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"--env-kwargs {json.dumps(dict(env_kwargs))}: {err}; give SWEEnv's keyword arguments"
        ) from None

    def verify(task: SWETask) -> str:
        sample = Sample(
            prompt_id=f"swe:{task.instance_id}", question=task.problem_statement, answer="", meta={"task": task}
        )
        env = SWEEnv(**env_kwargs)
        try:
            env.reset(sample)
            before = env.reward().details
            outcomes = before["outcomes"]
            if not outcomes or "timeout" in outcomes.values():
                raise RecordError("tests did not run", f"without the gold patch: {before['reason']}")
            passing = [t for t in task.fail_to_pass if outcomes[t] == "passed"]
            if passing:
                raise RecordError("passes before the gold patch", f"FAIL_TO_PASS {passing[0]!r} passes without the fix")
            env.reset(sample)
            assert env.workspace is not None
            applied = git(["apply", "-"], env.workspace, input=task.patch)
            if applied.returncode != 0:
                raise RecordError("gold patch does not apply", applied.stderr.strip()[:200])
            after = env.reward()
            if not after.correct:
                raise RecordError("fails with the gold patch", after.details["reason"])
        finally:
            env.close()
        failing = Counter(outcomes[t] for t in task.fail_to_pass)
        return (
            f"verified: FAIL_TO_PASS before the fix {dict(failing)}, all {len(task.tests)} tests pass "
            f"with it ({after.details['test_wall_s']:.1f} s)"
        )

    return verify


def read_records(path: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """``(where, record or RecordError)`` per JSONL line / Parquet row; a bad line is a RecordError."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"{path}: reading Parquet needs pyarrow, which is not installed; "
                ".venv/bin/pip install pyarrow, or convert the records to JSONL"
            ) from None
        from sao_megatron.envs.dataset import _parquet_rows

        yield from _parquet_rows(path)
        return
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the records ({err.strerror}); check the path") from None
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        where = f"{path}:{lineno}"
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            yield where, RecordError("bad record", f"not a JSON line ({err}); write one JSON object per line")
            continue
        yield where, row if isinstance(row, dict) else RecordError("bad record", "not a JSON object")


def import_records(
    records: str | Path,
    mirrors: str | Path,
    out: str | Path,
    *,
    verify: bool = False,
    env_kwargs: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> ImportReport:
    """Import every record of ``records`` (JSONL or Parquet) from the mirrors into the task file
    ``out`` (JSONL); see the module docstring. Bad input that concerns no single record (no such
    file or directory, a bad ``out``) raises :class:`ConfigError`; a bad record is skipped."""
    records, mirrors, out = Path(records), Path(mirrors), Path(out)
    if not mirrors.is_dir():
        raise ConfigError(f"--repos {mirrors}: not a directory; give the directory holding the git mirrors")
    if out.suffix != ".jsonl":
        raise ConfigError(f"--out {out}: write a .jsonl task file (what rollout.task_kwargs.path reads)")
    if out.resolve() == records.resolve():
        raise ConfigError(f"--out {out} is the records file; write the tasks elsewhere")
    verifier = make_verifier(env_kwargs or {}) if verify else None
    report = ImportReport(out)
    seen: dict[str, str] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as sink:
            for where, record in read_records(records):
                name = where
                if isinstance(record, dict) and isinstance(record.get("instance_id"), str):
                    name = record["instance_id"] or where
                try:
                    if isinstance(record, RecordError):
                        raise record
                    if name in seen:
                        raise RecordError("duplicate instance_id", f"already imported from {seen[name]}")
                    row, task, left_out = task_row(record, mirrors, where)
                    check_patches(task)
                    note = verifier(task) if verifier is not None else "not verified"
                except (RecordError, RuntimeError, OSError, ValueError, subprocess.SubprocessError) as err:
                    kind = err.kind if isinstance(err, RecordError) else "import error"
                    reason = str(err) if isinstance(err, RecordError) else f"{kind}: {type(err).__name__}: {err}"
                    report.skipped.append((name, where, kind, reason))
                    log(f"skipped {name}{f' ({where})' if name != where else ''}: {reason}")
                    continue
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
                seen[name] = where
                report.imported.append(name)
                shown = ", ".join(left_out[:3]) + (", ..." if len(left_out) > 3 else "")
                log(
                    f"imported {name}: {len(task.files)} files ({len(left_out)} left out{': ' if shown else ''}{shown}); {note}"
                )
        _finish(report, Path(partial))
    finally:
        Path(partial).unlink(missing_ok=True)
    return report


def _finish(report: ImportReport, partial: Path) -> None:
    """Rename the streamed task file into place (only with at least one task: tasks.py refuses an
    empty file) and write (or remove a stale) ``<out>.skipped.jsonl``."""
    if report.imported:
        partial.chmod(0o644)  # mkstemp's 0600 would hide the tasks from other users of the node
        shutil.move(partial, report.out)
    if report.skipped:
        lines = (
            json.dumps({"instance_id": name, "where": where, "kind": kind, "reason": reason}, ensure_ascii=False)
            for name, where, kind, reason in report.skipped
        )
        report.skipped_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    else:
        report.skipped_path.unlink(missing_ok=True)
