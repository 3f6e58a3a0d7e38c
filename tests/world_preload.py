"""What a forkserver imports once for every rank it forks (tests/conftest.py): the imports a spawned
rank of :func:`sao_megatron.spawn.run_world` would repeat, ~4 CPU-s each (torch, Megatron-Core,
the package's parallel setup and workers), with the third-party notices filtered first, as a
rank filters them."""

from sao_megatron.logs import quiet_third_party

quiet_third_party()

import megatron.core.parallel_state  # noqa: E402,F401
import torch  # noqa: E402,F401

import sao_megatron.parallel  # noqa: E402,F401
import sao_megatron.workers.actor  # noqa: E402,F401
import sao_megatron.workers.critic  # noqa: E402,F401
