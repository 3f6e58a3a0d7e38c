"""``rollout.engine_args`` (validated by SGLang's own parser before any engine starts),
``rollout.engine_start_timeout_s``, and the environment a multi-rank CPU engine needs (issue 30)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from sao_megatron.config import load_config
from sao_megatron.driver import engines as engines_mod
from sao_megatron.rollout import engine as engine_mod
from sao_megatron.rollout.engine import EngineProcess, EngineSpec
from sao_megatron.rollout.sglang_cpu import NO_NCCL, multi_rank_env


@pytest.fixture
def started(monkeypatch):
    """Engines launch_engines would start: (spec, environment, command) each; nothing is started."""
    calls: list = []

    class Recorded(engines_mod.EngineProcess):
        def start(self):
            calls.append((self.spec, self._environment(), self._command()))
            return self

    monkeypatch.setattr(engines_mod, "EngineProcess", Recorded)
    return calls


def _cfg(**rollout):
    cfg = load_config()
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **rollout))


def test_valid_engine_args_and_the_start_timeout_reach_every_engine(tmp_path, started):
    args = ["--chunked-prefill-size", "8192", "--context-length=4096"]
    engines_mod.launch_engines(_cfg(engine_args=args, engine_start_timeout_s=900.0, num_engines=2), tmp_path, tmp_path)
    assert len(started) == 2
    for spec, _, cmd in started:
        assert cmd[-3:] == args and spec.startup_timeout_s == 900.0
        assert spec.startup_timeout_key == "rollout.engine_start_timeout_s"


def test_an_engine_still_starting_at_its_timeout_names_the_setting(tmp_path, monkeypatch):
    """Seen on 2 cores with two runs' SFT beside the engine: still importing after 300 s. The error
    says which setting bounds the start, beside the log tail (how far the server got)."""
    import sys

    from sao_megatron.rollout.engine import EngineStartError

    slow = [sys.executable, "-c", "import time; print('still importing', flush=True); time.sleep(60)"]
    monkeypatch.setattr(EngineProcess, "_command", lambda self: slow)
    spec = EngineSpec(
        model_path=str(tmp_path),
        port=1,
        log_path=str(tmp_path / "engine0.log"),
        startup_timeout_s=1.0,
        startup_timeout_key="rollout.engine_start_timeout_s",
    )
    engine = EngineProcess(spec, cpu=False).start()
    try:
        log = tmp_path / "engine0.log"
        deadline = time.monotonic() + 60
        while "still importing" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(
            EngineStartError, match=r"not healthy after 1 s \(raise rollout.engine_start_timeout_s"
        ) as err:
            engine.wait_healthy()
        assert "still importing" in str(err.value)
    finally:
        engine.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-such-flag", "1"], "has no server flag --no-such-flag"),
        (["--chunked-prefill-size", "many"], "refuses them"),
        (["--tp-size", "4"], "sets --tp-size, which the project sets from rollout.tensor_parallel"),
        (["--enable-dp-attention"], "cluster.engine_dp_attention"),
        (["--enable-return-routed-experts"], "which the project sets from rollout.routing_replay"),
    ],
)
def test_bad_engine_args_fail_before_any_engine_starts(tmp_path, started, args, message):
    with pytest.raises(engine_mod.EngineArgsError, match=message):
        engines_mod.launch_engines(_cfg(engine_args=args), tmp_path, tmp_path)
    assert started == []


@pytest.mark.parametrize("cpu", [True, False])
def test_the_projects_own_command_parses_under_the_installed_sglang(cpu):
    """Every flag the project passes (DP attention through SGLang's current --attn-dp-size, a
    multi-node engine, CPU flags) is one SGLang's parser knows, with a value it accepts."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    spec = engine_mod.EngineSpec(
        model_path="m",
        port=30000,
        tensor_parallel=4,
        dp_attention=2,
        mem_fraction_static=0.8,
        nnodes=2,
        node_rank=1,
        dist_init_addr="10.0.0.1:5000",
        load_format="dummy",
        return_routed_experts=True,
    )
    cmd = engine_mod._command(spec, cpu=cpu)
    assert "--enable-return-routed-experts" in cmd
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    assert "--attn-dp-size 2" in joined and "--enable-dp-attention" not in joined and "--dp-size" not in joined
    parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
    ServerArgs.add_cli_args(parser)
    _, unknown = parser.parse_known_args(cmd[3:])
    assert unknown == []


