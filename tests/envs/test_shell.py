"""The SWE agent's sandboxed shell: basics, emulated state, hostile commands, concurrency, runner.

Assertions that need kernel isolation (mount + network namespaces, uid drop as root) skip,
naming why, where :func:`detect_isolation` says this host does not offer it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sao_megatron.envs import shell as shell_mod
from sao_megatron.envs.sandbox import REPO_ROOT, detect_isolation
from sao_megatron.envs.shell import ShellLimits, ShellResult, ShellSession
from sao_megatron.envs.swe.reward import pytest_command

ISO = detect_isolation()
FULL = pytest.mark.skipif(
    not ISO.full, reason=f"needs root with mount+network namespaces and uid drop; this host: {ISO}"
)
UNIQUE = pytest.mark.skipif(
    not (ISO.uid_drop and ISO.unique_uids), reason=f"needs a uid range of its own (root); this host: {ISO}"
)
LIMITS = ShellLimits(wall_s=5.0, cpu_s=5, max_output_bytes=32 * 1024, processes=32)
SLACK_S = 10.0
"""Reaping after a timeout fires, on a 2-core machine at load 25 beside the other pytest worker (a
CI run saw 3.8 s for a 0.5-s timeout). It guards against a timeout that never fires, where the
command would run its 1000 s."""


def _git_repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "README").write_text("hello\n")
    subprocess.run(["git", "init", "-q", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture
def session(tmp_path: Path) -> Iterator[ShellSession]:
    sess = ShellSession(_git_repo(tmp_path / "ws"), LIMITS)
    yield sess
    asyncio.run(sess.close())


def _live_pids(uid: int) -> list[int]:
    """Pids of non-zombie processes of ``uid``, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines() if ":" in line
            )
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry))
    return pids


def test_basics_exit_codes_and_merged_stderr(session: ShellSession) -> None:
    res = session.run_sync("echo out; echo err >&2; echo out2; exit 3")
    assert (res.status, res.returncode, res.output) == ("error", 3, "out\nerr\nout2\n")
    assert res.observation().endswith("[Command finished with exit code 3]")
    ok = session.run_sync("true")
    assert (ok.status, ok.returncode, ok.output) == ("ok", 0, "")
    assert ok.observation() == f"[Current working directory: {session.workdir}]\n[Command finished with exit code 0]"
    syntax = session.run_sync("if then fi")
    assert syntax.status == "error" and "syntax error" in syntax.output
    assert session.run_sync("echo a\nnosuchcmd").output == "a\nbash: line 2: nosuchcmd: command not found\n"
    memory = session.run_sync("python -c 'bytearray(3 << 30)'")  # over the 2 GiB address-space limit
    assert memory.status == "memory" and "MemoryError" in memory.output, memory
    assert session.run_sync("echo still here").output == "still here\n"


def test_cwd_and_exported_env_persist(session: ShellSession) -> None:
    w = session.workdir
    first = session.run_sync("mkdir -p pkg/sub && cd pkg && export FOO='a b' && BAR=unexported")
    assert first.status == "ok" and first.cwd == f"{w}/pkg"
    res = session.run_sync('pwd; echo "$FOO|$BAR"')
    assert res.output == f"{w}/pkg\na b|\n"
    failed = session.run_sync("cd sub && export FOO=2 && false")  # a failing command still saves
    assert failed.status == "error" and failed.cwd == f"{w}/pkg/sub"
    assert session.run_sync("unset FOO; exit 4").returncode == 4
    assert session.run_sync('pwd; echo "${FOO-unset}"').output == f"{w}/pkg/sub\nunset\n"
    killed = session.run_sync("cd /; export FOO=lost; sleep 30", timeout_s=0.5)  # killed: state kept
    assert killed.status == "timeout" and killed.cwd == f"{w}/pkg/sub"
    assert session.run_sync('pwd; echo "${FOO-unset}"').output == f"{w}/pkg/sub\nunset\n"
    session.run_sync(f"rm -rf {w}/pkg")  # the saved directory vanished: back to the workspace
    assert session.run_sync("pwd").output == f"{w}\n"


def test_python_pytest_git_and_files_on_host(session: ShellSession, tmp_path: Path) -> None:
    res = session.run_sync("python -c 'import pytest, sys; print(pytest.__version__, sys.prefix)'")
    assert res.status == "ok" and res.output.split()[1] == sys.prefix, res.output
    git = session.run_sync(
        "echo new > made.txt && git status --short && git add -A && "
        "git -c user.name=a -c user.email=a@b commit -qm x && git log --oneline | wc -l"
    )
    assert git.status == "ok" and git.output.splitlines() == ["?? README", "?? made.txt", "1"], git.output
    made = tmp_path / "ws" / "made.txt"
    assert made.read_text() == "new\n"
    if session.uid is not None:
        assert made.stat().st_uid == session.uid
    owner = (tmp_path / "ws").stat().st_uid if session.uid is None else os.geteuid()
    asyncio.run(session.close())
    assert made.stat().st_uid == owner  # given back, so host-side git accepts the repository
    assert session.run_sync("true").status == "sandbox_error"


