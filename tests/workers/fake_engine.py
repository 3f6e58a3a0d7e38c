"""A fake SGLang engine for the weight-sync tests: the control endpoints the trainer posts to, and
a real gloo broadcast group per sender (``/init_weights_update_group``), without a model.

It answers like SGLang does (``{"success": ..., "message": ...}``, HTTP 400 on a refusal), keeps
SGLang's session rule (one ``/begin_weight_update`` ... ``/end_weight_update`` at a time, updates
only inside one), loads one update at a time, and checks every received tensor against
:func:`weight_value`. ``GET /log`` returns every call in arrival order; ``POST /reset`` clears the
log, the session and the groups and sets the :class:`Faults` of the next test.

Start one per process with :class:`EngineProcess` (the pytest process owns it and stops it by PID).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import socket
import urllib.request
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

_NAME = re.compile(r"^model\.stage(\d+)\.bucket(\d+)\.tensor(\d+)\.weight$")


def weight_name(stage: int, bucket: int, index: int) -> str:
    """The HF-style name of tensor ``index`` of ``bucket`` of pipeline ``stage``."""
    return f"model.stage{stage}.bucket{bucket}.tensor{index}.weight"


def weight_value(name: str, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The float32 values the fake trainer sends under ``name``: they encode (stage, bucket,
    tensor) and each element's position, so a tensor sent under another name or out of order differs."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"not a fake weight name: {name}")
    stage, bucket, index = (int(g) for g in match.groups())
    numel = 1
    for n in shape:
        numel *= n
    return (torch.arange(numel, dtype=torch.float32) / 8 + 1000 * stage + 100 * bucket + 10 * index).reshape(
        tuple(shape)
    )


@dataclass
class Faults:
    """What one engine does wrong (by default nothing)."""

    refuse_begin_on_call: int = 0
    """Refuse this (1-based) ``/begin_weight_update`` call; 0: never."""
    fail_update: tuple[str, str] | None = None
    """``(group_name, first tensor name)``: receive that bucket, then answer it with success false
    and :attr:`message` (once)."""
    refuse_update: tuple[str, str] | None = None
    """``(group_name, first tensor name)``: answer that bucket with success false without receiving
    it (once). Its sender's broadcast stays pending (as under NCCL for a dead engine) until the
    sender's wait times out (``rollout.weight_sync_timeout_s``) and it aborts its group."""
    silent_update: tuple[str, str] | None = None
    """``(group_name, first tensor name)``: receive that bucket, then never answer it (once): the
    engine holds the weights but its answer is lost. Its sender's broadcast completes; only the
    trainer's bound on the engines' answers ends the wait."""
    hang_update: tuple[str, str] | None = None
    """``(group_name, first tensor name)``: neither receive that bucket nor answer it (once), as a hung
    engine. Its sender's broadcast stays pending until the sender's wait times out
    (``rollout.weight_sync_timeout_s``) and it aborts its group. A request left unanswered is
    answered (success false) at the next ``/reset``; the engine serves other requests meanwhile."""
    message: str = "cannot load"