@pytest.mark.parametrize(
    ("ranks", "cores", "bind"),
    [
        (2, [0, 1], "0|1"),
        (2, [0, 1, 2, 3], "0-1|2-3"),
        (3, [0, 1], "0|1|0"),
        (2, [0, 1, 2], "0-1|2"),
        (2, [1, 3], "1|3"),
    ],
)
def test_multi_rank_cpu_engines_bind_each_rank_and_turn_pynccl_off(ranks, cores, bind):
    assert multi_rank_env(ranks, cores) == {"SGLANG_CPU_OMP_THREADS_BIND": bind, "SGLANG_NCCL_SO_PATH": NO_NCCL}
    assert multi_rank_env(1, cores) == {}


def test_a_node_of_a_multi_node_cpu_engine_binds_its_one_rank():
    """SGLang checks the engine's whole world (tp_size) against this node's NUMA nodes, so a node's
    one rank of a TP=2 engine over two nodes needs the binding too; its rank indexes the list by its
    node-local id."""
    assert multi_rank_env(1, [0, 1], world=2) == {"SGLANG_CPU_OMP_THREADS_BIND": "0-1", "SGLANG_NCCL_SO_PATH": NO_NCCL}
    assert multi_rank_env(1, [1, 3], world=2)["SGLANG_CPU_OMP_THREADS_BIND"] == "1,3"
    assert multi_rank_env(1, [0, 1], world=1) == {}


def test_a_tp2_cpu_engine_gets_them_unless_the_user_set_them(tmp_path, started, monkeypatch):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("SGLANG_NCCL_SO_PATH", raising=False)
    engines_mod.launch_engines(_cfg(tensor_parallel=2), tmp_path, tmp_path)
    (_, env, cmd), *_ = started
    assert "--tp-size 2" in " ".join(cmd) and env["SGLANG_NCCL_SO_PATH"] == NO_NCCL
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1
    started.clear()
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-1|0-1")
    engines_mod.launch_engines(
        _cfg(tensor_parallel=2, engine_env={"SGLANG_NCCL_SO_PATH": "/opt/nccl.so"}), tmp_path, tmp_path
    )
    (_, env, _), *_ = started
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|0-1" and env["SGLANG_NCCL_SO_PATH"] == "/opt/nccl.so"
    started.clear()
    engines_mod.launch_engines(_cfg(), tmp_path, tmp_path)  # one rank: nothing added
    (_, env, _), *_ = started
    assert "SGLANG_NCCL_SO_PATH" not in env or env["SGLANG_NCCL_SO_PATH"] != NO_NCCL


def test_engines_get_the_runs_api_key_and_clients_send_it(tmp_path, started, monkeypatch):
    """One key per run: drawn once into the environment, given to every engine on stdin (on no
    command line: ``ps`` shows those to every user), to the router on stdin too, and sent by every
    EngineClient as a bearer token unless told otherwise."""
    import aiohttp.web

    from sao_megatron.rollout.client import API_KEY_ENV, EngineClient, run_api_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    key = run_api_key()
    assert len(key) == 64 and run_api_key() == key  # drawn once
    engines_mod.launch_engines(_cfg(num_engines=2), tmp_path, tmp_path)
    for spec, _, cmd in started:
        assert spec.api_key == key and cmd[1:3] == ["-m", "sao_megatron.rollout.engine_main"]
        assert key not in " ".join(cmd) and "--api-key" not in cmd
        assert engine_mod.EngineProcess(spec, cpu=True)._stdin_secret() == key
    router_spec = engine_mod.RouterSpec(worker_urls=["u"], port=1, api_key=key)
    router = engine_mod._router_command(router_spec, 2)
    assert key not in " ".join(router) and "--api-key" not in router and "--api-key-on-stdin" in router
    assert engine_mod.RouterProcess(router_spec)._stdin_secret() == key

    seen: list = []

    async def handler(request):
        seen.append(request.headers.get("Authorization"))
        return aiohttp.web.json_response({})

    async def scenario() -> None:
        app = aiohttp.web.Application()
        app.router.add_get("/get_model_info", handler)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            for api_key in (None, "other", ""):
                async with EngineClient(f"http://127.0.0.1:{port}", api_key=api_key) as client:
                    await client._call("GET", "/get_model_info")
        finally:
            await runner.cleanup()

    import asyncio

    asyncio.run(scenario())
    assert seen == [f"Bearer {key}", "Bearer other", None]


