"""Launch SGLang servers as subprocesses (one per engine) and wait until they serve.

On a GPU machine this runs SGLang as installed. Without CUDA it runs SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``, torch-native attention) with the pure-torch
``sgl_kernel`` stand-in from ``rollout/sglang_cpu`` on the subprocess's PYTHONPATH (and only
there), and refuses any SGLang version other than the one the stand-in was measured on.

Each server runs in its own session; :meth:`EngineProcess.stop` ends that process group by
the PID this module started, never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sao_megatron.rollout.sglang_cpu import STANDIN_DIR, SUPPORTED_SGLANG


class EngineStartError(RuntimeError):
    """An engine exited or did not become healthy in time; the message ends with its log tail."""


@dataclass
class EngineSpec:
    """How to start one SGLang server."""

    model_path: str
    """HF-format model directory (weights, config.json, tokenizer)."""
    port: int
    """HTTP port on ``host``."""
    host: str = "127.0.0.1"
    tensor_parallel: int = 1
    expert_parallel: int = 1
    dtype: str = "auto"
    """``float32`` on CPU makes engine logprobs match the trainer's to ~1e-6."""
    max_total_tokens: int = 32768
    """KV-cache capacity in tokens."""
    mem_fraction_static: float | None = None
    random_seed: int = 0
    log_path: str | None = None
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0
    watchdog_timeout_s: float = 3600.0
    """SGLang kills a server stuck this long; long weight publications must fit inside it."""


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def _command(spec: EngineSpec, cpu: bool) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model_path,
        "--host", spec.host, "--port", str(spec.port), "--tp-size", str(spec.tensor_parallel),
        "--ep-size", str(spec.expert_parallel), "--dtype", spec.dtype,
        "--max-total-tokens", str(spec.max_total_tokens), "--random-seed", str(spec.random_seed),
        "--watchdog-timeout", str(spec.watchdog_timeout_s), "--skip-server-warmup",
    ]  # fmt: skip
    if spec.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if cpu:
        # Without --sleep-on-idle the CPU scheduler spins a whole core while idle.
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
                "--sleep-on-idle"]  # fmt: skip
    return cmd + list(spec.extra_args)


def _environment(cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STANDIN_DIR), env.get("PYTHONPATH", "")) if p)
    return env


class EngineProcess:
    """One SGLang server subprocess."""

    def __init__(self, spec: EngineSpec, cpu: bool | None = None):
        self.spec = spec
        self.cpu = (not torch.cuda.is_available()) if cpu is None else cpu
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(spec.log_path or f"/tmp/sao-sglang-{spec.port}.log")

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def start(self) -> EngineProcess:
        if self.cpu and sglang_version() != SUPPORTED_SGLANG:
            raise EngineStartError(
                f"SGLang on CPU needs sglang=={SUPPORTED_SGLANG} (the sgl_kernel stand-in was measured on it), "
                f"found {sglang_version()}; install requirements/sglang-*.txt"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115  (owned by the child for its lifetime)
        self.proc = subprocess.Popen(
            _command(self.spec, self.cpu), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=_environment(self.cpu), start_new_session=True,
        )  # fmt: skip
        log.close()
        return self

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float | None = None) -> float:
        """Block until ``/health`` answers 200; returns seconds waited."""
        timeout_s = self.spec.startup_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineStartError(
                    f"SGLang engine on port {self.spec.port} exited with {self.proc.returncode}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise EngineStartError(
            f"SGLang engine on port {self.spec.port} not healthy after {timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the server's process group (started by us), then kill what remains."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # the child leads its own session (start_new_session=True)
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=grace_s)

    def __enter__(self) -> EngineProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
