"""Launch scripts without Slurm: syntax, shellcheck, signal forwarding, ``sao submit --dry-run``."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sao_megatron.config import REPO_ROOT

SCRIPTS = sorted(
    {*REPO_ROOT.glob("launch/**/*.sh"), *REPO_ROOT.glob(".ci/*.sh")}
    | {REPO_ROOT / p for p in ("launch/slurm/sao.sbatch", ".ci/run", "benchmarks/gpu/run.sh")}
)
"""Every launch script; .ci/run lints the same set with shellcheck before the tests."""
STUB = Path(__file__).with_name("stub_driver.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_bash_syntax(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck not installed (.ci/run installs it; apt-get install shellcheck)",
)
def test_shellcheck_clean():
    out = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _wait_for(path: Path, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip() == text:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never read {text!r} (got {path.read_text() if path.exists() else None!r})")


def _wait_for_traps(pid: int, timeout: float = 30.0) -> None:
    """Until the shell ``pid`` catches USR1, TERM and INT (its ``SigCgt`` mask in /proc; the
    launcher traps them in that order): a signal sent before ``trap`` runs would end the shell,
    not reach the driver."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
        if all(caught >> (sig - 1) & 1 for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)):
            return
        time.sleep(0.05)
    raise AssertionError(f"shell {pid} never trapped USR1, TERM and INT")


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_stop_signals_to_the_driver_as_sigint(tmp_path, sig):
    """Slurm's ``--signal=B:USR1@120``, preemption's SIGTERM and Ctrl-C reach the launcher
    shell; the driver, started in the background (where bash ignores SIGINT), must still get a
    KeyboardInterrupt so that ``sao train`` checkpoints in its ``finally:``."""
    marker = tmp_path / "marker"
    script = f'source launch/common.sh; sao_run_driver - "{sys.executable}" "{STUB}" "{marker}" cfg.yaml; echo "rc=$?"'
    # A shell started with SIGINT ignored cannot trap it (POSIX), as under a pytest run in a background
    # job (`nohup pytest &`); a Slurm batch shell, like a terminal's, starts with the default.
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        _wait_for(marker, "started")
        _wait_for_traps(proc.pid)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert marker.read_text().strip() == "SIGINT", err
    assert "rc=0" in out, out + err
    assert f"received SIG{sig.name[3:]}" in err


