"""``SAO_KILL_AT`` (sao_megatron.faults) and servers dying with the process that started them.

Fast and Ray-free; ``tests/test_kill_points.py`` checks what a kill at every point leaves and resumes
from it, ``tests/test_kill_resume.py`` kills a real ``sao train``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sao_megatron.faults import kill_point
from sao_megatron.rollout.server_session import session_pids


def _python(code: str, env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SAO_")}, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        **kwargs,
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_unset_or_other_point_is_a_no_op(monkeypatch):
    monkeypatch.delenv("SAO_KILL_AT", raising=False)
    kill_point("checkpoint:staged")
    monkeypatch.setenv("SAO_KILL_AT", "checkpoint:renaming")
    kill_point("checkpoint:staged")


def test_nth_visit_kills_the_process_group():
    out = _python(
        """
        import subprocess, sys
        from sao_megatron.faults import kill_point
        child = subprocess.Popen(["sleep", "60"])  # same process group: dies too
        print(child.pid, flush=True)
        kill_point("rl:after_update")
        print("survived the first visit", flush=True)
        kill_point("rl:after_update")
        print("survived the second visit", flush=True)
        """,
        {"SAO_KILL_AT": "rl:after_update@2"},
    )
    lines = out.stdout.split()
    assert out.returncode == -signal.SIGKILL, out
    assert "survived the first visit" in out.stdout and "second" not in out.stdout
    assert out.stderr.strip().startswith("SAO_KILL_AT rl:after_update pid="), out.stderr
    child = int(lines[0])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_worker_in_its_own_process_group_kills_the_driver():
    """As a Ray worker (its own process group, same session): SAO_DRIVER_PID takes the driver down,
    with its process group (Ray's GCS, raylet and agents: here a ``sleep``)."""
    out = _python(
        """
        import os, subprocess, sys
        os.environ["SAO_DRIVER_PID"] = str(os.getpid())
        print(subprocess.Popen(["sleep", "60"]).pid, flush=True)
        worker = subprocess.Popen([sys.executable, "-c", "from sao_megatron.faults import kill_point; "
                                   "import time; time.sleep(1); kill_point('weight_sync:bucket')"],
                                  process_group=0)
        print(worker.pid, flush=True)
        worker.wait()
        print("driver survived", flush=True)
        """,
        {"SAO_KILL_AT": "weight_sync:bucket"},
    )
    assert out.returncode == -signal.SIGKILL and "driver survived" not in out.stdout, out
    member, worker = map(int, out.stdout.split()[:2])
    assert f"SAO_KILL_AT weight_sync:bucket pid={worker}" in out.stderr
    deadline = time.monotonic() + 10
    while (_alive(worker) or _alive(member)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker) and not _alive(member), "the driver's process group survived"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_and_what_it_started_die_with_the_process_that_started_it(tmp_path):
    """``rollout.engine`` starts servers in their own session; a SIGKILLed parent takes the session along,
    even a process the server started that does not die with the server and ignores SIGTERM (SGLang's
    detokenizer asks for ``PR_SET_PDEATHSIG`` only after its imports: a server killed while it starts
    left it running)."""
    out = _python(
        f"""
        import os, signal, sys, time
        from sao_megatron.rollout.engine import _ServerProcess
        server_code = (
            "import subprocess, sys; "
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)'], "
            "stdout=subprocess.PIPE); child.stdout.readline(); print(child.pid, flush=True); child.wait()"
        )
        class Server(_ServerProcess):
            def _command(self):
                return [sys.executable, "-c", server_code]
        server = Server("127.0.0.1", 0, {str(tmp_path / "server.log")!r}, 60.0).start()
        print(server.proc.pid, flush=True)
        while not open(server.log_path).read().strip():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        {},
    )
    assert out.returncode == -signal.SIGKILL, out
    leader, child = int(out.stdout.split()[0]), int((tmp_path / "server.log").read_text().split()[0])
    deadline = time.monotonic() + 30
    while (alive := {leader, child, *session_pids(leader)} - {p for p in (leader, child) if not _alive(p)}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"outlived the process that started the server: {alive} (leader {leader}, child {child})"
