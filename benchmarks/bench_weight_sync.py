"""Weight sync against the raw broadcast bandwidth of the same transport, and the engines' pause.

In one run, interleaved round by round: (1) ``WeightSync.update`` of a Qwen3-MoE checkpoint to a
real SGLang engine (CPU here: gloo over loopback, float32; pause, per-bucket HTTP request +
broadcast, resume), per tensor and flat (``rollout.weight_sync_flat``), each against (2) a raw
broadcast of the very same buckets in the same wire format and order, over a group of the same
size and backend to a plain receiver process, and (3) the engine's pause + begin + end + resume
alone, to split the sync's extra time into that fixed part and a per-bucket part (the engine's
request and load). The ratio of their bytes/s is what the sync protocol keeps of the transport;
the pause is how long the engine stopped generating per sync (``SyncReport.paused_s``, also
logged as ``time/sync_pause_s``).

    .venv/bin/python benchmarks/bench_weight_sync.py [--quick] [--rounds 5] [--bucket-mb 64]

``--actor-layout dp2 pp2 ep2``: the same through the real actor instead (``ActorWorker.sync_weights``
in a 2-rank Megatron world built from the checkpoint's config, random weights, the actor's own
``rollout.weight_sync_senders``): at PP=2 each stage's sender gathers and broadcasts its own buckets
over its own group, at EP=2 each EP rank sends its own experts and half the dense tensors (two
senders in one stage), while rank 0 posts the engine's requests in the global order; at DP=2 rank 0
is the one sender. The raw side is the same senders broadcasting the same gathered buckets (in the
sync's wire format) over same-size groups to one plain receiver that takes them in the same global
order, so the ratio is what the protocol, the gathers and the engine's load keep of those groups'
bandwidth. (``--actor-pp 1 2`` is ``--actor-layout dp2 pp2``.)

``--engine-tp 1 2``: one sender (``WeightSync.update``, per tensor) to an engine of each of these
tensor-parallel sizes, all started at once and measured round by round side by side; each against a
raw broadcast of the same buckets over a group of the same size (1 + TP) to plain receivers, so
``sync / raw`` compares the protocol with TP=1 and TP=2 engines on the same transport.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_convert import build_checkpoint  # noqa: E402
from sao_megatron.config.rank import ActorRankConfig  # noqa: E402
from sao_megatron.parallel import join_store, open_store  # noqa: E402
from sao_megatron.rollout.client import EngineClient  # noqa: E402
from sao_megatron.rollout.engine import EngineProcess, EngineSpec  # noqa: E402
from sao_megatron.spawn import free_port  # noqa: E402
from sao_megatron.tokenizer import load_tokenizer  # noqa: E402
from sao_megatron.weight_sync import WeightSync, new_group, resolve_flat  # noqa: E402


def _receiver(port: int, shapes: list[list[tuple[list[int], torch.dtype]]], sizes: list[int], rounds: int) -> None:
    """Per round: the buckets tensor by tensor, then flat."""
    store = join_store("127.0.0.1", port, 2)
    group = new_group("gloo", store, 2, 1, "raw")
    for _ in range(rounds):
        for bucket in shapes:
            for shape, dtype in bucket:
                dist.broadcast(torch.empty(shape, dtype=dtype), src=0, group=group)
        for size in sizes:
            dist.broadcast(torch.empty(size, dtype=torch.uint8), src=0, group=group)


def _flat(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """A bucket as the flat sync sends it (one dtype: one byte buffer)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])


