"""Launch SGLang servers as subprocesses (one per engine) and wait until they serve.

On a GPU machine this runs SGLang as installed. Without CUDA it runs SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``, torch-native attention) with the pure-torch
``sgl_kernel`` stand-in from ``rollout/sglang_cpu`` on the subprocess's PYTHONPATH (and only
there), and refuses any SGLang version other than the one the stand-in was measured on.

:class:`RouterProcess` optionally puts an ``sglang-router`` (0.3.2) in front of the engines. It
proxies ``/generate`` (and ``/flush_cache``) but not pause, continue, abort or weight updates:
those control calls must go to every engine directly (``EngineClient(engine.url)``).

Each server runs in its own session, led by ``rollout.server_session``, which ends whatever the
server leaves in it; ``stop()`` ends that process group by the PID this module started, never by
name. A server also dies with the process that started it (Linux ``PR_SET_PDEATHSIG`` on the
session's leader): a SIGKILLed ``sao train`` leaves no engine behind, even one still starting.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import torch

from sao_megatron.config import ConfigError
from sao_megatron.rollout.server_session import die_with_parent, led, session_listens
from sao_megatron.rollout.sglang_cpu import STANDIN_DIR, SUPPORTED_SGLANG, multi_rank_env


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
    dp_attention: int = 1
    """Data-parallel attention ranks (``--dp-size`` with ``--enable-dp-attention``); 1: off."""
    nnodes: int = 1
    """Nodes this engine spans (its TP/EP ranks over several nodes); one server process per node."""
    node_rank: int = 0
    """This process's node among ``nnodes``; node 0 serves HTTP."""
    dist_init_addr: str = ""
    """``host:port`` where the engine's nodes meet (node 0's address) when ``nnodes`` > 1."""
    random_seed: int = 0
    return_routed_experts: bool = False
    """``--enable-return-routed-experts``: requests may ask for the experts each position was routed to
    (``rollout.routing_replay``)."""
    load_format: str = "auto"
    """SGLang ``--load-format``; ``dummy``: random weights from ``config.json`` alone (a weight
    sync gives the real ones), so the server starts without waiting for an export."""
    log_path: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server, e.g. ``{"OMP_NUM_THREADS": "1"}``. On a CPU
    machine shared with other busy processes one torch thread per engine avoids thread barriers
    waiting on a descheduled sibling (measured on 2 busy cores, tiny MoE: agent-loop throughput
    69 -> 404 tokens/s, and identical rounds no longer vary 10x+)."""
    api_key: str | None = None
    """``--api-key``: requests other than health and metrics must carry it (``EngineClient`` sends the
    run's key); None: an open server. It reaches SGLang on stdin (``rollout.engine_main``), so it is
    on no command line and in no log."""
    cpu: bool | None = None
    """Run SGLang's CPU engine. ``None``: whatever the starting process sees (no CUDA: CPU); a run sets
    it from ``cluster.gpus_per_node`` so an engine never lands on a GPU, or on the CPU, by accident."""
    startup_timeout_s: float = 300.0
    startup_timeout_key: str = ""
    """The setting that chose ``startup_timeout_s`` (e.g. ``rollout.engine_start_timeout_s``), named by
    the error when the engine misses it."""
    watchdog_timeout_s: float = 3600.0
    """SGLang kills a server stuck this long; long weight publications must fit inside it."""


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def _command(spec: EngineSpec, cpu: bool) -> list[str]:
    """The engine's command line. With an API key, ``engine_main`` runs SGLang and the key goes to
    it on stdin (:meth:`EngineProcess._stdin_secret`), never on the command line (``ps``) or in the log."""
    cmd = [
        sys.executable,
        "-m",
        "sao_megatron.rollout.engine_main" if spec.api_key else "sglang.launch_server",
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tp-size",
        str(spec.tensor_parallel),
        "--ep-size",
        str(spec.expert_parallel),
        "--dtype",
        spec.dtype,
        "--max-total-tokens",
        str(spec.max_total_tokens),
        "--random-seed",
        str(spec.random_seed),
        "--watchdog-timeout",
        str(spec.watchdog_timeout_s),
        "--skip-server-warmup",
    ]
    if spec.load_format != "auto":
        cmd += ["--load-format", spec.load_format]
    if spec.return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
    if spec.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.dp_attention > 1:  # SGLang 0.5.23's spelling; `--dp-size N --enable-dp-attention` is deprecated
        cmd += ["--attn-dp-size", str(spec.dp_attention)]
    if spec.nnodes > 1:
        if not spec.dist_init_addr:
            raise ValueError(f"an engine over {spec.nnodes} nodes needs dist_init_addr (node 0's host:port)")
        cmd += [
            "--nnodes",
            str(spec.nnodes),
            "--node-rank",
            str(spec.node_rank),
            "--dist-init-addr",
            spec.dist_init_addr,
        ]
    if cpu:
        # Without --sleep-on-idle the CPU scheduler spins a whole core while idle.
        cmd += [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--disable-overlap-schedule",
            "--sleep-on-idle",
        ]
    return cmd + list(spec.extra_args)


MANAGED_FLAGS = {
    "--model-path": "the run (the actor's HF export)",
    "--host": "the run",
    "--port": "the run (a free port)",
    "--tp-size": "rollout.tensor_parallel",
    "--tensor-parallel-size": "rollout.tensor_parallel",
    "--ep-size": "rollout.expert_parallel",
    "--expert-parallel-size": "rollout.expert_parallel",
    "--dtype": "rollout.dtype",
    "--max-total-tokens": "rollout.max_total_tokens",
    "--random-seed": "run.seed",
    "--load-format": "the run (dummy weights, then a weight sync)",
    "--mem-fraction-static": "cluster.engine_mem_fraction",
    "--attn-dp-size": "cluster.engine_dp_attention",
    "--dp-size": "cluster.engine_dp_attention (rollout.num_engines for data parallel engines)",
    "--enable-dp-attention": "cluster.engine_dp_attention",
    "--nnodes": "the placement (rollout.nodes_per_engine; derived: rollout.tensor_parallel over cluster.gpus_per_node)",
    "--node-rank": "the placement",
    "--dist-init-addr": "the placement",
    "--device": "cluster.gpus_per_node",
    "--api-key": "the run (a key drawn per run, sent by every client)",
    "--enable-return-routed-experts": "rollout.routing_replay",
}
"""SGLang flags :func:`_command` sets from the config: ``rollout.engine_args`` may not set them."""


class EngineArgsError(ConfigError):
    """``rollout.engine_args`` names an unknown flag, a bad value, or a flag the project sets."""


def check_engine_args(args: list[str]) -> None:
    """Raise :class:`EngineArgsError` unless ``args`` parse with the installed SGLang's own server
    argument parser and set no flag of :data:`MANAGED_FLAGS`. Imports SGLang's ``server_args``."""
    import argparse
    import contextlib
    import io

    args = [str(a) for a in args]
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise EngineArgsError(
                f"rollout.engine_args sets {flag}, which the project sets from {MANAGED_FLAGS[flag]}; remove it"
            )
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False, add_help=False)
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _, unknown = parser.parse_known_args(["--model-path", "m", *args])
    except (argparse.ArgumentError, SystemExit) as e:
        detail = str(e) if isinstance(e, argparse.ArgumentError) else err.getvalue().strip().splitlines()[-1]
        raise EngineArgsError(f"rollout.engine_args {args}: SGLang {sglang_version()} refuses them: {detail}") from None
    if unknown:
        raise EngineArgsError(
            f"rollout.engine_args: SGLang {sglang_version()} has no server flag {' '.join(unknown)} "
            "(`python -m sglang.launch_server --help` lists them)"
        )