def test_a_stop_signal_while_the_driver_starts_reaches_the_driver(tmp_path):
    """A SIGTERM that reaches the launcher while it is still starting the driver (its stderr
    blocked on a full pipe, as under a loaded machine it is just slow) is forwarded, not fatal:
    the shell trapped it before the driver started. Trapped after, it ended the shell and left the
    driver running (the fresh-clone CI of 9f79d36 lost its local-launcher test that way)."""
    marker, pid_file = tmp_path / "marker", tmp_path / "driver.pid"
    driver = f'echo $$ > "{pid_file}"; kill -TERM "$PPID"; exec "{sys.executable}" "{STUB}" "{marker}"'
    script = f"source launch/common.sh; sao_run_driver - sh -c '{driver}'; echo \"rc=$?\""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    with contextlib.suppress(BlockingIOError):  # fill the pipe: the launcher's first log line blocks
        while True:
            os.write(write_fd, b"." * 4096)
    os.set_blocking(write_fd, True)
    proc = subprocess.Popen(["bash", "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=write_fd, text=True)
    os.close(write_fd)
    drained: list[bytes] = []
    try:
        _wait_for(marker, "started")
        drainer = threading.Thread(target=lambda: drained.extend(iter(lambda: os.read(read_fd, 65536), b"")))
        drainer.start()
        out, _ = proc.communicate(timeout=60)
        drainer.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if marker.exists() and marker.read_text().strip() == "started":  # the driver outlived its launcher
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        os.close(read_fd)
    err = b"".join(drained).decode().lstrip(".")
    assert marker.read_text().strip() == "SIGINT", err
    assert "rc=0" in out, out + err
    assert "received SIGTERM" in err, err


def _submit_dry_run(*args: str) -> str:
    # RAY_AUTH_*: a test before this one may have started Ray in this process (init_ray sets
    # RAY_AUTH_MODE=token and a token for its own local Ray); a user submitting has none
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAO_", "RAY_AUTH"))}
    out = subprocess.run(
        [sys.executable, "-m", "sao_megatron.cli", "submit", *args, "--dry-run"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_submit_dry_run_prints_every_node_group(tmp_path):
    text = _submit_dry_run("configs/moe_750b_a40b.yaml", f"run.run_dir={tmp_path}/run")
    lines = text.splitlines()
    sbatch = next(line for line in lines if " sbatch " in line)
    assert "SAO_ACTOR_NODES=32 SAO_CRITIC_NODES=32 SAO_ROLLOUT_NODES=32" in sbatch
    assert "--nodes=96" in sbatch and "--gpus-per-node=8" in sbatch
    assert sbatch.endswith(f"configs/moe_750b_a40b.yaml run.run_dir={tmp_path}/run")
    sruns = [line for line in lines if line.startswith("srun ")]
    assert len(sruns) == 4  # head (node01, actor), the other actor nodes, critic, rollout
    head, actor, critic, rollout = sruns
    assert (
        "--nodelist=node01 " in head
        and "ray-start --head" in head
        and "exec ray start --num-cpus=" in head
        and '{"sao_actor": 8}' in head
    )
    assert "--nodes=31 " in actor and "--nodelist=node02,node03," in actor and "node32 " in actor
    assert "--nodes=32 " in critic and "--nodelist=node33," in critic and '{"sao_critic": 8}' in critic
    assert "--nodes=32 " in rollout and "node96 " in rollout and '{"sao_rollout": 8}' in rollout
    assert all("--address=HEAD_IP:6379" in line for line in (actor, critic, rollout))
    assert "export SAO_CRITIC_NODELIST=" + ",".join(f"node{i:02d}" for i in range(33, 65)) in lines
    driver = next(line for line in lines if line.startswith("env --default-signal=INT sao train "))
    assert (
        f"run.run_dir={tmp_path}/run cluster.ray_address=HEAD_IP:6379 > {tmp_path}/run/slurm/job-dry-run/train.log"
        in driver
    )
    assert "export SAO_HEAD_ADDRESS=HEAD_IP:6379" in lines
    assert not any("SAO_RAY_ADDRESS" in line for line in lines)  # the driver gets the address as an override
    # Ray token authentication: exported before the first `ray start`, the token in the job's log dir
    auth = f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={tmp_path}/run/slurm/job-dry-run/ray_auth_token"
    assert any(line.startswith(auth) for line in lines), text
    assert lines.index(next(line for line in lines if line.startswith(auth))) < lines.index(head)


def test_ray_token_auth_writes_a_private_random_token_and_can_be_turned_off(tmp_path):
    script = 'source launch/common.sh; sao_ray_auth "$1"; echo "$RAY_AUTH_MODE ${RAY_AUTH_TOKEN_PATH:-none}"'
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAO_", "RAY_AUTH"))}
    tokens = []
    for run in ("a", "b"):
        out = subprocess.run(
            ["bash", "-c", script, "sh", str(tmp_path / run)], cwd=REPO_ROOT, env=env, capture_output=True, text=True
        )
        path = tmp_path / run / "ray_auth_token"
        assert out.returncode == 0 and out.stdout.split() == ["token", str(path)], out.stderr
        assert path.stat().st_mode & 0o777 == 0o600
        tokens.append(path.read_text())
    assert all(len(t) == 64 and int(t, 16) for t in tokens) and tokens[0] != tokens[1]  # 32 random bytes each
    out = subprocess.run(
        ["bash", "-c", script, "sh", str(tmp_path / "off")],
        cwd=REPO_ROOT,
        env={**env, "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["disabled", "none"] and "authentication off" in out.stderr
    assert not (tmp_path / "off").exists()


def test_submit_dry_run_cpu_config_is_one_shared_node(tmp_path):
    text = _submit_dry_run("configs/tiny_cpu.yaml", "train.steps=2", f"run.run_dir={tmp_path}/run")
    assert "--nodes=1 " in text and "--gpus-per-node" not in text
    assert "export SAO_HEAD_ADDRESS=127.0.0.1:6379" in text
    assert "sao train " in text and " cluster.ray_address=127.0.0.1:6379 > " in text
    sruns = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 1
    assert '{"sao_actor": 1, "sao_critic": 1, "sao_rollout": 1}' in sruns[0]


def test_local_launcher_without_a_head_passes_the_arguments_unchanged(tmp_path):
    """Without ``SAO_RAY_HEAD=1`` the driver starts its own Ray: no ``cluster.ray_address`` is added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_")}
    env.update(SAO_TRAIN="echo driver-args:", SAO_LOG_DIR=str(tmp_path))
    out = subprocess.run(
        ["bash", "launch/local.sh", "cfg.yaml", "train.steps=2"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "driver-args: cfg.yaml train.steps=2"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_local_launcher_starts_a_ray_head_and_stops_it_by_pid(tmp_path):
    """``SAO_RAY_HEAD=1 launch/local.sh``: head on 127.0.0.1, SIGTERM -> driver SIGINT -> head stopped."""
    marker, ray_tmp, port = tmp_path / "marker", f"/tmp/ray-sao-t{os.getpid()}", _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_")}
    env.update(
        SAO_RAY_HEAD="1",
        SAO_RAY_PORT=str(port),
        SAO_RAY_TMP=ray_tmp,
        SAO_LOG_DIR=str(tmp_path),
        SAO_RAY_ARGS=f"--ray-client-server-port={_free_port()} --dashboard-agent-listen-port={_free_port()} "
        f"--num-cpus=1 --object-store-memory={128 << 20}",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        SAO_TRAIN=f"{sys.executable} {STUB} {marker}",
    )
    proc = subprocess.Popen(
        ["bash", "launch/local.sh", "cfg.yaml"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(marker, "started", timeout_s=240)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        assert proc.returncode == 0, out
        assert marker.read_text().strip() == "SIGINT", out
        assert "Ray head at 127.0.0.1:" in out and "received SIGTERM" in out
        assert f"{marker} cfg.yaml cluster.ray_address=127.0.0.1:{port}" in out  # the driver's command line
        assert list(tmp_path.glob("*/ray-head.log"))
        import psutil

        alive = [p.pid for p in psutil.process_iter(["cmdline"]) if any(ray_tmp in a for a in p.info["cmdline"] or [])]
        assert not alive, f"Ray head processes left: {alive}"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
