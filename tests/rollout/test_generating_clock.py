"""``EngineClient.generating_seconds``: time with a /generate call in flight, weight-update pauses excluded."""

from __future__ import annotations

import asyncio

from sao_megatron.rollout.client import EngineClient, SamplingParams


class _Clocked(EngineClient):
    """Answers every call after ``delay[endpoint]`` seconds, without a server."""

    def __init__(self, delay: dict[str, float]):
        super().__init__("http://unused")
        self.delay = delay

    async def _call(self, method, endpoint, payload=None, timeout_s=None):
        await asyncio.sleep(self.delay.get(endpoint, 0.0))
        if endpoint == "/generate":
            return {
                "output_ids": [5],
                "meta_info": {
                    "output_token_logprobs": [[-0.1, 5, None]],
                    "finish_reason": {"type": "length"},
                    "weight_version": "0",
                },
            }
        return {}


def test_overlapping_calls_count_once_and_a_pause_stops_the_clock():
    client = _Clocked({"/generate": 0.4})
    sampling = SamplingParams(max_new_tokens=1)

    async def go() -> float:
        first = asyncio.ensure_future(client.generate([1, 2], sampling))
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(client.generate([1, 2], sampling))  # overlaps the first
        await asyncio.sleep(0.1)
        await client.pause()  # 0.2 s in: paused until the resume at 0.5 s
        await asyncio.sleep(0.3)
        await client.resume()
        await asyncio.gather(first, second)  # the second ends at ~0.5 s
        await asyncio.sleep(0.2)  # idle: not generating
        return client.generating_seconds()

    seconds = asyncio.run(go())
    assert 0.15 <= seconds <= 0.3, seconds  # 0.0-0.2 s generating; 0.2-0.5 s paused; then idle
