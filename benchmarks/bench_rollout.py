"""Benchmark the rollout side against one CPU SGLang engine serving a tiny random model.

Two measurements in one run, against the same engine:

(a) Agent loop: ``--episodes`` concurrent ``arith_tool`` episodes (``AgentLoop`` over one
    ``EngineClient``), repeated ``--loop-rounds`` times: episodes/s, generated (action) tokens/s
    and the episode statuses. A random model never answers: episodes run the env's 3 turns (the
    env then ends them, status "finished"); what is measured is the multi-turn machinery
    (generate, decode, tool call, observation tokens) at full concurrency.

(b) Client overhead: the same load of ``/generate`` calls issued two ways,
      raw    - ``aiohttp`` POST of a hand-built payload, ``await resp.json()``;
      client - ``EngineClient.generate`` (payload building, error checks, parsing into
               ``Generation`` with per-token versions);
    same input ids, same sampling params (``--seed``, ``ignore_eos`` so every call makes exactly
    ``--max-new-tokens`` tokens), same concurrency. The two arms alternate in ``--rounds``
    interleaved rounds, raw-client-client-raw then client-raw-raw-client, ..., so a linear drift
    of the machine's speed inside a round cancels; the overhead of a round is
    ``sum(t_client) / sum(t_raw) - 1``, reported as the median over rounds, next to the client
    process's CPU time per call of each arm.
(b') Same-batch pairs: every prompt sent at the same moment once raw and once through the client,
    so both calls ride the same engine batches; the per-pair latency difference is what the
    client adds, immune to the machine's speed changes (median and IQR over all pairs).

The engine runs with one torch thread (``--engine-threads 1``, ``OMP_NUM_THREADS``): on a
machine shared with other busy processes, multi-threaded CPU decode steps wait on descheduled
sibling threads and vary by 10x+ between identical rounds.

Note: SGLang applies ``sampling_seed`` only with ``--enable-deterministic-inference``; without it
the seed is sent but ignored, so the arms sample different tokens (same counts).

    .venv/bin/python benchmarks/bench_rollout.py                # defaults (~5-10 min on 2 busy cores)
    .venv/bin/python benchmarks/bench_rollout.py --quick        # smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sao_megatron.envs.registry import make_env  # noqa: E402
from sao_megatron.rollout.agent_loop import AgentLoop, AgentLoopConfig  # noqa: E402
from sao_megatron.rollout.client import EngineClient, SamplingParams  # noqa: E402
from sao_megatron.rollout.engine import EngineProcess, EngineSpec  # noqa: E402
from sao_megatron.spawn import free_port  # noqa: E402
from sao_megatron.tokenizer import load_tokenizer  # noqa: E402


# ---- (a) agent loop ---------------------------------------------------------------------------
async def agent_loop_round(url: str, tokenizer, n: int, cfg: AgentLoopConfig, offset: int) -> dict:
    async with EngineClient(url) as client:
        loop = AgentLoop(client, tokenizer, cfg)
        env_task = make_env("arith_tool").task_class()
        t0 = time.perf_counter()

        async def one(i: int):
            env = make_env("arith_tool")
            return await loop.run(env, env_task.get("train", offset + i), index=offset + i)

        trajs = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for t in trajs:
        statuses[t.status] = statuses.get(t.status, 0) + 1
    return {
        "wall_s": wall,
        "episodes": n,
        "action_tokens": sum(sum(t.action_mask) for t in trajs),
        "turns": sum(len(t.turns) for t in trajs),
        "statuses": statuses,
    }


# ---- (b) client overhead ----------------------------------------------------------------------
def workload(requests: int, prompt_len: int) -> list[list[int]]:
    # distinct prompts (ids 40..499 are ordinary tokens of our tokenizer), identical for both arms
    return [[2] + [40 + (7 * i + 3 * j) % 460 for j in range(prompt_len - 2)] + [3] for i in range(requests)]


def raw_payload(ids: list[int], sampling_json: dict) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": sampling_json,
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def raw_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=1024)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def raw_generate(session: aiohttp.ClientSession, url: str, ids: list[int], sampling_json: dict) -> int:
    async with session.post(url + "/generate", json=raw_payload(ids, sampling_json)) as resp:
        body = await resp.json()
    return len(body["meta_info"]["output_token_logprobs"])


async def run_arm(arm: str, url: str, prompts: list[list[int]], sampling: SamplingParams, concurrency: int) -> dict:
    """One arm: all prompts at ``concurrency``; wall time and this process's CPU time."""
    sem = asyncio.Semaphore(concurrency)
    sampling_json = sampling.to_json()
    async with raw_session() as session, EngineClient(url) as client:

        async def one(ids: list[int]) -> int:
            async with sem:
                if arm == "raw":
                    return await raw_generate(session, url, ids, sampling_json)
                return len((await client.generate(ids, sampling)).output_ids)

        c0, t0 = time.process_time(), time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(counts), "calls": len(prompts)}


