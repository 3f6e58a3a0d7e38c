"""Megatron distributed checkpoints (``torch_dist``) of a model that reshard on load.

A checkpoint saved at one TP/PP/EP layout loads into any other layout of the same model
config: Megatron's sharded state dict records each shard's global offsets. Used by the
converter (``sao convert``) and by role checkpoints (``workers.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron.models.layout import unwrap


def save_model(model: torch.nn.Module, directory: str | Path) -> Path:
    """Collective: every rank of the role's world writes its shards into ``directory``."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(unwrap(model).sharded_state_dict(), str(directory))
    dist.barrier()
    return directory


def load_model(model: torch.nn.Module, directory: str | Path) -> None:
    """Collective: load ``directory`` into ``model`` whatever layout it was saved from."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not (directory / "metadata.json").exists():
        raise FileNotFoundError(f"{directory} is not a Megatron distributed checkpoint (no metadata.json)")
    module = unwrap(model)
    state = dist_checkpointing.load(module.sharded_state_dict(), str(directory))
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"checkpoint {directory} lacks tensors {missing[:5]}")
