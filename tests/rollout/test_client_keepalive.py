"""``EngineClient`` never reuses a connection the engine's server may be closing."""

import asyncio

from aiohttp import web

from sao_megatron.rollout.client import EngineClient


def test_the_client_drops_idle_connections_before_the_sglang_server_does():
    from sglang.srt.environ import envs

    assert EngineClient.KEEPALIVE_S <= envs.SGLANG_TIMEOUT_KEEP_ALIVE.get() - 2


def test_idle_connections_are_reused_briefly_then_replaced():
    peers: list[int] = []

    async def info(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])  # the client's port
        return web.json_response({"ok": True})

    async def go() -> None:
        app = web.Application()
        app.router.add_get("/model_info", info)
        runner = web.AppRunner(app, keepalive_timeout=60)  # this server keeps every connection
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with EngineClient(f"http://127.0.0.1:{port}") as client:
                await client.model_info()
                await client.model_info()  # at once: the same connection
                await asyncio.sleep(EngineClient.KEEPALIVE_S + 0.5)
                await client.model_info()  # idle past KEEPALIVE_S: a new one
        finally:
            await runner.cleanup()

    asyncio.run(go())
    assert len(peers) == 3 and peers[0] == peers[1] != peers[2], peers