def test_each_node_of_a_multi_node_engine_advertises_its_own_address(monkeypatch):
    """SGLang's tensor-parallel message queues across nodes connect to the address each node
    advertises; without ``SGLANG_HOST_IP`` it is the interface routing to 8.8.8.8, or ``0.0.0.0``
    (a hang) on nodes without a default route. The engine's node address, unless the user set one."""
    for name in ("SGLANG_HOST_IP", "HOST_IP"):
        monkeypatch.delenv(name, raising=False)

    def env(**kw) -> dict[str, str]:
        spec = EngineSpec(model_path="/m", port=30000, host="10.200.0.5", tensor_parallel=2, **kw)
        return EngineProcess(spec, cpu=True)._environment()

    assert env(nnodes=2, node_rank=1, dist_init_addr="10.200.0.4:5000")["SGLANG_HOST_IP"] == "10.200.0.5"
    assert "SGLANG_HOST_IP" not in env()  # one node: SGLang's local queues only
    given = env(nnodes=2, node_rank=1, dist_init_addr="10.200.0.4:5000", env={"SGLANG_HOST_IP": "192.168.1.5"})
    assert given["SGLANG_HOST_IP"] == "192.168.1.5"
    monkeypatch.setenv("HOST_IP", "192.168.1.6")
    assert "SGLANG_HOST_IP" not in env(nnodes=2, node_rank=1, dist_init_addr="10.200.0.4:5000")


@pytest.mark.parametrize("launch", ["module", "fast"])
def test_the_router_reads_its_key_from_stdin_and_passes_it_on_after_the_other_flags(tmp_path, launch):
    """``_ROUTER_MAIN`` under a stand-in ``sglang_router`` that prints what it was given: the key from
    stdin joins the arguments (never the command line), and a missing key stops it with a reason."""
    import subprocess
    import sys

    stand_in = tmp_path / "sglang_router"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text("")
    (stand_in / "launch_router.py").write_text("import sys, json\nprint(json.dumps(sys.argv[1:]))\n")
    (stand_in / "router_args.py").write_text(
        "class RouterArgs:\n"
        "    @staticmethod\n"
        "    def add_cli_args(parser, use_router_prefix):\n"
        "        parser.add_argument('--port'); parser.add_argument('--api-key')\n"
        "    @staticmethod\n"
        "    def from_cli_args(ns, use_router_prefix):\n"
        "        ns._validate_router_args = lambda: None\n"
        "        return ns\n"
    )
    (stand_in / "router.py").write_text(
        "import json\n"
        "class Router:\n"
        "    @staticmethod\n"
        "    def from_args(args):\n"
        "        class Started:\n"
        "            def start(self):\n"
        "                print(json.dumps(['--port', args.port, '--api-key', args.api_key]))\n"
        "        return Started()\n"
    )
    command = [sys.executable, "-c", engine_mod._ROUTER_MAIN, launch, "--port", "7", "--api-key-on-stdin"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(command, input="s3cret\n", capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["--port", "7", "--api-key", "s3cret"]
    missing = subprocess.run(command, input="", capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 1 and "no API key on stdin" in missing.stderr


def test_a_real_router_gets_its_key_on_stdin_sends_it_to_engines_and_requires_it_of_clients(tmp_path):
    """The real sglang-router in front of a stand-in engine that records each request's key: the key
    reaches the router on stdin only (no process's command line holds it, nor the router's log), the
    router sends it with every request to the engine, and refuses clients without it (401)."""
    import asyncio
    import secrets
    import threading
    import urllib.error
    import urllib.request
    from pathlib import Path

    import aiohttp.web

    from sao_megatron.spawn import free_port

    seen: list[tuple[str, str | None]] = []

    async def answer(request):
        seen.append((request.path, request.headers.get("Authorization")))
        if request.path == "/generate":
            return aiohttp.web.json_response({"text": "", "meta_info": {}})
        return aiohttp.web.json_response({"status": "ok", "model_path": "m", "is_generation": True})

    port, loop = free_port(), asyncio.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        app = aiohttp.web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = aiohttp.web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(aiohttp.web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    key = secrets.token_hex(32)
    spec = engine_mod.RouterSpec(
        worker_urls=[f"http://127.0.0.1:{port}"], port=free_port(), log_path=str(tmp_path / "router.log"), api_key=key
    )

    def generate(url: str, auth: str | None) -> int:
        headers = {"Content-Type": "application/json"} | ({"Authorization": auth} if auth else {})
        body = json.dumps({"input_ids": [1, 2], "sampling_params": {}}).encode()
        try:
            return urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=60).status
        except urllib.error.HTTPError as err:
            return err.code

    try:
        with engine_mod.RouterProcess(spec) as router:
            on_command_lines = []
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    if key.encode() in (proc / "cmdline").read_bytes():
                        on_command_lines.append(proc.name)
                except OSError:  # ended meanwhile
                    pass
            statuses = [generate(router.url + "/generate", a) for a in (None, "Bearer other", f"Bearer {key}")]
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert on_command_lines == []
    assert statuses == [401, 401, 200]
    assert seen and all(auth == f"Bearer {key}" for path, auth in seen if path == "/generate")
    assert [path for path, _ in seen].count("/generate") == 1  # the refused ones never reached the engine
    assert key not in Path(spec.log_path).read_text(errors="replace")
