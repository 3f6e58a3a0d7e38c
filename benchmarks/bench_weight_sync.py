"""Weight sync against the raw broadcast bandwidth of the same transport, and the engines' pause.

In one run, interleaved round by round: (1) ``WeightSync.update`` of a Qwen3-MoE checkpoint to a
real SGLang engine (CPU here: gloo over loopback, float32; pause, per-bucket HTTP request +
broadcast, resume), and (2) a raw broadcast of the very same tensors, in the same buckets and
order, over a group of the same size and backend to a plain receiver process. The ratio of their
bytes/s is what the sync protocol keeps of the transport; the pause is how long the engine
stopped generating per sync (``SyncReport.paused_s``, also logged as ``time/sync_pause_s``).

    .venv/bin/python benchmarks/bench_weight_sync.py [--quick] [--rounds 5] [--bucket-mb 64]
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

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_convert import build_checkpoint  # noqa: E402
from sao_megatron.parallel import join_store, open_store  # noqa: E402
from sao_megatron.rollout.engine import EngineProcess, EngineSpec  # noqa: E402
from sao_megatron.spawn import free_port  # noqa: E402
from sao_megatron.tokenizer import load_tokenizer  # noqa: E402
from sao_megatron.weight_sync import WeightSync, new_group  # noqa: E402


def _receiver(port: int, shapes: list[list[tuple[list[int], torch.dtype]]], rounds: int) -> None:
    store = join_store("127.0.0.1", port, 2)
    group = new_group("gloo", store, 2, 1, "raw")
    for _ in range(rounds):
        for bucket in shapes:
            for shape, dtype in bucket:
                dist.broadcast(torch.empty(shape, dtype=dtype), src=0, group=group)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~40 MB model, 2 rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    args = ap.parse_args()
    shape = (2, 256, 8, 512) if args.quick else (4, 512, 16, 640)
    rounds = 2 if args.quick else args.rounds
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-wsync-") as tmp:
        model = Path(tmp) / "hf"
        nbytes = build_checkpoint(model, *shape, vocab=len(tokenizer))
        tokenizer.save_pretrained(model)
        buckets = _buckets(model, args.bucket_mb << 20)
        total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        print(f"model: layers, hidden, experts, expert width = {shape}; {nbytes / 1e6:.1f} MB float32, "
              f"{len(buckets)} buckets of <= {args.bucket_mb} MB")  # fmt: skip
        spec = EngineSpec(model_path=str(model), port=free_port(), dtype="float32", max_total_tokens=4096,
                          log_path=str(Path(tmp) / "engine.log"), env={"OMP_NUM_THREADS": "1"})  # fmt: skip
        with EngineProcess(spec) as engine:
            store = open_store("127.0.0.1", 2)
            shapes = [[(list(t.shape), t.dtype) for _, t in b] for b in buckets]
            receiver = mp.get_context("spawn").Process(target=_receiver, args=(store.port, shapes, rounds))
            receiver.start()
            raw_group = new_group("gloo", store, 2, 0, "raw")
            sync = WeightSync([engine.url], backend="gloo")
            asyncio.run(sync.connect())
            raw, synced, paused = [], [], []
            for r in range(rounds):
                t0 = time.perf_counter()
                for bucket in buckets:
                    for _, t in bucket:
                        dist.broadcast(t.contiguous(), src=0, group=raw_group)
                raw.append(total / (time.perf_counter() - t0) / 1e9)
                report = asyncio.run(sync.update(buckets, version=r + 1))
                synced.append(report.gb_per_s)
                paused.append(report.paused_s)
                print(f"round {r}: raw {raw[-1]:.3f} GB/s, sync {synced[-1]:.3f} GB/s, "
                      f"pause {paused[-1]:.3f} s", flush=True)  # fmt: skip
            receiver.join(timeout=60)
    ratio = statistics.median(s / w for s, w in zip(synced, raw, strict=True))
    summary = {"model_mb": nbytes / 1e6, "buckets": len(buckets), "rounds": rounds,
               "raw_gb_per_s": statistics.median(raw), "sync_gb_per_s": statistics.median(synced),
               "sync_over_raw": ratio, "pause_s": statistics.median(paused)}  # fmt: skip
    print(f"median: sync / raw = {ratio:.2f} ({summary['sync_gb_per_s']:.3f} / {summary['raw_gb_per_s']:.3f} "
          f"GB/s), engine pause {summary['pause_s']:.3f} s per sync of {total / 1e6:.1f} MB")  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