@FULL
def test_outside_the_workspace_is_hidden_or_read_only(session: ShellSession, tmp_path: Path) -> None:
    secret, content = Path(tempfile.gettempdir(), f"sao_shell_{uuid.uuid4().hex}"), uuid.uuid4().hex
    secret.write_text(content)
    try:
        cmd = (
            f"cat {secret} {REPO_ROOT}/Makefile /root/.bashrc; touch /etc/x /usr/x {tmp_path}/x; "
            f"ls -A {REPO_ROOT}; echo > /tmp/private && ls /tmp"
        )
        res = session.run_sync(cmd)
    finally:
        secret.unlink()
    assert content not in res.output and "Read-only file system" in res.output, res.output
    assert set(res.output.split("\n")) >= {f"cat: {secret}: No such file or directory"}
    assert not Path("/etc/x").exists() and not (tmp_path / "x").exists()
    listing = res.output.split(f"'{tmp_path}/x': No such file or directory\n")[1].split()
    under_tmp = [REPO_ROOT.parts[2]] if REPO_ROOT.parts[1:2] == ("tmp",) else []  # a clone in /tmp: its bind's path
    assert listing == [
        ".venv",
        *sorted(["private", "work", *under_tmp]),
    ]  # the repo shows only the venv; /tmp is private


@FULL
def test_rm_rf_only_affects_the_workspace(session: ShellSession, tmp_path: Path) -> None:
    (tmp_path / "sibling.txt").write_text("keep")
    res = session.run_sync(
        f"rm -rf {session.workdir}/* {session.workdir}/.git; rm -rf ..; cd /; rm -rf *; ls -A /workspace"
    )
    assert res.output.strip().splitlines()[-1:] != ["README"]
    assert (tmp_path / "sibling.txt").read_text() == "keep"
    assert list((tmp_path / "ws").iterdir()) == []
    assert REPO_ROOT.joinpath("Makefile").exists() and Path(sys.prefix, "bin").is_dir()
    assert session.run_sync("echo alive").output == "alive\n"


@FULL
def test_network_is_unreachable(session: ShellSession) -> None:
    res = session.run_sync(
        "python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"; echo py=$?; "
        "if command -v curl >/dev/null; then curl -sS -m 2 http://1.1.1.1/ >/dev/null; echo curl=$?; fi"
    )
    assert "py=1" in res.output and "unreachable" in res.output, res.output
    assert "curl=0" not in res.output


@UNIQUE
def test_timeout_and_background_processes_are_killed(session: ShellSession) -> None:
    assert session.uid is not None
    start = time.monotonic()
    res = session.run_sync("sleep 1000", timeout_s=1.0)
    assert res.status == "timeout" and time.monotonic() - start < 1.0 + SLACK_S
    assert res.observation().endswith("[Command timed out after 1s and was killed]")
    assert _live_pids(session.uid) == []
    bg = session.run_sync("sleep 1000 & setsid sleep 1001 & echo started")
    assert bg.status == "ok" and bg.output == "started\n"
    assert _live_pids(session.uid) == []
    assert "sleep" not in session.run_sync('ps -o args= -u "$(id -u)"').output
    if ISO.pidns:  # its own PID namespace: bash is init, and /proc shows nothing of the host
        assert session.run_sync("echo $$; ps -e -o comm=").output.split() == ["1", "bash", "ps"]


@UNIQUE
def test_fork_bomb_is_contained_and_the_session_survives(session: ShellSession) -> None:
    assert session.uid is not None
    start = time.monotonic()
    res = session.run_sync(":(){ :|:& };:; sleep 2", timeout_s=3.0)  # the bomb rages for 2-3 s
    assert time.monotonic() - start < 3.0 + SLACK_S
    assert res.status in ("ok", "timeout", "output_limit", "error"), res
    assert _live_pids(session.uid) == []
    after = session.run_sync("echo ok && python -c 'print(6*7)'")
    assert (after.status, after.output) == ("ok", "ok\n42\n"), after


def test_huge_output_is_cut(session: ShellSession) -> None:
    res = session.run_sync("yes")
    assert res.status == "output_limit" and len(res.output) == LIMITS.max_output_bytes
    obs = res.observation(max_chars=1000)
    assert "characters cut" in obs and obs.endswith(f"[Command was killed: output exceeded {32 * 1024} bytes]")
    assert len(obs) < 1200


