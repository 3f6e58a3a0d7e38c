"""Where a rank sits in its role's Megatron world, and its start-up (model-parallel groups, seed)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sao_megatron.config import ParallelConfig


def parallel_state():
    """Megatron's ``parallel_state`` module, imported when a worker first needs it."""
    from megatron.core import parallel_state as ps

    return ps


@dataclass(frozen=True)
class RankCoordinates:
    """Where this rank sits in its role's Megatron world."""

    rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_last: bool
    cp_rank: int

    @property
    def reports(self) -> bool:
        """Holds complete per-row outputs and metrics: last pipeline stage, TP and CP rank 0."""
        return self.pp_last and self.tp_rank == 0 and self.cp_rank == 0


def coordinates() -> RankCoordinates:
    ps = parallel_state()
    return RankCoordinates(
        rank=dist.get_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_last=ps.is_pipeline_last_stage(),
        cp_rank=ps.get_context_parallel_rank(),
    )


def check_cuda(gpus_per_node: int, who: str, node_ip: str) -> None:
    """A rank of a GPU run (``cluster.gpus_per_node`` > 0) whose process sees no CUDA device fails
    at start, naming its node, instead of training on CPU."""
    if gpus_per_node > 0 and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            f"{who} on host {socket.gethostname()} ({node_ip}) sees no CUDA device (CUDA_VISIBLE_DEVICES "
            f"{'unset' if visible is None else repr(visible)}) but cluster.gpus_per_node={gpus_per_node}; "
            "check the node's GPUs and driver, or set cluster.gpus_per_node=0 for a CPU-only run"
        )


def init_rank(parallel: ParallelConfig, seed: int) -> None:
    from sao_megatron.parallel import initialize_model_parallel, seed_everything

    initialize_model_parallel(parallel)
    seed_everything(seed)
    # Where this rank runs, for anyone reading its log (tests/launch/test_slurm_multinode.py).
    print(
        f"[sao-rank] rank {dist.get_rank()} of {dist.get_world_size()} on host {socket.gethostname()} "
        f"addresses {','.join(node_addresses()) or '-'}",
        flush=True,
    )


def node_addresses() -> list[str]:
    """This node's IPv4 addresses other than loopback."""
    import psutil

    return sorted(
        {
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")
        }
    )
