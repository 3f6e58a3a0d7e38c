"""Benchmark HF <-> Megatron checkpoint conversion throughput (CPU, gloo) in both directions.

Workload: a random Qwen3-MoE built with ``transformers`` (float32, default ~300 MB: 4 layers,
hidden 512, 16 experts of width 640, vocabulary 8192) saved with ``save_pretrained`` in 100 MB
shards, then converted with the same functions ``sao convert`` runs:

* ``hf-to-mcore`` at world 1 and world 2 (EP=2): each rank reads its HF slices
  (``read_hf``) and saves a ``torch_dist`` checkpoint (``save_torch_dist``);
* ``mcore-to-hf`` at world 1 and world 2 (EP=2): ``torch_dist`` load (``load_torch_dist``),
  then the gather to rank 0 and streamed safetensors shards (``export_hf``).

GB/s = checkpoint bytes (1e9) / seconds of a phase (slowest rank). "copy" is all phases, "wall"
adds process start-up, imports and model construction. Each row shows the median (and best) of
``--repeat`` runs: the 2-core development machine is shared, so single runs vary several-fold. The files were just written, so reads
come from the page cache: the figures measure the conversion code, not the disk.

    .venv/bin/python benchmarks/bench_convert.py            # ~300 MB
    .venv/bin/python benchmarks/bench_convert.py --quick    # ~40 MB smoke run
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sao_megatron.models.hf_convert import hf_to_mcore, mcore_to_hf, parallel_config


def build_checkpoint(directory: Path, layers: int, hidden: int, experts: int, width: int, vocab: int) -> int:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        num_experts=experts,
        num_experts_per_tok=4,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).float()
    model.save_pretrained(directory, max_shard_size="100MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _mm(values: list[float], fmt: str, best=min) -> str:
    return f"{statistics.median(values):{fmt}} ({best(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~40 MB model")
    parser.add_argument("--worlds", default="1,2", help="conversion worlds; 2 means EP=2")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row (median and best shown)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    shape = (2, 256, 8, 512, 4096) if args.quick else (4, 512, 16, 640, 8192)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sao-bench-convert-"))
    try:
        t0 = time.perf_counter()
        nbytes = build_checkpoint(work / "hf", *shape)
        print(
            f"model: layers, hidden, experts, expert width, vocab = {shape}; {nbytes / 1e6:.1f} MB float32 "
            f"(built and saved in {time.perf_counter() - t0:.1f} s)"
        )
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
        print(f"median (min) of {args.repeat} runs\n")
        print("| direction | world | phase | s | GB/s | copy GB/s | wall s |")
        print("|---|---|---|---|---|---|---|")
        for world in (int(w) for w in args.worlds.split(",")):
            p = parallel_config(world, 1, 1, world)
            runs: dict[str, list] = {"hf-to-mcore": [], "mcore-to-hf": []}
            for _ in range(args.repeat):
                mcore, back = work / f"mcore{world}", work / f"back{world}"
                runs["hf-to-mcore"].append(hf_to_mcore(work / "hf", mcore, p))
                runs["mcore-to-hf"].append(mcore_to_hf(mcore, back, p))
                shutil.rmtree(mcore)
                shutil.rmtree(back)
            for direction, summaries in runs.items():
                copy = [x.bytes / x.transfer_s / 1e9 for x in summaries]
                wall = [x.wall_s for x in summaries]
                for phase in summaries[0].phases:
                    sec = [x.phases[phase] for x in summaries]
                    print(
                        f"| {direction} | {world} (EP={world}) | {phase} | {_mm(sec, '.2f')} | "
                        f"{_mm([summaries[0].bytes / t / 1e9 for t in sec], '.2f', best=max)} | "
                        f"{_mm(copy, '.2f', best=max)} | {_mm(wall, '.1f')} |"
                    )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