@FULL
def test_eight_sessions_concurrently_are_isolated(tmp_path: Path) -> None:
    sessions = [ShellSession(_git_repo(tmp_path / f"ws{i}"), LIMITS) for i in range(8)]
    uids = {s.uid for s in sessions}
    assert len(uids) == 8

    async def episode(i: int, sess: ShellSession) -> list[ShellResult]:
        other = tmp_path / f"ws{(i + 1) % 8}"
        return [
            await sess.run(f"echo session{i} > mine.txt && export N={i}"),
            await sess.run(f"cat mine.txt; echo $N; python -c 'print({i} * 11)'; ls {other} {tmp_path}"),
        ]

    async def main() -> list[list[ShellResult]]:
        try:
            return await asyncio.gather(*(episode(i, s) for i, s in enumerate(sessions)))
        finally:
            await asyncio.gather(*(s.close() for s in sessions))

    for i, (first, second) in enumerate(asyncio.run(main())):
        assert first.status == "ok", first
        lines = second.output.splitlines()
        assert lines[:3] == [f"session{i}", str(i), str(i * 11)], second.output
        assert "No such file or directory" in second.output and "mine.txt" not in "".join(lines[3:])
        assert (tmp_path / f"ws{i}" / "mine.txt").read_text() == f"session{i}\n"


def test_runner_runs_pytest_inside_and_times_out(session: ShellSession, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "test_tiny.py").write_text("def test_ok():\n    assert 1\n\ndef test_bad():\n    assert 0\n")
    session.run_sync("export PYTHONPATH=/nowhere PYTEST_ADDOPTS=--collect-only")  # ignored by the runner
    run = session.runner()
    res = run(pytest_command(["test_tiny.py::test_ok", "test_tiny.py::test_bad"]), ws, 60.0)
    assert res.returncode == 1 and not res.timed_out, res.output
    assert "PASSED test_tiny.py::test_ok" in res.output and "FAILED test_tiny.py::test_bad" in res.output
    slow = run([sys.executable, "-c", "import time; time.sleep(1000)"], ws, 0.5)
    assert slow.timed_out and slow.returncode is None and slow.wall_s < 0.5 + SLACK_S


@pytest.mark.parametrize("mode", ["no_namespaces", "no_pid_namespace"])
def test_degraded_isolation_and_require_isolation(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """What a container without namespaces gets: the host path, rlimits, uid drop; or a refusal."""
    iso = replace(ISO, netns=False, mountns=False) if mode == "no_namespaces" else replace(ISO, pidns=False)
    monkeypatch.setattr(shell_mod, "detect_isolation", lambda: iso)
    ws = Path(tempfile.mkdtemp(prefix="sao_shell_test_"))  # parents traversable by the session uid
    sess = ShellSession(ws, LIMITS)
    try:
        inside = str(ws.resolve()) if not iso.mountns else ShellSession.WORKDIR
        assert sess.workdir == inside
        sess.run_sync("mkdir d && cd d && export X=1")
        res = sess.run_sync("pwd; echo $X; echo hi > f; sleep 1000 & id -u")
        assert res.status == "ok" and res.output.splitlines()[:2] == [f"{inside}/d", "1"], res
        assert (ws / "d" / "f").read_text() == "hi\n"
        assert (int(res.output.split()[-1]) != 0) == iso.uid_drop
        if sess.uid is not None and iso.unique_uids:
            assert _live_pids(sess.uid) == []
        if not iso.full:
            strict = ShellSession(ws, replace(LIMITS, require_isolation=True))
            refused = strict.run_sync("echo no")
            assert refused.status == "sandbox_error" and "isolation unavailable" in refused.detail
            assert refused.observation().startswith("[Command could not run: isolation unavailable")
            asyncio.run(strict.close())
    finally:
        asyncio.run(sess.close())
        subprocess.run(["rm", "-rf", str(ws)], check=False)


def _sleepers(marker: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().split(b"\0")[:2] == [
                b"sleep",
                marker.encode(),
            ]:
                out.append(int(proc.name))
        except OSError:
            pass
    return out


def test_a_command_dies_with_its_killed_supervisor(tmp_path):
    """SIGKILL of the process running a session (a killed ``sao train``) ends its command too."""
    marker = "1234.5"
    code = (
        "import asyncio, sys\n"
        "from sao_megatron.envs.shell import ShellLimits, ShellSession\n"
        f"asyncio.run(ShellSession(sys.argv[1], ShellLimits(wall_s=300)).run('sleep {marker}'))\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 30
        while not _sleepers(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _sleepers(marker), "the command never started"
    finally:
        supervisor.kill()
        supervisor.wait()
    deadline = time.monotonic() + 10
    while _sleepers(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _sleepers(marker)
    for pid in left:  # do not leave them behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"sandboxed processes outlived their supervisor: {left}"