class FakeEngine:
    """The endpoints' state: session, groups, call log, faults."""

    def __init__(self, faults: Faults):
        self.faults = faults
        self.session = False
        self.groups: dict[str, Any] = {}
        self.log: list[dict[str, Any]] = []
        self.begin_calls = 0
        self.loading = asyncio.Lock()  # one update at a time, as SGLang's scheduler
        self.unanswered = asyncio.Event()  # set at /reset: the hung requests answer then

    def _record(self, endpoint: str, **fields: Any) -> dict[str, Any]:
        entry = {"endpoint": endpoint, **fields}
        self.log.append(entry)
        return entry

    @staticmethod
    def _answer(entry: dict[str, Any], success: bool, message: str = "Success") -> web.Response:
        entry["success"] = success
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def pause(self, request: web.Request) -> web.Response:
        entry = self._record("/pause_generation", mode=(await request.json()).get("mode"))
        return self._answer(entry, True)

    async def resume(self, request: web.Request) -> web.Response:
        return self._answer(self._record("/continue_generation"), True)

    async def flush(self, request: web.Request) -> web.Response:
        self._record("/flush_cache")["success"] = True
        return web.Response(text="Cache flushed.\n")  # SGLang answers plain text

    async def begin(self, request: web.Request) -> web.Response:
        entry = self._record("/begin_weight_update")
        self.begin_calls += 1
        if self.begin_calls == self.faults.refuse_begin_on_call:
            return self._answer(entry, False, "refused by fault injection")
        if self.session:
            return self._answer(entry, False, "a weight-update session is already open")
        self.session = True
        return self._answer(entry, True)

    async def end(self, request: web.Request) -> web.Response:
        entry = self._record("/end_weight_update")
        if not self.session:
            return self._answer(entry, False, "no weight-update session is open")
        self.session = False
        return self._answer(entry, True)

    async def init_group(self, request: web.Request) -> web.Response:
        from sao_megatron.parallel import join_store, resolve_backend
        from sao_megatron.runtime import strict_nccl
        from sao_megatron.weight_sync import new_group

        body = await request.json()
        name = body["group_name"]
        entry = self._record(
            "/init_weights_update_group",
            group_name=name,
            rank=body["rank_offset"],
            world_size=body["world_size"],
            backend=body["backend"],
        )

        resolve_backend(body["backend"])  # strict_nccl: registered in this process
        # an engine's GPU is not one of the trainer's; a fake engine has none to name (as the CPU shim)
        os.environ.setdefault(strict_nccl.DEVICE_ENV, "none")

        def join() -> Any:
            store = join_store(body["master_address"], body["master_port"], body["world_size"], timeout_s=60)
            return new_group(body["backend"], store, body["world_size"], body["rank_offset"], name)

        try:
            self.groups[name] = await asyncio.to_thread(join)
        except Exception as err:
            return self._answer(entry, False, f"{type(err).__name__}: {err}")
        return self._answer(entry, True)

    async def destroy_group(self, request: web.Request) -> web.Response:
        name = (await request.json())["group_name"]
        entry = self._record("/destroy_weights_update_group", group_name=name)
        group = self.groups.pop(name, None)
        if group is None:
            return self._answer(entry, False, f"no group {name}")
        await asyncio.to_thread(dist.destroy_process_group, group)
        return self._answer(entry, True)

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        names, name = body["names"], body["group_name"]
        entry = self._record(
            "/update_weights_from_distributed",
            group_name=name,
            names=names,
            version=body["weight_version"],
            flush_cache=body["flush_cache"],
            load_format=body["load_format"],
            overlapped=self.loading.locked(),
        )
        bucket = (name, names[0])
        async with self.loading:
            if not self.session:
                return self._answer(entry, False, "update_weights_from_distributed must run inside a session")
            if self.faults.refuse_update == bucket:
                self.faults.refuse_update = None
                return self._answer(entry, False, self.faults.message)
            hang = self.faults.hang_update == bucket
            if hang:
                self.faults.hang_update = None
            else:
                group = self.groups.get(name)
                if group is None or body["load_format"] is not None:
                    return self._answer(entry, False, f"unknown group {name} or format {body['load_format']}")
                entry["bad"] = await asyncio.to_thread(self._receive, group, names, body["dtypes"], body["shapes"])
                if self.faults.fail_update == bucket:
                    self.faults.fail_update = None
                    return self._answer(entry, False, self.faults.message)
                hang = self.faults.silent_update == bucket
                if hang:
                    self.faults.silent_update = None
        if hang:  # not holding the lock: the engine serves the next requests
            entry["unanswered"] = True
            await self.unanswered.wait()
            return self._answer(entry, False, "never answered (fault injection)")
        return self._answer(entry, True)

    @staticmethod
    def _receive(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[str]:
        """Receive one bucket tensor by tensor (the group's rank 0 sends); the names whose values
        differ from :func:`weight_value`."""
        bad = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=group)
            if not torch.equal(tensor, weight_value(name, shape)):
                bad.append(name)
        return bad

    async def get_log(self, request: web.Request) -> web.Response:
        return web.json_response({"log": self.log})

    async def reset(self, request: web.Request) -> web.Response:
        """Forget the last test: its log, session and groups (destroyed here); new faults."""
        body = await request.json()
        for group in self.groups.values():
            await asyncio.to_thread(dist.destroy_process_group, group)
        self.groups.clear()
        self.unanswered.set()
        self.unanswered = asyncio.Event()
        self.log.clear()
        self.session = False
        self.begin_calls = 0
        self.faults = _faults(body)
        return web.json_response({"success": True})


def _faults(fields: dict[str, Any]) -> Faults:
    given: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return Faults(**given)


async def _serve(conn: Connection, faults: dict[str, Any]) -> None:
    engine = FakeEngine(_faults(faults))
    app = web.Application()
    app.add_routes(
        [
            web.post("/pause_generation", engine.pause),
            web.post("/continue_generation", engine.resume),
            web.post("/flush_cache", engine.flush),
            web.post("/begin_weight_update", engine.begin),
            web.post("/end_weight_update", engine.end),
            web.post("/init_weights_update_group", engine.init_group),
            web.post("/destroy_weights_update_group", engine.destroy_group),
            web.post("/update_weights_from_distributed", engine.update),
            web.get("/log", engine.get_log),
            web.post("/reset", engine.reset),
        ]
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # port 0: bound here, so no other process can take it meanwhile
    site = web.SockSite(runner, sock)
    await site.start()
    conn.send(sock.getsockname()[1])
    conn.close()
    await asyncio.Event().wait()  # until terminated


def serve(conn: Connection, faults: dict[str, Any]) -> None:
    """The engine process: serve on a free loopback port and send it over ``conn``."""
    asyncio.run(_serve(conn, faults))


class EngineProcess:
    """One fake engine in a spawned process of its own."""

    def __init__(self, faults: Faults | None = None):
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=serve, args=(child, asdict(faults or Faults())), daemon=True)
        self.process.start()
        child.close()
        self._conn = parent
        self.url = ""

    def wait_ready(self, timeout_s: float = 60.0) -> str:
        """Its URL, once it listens."""
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"fake engine (pid {self.process.pid}) did not start in {timeout_s:.0f} s")
        self.url = f"http://127.0.0.1:{self._conn.recv()}"
        return self.url

    def _post(self, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + endpoint, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.load(resp)

    def reset(self, faults: Faults | None = None) -> None:
        self._post("/reset", asdict(faults or Faults()))

    def log(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.url + "/log", timeout=30) as resp:
            return json.load(resp)["log"]

    def stop(self) -> None:
        """Terminate it (by its PID), killing it if it does not exit."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._conn.close()
