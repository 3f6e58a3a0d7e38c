"""A driver that starts its own Ray (no ``cluster.ray_address``) gives it a token, as a Slurm job's
Ray has one (``launch/common.sh``): a process without the token cannot join it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DRIVER = """
import json, os, sys
import ray
from sao_megatron.driver.roles import init_ray
init_ray(num_cpus=1)
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "token": os.environ.get("RAY_AUTH_TOKEN")}), flush=True)
sys.stdin.read()  # up until the test closes our stdin
ray.shutdown()
"""

CLIENT = """
import sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("joined with", ray.cluster_resources().get("CPU"), "CPU", flush=True)
"""


def _env(tmp_path, **extra: str) -> dict[str, str]:
    """This process's environment without Ray's auth settings (a test before may have started Ray
    here) and with a HOME of its own, so no ``~/.ray/auth_token`` is read or written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "HOME": str(tmp_path), **extra}


@pytest.mark.slow
def test_a_local_ray_refuses_a_process_without_its_token(tmp_path):
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(tmp_path),
        text=True,
    )
    try:
        assert driver.stdout is not None and driver.stdin is not None
        line = driver.stdout.readline()
        assert line, f"the driver exited ({driver.wait()}) before its Ray started"
        started = json.loads(line)
        assert started["token"] and len(started["token"]) == 64  # 32 random bytes, hex
        # Without the token: refused (Ray's client retries until its GCS timeout, shortened here).
        stranger = subprocess.run(
            [sys.executable, "-c", CLIENT, started["gcs"]],
            env=_env(tmp_path, RAY_gcs_rpc_server_reconnect_timeout_s="5"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stranger.returncode != 0 and "joined" not in stranger.stdout, stranger.stdout
        assert "InvalidAuthToken" in stranger.stderr, stranger.stderr[-2000:]
        member = subprocess.run(
            [sys.executable, "-c", CLIENT, started["gcs"]],
            env=_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=started["token"]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert member.stdout.strip() == "joined with 1.0 CPU", member.stderr[-2000:]
        assert not (tmp_path / ".ray").exists()  # the token lives in the driver's environment only
    finally:
        if driver.stdin is not None:
            driver.stdin.close()
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()


class _FlakyRay:
    """``ray.init`` that fails as Ray does when its raylet registers late, ``fails`` times, then starts."""

    def __init__(
        self, fails: int, message: str = "The current node timed out during startup. This could happen"
    ) -> None:
        self.fails, self.message = fails, message
        self.inits = self.shutdowns = 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.inits += 1
        if self.inits <= self.fails:
            raise Exception(self.message)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.mark.parametrize("fails", [0, 1, 2])
def test_a_local_ray_that_registers_late_is_started_again(monkeypatch, caplog, fails):
    from sao_megatron.driver import roles

    flaky = _FlakyRay(fails)
    monkeypatch.setattr(roles, "ray", flaky)
    monkeypatch.setattr(roles, "local_ray_token", lambda: None)
    monkeypatch.setenv("SAO_ENGINE_API_KEY", "k")
    roles.init_ray(num_cpus=1)
    assert (flaky.inits, flaky.shutdowns) == (fails + 1, fails)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "Ray's local node did not register within Ray's fixed 30 s"
    ] * fails


def test_a_local_ray_that_never_registers_or_fails_otherwise_fails_the_run(monkeypatch):
    from sao_megatron.driver import roles

    monkeypatch.setattr(roles, "local_ray_token", lambda: None)
    monkeypatch.setenv("SAO_ENGINE_API_KEY", "k")
    flaky = _FlakyRay(roles.LOCAL_RAY_ATTEMPTS)
    monkeypatch.setattr(roles, "ray", flaky)
    with pytest.raises(Exception, match="timed out during startup"):
        roles.init_ray(num_cpus=1)
    assert flaky.inits == roles.LOCAL_RAY_ATTEMPTS
    other = _FlakyRay(1, "Ray has not been started yet: no GPUs")
    monkeypatch.setattr(roles, "ray", other)
    with pytest.raises(Exception, match="no GPUs"):
        roles.init_ray(num_cpus=1)
    assert (other.inits, other.shutdowns) == (1, 0)  # any other failure is not retried
