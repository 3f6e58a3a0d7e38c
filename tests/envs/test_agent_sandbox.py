"""A ``command`` agent of ``rollout.env=openai_agent`` in the sandbox (sao_megatron/envs/agent_sandbox.py),
through a real gateway on a scripted engine: it completes its session with the official ``openai``
client (the run's interpreter and site-packages are bound into the sandbox), reaches nothing but
its gateway, cannot read the project directory, leaves nothing running, and every way it can fail
is a failed episode naming the cause."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import uuid
from dataclasses import replace

import pytest

from sao_megatron.config.agent import GatewayConfig, OpenAIAgentConfig
from sao_megatron.config.schema import REPO_ROOT
from sao_megatron.envs import agent_sandbox, make_env
from sao_megatron.envs.sandbox import detect_isolation
from sao_megatron.records import Trajectory
from sao_megatron.rollout.gateway import Gateway
from tests.rollout.gateway_fakes import SAMPLE, scripted_loop

needs_namespaces = pytest.mark.skipif(
    not (detect_isolation().full and detect_isolation().pidns and detect_isolation().unique_uids),
    reason="needs network, mount and PID namespaces and per-sandbox uids (root where the kernel allows them)",
)

# The agent: asks the task through the openai client, probes what it should not reach, posts its reward
# with what it saw. argv: the host port to probe, a project file, a marker for a child it leaves running,
# what to do after the session ('exit' or 'hang').
AGENT = """
import json, os, signal, socket, subprocess, sys, time, urllib.request
import openai

port, project_file, marker, then = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
task = sys.stdin.read()
if marker != "-":  # a child that ignores SIGTERM and leaves the process group (when hanging, also our pipes)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.Popen([sys.executable, "-c", code, marker], start_new_session=True, **(quiet if then == "hang" else {}))
seen = {"env_leak": "SAO_TEST_SECRET" in os.environ}
try:
    socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
    seen["connect"] = "connected"
except OSError as err:
    seen["connect"] = type(err).__name__
try:
    open(project_file).read()
    seen["read"] = "read"
except OSError as err:
    seen["read"] = type(err).__name__
