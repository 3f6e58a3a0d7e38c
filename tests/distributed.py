"""Spawned gloo worlds for tests: a thin wrapper over :func:`sao_megatron.spawn.run_world`."""

from sao_megatron.spawn import WorldTimeout, run_world


def run_distributed(fn, world_size: int = 2, *args, timeout_s: float = 600.0) -> list:
    """A hung world fails with its ranks' stacks in the message (a CI log keeps no files)."""
    try:
        return run_world(fn, world_size, *args, backend="gloo", timeout_s=timeout_s)
    except WorldTimeout as err:
        raise TimeoutError(f"{err}\n{err.stacks}") from None
