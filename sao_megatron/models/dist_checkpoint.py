"""Megatron distributed checkpoints (``torch_dist``) of a model that reshard on load.

A checkpoint saved at one TP/PP/EP layout loads into any other layout of the same model
config: Megatron's sharded state dict records each shard's global offsets. Used by the
converter (``sao convert``), by ``init_from`` loads of Megatron checkpoints and by role
checkpoints (``workers.checkpoint``).

Resident memory stays at the model plus about one tensor, both ways, where Megatron's own
paths hold a second copy of much of the shard at once:

- saving: Megatron's writer (``FileSystemWriterAsync``) copies every tensor that is a view (the
  SwiGLU ``fc1`` halves its sharded state dict cuts; on a GPU every tensor, to host memory)
  before it writes the first; :func:`save_model` writes the same ``torch_dist`` format through
  torch's ``FileSystemWriter``, which resolves, copies if needed and writes one tensor at a time;
- loading: Megatron reads the SwiGLU halves into views of the parameters, then concatenates them
  into new tensors (its factory merge) that ``load_state_dict`` copies back; :func:`load_model`
  applies the factories itself, so every tensor is read in place into the parameters and nothing
  is merged.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

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
    dist_checkpointing.save(unwrap(model).sharded_state_dict(), str(directory), sharded_strategy=_streaming_save())
    dist.barrier()
    return directory


def _streaming_save():
    """Megatron's ``torch_dist`` save strategy writing through torch's ``FileSystemWriter`` (one tensor at a time)."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    class StreamingSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir: Path) -> None:
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            dcp_save(
                mcore_to_pyt_state_dict(sharded_state_dict, False),
                storage_writer=FileSystemWriter(checkpoint_dir, thread_count=1),
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False,
                    flatten_sharded_tensors=False,
                ),
            )

    return StreamingSave("torch_dist", 1)


def load_model(model: torch.nn.Module, directory: str | Path) -> None:
    """Collective: load ``directory`` into ``model`` whatever layout it was saved from."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    directory = Path(directory)
    if not (directory / "metadata.json").exists():
        raise FileNotFoundError(f"{directory} is not a Megatron distributed checkpoint (no metadata.json)")
    module = unwrap(model)
    sharded = module.sharded_state_dict()
    apply_factories(sharded)  # the SwiGLU halves become ShardedTensors of parameter views
    tensors = [v.data for v in nested_values(sharded) if isinstance(v, ShardedTensor) and v.data is not None]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    own = {
        t.untyped_storage().data_ptr(): name
        for name, t in module.state_dict(keep_vars=True).items()
        if t is not None and isinstance(t, torch.Tensor)
    }
    if not storages <= set(own):  # a factory built copies: load the usual way (merged, then copied)
        state = cast(dict, dist_checkpointing.load(module.sharded_state_dict(), str(directory)))
        _load_state(module, state, directory)
        return
    missing = [name for ptr, name in own.items() if ptr not in storages and not name.endswith("_extra_state")]
    if missing:
        raise KeyError(f"the model's sharded state dict leaves out {missing[:5]}; cannot load them from {directory}")
    state = cast(dict, dist_checkpointing.load(sharded, str(directory)))  # read in place into the parameters
    extra = {k: v for k, v in state.items() if k.endswith("_extra_state")}
    module.load_state_dict(extra, strict=False)


def _load_state(module: torch.nn.Module, state: dict, directory: Path) -> None:
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"checkpoint {directory} lacks tensors {missing[:5]}")
