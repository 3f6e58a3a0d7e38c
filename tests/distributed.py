"""Spawned worlds for tests: a thin wrapper over :func:`sao_megatron.spawn.run_world`.

The backend is gloo unless ``SAO_TEST_BACKEND`` names another: ``strict_nccl`` runs the same tests
under NCCL's contract (``sao_megatron.runtime.strict_nccl``; ``tools/strict_suite.sh``)."""

import os

from sao_megatron.spawn import WorldTimeout, run_world

BACKEND_ENV = "SAO_TEST_BACKEND"


def world_backend() -> str:
    """The backend the tests' worlds use: ``$SAO_TEST_BACKEND``, default gloo."""
    return os.environ.get(BACKEND_ENV) or "gloo"


def run_distributed(fn, world_size: int = 2, *args, timeout_s: float = 600.0) -> list:
    """A hung world fails with its ranks' stacks in the message (a CI log keeps no files)."""
    try:
        return run_world(fn, world_size, *args, backend=world_backend(), timeout_s=timeout_s)
    except WorldTimeout as err:
        raise TimeoutError(f"{err}\n{err.stacks}") from None
