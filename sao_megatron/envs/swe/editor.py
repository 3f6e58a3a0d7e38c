"""The file viewer/editor tool of the OpenHands scaffold (``str_replace_editor``), confined to a workspace.

Commands and arguments follow OpenHands: ``view`` (a file with line numbers, optionally a
``view_range`` ``[start, end]`` with ``end`` -1 for the last line; a directory two levels deep),
``create`` (``file_text``; refuses an existing file), ``str_replace`` (``old_str`` must occur
exactly once; ``new_str`` may be empty), ``insert`` (``new_str`` after line ``insert_line``, 0 for
the top) and ``undo_edit`` (the last edit of that file). Every outcome, errors included, is an
observation string for the model: a bad call never raises.

Paths may be absolute or relative to the workspace; whatever they name (after resolving ``..``
and symbolic links) must lie inside the workspace, else the call is refused. Observations are cut
to ``max_chars`` with a note saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache"}


class EditorError(Exception):
    """A refused call; its message is the observation."""


class FileEditor:
    """``str_replace_editor`` over the files under ``root`` (one episode's workspace)."""

    def __init__(self, root: str | Path, max_chars: int = 16_000, max_file_bytes: int = 2_000_000):
        self.root = Path(root).resolve()
        self.max_chars = max_chars
        self.max_file_bytes = max_file_bytes
        self._history: dict[Path, list[str | None]] = {}  # earlier contents; None: did not exist

    def __call__(self, command: str, path: str, **args: Any) -> str:
        """Run one tool call; the observation (an ``ERROR: ...`` line when refused)."""
        try:
            if command not in COMMANDS:
                raise EditorError(f"unknown command {command!r}; use one of {', '.join(COMMANDS)}")
            target = self._resolve(path)
            out = getattr(self, f"_{command}")(target, **args)
        except EditorError as err:
            return f"ERROR: {err}"
        except TypeError as err:  # missing or unexpected arguments
            return f"ERROR: bad arguments for {command}: {err}"
        return self._cut(out)

    # ---- paths ----------------------------------------------------------------------------------
    def _resolve(self, path: str) -> Path:
        if not isinstance(path, str) or not path:
            raise EditorError("path must be a non-empty string")
        raw = Path(path)
        target = (raw if raw.is_absolute() else self.root / raw).resolve()
        if target != self.root and self.root not in target.parents:
            raise EditorError(f"{path} is outside the workspace {self.root}; use paths inside it")
        return target

    def _show(self, target: Path) -> str:
        return str(target.relative_to(self.root)) if target != self.root else "."

    def _read(self, target: Path) -> str:
        if not target.is_file():
            raise EditorError(
                f"{self._show(target)} is not a file" if target.exists() else f"{self._show(target)} does not exist"
            )
        if target.stat().st_size > self.max_file_bytes:
            raise EditorError(
                f"{self._show(target)} is larger than {self.max_file_bytes} bytes; view a range "
                "with a shell command instead"
            )
        data = target.read_bytes()
        if b"\0" in data:
            raise EditorError(f"{self._show(target)} is a binary file")
        return data.decode("utf-8", errors="replace")

    def _write(self, target: Path, text: str, previous: str | None) -> None:
        self._history.setdefault(target, []).append(previous)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_chars:
            return text
        return text[: self.max_chars] + f"\n<response clipped: {len(text) - self.max_chars} more characters>"

    # ---- commands -------------------------------------------------------------------------------
    def _view(self, target: Path, view_range: list[int] | None = None) -> str:
        if target.is_dir():
            if view_range is not None:
                raise EditorError("view_range applies to files, not directories")
            return self._tree(target)
        lines = self._read(target).split("\n")
        start, end = 1, len(lines)
        if view_range is not None:
            if len(view_range) != 2 or not all(isinstance(v, int) for v in view_range):
                raise EditorError("view_range must be two integers [start, end] (end -1: the last line)")
            start, end = view_range[0], len(lines) if view_range[1] == -1 else view_range[1]
            if not 1 <= start <= end <= len(lines):
                raise EditorError(f"view_range {view_range} is outside lines 1..{len(lines)} of {self._show(target)}")
        numbered = "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines[start - 1 : end], start))
        return f"Here's the result of running `cat -n` on {self._show(target)}:\n{numbered}\n"

    def _tree(self, directory: Path) -> str:
        entries = []
        for child in sorted(directory.iterdir()):
            if child.name in SKIPPED_DIRS or child.name.startswith("."):
                continue
            entries.append(self._show(child) + ("/" if child.is_dir() else ""))
            if child.is_dir():
                entries += [
                    self._show(c) + ("/" if c.is_dir() else "")
                    for c in sorted(child.iterdir())
                    if c.name not in SKIPPED_DIRS and not c.name.startswith(".")
                ]
        listing = "\n".join(entries) or "(empty)"
        return (
            f"Files and directories up to 2 levels deep in {self._show(directory)}, hidden items excluded:\n{listing}\n"
        )

    def _create(self, target: Path, file_text: str) -> str:
        if target.exists():
            raise EditorError(f"{self._show(target)} already exists; edit it with str_replace or insert")
        self._write(target, file_text, None)
        return f"File created successfully at: {self._show(target)}"

    def _str_replace(self, target: Path, old_str: str, new_str: str = "") -> str:
        text = self._read(target)
        if not old_str:
            raise EditorError("old_str must not be empty")
        count = text.count(old_str)
        if count == 0:
            raise EditorError(
                f"old_str did not appear verbatim in {self._show(target)}; view the file and copy it exactly"
            )
        if count > 1:
            lines = [text[:i].count("\n") + 1 for i in _positions(text, old_str)]
            raise EditorError(
                f"old_str occurs {count} times in {self._show(target)} (lines {lines}); "
                "include more context so it is unique"
            )
        self._write(target, text.replace(old_str, new_str, 1), text)
        line = text[: text.index(old_str)].count("\n") + 1
        return f"The file {self._show(target)} has been edited (from line {line}). Review it and edit again if needed."

    def _insert(self, target: Path, insert_line: int, new_str: str) -> str:
        text = self._read(target)
        lines = text.split("\n")
        if not isinstance(insert_line, int) or not 0 <= insert_line <= len(lines):
            raise EditorError(f"insert_line {insert_line} is outside 0..{len(lines)} of {self._show(target)}")
        updated = "\n".join([*lines[:insert_line], *new_str.split("\n"), *lines[insert_line:]])
        self._write(target, updated, text)
        return f"The file {self._show(target)} has been edited (inserted after line {insert_line})."

    def _undo_edit(self, target: Path) -> str:
        history = self._history.get(target)
        if not history:
            raise EditorError(f"no edit of {self._show(target)} to undo")
        previous = history.pop()
        if previous is None:
            target.unlink(missing_ok=True)
            return f"Undid the creation of {self._show(target)}."
        target.write_text(previous, encoding="utf-8")
        return f"Last edit to {self._show(target)} undone."


def _positions(text: str, needle: str) -> list[int]:
    out, i = [], text.find(needle)
    while i != -1:
        out.append(i)
        i = text.find(needle, i + 1)
    return out
