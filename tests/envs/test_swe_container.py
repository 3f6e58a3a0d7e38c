"""The ``swe`` environment with ``container`` set: commands and hidden tests in a container image.

No container runtime is installed on CI machines, so these tests run the real code path against
a stand-in ``apptainer``: a small program that does what ``apptainer exec`` does with the flags
this project passes (a new mount and network namespace, ``--bind`` mounts, ``--pwd``), on the
host's root filesystem instead of an image. What it shows: the command lines, the binds, the
persistent shell, the editor and the reward all work through a runtime; not that Apptainer or
enroot themselves behave the same (that needs a cluster with them).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from sao_megatron.envs.shell import ContainerSpec, ShellSession
from sao_megatron.envs.swe.env import SWEEnv, reference_actions
from tests.envs.test_swe_env import TASKS, sample_of

FAKE_APPTAINER = f"""#!{sys.executable}
import os, subprocess, sys
args = sys.argv[1:]
assert args.pop(0) == "exec", args
binds, pwd, net = [], None, True
while args[0].startswith("--"):
    flag = args.pop(0)
    if flag == "--bind":
        binds.append(args.pop(0).split(":"))
    elif flag == "--pwd":
        pwd = args.pop(0)
    elif flag == "--network":
        net = args.pop(0) != "none"
    elif flag not in ("--containall", "--writable-tmpfs", "--net"):
        sys.exit(f"fake apptainer: unknown flag {{flag}}")
image, command = args[0], args[1:]
os.unshare(os.CLONE_NEWNS | (0 if net else os.CLONE_NEWNET))
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
for src, dst in binds:
    os.makedirs(dst, exist_ok=True)
    subprocess.run(["mount", "--bind", src, dst], check=True)
os.chdir(pwd or "/")
os.execv(command[0], command)
"""


@pytest.fixture
def apptainer(tmp_path):
    exe = tmp_path / "apptainer"
    exe.write_text(FAKE_APPTAINER)
    exe.chmod(0o755)
    return str(exe)


def test_command_lines_of_both_runtimes():
    binds = [("/host/ws", "/testbed")]
    env = {"PATH": "/opt/env/bin:/usr/bin"}
    app = ContainerSpec("docker://swebench/x:latest").argv(binds, env, ["/bin/bash", "-c", "ls"])
    assert app == [
        "apptainer",
        "exec",
        "--containall",
        "--writable-tmpfs",
        "--net",
        "--network",
        "none",
        "--bind",
        "/host/ws:/testbed",
        "--pwd",
        "/tmp/.sao_cmd",
        "docker://swebench/x:latest",
        "/usr/bin/env",
        "-i",
        "PATH=/opt/env/bin:/usr/bin",
        "/bin/bash",
        "-c",
        "ls",
    ]
    enroot = ContainerSpec("swe-x", runtime="enroot").argv(binds, env, ["/bin/bash"])
    assert enroot == [
        "enroot",
        "start",
        "--mount",
        "/host/ws:/testbed",
        "swe-x",
        "/usr/bin/env",
        "-i",
        "PATH=/opt/env/bin:/usr/bin",
        "/bin/bash",
    ]
    with pytest.raises(ValueError, match="use 'apptainer' or 'enroot'"):
        ContainerSpec("img", runtime="docker")
    with pytest.raises(ValueError, match="unknown key"):
        SWEEnv(container={"image": "x", "tag": "y"})


def test_shell_through_the_runtime_keeps_state_and_sees_the_workspace(tmp_path, apptainer):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "hello.txt").write_text("hi\n")

    async def go():
        async with ShellSession(ws, container=ContainerSpec("img", executable=apptainer)) as sh:
            first = await sh.run("cat hello.txt && mkdir -p pkg && cd pkg && export FOO=bar && touch made")
            second = await sh.run(
                'pwd; echo "$FOO"; python3 -c "import socket; socket.create_connection((\'1.1.1.1\', 80), 2)"'
            )
            return sh.workdir, first, second

    workdir, first, second = asyncio.run(go())
    assert workdir == "/testbed" and first.status == "ok" and "hi" in first.output, first
    assert second.output.startswith("/testbed/pkg\nbar\n"), second.output
    assert second.status == "error" and "Network is unreachable" in second.output  # --network none
    assert (ws / "pkg" / "made").exists()


def test_swe_episode_in_a_container_gets_the_reference_reward(apptainer):
    task = TASKS[0]
    env = SWEEnv(
        container={
            "image": "docker://swebench/sweb.eval.x86_64.{instance_id}:latest",
            "executable": apptainer,
            "env": {"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"},
        }
    )
    env.use_tool_format("tags")

    async def go():
        question = await env.areset(sample_of(task.instance_id))
        assert env.shell is not None and env.shell.container is not None
        image = env.shell.container.image
        observations = []
        for action in [
            env.call_text("execute_bash", {"command": "pwd && git status --short | wc -l"}),
            *reference_actions(task, env),
        ]:
            step = await env.astep(action)
            observations.append(step.observation)
        result = await env.areward()
        await env.aclose()
        return question, image, observations, result

    question, image, observations, result = asyncio.run(go())
    assert image == f"docker://swebench/sweb.eval.x86_64.{task.instance_id}:latest"
    assert "/testbed" in question and (observations[0] or "").startswith("/testbed\n0"), observations[0]
    assert result.reward == 1.0 and result.details["reason"] == "resolved", result.details
