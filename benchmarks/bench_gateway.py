"""Benchmark the OpenAI-compatible gateway against direct ``/generate`` calls at equal load.

One CPU SGLang engine serving the tiny random model (``tests/rollout/engine_fixtures.make_tiny_hf``,
the tiny template); three arms, side by side in one run, against the same engine:

gateway - ``--sessions`` concurrent agents on a session each, ``--turns`` chat-completion requests
          per session (the answer and a user follow-up sent back each time, so every request
          extends the session's token sequence), each request a bare ``aiohttp`` POST of the OpenAI
          JSON: what the gateway itself adds;
openai  - the same agents through the official ``openai.AsyncOpenAI`` client, one per session (built
          before the clock starts: building one costs ~60 ms of CPU, its SSL context, paid once per
          session by an agent that makes its own): what an agent written against it pays on top;
direct  - the same requests replayed through ``EngineClient.generate``: each session's recorded
          contexts (prompt + response so far) and action lengths, at the same concurrency, one
          request after the other per session.

The agents run in the rollout process, as ``rollout.agent.entry_point`` agents do. Every arm asks
the same questions with greedy decoding (temperature 0), so every arm generates the same tokens (the
totals are printed). Per request, the latency from the caller's send to its parsed answer; per arm
round, the sum over requests. In a group the arms run gateway-direct-openai-openai-direct-gateway
(the next group reversed), so a linear drift of the machine's speed cancels; the ratio of a group
is ``sum(arm) / sum(direct)``, reported as the median over groups with the rollout process's CPU
seconds per request of each arm. A lost session (fewer than ``--turns`` recorded actions, or more
than one segment) fails the run.

    .venv/bin/python benchmarks/bench_gateway.py               # 64 sessions x 3 turns, 2 groups
    .venv/bin/python benchmarks/bench_gateway.py --quick       # smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sao_megatron.config.loop import AgentLoopConfig  # noqa: E402
from sao_megatron.config.schema import GatewayConfig  # noqa: E402
from sao_megatron.envs.base import Sample  # noqa: E402
from sao_megatron.rollout.agent_loop import AgentLoop  # noqa: E402
from sao_megatron.rollout.client import EngineClient, SamplingParams  # noqa: E402
from sao_megatron.rollout.engine import EngineProcess, EngineSpec  # noqa: E402
from sao_megatron.rollout.gateway import Gateway  # noqa: E402
from sao_megatron.spawn import free_port  # noqa: E402
from sao_megatron.tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Arm:
    latencies: list[float]
    tokens: int
    wall_s: float
    cpu_s: float


@dataclass
class Request:
    context: list[int]
    tokens: int


async def gateway_arm(url: str, tokenizer, args, group: int, official: bool):
    """``args.sessions`` agents through one gateway, each its own client built before the clock starts;
    the arm and each session's requests (for the replay). ``official``: the ``openai`` client, else a
    bare ``aiohttp`` POST of the same OpenAI JSON (what the gateway itself costs)."""
    cfg = AgentLoopConfig(
        max_new_tokens=args.max_tokens, max_context_tokens=4096, max_response_tokens=4096, temperature=0.0
    )
    async with EngineClient(url) as client:
        loop = AgentLoop(client, tokenizer, cfg, engine_name="bench")
        gateway = Gateway(GatewayConfig())
        await gateway.start()
        opened = [gateway.open(loop, Sample(f"b{i}", f"What is {group}+{i}?", "")) for i in range(args.sessions)]
        latencies: list[float] = []
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        apis = [openai.AsyncOpenAI(base_url=gateway.base_url(s), api_key=s.key, max_retries=0) for s in opened]

        async def ask(k: int, messages: list) -> dict:
            if official:
                reply = await apis[k].chat.completions.create(
                    model="sao-policy", messages=messages, max_tokens=args.max_tokens
                )
                return reply.choices[0].message.model_dump(exclude_none=True)
            body = {"model": "sao-policy", "messages": messages, "max_tokens": args.max_tokens}
            headers = {"Authorization": f"Bearer {opened[k].key}"}
            async with http.post(f"{gateway.base_url(opened[k])}/chat/completions", json=body, headers=headers) as r:
                return (await r.json())["choices"][0]["message"]

        async def agent(k: int) -> None:
            messages: list = [{"role": "user", "content": opened[k].sample.question}]
            for _ in range(args.turns):
                t0 = time.perf_counter()
                message = await ask(k, messages)
                latencies.append(time.perf_counter() - t0)
                messages += [message, {"role": "user", "content": "more"}]

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(agent(k) for k in range(len(opened))))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        await http.close()
        for api in apis:
            await api.close()
        await gateway.close()
    requests = []
    for s in opened:
        if len(s.segments) != 1 or len(s.segments[0].ep.turns) != args.turns:
            raise SystemExit(
                f"session {s.id} lost: {len(s.segments)} segments, {[len(g.ep.turns) for g in s.segments]} actions"
            )
        seg = s.segments[0]
        requests.append(
            [Request(seg.prompt_ids + seg.ep.response_ids[: t.start], t.end - t.start) for t in seg.ep.turns]
        )
    tokens = sum(r.tokens for rs in requests for r in rs)
    return Arm(latencies, tokens, wall, cpu), requests


async def direct_arm(url: str, tokenizer, requests: list[list[Request]]) -> Arm:
    """The same requests straight to ``/generate`` through the engine client, per session in order."""
    stop = (int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)),)
    latencies: list[float] = []
    tokens = 0
    async with EngineClient(url) as client:

        async def session(rs: list[Request]) -> None:
            nonlocal tokens
            for r in rs:
                sampling = SamplingParams(max_new_tokens=r.tokens, temperature=0.0, stop_token_ids=stop)
                t0 = time.perf_counter()
                gen = await client.generate(r.context, sampling)
                latencies.append(time.perf_counter() - t0)
                tokens += len(gen.output_ids)

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(session(rs) for rs in requests))
        return Arm(latencies, tokens, time.perf_counter() - t0, time.process_time() - cpu0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=64, help="concurrent sessions (and direct callers)")
    ap.add_argument("--turns", type=int, default=3, help="requests per session")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request")
    ap.add_argument("--groups", type=int, default=2, help="groups of six arm rounds (two of each arm)")
    ap.add_argument("--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of the engine")
    ap.add_argument("--quick", action="store_true", help="smoke size: 8 sessions, 1 group")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.groups = 8, 1
    from tests.rollout.engine_fixtures import make_tiny_hf

    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:])
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    tokenizer = load_tokenizer()
    names = ("gateway", "direct", "openai")
    ratios: dict[str, list[float]] = {"gateway": [], "openai": []}
    arms: dict[str, list[Arm]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        model = make_tiny_hf(Path(tmp) / "tiny", seed=0)
        spec = EngineSpec(
            model_path=str(model),
            port=free_port(),
            dtype="float32",
            max_total_tokens=32768,
            log_path=str(Path(tmp) / "engine.log"),
            env={"OMP_NUM_THREADS": str(args.engine_threads)} if args.engine_threads else {},
        )
        with EngineProcess(spec) as engine:
            warm = argparse.Namespace(**{**vars(args), "sessions": 2})
            asyncio.run(gateway_arm(engine.url, tokenizer, warm, 99, official=True))
            for g in range(args.groups):
                order = [*names, *reversed(names)] if g % 2 == 0 else [*reversed(names), *names]
                sums: dict[str, float] = dict.fromkeys(names, 0.0)
                _, requests = asyncio.run(gateway_arm(engine.url, tokenizer, args, g, official=False))  # the replay's
                for name in order:
                    if name == "direct":
                        arm = asyncio.run(direct_arm(engine.url, tokenizer, requests))
                    else:
                        arm, _ = asyncio.run(gateway_arm(engine.url, tokenizer, args, g, official=name == "openai"))
                    arms[name].append(arm)
                    sums[name] += sum(arm.latencies)
                    print(
                        f"group {g} {name:7s}: {len(arm.latencies)} requests, {arm.tokens} tokens, wall {arm.wall_s:.2f} s, "
                        f"mean latency {statistics.mean(arm.latencies) * 1e3:.1f} ms, "
                        f"cpu {arm.cpu_s / len(arm.latencies) * 1e3:.2f} ms/request",
                        flush=True,
                    )
                for name in ratios:
                    ratios[name].append(sums[name] / sums["direct"])
    n_sessions = args.sessions * 4 * args.groups
    print(
        f"\n# gateway bench: {args.sessions} sessions x {args.turns} turns, max_tokens {args.max_tokens}, {args.groups} groups"
    )
    print(f"# command: {command}; code {commit}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"sessions lost: 0 of {n_sessions} measured through the gateway")
    for name in names:
        lat = [x for a in arms[name] for x in a.latencies]
        print(
            f"{name:7s}: mean latency {statistics.mean(lat) * 1e3:.1f} ms, median {statistics.median(lat) * 1e3:.1f} ms, "
            f"tokens {sum(a.tokens for a in arms[name])}, "
            f"rollout-process cpu {sum(a.cpu_s for a in arms[name]) / len(lat) * 1e3:.2f} ms/request"
        )
    for name, rs in ratios.items():
        print(
            f"latency ratio {name} / direct per group: {', '.join(f'{r:.3f}' for r in rs)}; median {statistics.median(rs):.3f}"
        )


if __name__ == "__main__":
    main()
