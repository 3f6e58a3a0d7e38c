"""Process groups and seeding for one Megatron world (one role: actor or critic).

Each role is its own ``torch.distributed`` world. Callers pass what they need explicitly; the
only global state is Megatron's own ``parallel_state``, which this module initialises.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import Store, TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public API

from sao_megatron.config import ParallelConfig
from sao_megatron.runtime import strict_nccl


def resolve_backend(backend: str = "auto") -> str:
    """``auto``: nccl with CUDA, gloo otherwise; :data:`~sao_megatron.runtime.strict_nccl.NAME` (the
    NCCL contract on CPU, for tests) is registered in this process when named."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == strict_nccl.NAME:
        strict_nccl.register()
    return backend


def device() -> torch.device:
    """Where this rank computes: its CUDA device when CUDA exists (set by :func:`init_distributed`),
    else the CPU. Batches are moved here in one place (``workers.role``) and every collective's
    tensors live here (NCCL takes device tensors only)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "auto",
    timeout_s: float = 600.0,
    store: Store | None = None,
) -> None:
    """Join the role's world (idempotent). CUDA device = local rank when CUDA exists.

    ``store``: a rendezvous store already open (see :func:`open_store`); otherwise the world
    meets at ``tcp://master_addr:master_port``."""
    if dist.is_initialized():
        return
    backend = resolve_backend(backend)
    device = None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":  # bound to its GPU: NCCL makes the world's communicator at once and splits
        # every later group's from it (Megatron's, the weight sync's gathers) instead of a fresh one each
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    elif backend == strict_nccl.NAME:  # the same choice of device; the backend binds its world itself
        strict_nccl.set_device(local_rank % strict_nccl.device_count())
    init_method = None if store is not None else f"tcp://{master_addr}:{master_port}"
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device,
    )


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host`` (not every interface) and listening; ``port`` 0: any free one."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own server does
        sock.bind(address)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


class RendezvousError(RuntimeError):
    """A world could not meet: the message names the endpoint, what went wrong and what to check."""


def open_store(host: str, world_size: int, port: int = 0, timeout_s: float = 600.0) -> TCPStore:
    """Rank 0's rendezvous store on ``host``; ``port`` 0 lets the OS pick a free port while the
    store holds it (read it back from ``store.port``), so no other process can take it between
    choosing and binding. Other ranks call :func:`join_store`.

    The store listens on ``host`` only: 127.0.0.1 for a world on one machine, the node's cluster
    address on a cluster (where the other nodes reach it). TCPStore's own server would listen on
    every interface, and it has no authentication; so the socket is bound here and handed over
    (``master_listen_fd``)."""
    try:
        sock = listening_socket(host, port)
    except OSError as err:
        raise RendezvousError(
            f"cannot open the rendezvous store at {host}:{port} ({err.strerror or err}): "
            + (
                "another process holds the port; use port 0 (any free one)"
                if port
                else f"{host} is not an address of this node"
            )
        ) from None
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on
    try:
        return TCPStore(
            host,
            bound,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def join_store(host: str, port: int, world_size: int, timeout_s: float = 600.0) -> TCPStore:
    """A client of rank 0's store (:func:`open_store`); :class:`RendezvousError` naming the endpoint
    after ``timeout_s`` if it never answers."""
    try:
        return TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError subclass RuntimeError
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise RendezvousError(
            f"no rendezvous store answered at {host}:{port} within {timeout_s:g} s ({first}): rank 0 did not "
            "start or died (see its log), or this node cannot reach that address (firewall, "
            "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
        ) from None


def initialize_model_parallel(p: ParallelConfig) -> None:
    """Megatron process groups for ``p``; on CPU also makes Megatron-Core usable (gloo)."""
    from megatron.core import parallel_state

    from sao_megatron import megatron_cpu

    megatron_cpu.apply()
    if dist.get_world_size() != p.world_size:
        raise ValueError(
            f"parallel.world_size={p.world_size} but torch.distributed has {dist.get_world_size()} ranks; "
            "start as many processes as world_size"
        )
    _destroy_groups(parallel_state)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        context_parallel_size=p.context_parallel,
        expert_model_parallel_size=p.expert_parallel,
        expert_tensor_parallel_size=p.expert_tensor_parallel,
    )


def _destroy_groups(parallel_state) -> None:
    """Megatron's ``destroy_model_parallel``, and the process groups it only forgets destroyed too:
    torch's registry keeps them (gloo: two threads each, ~30 groups a layout), so a world that
    changes layout many times (the tests' reused worlds) grew by ~60 threads per layout."""
    held = []
    for value in vars(parallel_state).values():
        for group in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.WORLD:
                held.append(group)
    parallel_state.destroy_model_parallel()
    known = dist.distributed_c10d._world.pg_map
    for group in {id(g): g for g in held}.values():
        if group in known:
            dist.destroy_process_group(group)


def seed_everything(seed: int) -> None:
    """Seed python, torch and Megatron's model-parallel RNG tracker.

    Without CUDA the tracker is the inference one (its ``fork`` is a no-op, so TP-sharded
    initialisation draws from the default CPU generator); dropout is 0 in our models, so
    the choice does not change training. With CUDA the regular tracker is used.
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    torch.manual_seed(seed)
    cpu = not torch.cuda.is_available()
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=cpu, force_reset_rng=cpu)


def destroy() -> None:
    """Tear down Megatron's model-parallel groups (when this process imported Megatron: a world that
    never did, e.g. a weight-sync or store test, does not pay its import to find nothing to undo) and
    the default process group."""
    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
