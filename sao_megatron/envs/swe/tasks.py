"""SWE task records (the SWE-bench instance schema) and their repositories.

One record per JSONL line (or Parquet row)::

    instance_id        unique id, e.g. "sao-tasks__pager-1"
    repo               "owner/name"
    base_commit        git commit id of the snapshot (see below)
    problem_statement  the issue text the agent sees
    patch              hidden reference fix, a git-style unified diff
    test_patch         the diff adding/changing the tests that check the fix
    FAIL_TO_PASS       pytest node ids that fail before the fix and pass after it
    PASS_TO_PASS       pytest node ids that pass before and after
    files              the repository at base_commit, {relative path: text} (in Parquet, where a
                       map with varying keys has no schema: a list of {"path", "content"})
    bug_kind           optional: what kind of bug it is (off-by-one, ...)

``FAIL_TO_PASS`` / ``PASS_TO_PASS`` may be lists or JSON strings of lists (as in the SWE-bench
datasets on the Hub). ``base_commit`` is not stored separately from the snapshot: it is the id
git gives the commit of ``files`` made by :func:`materialise` (fixed author, committer, date and
message, no parent), computed in pure Python by :func:`snapshot_commit`, so a record can be
checked without git and every materialised repository has the same history on every machine.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from sao_megatron.config.schema import ConfigError
from sao_megatron.envs.dataset import _fields_hint, _jsonl_rows, _parquet_rows

DATA_PATH = Path(__file__).resolve().parents[1] / "data" / "swe" / "tasks.jsonl"
REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "patch",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "files",
)

# The one commit of a materialised repository; snapshot_commit reproduces git's id for it.
AUTHOR = ("SAO Tasks", "tasks@sao.invalid")
COMMIT_TIME = 1_700_000_000  # seconds since the epoch, UTC
COMMIT_MESSAGE = "Initial snapshot\n"
# Repository-local config is under the agent's control: never let it run programs for us.
_GIT_SAFETY = (
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "commit.gpgsign=false",
    "-c",
    "init.defaultBranch=main",
    "-c",
    "core.autocrlf=false",
    "-c",
    "safe.directory=*",  # workspaces belong to their sandbox's uid; trust_repository vets their config
)


@dataclass(frozen=True)
class SWETask:
    """One task: a repository snapshot, the issue, the hidden fix and the tests that judge it."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    """Hidden reference fix (unified diff against ``files``)."""
    test_patch: str
    """Tests that check the fix (unified diff against ``files``); applied only when rewarding."""
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    files: Mapping[str, str] = field(repr=False)
    """The repository at ``base_commit``: relative POSIX path -> UTF-8 text."""
    bug_kind: str = ""
    source: str = ""
    """``file:line`` the record was read from (empty when built in code)."""

    @property
    def tests(self) -> tuple[str, ...]:
        return self.fail_to_pass + self.pass_to_pass


def _git_object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def snapshot_commit(files: Mapping[str, str]) -> str:
    """The git commit id :func:`materialise` gives ``files`` (trees and blobs hashed as git does)."""
    root: dict[str, Any] = {}
    for path, text in files.items():
        *dirs, name = PurePosixPath(path).parts
        node = root
        for d in dirs:
            node = node.setdefault(d, {})
        node[name] = text.encode("utf-8")

    def tree(node: dict[str, Any]) -> bytes:
        # git orders entries by name, a directory's name compared as if it ended with "/"
        names = sorted(node, key=lambda n: n + "/" if isinstance(node[n], dict) else n)
        body = b""
        for n in names:
            value = node[n]
            mode, oid = ("40000", tree(value)) if isinstance(value, dict) else ("100644", _git_object("blob", value))
            body += f"{mode} {n}\0".encode() + oid
        return _git_object("tree", body)

    who = f"{AUTHOR[0]} <{AUTHOR[1]}> {COMMIT_TIME} +0000"
    commit = f"tree {tree(root).hex()}\nauthor {who}\ncommitter {who}\n\n{COMMIT_MESSAGE}"
    return _git_object("commit", commit.encode()).hex()


def git(
    args: Sequence[str],
    cwd: str | Path,
    *,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``git args`` in ``cwd`` without the user's or system's config, hooks or external programs."""
    return subprocess.run(
        ["git", *_GIT_SAFETY, *args],
        cwd=cwd,
        input=input,
        env=_git_env(cwd, env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def git_bytes(
    args: Sequence[str], cwd: str | Path, *, input: bytes | None = None, timeout_s: float = 600.0
) -> subprocess.CompletedProcess[bytes]:
    """:func:`git` with bytes in and out (blob contents, ``-z`` path lists that need not be UTF-8)."""
    return subprocess.run(
        ["git", *_GIT_SAFETY, *args],
        cwd=cwd,
        input=input,
        env=_git_env(cwd, None),
        capture_output=True,
        timeout=timeout_s,
    )


def _git_env(cwd: str | Path, env: Mapping[str, str] | None) -> dict[str, str]:
    base = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(cwd),
        "LC_ALL": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CEILING_DIRECTORIES": str(Path(cwd).resolve().parent),  # never a repository above cwd
        "GIT_AUTHOR_NAME": AUTHOR[0],
        "GIT_AUTHOR_EMAIL": AUTHOR[1],
        "GIT_AUTHOR_DATE": f"{COMMIT_TIME} +0000",
        "GIT_COMMITTER_NAME": AUTHOR[0],
        "GIT_COMMITTER_EMAIL": AUTHOR[1],
        "GIT_COMMITTER_DATE": f"{COMMIT_TIME} +0000",
    }
    return {**base, **(env or {})}


def materialise(task: SWETask, directory: str | Path) -> Path:
    """Write ``task.files`` into ``directory`` (created; must be empty) as a git repository whose
    only commit, on branch ``main``, is ``task.base_commit``. Returns the directory."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise FileExistsError(f"{root}: not empty; materialise a task into a new directory")
    for path, text in task.files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    for args in (
        ["init", "-q"],
        ["add", "-A"],
        ["commit", "-q", "--no-verify", "-m", COMMIT_MESSAGE.strip()],
    ):
        out = git(args, root)
        if out.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)} in {root} failed: {out.stderr.strip()}")
    head = git(["rev-parse", "HEAD"], root).stdout.strip()
    if head != task.base_commit:
        raise RuntimeError(f"{task.instance_id}: materialised commit {head} is not base_commit {task.base_commit}")
    return root


_TRUSTED_CONFIG = (
    "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n\tlogallrefupdates = true\n"
)


def trust_repository(root: str | Path) -> None:
    """Make an agent-edited workspace safe for host-side git: the repository's own config (where
    filter, diff and fsmonitor commands would live), ``commondir`` redirection and hooks are
    replaced by trusted ones. Raises RuntimeError when ``.git`` is not a plain directory."""
    gitdir = Path(root) / ".git"
    if gitdir.is_symlink() or not gitdir.is_dir():
        raise RuntimeError(f"{gitdir} is not a git directory (deleted or replaced)")
    for name in ("config", "commondir", "hooks"):
        target = gitdir / name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
    (gitdir / "config").write_text(_TRUSTED_CONFIG, encoding="utf-8")


def unified_diff(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    """A git-style patch (``git apply`` reads it) turning snapshot ``before`` into ``after``."""
    out: list[str] = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        if old is None:
            out.append("new file mode 100644\n")
        elif new is None:
            out.append("deleted file mode 100644\n")
        src = "/dev/null" if old is None else f"a/{path}"
        dst = "/dev/null" if new is None else f"b/{path}"
        lines = difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True), src, dst
        )
        for line in lines:
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def patched_paths(patch: str) -> list[str]:
    """Paths a git-style patch touches (the ``b/`` side, or ``a/`` for deletions), in order."""
    paths: list[str] = []
    for line in patch.splitlines():
        if line.startswith("diff --git a/"):
            a, _, b = line.removeprefix("diff --git a/").partition(" b/")
            path = b or a
            if path not in paths:
                paths.append(path)
    return paths


def _string_list(value: Any, key: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):  # the Hub's SWE-bench datasets store these lists as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(
                f"{where}: {key} is a string but not a JSON list; give a list of pytest node ids"
            ) from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: {key} must be a list of pytest node ids (strings), got {repr(value)[:60]}")
    return tuple(value)


def _files(value: Any, where: str) -> dict[str, str]:
    if isinstance(value, list) and all(isinstance(v, dict) and set(v) == {"path", "content"} for v in value):
        value = {v["path"]: v["content"] for v in value}  # Parquet's form: a list of {path, content}
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: files must be a non-empty object {{path: text}} (the repository snapshot)")
    for path, text in value.items():
        parts = PurePosixPath(path).parts
        if not isinstance(text, str) or path.startswith("/") or ".." in parts or ".git" in parts or not parts:
            raise ConfigError(
                f"{where}: files[{path!r}] must be text at a relative path inside the repository (no '..', no .git)"
            )
    return dict(sorted(value.items()))


def parse_task(row: Mapping[str, Any], where: str = "") -> SWETask:
    """One record as an :class:`SWETask`; ConfigError naming ``where`` and the problem."""
    missing = [key for key in REQUIRED if key not in row]
    if missing:
        raise ConfigError(
            f"{where}: no field {missing[0]!r} (the row has: {_fields_hint(dict(row))}); an SWE task "
            f"needs {', '.join(REQUIRED)}"
        )
    for key in ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch"):
        if not isinstance(row[key], str) or not row[key].strip():
            raise ConfigError(f"{where}: {key} must be a non-empty string, got {repr(row[key])[:60]}")
    files = _files(row["files"], where)
    commit = snapshot_commit(files)
    if row["base_commit"] != commit:
        raise ConfigError(
            f"{where}: base_commit {row['base_commit']} is not the commit of the files snapshot "
            f"({commit}); regenerate the record"
        )
    fail_to_pass = _string_list(row["FAIL_TO_PASS"], "FAIL_TO_PASS", where)
    if not fail_to_pass:
        raise ConfigError(f"{where}: FAIL_TO_PASS is empty; a task needs at least one test the fix makes pass")
    pass_to_pass = _string_list(row["PASS_TO_PASS"], "PASS_TO_PASS", where)
    both = sorted(set(fail_to_pass) & set(pass_to_pass))
    if both:
        raise ConfigError(f"{where}: {both[0]!r} is in both FAIL_TO_PASS and PASS_TO_PASS; keep it in one")
    return SWETask(
        instance_id=row["instance_id"],
        repo=row["repo"],
        base_commit=commit,
        problem_statement=row["problem_statement"],
        patch=row["patch"],
        test_patch=row["test_patch"],
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        files=files,
        bug_kind=str(row.get("bug_kind") or ""),
        source=where,
    )


def load_tasks(path: str | Path = DATA_PATH) -> list[SWETask]:
    """Every record of a JSONL or Parquet file; ConfigError at the first bad one (``file:line``)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the SWE task file ({err.strerror}); check the path") from None
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path, data)
    tasks: list[SWETask] = []
    seen: dict[str, str] = {}
    for where, row in rows:
        task = parse_task(row, where)
        if task.instance_id in seen:
            raise ConfigError(f"{where}: instance_id {task.instance_id!r} repeats {seen[task.instance_id]}")
        seen[task.instance_id] = where
        tasks.append(task)
    if not tasks:
        raise ConfigError(f"{path}: no tasks (the file is empty); write one JSON object per line")
    return tasks