base = os.environ["OPENAI_BASE_URL"]
api = openai.OpenAI(base_url=base, api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
answer = api.chat.completions.create(model="sao-policy", messages=[{"role": "user", "content": task}])
seen["answer"] = answer.choices[0].message.content
body = json.dumps({"reward": 1.0 if seen["answer"] == "5" else 0.0, "details": seen}).encode()
request = urllib.request.Request(base[: -len("/v1")] + "/reward", body, {
    "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(request, timeout=10).read()
if then == "hang":
    time.sleep(120)
"""


@pytest.fixture
def agent_dir(tmp_path):
    """A directory with the agent script, readable by the sandbox's unprivileged uid."""
    (tmp_path / "agent.py").write_text(AGENT)
    tmp_path.chmod(0o755)
    (tmp_path / "agent.py").chmod(0o644)
    return tmp_path


@pytest.fixture
def host_port():
    """A listener on the host's loopback that the agent must not reach."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        yield listener


def run_episode(
    cfg: OpenAIAgentConfig, timeout_s: float = 120.0, before=None, actions=("<answer>5</answer><|end|>",)
) -> tuple[Trajectory, Gateway]:
    gateway = Gateway(GatewayConfig(session_timeout_s=timeout_s), cfg)
    loop = scripted_loop(list(actions))
    loop.gateway = gateway

    async def go() -> list[Trajectory]:
        await gateway.start()
        if before is not None:
            before(gateway)
        try:
            return await loop.run_segments(make_env("openai_agent"), SAMPLE)
        finally:
            await gateway.close()

    [traj] = asyncio.run(go())
    return traj, gateway


def command(agent_dir, port: int = 9, marker: str = "-", then: str = "exit") -> list[str]:
    return [sys.executable, str(agent_dir / "agent.py"), str(port), str(REPO_ROOT / "pyproject.toml"), marker, then]


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (a zombie's is empty)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                found.append(int(entry))
        except OSError:
            pass
    return found


@needs_namespaces
def test_a_sandboxed_agent_completes_its_session_and_reaches_nothing_else(agent_dir, host_port):
    port = host_port.getsockname()[1]
    traj, gateway = run_episode(OpenAIAgentConfig(command=command(agent_dir, port)))
    assert (traj.status, traj.reward) == ("finished", 1.0), traj.status_reason
    seen = traj.reward_details
    assert seen["answer"] == "5" and gateway.counts.requests == 1
    assert seen["connect"] == "ConnectionRefusedError"  # its own loopback: nothing of the host's listens there
    with pytest.raises(BlockingIOError):  # and the host's listener was never reached
        host_port.accept()
    assert seen["read"] == "FileNotFoundError"  # the project directory is an empty mount
    assert not seen["env_leak"] and not gateway.unix_socket  # the socket's directory is gone with the gateway


@needs_namespaces
def test_the_example_agent_runs_as_a_sandboxed_command_named_relative_to_the_run(monkeypatch):
    """``python examples/arith_agent.py`` from the project directory: ``python`` is the run's environment's
    (first on the agent's PATH, whatever the rollout process's is), the script's directory is readable."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("PATH", "/nonexistent")
    actions = ("<tool>2+3</tool><|end|>", "<answer>5</answer><|end|>")
    traj, gateway = run_episode(OpenAIAgentConfig(command=["python", "examples/arith_agent.py"]), actions=actions)
    assert (traj.status, traj.reward, traj.correct) == ("finished", 1.0, True), traj.status_reason
    assert gateway.counts.requests == 2


@needs_namespaces
@pytest.mark.parametrize("then", ["exit", "hang"])
def test_nothing_the_agent_started_outlives_its_session(agent_dir, then):
    """A child that ignores SIGTERM in a session of its own dies with the agent (the episode ends although
    the child holds the agent's stderr), or at the session timeout."""
    marker = f"sao-agent-test-{uuid.uuid4().hex}"
    try:
        # 'exit' must finish: the sandbox runs it at nice 10, and beside CI's load importing openai can take 25 s
        timeout_s = 8.0 if then == "hang" else 120.0
        traj, gateway = run_episode(OpenAIAgentConfig(command=command(agent_dir, marker=marker, then=then)), timeout_s)
        if then == "exit":
            assert traj.status == "finished", traj.status_reason
        else:
            assert traj.status_reason.startswith("gateway: session timed out after 8.0s") and gateway.counts.dropped
        deadline = time.monotonic() + 2.0
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker) == []
    finally:
        for pid in processes_with(marker):  # only when the test failed: what it started, by pid
            os.kill(pid, 9)


@needs_namespaces
def test_an_agent_that_cannot_reach_its_gateway_fails_naming_the_cause(agent_dir):
    traj, _ = run_episode(
        OpenAIAgentConfig(command=command(agent_dir)), before=lambda gateway: os.unlink(gateway.unix_socket)
    )
    assert traj.status == "failed"
    assert traj.status_reason.startswith("agent: ") and "exited with code 1" in traj.status_reason
    assert "it could not reach the gateway (FileNotFoundError: [Errno 2] No such file" in traj.status_reason


HOG_MEMORY = "import sys; sys.stdin.read(); b = bytearray(1 << 30)"
HOG_CPU = "import sys; sys.stdin.read()\nwhile True: pass"
EXIT_7_UNLESS_ROOT = "import os, sys; sys.exit(7 if os.getuid() else 0)"  # the sandbox drops root


@needs_namespaces
@pytest.mark.parametrize(
    ("cfg", "reason"),
    [
        (
            OpenAIAgentConfig(command=[sys.executable, "-c", HOG_MEMORY], memory_mb=256),
            "exited with code 1 (memory limit rollout.agent.memory_mb=256): Traceback",
        ),
        (
            OpenAIAgentConfig(command=[sys.executable, "-c", HOG_CPU], cpu_s=1),
            "was killed by SIGXCPU (CPU time limit rollout.agent.cpu_s=1)",
        ),
        (OpenAIAgentConfig(command=[sys.executable, "-c", EXIT_7_UNLESS_ROOT]), "exited with code 7"),
        (
            OpenAIAgentConfig(command=["/no/such/agent"]),
            "cannot start '/no/such/agent' in the sandbox: FileNotFoundError",
        ),
        (
            OpenAIAgentConfig(command=[sys.executable], readable_paths=["/no/such/dir"]),
            "rollout.agent.readable_paths: '/no/such/dir' is not a directory",
        ),
    ],
    ids=["memory", "cpu", "exit-code", "no-program", "readable-path"],
)
def test_each_failure_of_a_sandboxed_agent_is_a_failed_episode_naming_its_cause(cfg, reason):
    traj, gateway = run_episode(cfg)
    assert traj.status == "failed" and reason in traj.status_reason, traj.status_reason
    assert gateway.counts.failed == 1


NO_NAMESPACES = replace(detect_isolation(), netns=False, mountns=False, pidns=False, uid_drop=False, unique_uids=False)


def test_without_namespaces_require_fails_the_episode_naming_what_is_missing(agent_dir, monkeypatch):
    monkeypatch.setattr(agent_sandbox, "detect_isolation", lambda: NO_NAMESPACES)
    traj, _ = run_episode(OpenAIAgentConfig(command=command(agent_dir), sandbox="require"))
    assert traj.status == "failed" and traj.status_reason == (
        "agent: sandbox: this host lacks network namespace, mount namespace, uid drop (run as root), which "
        "rollout.agent.sandbox=require needs; run where namespaces are allowed, as root, or set "
        "rollout.agent.sandbox=auto"
    )


def test_without_namespaces_auto_still_runs_the_agent_in_a_clean_environment(agent_dir, monkeypatch):
    """What ``auto`` keeps on such a host: the relay, a fixed environment, the process group killed at the end."""
    monkeypatch.setattr(agent_sandbox, "detect_isolation", lambda: NO_NAMESPACES)
    monkeypatch.setenv("SAO_TEST_SECRET", "1")
    marker = f"sao-agent-test-{uuid.uuid4().hex}"
    try:
        traj, _ = run_episode(OpenAIAgentConfig(command=command(agent_dir, marker=marker)))
        assert (traj.status, traj.reward) == ("finished", 1.0), traj.status_reason
        assert not traj.reward_details["env_leak"] and traj.reward_details["read"] == "read"  # files: not hidden
    finally:
        for pid in processes_with(marker):  # its child left the process group: without a uid or PID
            os.kill(pid, 9)  # namespace of its own, nothing reaches it (documented)
