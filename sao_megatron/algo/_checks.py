"""Input validation shared by the algo functions.

Every check raises ``ValueError`` whose message names the offending argument and says how to fix
it. Checks that read tensor values (finiteness, mask values) synchronise with the device once per
call; they are cheap next to the forward/backward pass they guard.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}.")
    return x


def check_shape(name: str, x: Tensor, shape: tuple[int, ...], like: str = "action_mask") -> None:
    check_tensor(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"`{name}` has shape {tuple(x.shape)} but must have shape {tuple(shape)} (the shape of "
            f"`{like}`); pass one value per token of `{like}`."
        )


def check_finite(name: str, x: Tensor) -> None:
    """Raise if ``x`` holds NaN or inf anywhere (padding included: a NaN there is an upstream bug).

    Fast path: one sum (NaN/inf anywhere make it non-finite); the elementwise test runs only when the
    sum is not finite, to tell an overflowing sum of finite values from a real NaN/inf.
    """
    check_tensor(name, x)
    if not x.is_floating_point() or x.numel() == 0:
        return
    x = x.detach()
    if bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all()):
        return
    n_bad = int((~torch.isfinite(x)).sum())
    raise ValueError(
        f"`{name}` contains {n_bad} NaN/inf value(s); fix the producer of `{name}` or fill padding "
        "positions with 0 before calling."
    )


def check_action_mask(action_mask: Tensor, *, ndim: int = 2) -> Tensor:
    """Validate a 0/1 mask of rank ``ndim`` and return it as ``bool``."""
    check_tensor("action_mask", action_mask)
    if action_mask.dim() != ndim:
        raise ValueError(f"`action_mask` must have {ndim} dims ([B, T]), got shape {tuple(action_mask.shape)}.")
    if action_mask.dtype == torch.bool:
        return action_mask
    if not bool(((action_mask == 0) | (action_mask == 1)).all()):
        raise ValueError("`action_mask` must hold only 0/1 (or be bool); 1 marks model-generated tokens.")
    return action_mask.bool()


def check_nonempty(mask: Tensor, what: str = "action_mask") -> int:
    n = int(mask.sum())
    if n == 0:
        raise ValueError(
            f"`{what}` has no action tokens in the whole batch; drop empty batches before calling or "
            "pass an explicit global normaliser."
        )
    return n


def row_counts(mask: Tensor) -> Tensor:
    """Number of true entries per row of a bool [B, T] mask, int32 [B] (uint8 sum: fast on CPU)."""
    return mask.view(torch.uint8).sum(dim=-1, dtype=torch.int32)


def check_rows_nonempty(mask: Tensor, why: str) -> None:
    empty = (row_counts(mask) == 0).nonzero().flatten()
    if empty.numel() > 0:
        rows = empty[:8].tolist()
        raise ValueError(
            f"`action_mask` rows {rows} have zero action tokens, but {why}; drop those rows before calling."
        )


def check_unit_interval(name: str, x: float | Tensor) -> None:
    """``x`` (a float or a tensor) must lie in [0, 1] and be finite."""
    if isinstance(x, Tensor):
        check_finite(name, x)
        if x.numel() and not bool(((x >= 0) & (x <= 1)).all()):
            raise ValueError(f"`{name}` must lie in [0, 1]; got values in [{x.min().item()}, {x.max().item()}].")
        return
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise ValueError(f"`{name}` must be a float in [0, 1] or a tensor, got {type(x).__name__}.")
    if not (0.0 <= float(x) <= 1.0) or math.isnan(float(x)):
        raise ValueError(f"`{name}` must lie in [0, 1], got {x}.")


def check_nonneg(name: str, x: float) -> None:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(float(x)) or x < 0:
        raise ValueError(f"`{name}` must be a finite float >= 0, got {x!r}.")


def check_positive(name: str, x: float) -> None:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(float(x)) or x <= 0:
        raise ValueError(f"`{name}` must be a finite number > 0, got {x!r}.")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; choose one of {', '.join(repr(c) for c in choices)}.")


def check_segment_ids(segment_ids: Tensor | None, shape: tuple[int, ...]) -> None:
    if segment_ids is None:
        return
    check_shape("segment_ids", segment_ids, shape)
    if segment_ids.is_floating_point() or segment_ids.dtype == torch.bool:
        raise ValueError("`segment_ids` must be an integer tensor [B, T] (one trajectory id per token).")
