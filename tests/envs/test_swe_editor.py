"""The OpenHands-style file editor: every command, its refusals as observations, and confinement
to the workspace (no path, relative, absolute or through a symbolic link, reaches outside)."""

import os

import pytest

from sao_megatron.envs.swe.editor import FileEditor


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "core.py").write_text("def f(x):\n    return x + 1\n\n\ndef g():\n    return f(1)\n")
    (root / ".git").mkdir()
    (root / "notes.txt").write_text("a\nb\nc")
    return root


def test_view_numbers_lines_ranges_and_lists_directories(ws):
    ed = FileEditor(ws)
    out = ed("view", "pkg/core.py")
    assert "     1\tdef f(x):" in out and "     6\t    return f(1)" in out
    assert ed("view", str(ws / "pkg/core.py"), view_range=[2, 2]).endswith("     2\t    return x + 1\n")
    assert "     3\tc" in ed("view", "notes.txt", view_range=[2, -1])
    tree = ed("view", ".")
    assert "pkg/" in tree and "pkg/core.py" in tree and "notes.txt" in tree and ".git" not in tree
    assert ed("view", "notes.txt", view_range=[0, 9]).startswith("ERROR: view_range [0, 9] is outside lines 1..3")
    assert ed("view", "missing.py") == "ERROR: missing.py does not exist"


def test_create_replace_insert_and_undo(ws):
    ed = FileEditor(ws)
    assert ed("create", "pkg/new.py", file_text="x = 1\n") == "File created successfully at: pkg/new.py"
    assert ed("create", "pkg/new.py", file_text="y").startswith("ERROR: pkg/new.py already exists")
    assert "edited (from line 2)" in ed("str_replace", "pkg/core.py", old_str="x + 1", new_str="x + 2")
    assert "return x + 2" in (ws / "pkg/core.py").read_text()
    assert "occurs 2 times" in ed("str_replace", "pkg/core.py", old_str="return", new_str="yield")
    assert "did not appear verbatim" in ed("str_replace", "pkg/core.py", old_str="nope", new_str="")
    ed("insert", "notes.txt", insert_line=0, new_str="top")
    ed("insert", "notes.txt", insert_line=4, new_str="end")
    assert (ws / "notes.txt").read_text() == "top\na\nb\nc\nend"
    assert ed("insert", "notes.txt", insert_line=9, new_str="x").startswith("ERROR: insert_line 9 is outside 0..5")
    assert ed("undo_edit", "notes.txt") == "Last edit to notes.txt undone."
    assert (ws / "notes.txt").read_text() == "top\na\nb\nc"
    ed("undo_edit", "notes.txt")
    assert ed("undo_edit", "notes.txt") == "ERROR: no edit of notes.txt to undo"
    assert ed("undo_edit", "pkg/new.py") == "Undid the creation of pkg/new.py."
    assert not (ws / "pkg/new.py").exists()
    assert (ws / "notes.txt").read_text() == "a\nb\nc"


def test_escapes_and_bad_calls_are_refused_as_observations(ws, tmp_path):
    ed = FileEditor(ws)
    secret = tmp_path / "secret.txt"
    secret.write_text("key")
    os.symlink(secret, ws / "link.txt")
    os.symlink(tmp_path, ws / "outside")  # a directory link out of the workspace
    for path in ("../secret.txt", str(secret), "link.txt", "/etc/passwd", "pkg/../../secret.txt", "outside/secret.txt"):
        assert "is outside the workspace" in ed("view", path), path
        assert "is outside the workspace" in ed("str_replace", path, old_str="key", new_str="x"), path
    for path in ("../evil.py", "outside/evil.py", str(tmp_path / "evil.py")):
        assert "is outside the workspace" in ed("create", path, file_text="x"), path
    assert secret.read_text() == "key" and not (tmp_path / "evil.py").exists()
    assert ed("rm", "notes.txt").startswith("ERROR: unknown command 'rm'")
    assert ed("str_replace", "notes.txt").startswith("ERROR: bad arguments for str_replace")
    (ws / "blob.bin").write_bytes(b"\0\1\2")
    assert ed("view", "blob.bin") == "ERROR: blob.bin is a binary file"


def test_long_observations_are_clipped_with_a_note(ws):
    (ws / "big.txt").write_text("\n".join(f"line {i}" for i in range(5000)))
    out = FileEditor(ws, max_chars=500)("view", "big.txt")
    assert len(out) < 600 and "<response clipped:" in out
