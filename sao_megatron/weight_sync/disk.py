"""The disk weight sync (``rollout.weight_sync: disk``), run by the driver: the actor writes the
policy as an HF checkpoint on a filesystem the engines share, then every engine loads it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

from sao_megatron.rollout.client import EngineClient


class Exported(Protocol):
    """What an export reports (``ActorWorker.export_hf``'s ``ExportReport``)."""

    @property
    def seconds(self) -> float: ...


async def sync_from_disk(
    export: Callable[[Path], Awaitable[Exported]], hf_dir: Path, clients: Sequence[EngineClient], version: int
) -> dict[str, float]:
    """``export(hf_dir)`` writes the policy, then every engine of ``clients`` loads it
    (``/update_weights_from_disk``) labelled ``version``. ``{"time/sync_s": the export's seconds}``
    (the engines' load is not timed)."""
    report = await export(hf_dir)
    await asyncio.gather(*(c.update_weights_from_disk(str(hf_dir), str(version)) for c in clients))
    return {"time/sync_s": report.seconds}