async def sequential(url: str, args, prompts, sampling) -> list[dict]:
    """Interleaved rounds, each raw-client-client-raw (or client-raw-raw-client), so a linear drift
    of the machine's speed inside a round cancels; overhead = sum(client) / sum(raw) - 1."""
    expected = args.requests * args.max_new_tokens
    rounds = []
    for r in range(args.rounds):
        order = ("raw", "client", "client", "raw") if r % 2 == 0 else ("client", "raw", "raw", "client")
        res: dict[str, list[dict]] = {"raw": [], "client": []}
        for arm in order:
            out = await run_arm(arm, url, prompts, sampling, args.concurrency)
            assert out["tokens"] == expected, (arm, out, expected)
            res[arm].append(out)
        row = {arm: {k: sum(x[k] for x in res[arm]) for k in ("wall_s", "cpu_s", "calls")} for arm in res}
        row["overhead"] = row["client"]["wall_s"] / row["raw"]["wall_s"] - 1
        rounds.append(row)
        print(
            f"  round {r} ({'-'.join(order)}): raw {row['raw']['wall_s']:.3f} s, "
            f"client {row['client']['wall_s']:.3f} s, overhead {100 * row['overhead']:+.2f}%",
            flush=True,
        )
    return rounds


async def paired(url: str, args, prompts, sampling) -> list[float]:
    """Each prompt sent twice at the same moment, once raw and once through the client (order
    alternating), so both calls share the engine's batches: their latency difference is what the
    client adds, free of the machine's speed changes. Returns per-pair relative differences."""
    sem = asyncio.Semaphore(args.concurrency)
    sampling_json = sampling.to_json()
    rel: list[float] = []
    async with raw_session() as session, EngineClient(url) as client:

        async def timed_raw(ids):
            t0 = time.perf_counter()
            n = await raw_generate(session, url, ids, sampling_json)
            return n, time.perf_counter() - t0

        async def timed_client(ids):
            t0 = time.perf_counter()
            n = len((await client.generate(ids, sampling)).output_ids)
            return n, time.perf_counter() - t0

        async def pair(i: int, ids: list[int]):
            async with sem:
                if i % 2 == 0:
                    (nr, tr), (nc, tc) = await asyncio.gather(timed_raw(ids), timed_client(ids))
                else:
                    (nc, tc), (nr, tr) = await asyncio.gather(timed_client(ids), timed_raw(ids))
            assert nr == nc == args.max_new_tokens, (nr, nc)
            rel.append((tc - tr) / tr)

        for r in range(args.rounds):
            await asyncio.gather(*(pair(r + i, p) for i, p in enumerate(prompts)))
    return rel