def _buckets(model_dir: Path, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out, bucket, size = [], [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if bucket and size + t.numel() * t.element_size() > bucket_bytes:
            out.append(bucket)
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.numel() * t.element_size()
    return out + ([bucket] if bucket else [])


def _tp_receiver(port: int, world: int, rank: int, shapes: list[list[tuple[list[int], torch.dtype]]], rounds: int):
    """Rank ``rank`` of a raw group of ``world``: per round, the buckets tensor by tensor."""
    store = join_store("127.0.0.1", port, world)
    group = new_group("gloo", store, world, rank, f"raw_tp{world - 1}")
    for _ in range(rounds):
        for bucket in shapes:
            for shape, dtype in bucket:
                dist.broadcast(torch.empty(shape, dtype=dtype), src=0, group=group)


def engine_tp_main(args, model: Path, buckets: list[list[tuple[str, torch.Tensor]]], rounds: int, logs: Path) -> dict:
    """Per tensor sync to an engine of each ``--engine-tp`` size against raw groups of 1 + TP, interleaved."""
    from contextlib import ExitStack

    total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    shapes = [[(list(t.shape), t.dtype) for _, t in b] for b in buckets]
    tensors = [t.contiguous() for b in buckets for _, t in b]
    rows: dict[int, list[dict]] = {tp: [] for tp in args.engine_tp}
    with ExitStack() as stack:
        engines = {
            tp: EngineProcess(
                EngineSpec(
                    model_path=str(model),
                    port=free_port(),
                    tensor_parallel=tp,
                    dtype="float32",
                    max_total_tokens=4096,
                    log_path=str(logs / f"engine_tp{tp}.log"),
                    env={"OMP_NUM_THREADS": "1"},
                )
            ).start()
            for tp in args.engine_tp
        }
        for engine in engines.values():
            stack.callback(engine.stop)
        for engine in engines.values():
            engine.wait_healthy()
        raw, syncs, receivers = {}, {}, []
        for tp, engine in engines.items():
            store = open_store("127.0.0.1", 1 + tp)
            for rank in range(1, 1 + tp):
                receivers.append(
                    mp.get_context("spawn").Process(
                        target=_tp_receiver, args=(store.port, 1 + tp, rank, shapes, rounds)
                    )
                )
                receivers[-1].start()
            raw[tp] = new_group("gloo", store, 1 + tp, 0, f"raw_tp{tp}")
            syncs[tp] = WeightSync([engine.url], engine_tp=tp, backend="gloo", group_name=f"bench_tp{tp}")
            asyncio.run(syncs[tp].connect())
        for r in range(rounds):
            for tp, sync in syncs.items():
                t0 = time.perf_counter()
                for t in tensors:
                    dist.broadcast(t, src=0, group=raw[tp])
                raw_s = time.perf_counter() - t0
                x = _round(sync, buckets, r + 1, engines[tp].url, total, raw_s)
                rows[tp].append(x)
                control = x["control"]
                print(
                    f"round {r} engine TP={tp}: raw {x['raw']:.3f} GB/s (1 + {tp} ranks), sync {x['sync']:.3f} GB/s, "
                    f"pause {x['pause']:.3f} s; pause+begin+end+resume alone {control:.3f} s",
                    flush=True,
                )
        for p in receivers:
            p.join(timeout=60)
    summary = {}
    for tp, xs in rows.items():
        ratio = statistics.median(x["sync"] / x["raw"] for x in xs)
        summary[f"tp{tp}"] = {
            "raw_gb_per_s": statistics.median(x["raw"] for x in xs),
            "sync_gb_per_s": statistics.median(x["sync"] for x in xs),
            "sync_over_raw": ratio,
            "pause_s": statistics.median(x["pause"] for x in xs),
            "control_only_s": statistics.median(x["control"] for x in xs),
            "per_bucket_extra_s": statistics.median(x["extra"] for x in xs),
            "control_calls_median_s": {n: statistics.median(x[f"call_{n}"] for x in xs) for n in CONTROL_CALLS},
            "control_calls_max_s": {n: max(x[f"call_{n}"] for x in xs) for n in CONTROL_CALLS},
        }
        print(f"engine TP={tp}: control calls, median/max over rounds (s): {_calls_line(xs)}", flush=True)
        x = summary[f"tp{tp}"]
        print(
            f"engine TP={tp}: median sync / raw = {ratio:.2f} ({x['sync_gb_per_s']:.3f} / {x['raw_gb_per_s']:.3f} "
            f"GB/s), engine pause {x['pause_s']:.3f} s per sync of {total / 1e6:.1f} MB; of the sync's time beyond "
            f"the raw broadcast, {x['control_only_s']:.3f} s is pause+begin+end+resume and "
            f"{x['per_bucket_extra_s']:.3f} s per bucket the engine's request and load",
            flush=True,
        )
    return summary


def _round(sync, buckets: list, version: int, url: str, total: int, raw_s: float) -> dict[str, float]:
    """One round's sync of ``buckets`` beside its raw broadcast (``total`` bytes in ``raw_s``): GB/s
    of both, the engine's pause, the control calls alone and the per-bucket rest."""
    report = asyncio.run(sync.update(buckets, version=version))
    calls = asyncio.run(_control_only(url))
    control = sum(calls.values())
    return {
        "raw": total / raw_s / 1e9,
        "sync": report.gb_per_s,
        "pause": report.paused_s,
        "control": control,
        "extra": (report.seconds - raw_s - control) / len(buckets),
        **{f"call_{name}": s for name, s in calls.items()},
    }


CONTROL_CALLS = ("pause", "begin", "end", "flush", "resume")


async def _control_only(url: str) -> dict[str, float]:
    """Seconds of each control call of one update with no bucket in between, in the order and
    mode :class:`~sao_megatron.weight_sync.EngineControl` makes them: pause (retract), begin, end, flush, resume."""
    out: dict[str, float] = {}
    async with EngineClient(url) as client:
        for name, call in zip(
            CONTROL_CALLS,
            (client.pause, client.begin_weight_update, client.end_weight_update, client.flush_cache, client.resume),
            strict=True,
        ):
            t0 = time.perf_counter()
            await call()
            out[name] = time.perf_counter() - t0
    return out


def _calls_line(xs: list[dict]) -> str:
    """The control calls' medians and maxima over rounds, e.g. ``pause 0.004/0.012 s``."""
    return ", ".join(
        f"{n} {statistics.median(x[f'call_{n}'] for x in xs):.3f}/{max(x[f'call_{n}'] for x in xs):.3f}"
        for n in CONTROL_CALLS
    )


def _actor_ranks(rank: int, world: int, cfg, engine_url: str, store_port: int, rounds: int, tag: str) -> list[dict]:
    """One rank of the actor's world: per round, the raw broadcast of its (pre-gathered) stage's
    buckets, then a real ``sync_weights``; rank 0 returns the figures."""
    from sao_megatron.models.hf_weights import HFWeightStream
    from sao_megatron.workers.actor import ActorWorker

    worker = ActorWorker(ActorRankConfig.of(cfg))
    bucket_bytes = cfg.rollout.weight_sync_bucket_mb << 20
    gather_group = cast(dist.ProcessGroup, dist.new_group())  # every rank is a member
    per_stage = max(1, cfg.rollout.weight_sync_senders // cfg.actor.parallel.pipeline_parallel)
    stream = HFWeightStream(worker.role.module, cfg.model, senders=per_stage, group=gather_group)
    plan = stream.bucket_plan(bucket_bytes)
    flat = resolve_flat(cfg.rollout.weight_sync_flat, "gloo")  # as the actor resolves it on CPU
    mine = [[_flat(b)] if flat else [t.contiguous() for _, t in b] for b in stream.buckets(bucket_bytes) if b]
    store = join_store("127.0.0.1", store_port, 1 + len(plan))
    raw = None
    if stream.lane is not None:
        if rank == 0:  # per stage, bucket, broadcast: its byte count, or its shape and dtype
            shapes = [
                [
                    [[sum(t.nbytes for t in b)]] if flat else [[list(t.shape), str(t.dtype)[6:]] for t in b]
                    for b in stage
                ]
                for stage in plan
            ]
            store.set("plan", json.dumps({"flat": flat, "shapes": shapes}))
        raw = new_group("gloo", store, 2, 0, f"raw_{tag}_{stream.lane}")
    total = sum(t.nbytes for stage in plan for b in stage for t in b)
    out = []
    for r in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for bucket in mine if raw is not None else []:
            for buf in bucket:
                dist.broadcast(buf, src=0, group=raw)
        dist.barrier()
        raw_s = time.perf_counter() - t0
        report = worker.sync_weights([engine_url], r + 1, "127.0.0.1")
        if rank == 0:
            out.append(
                {
                    "raw_gb_per_s": total / raw_s / 1e9,
                    "sync_gb_per_s": report["sync_gb_per_s"],
                    "pause_s": report["sync_pause_s"],
                    "senders": report["sync_senders"],
                    "buckets": [len(stage) for stage in plan],
                    "bytes": total,
                }
            )
            print(
                f"round {r}: raw {out[-1]['raw_gb_per_s']:.3f} GB/s, sync {report['sync_gb_per_s']:.3f} GB/s, "
                f"pause {report['sync_pause_s']:.3f} s",
                flush=True,
            )
    return out


def _raw_receiver(store, rounds: int, tag: str) -> None:
    """The raw side's one receiver: joins every sender's group, takes their buckets in the global order."""
    from sao_megatron.weight_sync import sync_order

    plan = json.loads(store.get("plan"))
    shapes = plan["shapes"]
    groups = [new_group("gloo", store, 2, 1, f"raw_{tag}_{s}") for s in range(len(shapes))]
    for _ in range(rounds):
        for s, k in sync_order([len(stage) for stage in shapes]):
            for piece in shapes[s][k]:
                buf = (
                    torch.empty(piece[0], dtype=torch.uint8)
                    if plan["flat"]
                    else torch.empty(piece[0], dtype=getattr(torch, piece[1]))
                )
                dist.broadcast(buf, src=0, group=groups[s])


ACTOR_LAYOUTS = {"dp2": [], "pp2": ["actor.parallel.pipeline_parallel=2"], "ep2": ["actor.parallel.expert_parallel=2"]}
"""The 2-rank actor layouts ``--actor-layout`` measures: one sender, one per stage, two in one stage."""


def actor_main(args, model: Path, engine_url: str, rounds: int) -> dict:
    import threading

    from sao_megatron.config import load_config
    from sao_megatron.config.hf import model_config_from_hf, read_hf_config
    from sao_megatron.plan.sync_traffic import senders_per_stage
    from sao_megatron.spawn import run_world

    results = {}
    for layout in args.actor_layout:
        cfg = load_config(
            None,
            [
                "actor.parallel.world_size=2",
                *ACTOR_LAYOUTS[layout],
                f"rollout.weight_sync_bucket_mb={args.bucket_mb}",
                "rollout.dtype=float32",
                f"rollout.weight_sync_flat={str(args.flat).lower()}",
            ],
        )
        cfg.model = model_config_from_hf(read_hf_config(model))
        p = cfg.actor.parallel
        lanes = senders_per_stage(p, cfg.rollout.weight_sync_senders) * p.pipeline_parallel
        store = open_store("127.0.0.1", 1 + lanes)
        receiver = threading.Thread(target=_raw_receiver, args=(store, rounds, layout), daemon=True)
        receiver.start()
        rows = run_world(_actor_ranks, 2, cfg, engine_url, store.port, rounds, layout, backend="gloo", timeout_s=1800)[
            0
        ]
        receiver.join(timeout=60)
        ratio = statistics.median(x["sync_gb_per_s"] / x["raw_gb_per_s"] for x in rows)
        results[layout] = {
            "senders": rows[0]["senders"],
            "buckets": rows[0]["buckets"],
            "rounds": rounds,
            "bytes": rows[0]["bytes"],
            "raw_gb_per_s": statistics.median(x["raw_gb_per_s"] for x in rows),
            "sync_gb_per_s": statistics.median(x["sync_gb_per_s"] for x in rows),
            "sync_over_raw": ratio,
            "pause_s": statistics.median(x["pause_s"] for x in rows),
        }
        x = results[layout]
        print(
            f"{layout} ({x['senders']:.0f} sender(s), buckets {x['buckets']}): median sync / raw = {ratio:.2f} "
            f"({x['sync_gb_per_s']:.3f} / {x['raw_gb_per_s']:.3f} GB/s), pause {x['pause_s']:.3f} s",
            flush=True,
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~40 MB model, 2 rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--flat", action="store_true", help="with --actor-layout: rollout.weight_sync_flat=true")
    ap.add_argument(
        "--actor-layout",
        nargs="*",
        default=[],
        choices=sorted(ACTOR_LAYOUTS),
        help="measure through the real actor (2 ranks) at these layouts",
    )
    ap.add_argument("--actor-pp", type=int, nargs="*", default=[], help="--actor-layout dp2 (1) / pp2 (2)")
    ap.add_argument(
        "--engine-tp",
        type=int,
        nargs="*",
        default=[],
        help="one sender, per tensor, to an engine of each of these tensor-parallel sizes, side by side",
    )
    args = ap.parse_args()
    args.actor_layout += [{1: "dp2", 2: "pp2"}[pp] for pp in args.actor_pp]
    shape = (2, 256, 8, 512) if args.quick else (4, 512, 16, 640)
    rounds = 2 if args.quick else args.rounds
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-wsync-") as tmp:
        model = Path(tmp) / "hf"
        nbytes = build_checkpoint(model, *shape, vocab=len(tokenizer))
        tokenizer.save_pretrained(model)
        buckets = _buckets(model, args.bucket_mb << 20)
        total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        print(
            f"model: layers, hidden, experts, expert width = {shape}; {nbytes / 1e6:.1f} MB float32, "
            f"{len(buckets)} buckets of <= {args.bucket_mb} MB"
        )
        if args.engine_tp:
            print(json.dumps(engine_tp_main(args, model, buckets, rounds, Path(tmp))))
            return
        spec = EngineSpec(
            model_path=str(model),
            port=free_port(),
            dtype="float32",
            max_total_tokens=4096,
            log_path=str(Path(tmp) / "engine.log"),
            env={"OMP_NUM_THREADS": "1"},
        )
        with EngineProcess(spec) as engine:
            if args.actor_layout:
                summary = actor_main(args, model, engine.url, rounds)
                print(json.dumps(summary))
                return
            store = open_store("127.0.0.1", 2)
            flat = [_flat(b) for b in buckets]
            shapes = [[(list(t.shape), t.dtype) for _, t in b] for b in buckets]
            receiver = mp.get_context("spawn").Process(
                target=_receiver, args=(store.port, shapes, [f.numel() for f in flat], rounds)
            )
            receiver.start()
            raw_group = new_group("gloo", store, 2, 0, "raw")
            syncs = {
                "per_tensor": WeightSync([engine.url], backend="gloo", group_name="bench_per_tensor"),
                "flat": WeightSync([engine.url], backend="gloo", group_name="bench_flat", flat=True),
            }
            for sync in syncs.values():
                asyncio.run(sync.connect())
            rows: dict[str, list[dict]] = {mode: [] for mode in syncs}
            for r in range(rounds):
                for mode, sync in syncs.items():
                    t0 = time.perf_counter()
                    for buf in flat if sync.flat else [t.contiguous() for b in buckets for _, t in b]:
                        dist.broadcast(buf, src=0, group=raw_group)
                    raw_s = time.perf_counter() - t0
                    x = _round(sync, buckets, r + 1, engine.url, total, raw_s)
                    rows[mode].append(x)
                    control = x["control"]
                    print(
                        f"round {r} {mode}: raw {x['raw']:.3f} GB/s, sync {x['sync']:.3f} GB/s, pause "
                        f"{x['pause']:.3f} s; pause+begin+end+resume alone {control:.3f} s",
                        flush=True,
                    )
            receiver.join(timeout=60)
    summary = {"model_mb": nbytes / 1e6, "buckets": len(buckets), "rounds": rounds}
    for mode, xs in rows.items():
        m = {k: statistics.median(x[k] for x in xs) for k in xs[0]}
        ratio = statistics.median(x["sync"] / x["raw"] for x in xs)
        summary[mode] = {
            "raw_gb_per_s": m["raw"],
            "sync_gb_per_s": m["sync"],
            "sync_over_raw": ratio,
            "pause_s": m["pause"],
            "control_only_s": m["control"],
            "per_bucket_extra_s": m["extra"],
        }
        print(
            f"{mode}: median sync / raw = {ratio:.2f} ({m['sync']:.3f} / {m['raw']:.3f} GB/s), engine pause "
            f"{m['pause']:.3f} s per sync of {total / 1e6:.1f} MB; of the sync's time beyond the raw broadcast, "
            f"{m['control']:.3f} s is pause+begin+end+resume and {m['extra']:.3f} s per bucket the engine's "
            "request and load"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