def _environment(cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STANDIN_DIR), env.get("PYTHONPATH", "")) if p)
    return env


class _ServerProcess:
    """A server subprocess in its own session (``self.proc``: the session's leader, which exits as the
    server does), polled until healthy, stopped by process group."""

    kind = "server"
    health_path = "/health"

    def __init__(self, host: str, port: int, log_path: str | None, startup_timeout_s: float):
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.startup_timeout_key = ""
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(log_path or f"/tmp/sao-{self.kind}-{port}.log")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _environment(self) -> dict[str, str]:
        return dict(os.environ)

    def _check(self) -> None:
        """Raise before launching if this server cannot run here."""

    def _stdin_secret(self) -> str | None:
        """A secret the server reads as one line on stdin (else stdin is ``/dev/null``)."""
        return None

    def start(self) -> Self:
        self._check()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115  (owned by the child for its lifetime)
        secret = self._stdin_secret()
        self.proc = subprocess.Popen(
            led(self._command()),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if secret else subprocess.DEVNULL,
            env=self._environment(),
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        log.close()
        if secret and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # died at once: the health wait reports it, with its log
                self.proc.stdin.write(f"{secret}\n".encode())
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        return self

    def alive(self) -> bool:
        """The server process this object started is running."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def _healthy_body(self, body: bytes) -> bool:
        return True

    def healthy(self) -> bool:
        """The health endpoint on the port answers 200 (whoever serves it: see :meth:`serves_port`)."""
        try:
            with urllib.request.urlopen(f"{self.url}{self.health_path}", timeout=2) as response:
                return response.status == 200 and self._healthy_body(response.read())
        except (urllib.error.URLError, OSError, http.client.HTTPException):  # not HTTP: another protocol's server
            return False

    def serves_port(self) -> bool:
        """The process this object started (or one of its session) listens on the port: a health answer
        is this server's, not that of another that took the port before it bound."""
        return self.proc is not None and self.proc.poll() is None and session_listens(self.proc.pid, self.port)

    port_retries = 3
    """Restarts on a fresh port when the chosen one was taken meanwhile (``spawn.free_port``)."""

    def _use_port(self, port: int) -> None:
        self.port = port

    def _port_clash(self) -> bool:
        """The server exited because its port was already bound by someone else."""
        return "address already in use" in self.log_tail(200).lower()

    def wait_healthy(self, timeout_s: float | None = None) -> float:
        """Block until the health endpoint answers 200 from our own, running process; returns
        seconds waited. A server that died on a port clash is restarted on a fresh port."""
        from sao_megatron.spawn import free_port

        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        retries = self.port_retries
        while time.monotonic() - t0 < timeout_s:
            if self.proc is not None and self.proc.poll() is not None and retries and self._port_clash():
                retries -= 1
                clashed = self.port
                self._use_port(free_port())
                logging.getLogger(__name__).warning(
                    "%s: port %d was taken; restarting on %d", self.kind, clashed, self.port
                )
                self.start()
                continue
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineStartError(
                    f"{self.kind} on port {self.port} exited with {self.proc.returncode}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy() and (self.proc is None or self.serves_port()):
                return time.monotonic() - t0
            time.sleep(0.5)
        key = self.startup_timeout_key
        hint = f" (raise {key} if it was still starting: the log's last lines show how far it got)" if key else ""
        raise EngineStartError(
            f"{self.kind} on port {self.port} not healthy after {timeout_s:.0f} s{hint}; "
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

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EngineProcess(_ServerProcess):
    """One SGLang server subprocess."""

    kind = "SGLang engine"

    def __init__(self, spec: EngineSpec, cpu: bool | None = None):
        super().__init__(
            spec.host, spec.port, spec.log_path or f"/tmp/sao-sglang-{spec.port}.log", spec.startup_timeout_s
        )
        self.spec = spec
        self.startup_timeout_key = spec.startup_timeout_key
        if cpu is None:
            cpu = spec.cpu if spec.cpu is not None else not torch.cuda.is_available()
        self.cpu = cpu

    def _check(self) -> None:
        if self.cpu and sglang_version() != SUPPORTED_SGLANG:
            raise EngineStartError(
                f"SGLang on CPU needs sglang=={SUPPORTED_SGLANG} (the sgl_kernel stand-in was measured on it), "
                f"found {sglang_version()}; install requirements/sglang-*.txt"
            )

    def _command(self) -> list[str]:
        return _command(self.spec, self.cpu)

    def _stdin_secret(self) -> str | None:
        return self.spec.api_key or None

    def _use_port(self, port: int) -> None:
        self.port = self.spec.port = port

    def _environment(self) -> dict[str, str]:
        env = _environment(self.cpu)
        if self.spec.nnodes > 1 and not {"SGLANG_HOST_IP", "HOST_IP"} & (os.environ.keys() | self.spec.env.keys()):
            # The address this node's ranks advertise to the engine's other nodes (the tensor-parallel
            # groups' message queues): SGLang otherwise takes the interface of a route to 8.8.8.8, and
            # "0.0.0.0" without one, where the other nodes' ranks wait forever (measured on the
            # five-node CI cluster, whose nodes have no default route).
            env["SGLANG_HOST_IP"] = self.spec.host
        if self.cpu:  # a multi-rank CPU engine's needs, unless the user set them (issue 30)
            ranks_here = self.spec.tensor_parallel // max(1, self.spec.nnodes)
            needs = multi_rank_env(ranks_here, world=self.spec.tensor_parallel)
            env.update({k: v for k, v in needs.items() if k not in os.environ})
        return {**env, **self.spec.env}


# ---- sglang-router ----------------------------------------------------------------------------

SUPPORTED_ROUTER = "0.3.2"

# ``python -m sglang_router.launch_router`` imports ``mini_lb`` and with it all of ``sglang``
# (~15-20 s on a busy 2-core machine). This does what its ``main()`` does (same flags, same Rust
# router) with only ``sglang_router.router`` imported (~0.1 s).
_ROUTER_MAIN = """
import os, sys
mode, argv = sys.argv[1], sys.argv[2:]
if "--api-key-on-stdin" in argv:  # the key as stdin's first line, never in ps or /proc/PID/cmdline
    argv.remove("--api-key-on-stdin")
    key = sys.stdin.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if not key:
        sys.exit("router: no API key on stdin (RouterProcess sends RouterSpec.api_key there)")
    argv += ["--api-key", key]
if mode == "module":
    import runpy
    sys.argv = ["sglang_router.launch_router", *argv]
    runpy.run_module("sglang_router.launch_router", run_name="__main__", alter_sys=True)
    sys.exit(0)
import argparse
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs
try:
    import setproctitle; setproctitle.setproctitle("sglang::router")
except ImportError:
    pass
parser = argparse.ArgumentParser(prog="sglang_router.launch_router")
RouterArgs.add_cli_args(parser, use_router_prefix=False)
args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
args._validate_router_args()
Router.from_args(args).start()
"""


def router_version() -> str:
    from importlib.metadata import version

    return version("sglang-router")


@dataclass
class RouterSpec:
    """How to start one ``sglang-router`` in front of running engines (for ``/generate`` only)."""

    worker_urls: list[str]
    """Engine base URLs, e.g. ``[engine.url for engine in engines]``."""
    port: int
    host: str = "127.0.0.1"
    policy: str = "cache_aware"
    """``cache_aware`` (prefix affinity, good for multi-turn episodes), ``round_robin``, ``random``,
    ``power_of_two``."""
    prometheus_port: int | None = None
    """Metrics port, bound on ``host``; None picks a free one (the router's default is 0.0.0.0:29000)."""
    request_timeout_s: float = 3600.0
    """The router cuts requests longer than this (its default: 1800 s)."""
    health_check_timeout_s: float = 600.0
    """An engine's ``/health`` generates one token, so it hangs while generation is paused for a weight
    update; with the router's default (5 s) three missed checks during a long pause mark the engine
    unhealthy and ``/generate`` answers 503 until it recovers."""
    shutdown_grace_s: float = 5.0
    """How long the router waits for in-flight requests on SIGTERM (its default: 180 s)."""
    log_level: str = "warn"
    log_path: str | None = None
    extra_args: list[str] = field(default_factory=list)
    fast_launch: bool = True
    """Start the Rust router without importing ``sglang`` (see ``_ROUTER_MAIN``); False runs
    ``sglang_router.launch_router`` with the same flags."""
    startup_timeout_s: float = 120.0
    api_key: str | None = None
    """The engines' key (``EngineSpec.api_key``), which the router sends them; it reaches the router
    on stdin (``_ROUTER_MAIN``), as the engines' does. sglang-router 0.3.2 also requires it of its own
    clients (401 without it or with another; tests/rollout/test_engine_args.py)."""


def _router_command(spec: RouterSpec, prometheus_port: int) -> list[str]:
    key = ["--api-key-on-stdin"] if spec.api_key else []
    return [
        sys.executable,
        "-c",
        _ROUTER_MAIN,
        "fast" if spec.fast_launch else "module",
        "--worker-urls",
        *spec.worker_urls,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--policy",
        spec.policy,
        "--prometheus-host",
        spec.host,
        "--prometheus-port",
        str(prometheus_port),
        "--request-timeout-secs",
        str(int(spec.request_timeout_s)),
        "--health-check-timeout-secs",
        str(int(spec.health_check_timeout_s)),
        "--shutdown-grace-period-secs",
        str(int(spec.shutdown_grace_s)),
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        spec.log_level,
        *key,
        *spec.extra_args,
    ]


class RouterProcess(_ServerProcess):
    """One ``sglang-router`` subprocess; healthy once every worker in the spec is registered healthy.

    Send only ``/generate`` (``EngineClient(router.url).generate``) through it. Pause, continue,
    abort and weight updates answer 404 on the router: send them to each engine's own URL.
    """

    kind = "sglang-router"
    health_path = "/readiness"

    def __init__(self, spec: RouterSpec):
        if not spec.worker_urls:
            raise ValueError("RouterSpec.worker_urls is empty: start the engines first")
        super().__init__(spec.host, spec.port, spec.log_path, spec.startup_timeout_s)
        self.spec = spec
        if spec.prometheus_port is None:
            from sao_megatron.spawn import free_port

            self.prometheus_port = free_port()
        else:
            self.prometheus_port = spec.prometheus_port

    def _check(self) -> None:
        if router_version() != SUPPORTED_ROUTER:
            raise EngineStartError(
                f"RouterProcess was measured on sglang-router=={SUPPORTED_ROUTER}, found {router_version()}"
            )

    def _stdin_secret(self) -> str | None:
        return self.spec.api_key or None

    def _command(self) -> list[str]:
        return _router_command(self.spec, self.prometheus_port)

    def _use_port(self, port: int) -> None:
        from sao_megatron.spawn import free_port

        self.port = self.spec.port = port
        if self.spec.prometheus_port is None:  # ours to choose: it may have been the one taken
            self.prometheus_port = free_port()

    def _healthy_body(self, body: bytes) -> bool:
        # {"status": "ready", "healthy_workers": n, "total_workers": m}
        try:
            ready = json.loads(body)
        except ValueError:
            return False
        healthy = int(ready.get("healthy_workers", 0))
        return ready.get("status") == "ready" and healthy >= len(self.spec.worker_urls)