async def overhead(url: str, args) -> tuple[list[dict], list[float]]:
    prompts = workload(args.requests, args.prompt_len)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed, ignore_eos=True)
    await run_arm("raw", url, prompts[: args.concurrency], sampling, args.concurrency)  # warm-up
    await run_arm("client", url, prompts[: args.concurrency], sampling, args.concurrency)
    print("client overhead, sequential interleaved rounds:", flush=True)
    rounds = await sequential(url, args, prompts, sampling)
    pairs: list[float] = []
    if args.paired:
        print("client overhead, same-batch pairs ...", flush=True)
        pairs = await paired(url, args, prompts, sampling)
    return rounds, pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32, help="concurrent agent-loop episodes per round")
    ap.add_argument("--loop-rounds", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--action-tokens", type=int, default=32, help="AgentLoopConfig.max_new_tokens")
    ap.add_argument("--requests", type=int, default=64, help="/generate calls per overhead arm")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds (2 raw + 2 client arms each)")
    ap.add_argument("--no-paired", dest="paired", action="store_false", help="skip the same-batch pairs")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--quick", action="store_true", help="smoke size")
    ap.add_argument("--log", default=None, help="engine log path (default: in the temp dir)")
    ap.add_argument(
        "--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of the engine (0: torch's default, one per core)"
    )
    args = ap.parse_args()
    if args.quick:
        args.episodes, args.loop_rounds, args.requests, args.rounds = 4, 1, 8, 2

    from tests.rollout.engine_fixtures import make_tiny_hf

    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:])
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        model = make_tiny_hf(Path(tmp) / "tiny", seed=0)
        spec = EngineSpec(
            model_path=str(model),
            port=free_port(),
            dtype="float32",
            max_total_tokens=32768,
            log_path=args.log or str(Path(tmp) / "engine.log"),
            env={"OMP_NUM_THREADS": str(args.engine_threads)} if args.engine_threads else {},
        )
        t0 = time.perf_counter()
        with EngineProcess(spec) as engine:
            print(
                f"engine up in {time.perf_counter() - t0:.1f} s at {engine.url} (cpu={engine.cpu})",
                flush=True,
            )
            cfg = AgentLoopConfig(
                max_turns=args.max_turns,
                max_new_tokens=args.action_tokens,
                max_response_tokens=512,
                max_context_tokens=1024,
            )
            asyncio.run(agent_loop_round(engine.url, tokenizer, 2, cfg, offset=10_000))  # warm-up
            loop_rounds = []
            for r in range(args.loop_rounds):
                res = asyncio.run(agent_loop_round(engine.url, tokenizer, args.episodes, cfg, offset=r * args.episodes))
                loop_rounds.append(res)
                print(
                    f"  agent loop round {r}: {res['episodes']} episodes in {res['wall_s']:.2f} s, "
                    f"{res['action_tokens']} action tokens, {res['turns']} turns, {res['statuses']}",
                    flush=True,
                )
            rounds, pairs = asyncio.run(overhead(engine.url, args))

    # ---- report ----
    loop_wall = sum(r["wall_s"] for r in loop_rounds)
    loop_eps = sum(r["episodes"] for r in loop_rounds) / loop_wall
    loop_tps = sum(r["action_tokens"] for r in loop_rounds) / loop_wall
    statuses: dict[str, int] = {}
    for r in loop_rounds:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    rel = [row["overhead"] for row in rounds]
    med = statistics.median(rel)
    tokens = 2 * args.requests * args.max_new_tokens  # per arm and round (two runs of the arm)

    def arm(name: str) -> tuple[float, float]:
        wall = statistics.median(row[name]["wall_s"] for row in rounds)
        cpu = statistics.median(1e3 * row[name]["cpu_s"] / row[name]["calls"] for row in rounds)
        return wall, cpu

    (raw_wall, raw_cpu), (cli_wall, cli_cpu) = arm("raw"), arm("client")

    print()
    print(f"command: {command}")
    print(
        f"(a) agent loop, arith_tool, {args.episodes} concurrent episodes x {args.loop_rounds} rounds, "
        f"max_turns={args.max_turns}, {args.action_tokens} tokens/action"
    )
    print("| episodes/s | action tokens/s | statuses |")
    print("|---|---|---|")
    status_text = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
    print(f"| {loop_eps:.2f} | {loop_tps:.0f} | {status_text} |")
    print()
    print(
        f"(b) /generate, {args.requests} calls x {args.max_new_tokens} tokens (ignore_eos) per arm run, "
        f"concurrency {args.concurrency}, {len(rounds)} interleaved rounds (ABBA), medians"
    )
    print("| arm | wall s / round (2 runs) | tokens/s | client CPU ms / call |")
    print("|---|---|---|---|")
    print(f"| raw aiohttp | {raw_wall:.3f} | {tokens / raw_wall:.0f} | {raw_cpu:.2f} |")
    print(f"| EngineClient.generate | {cli_wall:.3f} | {tokens / cli_wall:.0f} | {cli_cpu:.2f} |")
    print(
        f"| overhead, sequential rounds: median of per-round (client/raw - 1) | {100 * med:+.2f}% "
        f"(rounds: min {100 * min(rel):+.2f}%, max {100 * max(rel):+.2f}%) | | {cli_cpu - raw_cpu:+.2f} |"
    )
    if pairs:
        q = statistics.quantiles(pairs, n=4)
        print(
            f"| overhead, same-batch pairs: median of per-call (client/raw - 1), {len(pairs)} pairs "
            f"| {100 * statistics.median(pairs):+.2f}% (IQR {100 * q[0]:+.2f}% .. {100 * q[2]:+.2f}%) | | |"
        )
    print(f"target < 5% (sequential median): {'met' if med < 0.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
