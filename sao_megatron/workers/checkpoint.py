"""Role checkpoints: model, optimizer, LR schedule and RNG of one rank's role (``torch_dist``).

The model and optimizer shards reshard on load (any TP/PP/EP layout); per-rank extras
(schedule, RNG) are restored when the layout is the same. A role whose optimizer has never stepped
(the critic of a run stopped during SFT, or of an SFT-only run) has no optimizer state to save:
its checkpoint holds the model and a ``NOT_STEPPED`` marker, and loading it leaves the optimizer
fresh, exactly as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from sao_megatron.models.dist_checkpoint import load_model, save_model
from sao_megatron.models.layout import unwrap

__all__ = ["load_model", "load_role", "save_model", "save_role"]

NOT_STEPPED = "optimizer_not_stepped"
"""Marker file of a role checkpoint saved before its optimizer's first step (no optimizer state)."""


def _optimizers(role) -> list:
    return list(getattr(role.optimizer, "chained_optimizers", [role.optimizer]))


def _never_stepped(role) -> bool:
    """No optimizer of the role holds state yet (Megatron's distributed optimizer cannot write a
    state dict then: it reads the step count from the Adam state)."""
    inner = [getattr(opt, "optimizer", None) for opt in _optimizers(role)]
    return all(o is not None and not o.state for o in inner)


def _role_sharded_state(role, is_loading: bool, with_optimizer: bool = True) -> dict:
    model_sd = unwrap(role.model).sharded_state_dict()
    if not with_optimizer:
        return {"model": model_sd}
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    return {
        "model": model_sd,
        "optimizer": role.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata),
    }


def save_role(role, directory: str | Path) -> Path:
    """Collective: model, optimizer, LR schedule and RNG of a role (``engine.MegatronRole``)."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    stepped = not _never_stepped(role)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if not stepped:
            (directory / NOT_STEPPED).write_text("the optimizer had not stepped; it has no state to restore\n")
        else:
            (directory / NOT_STEPPED).unlink(missing_ok=True)
    dist.barrier()
    dist_checkpointing.save(_role_sharded_state(role, is_loading=False, with_optimizer=stepped), str(directory))
    extra = {"scheduler": role.scheduler.state_dict(), "steps": role.steps, "rng": torch.get_rng_state()}
    torch.save(extra, directory / f"extra_rank{dist.get_rank()}.pt")
    dist.barrier()
    return directory


def load_role(role, directory: str | Path) -> None:
    """Collective: restore :func:`save_role` (the layout may differ; per-rank extras must match)."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not (directory / "metadata.json").exists():
        raise FileNotFoundError(f"{directory} is not a role checkpoint (no metadata.json)")
    stepped = not (directory / NOT_STEPPED).exists()
    for opt in _optimizers(role) if stepped else []:
        # A fresh distributed optimizer has no Adam state to load into; Megatron's own loader
        # fills it with a zero-gradient step first (the loaded tensors then replace it).
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    sharded = _role_sharded_state(role, is_loading=True, with_optimizer=stepped)
    state = cast(dict, dist_checkpointing.load(sharded, str(directory)))
    result = unwrap(role.model).load_state_dict(state["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"checkpoint {directory} lacks tensors {missing[:5]}")
    with torch.no_grad():  # the optimizer copies into views of leaf parameters
        if stepped:
            role.optimizer.load_state_dict(state["optimizer"])
            _restore_adam_steps(role)
        else:  # the fresh optimizer's main (e.g. fp32) copies must start from the loaded weights
            role.optimizer.reload_model_params()
    extra_path = directory / f"extra_rank{dist.get_rank()}.pt"
    if extra_path.exists():
        # Plain data (schedule numbers, step count, RNG bytes): never unpickle objects from a file.
        extra = torch.load(extra_path, weights_only=True)
        role.scheduler.load_state_dict(extra["scheduler"])
        role.steps = extra["steps"]
        torch.set_rng_state(extra["rng"])


def _restore_adam_steps(role) -> None:
    """Give torch's Adam its step count back after a load (its bias correction depends on it).

    Megatron-Core 0.19.2's distributed optimizer saves the count in the param groups (where TE's and
    Apex's fused Adam keep it) and, without them, writes it into torch's per-parameter state on load,
    then overwrites it from the loading template's state, whose count is 1 (the zero-gradient step
    that allocates it): every resumed run restarted Adam's bias correction, a smaller effective
    learning rate for hundreds of steps. The loaded param groups still hold the saved count."""
    for opt in _optimizers(role):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        steps = {g["step"] for g in inner.param_groups if g["params"] and "step" in g}
        if len(steps) != 1:  # no count in the groups (the plain optimizer restores its own)
            continue
        count = float(steps.pop())
        for param_state in inner.state.values():
            old = param_state.get("step")
            if isinstance(old, torch.Tensor):  # one tensor each: Adam increments them in place
                param_state["step"] = torch.full_like(old, count)
