"""Spawned gloo worlds for tests: a thin wrapper over :func:`sao_megatron.spawn.run_world`."""

from sao_megatron.spawn import run_world


def run_distributed(fn, world_size: int = 2, *args, timeout_s: float = 600.0) -> list:
    return run_world(fn, world_size, *args, backend="gloo", timeout_s=timeout_s)
