"""Outcome-reward baselines: GRPO and RLOO group baselines, running-mean baselines (with state).

All take one scalar reward per trajectory ``rewards`` [N] and return one advantage per trajectory
[N]; ``broadcast_to_tokens`` spreads them over the action tokens [B, T]. Metrics are python floats,
local to the call (reduce across ranks with an ``num_samples``-weighted mean).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from sao_megatron.algo._checks import check_action_mask, check_finite, check_nonneg, check_shape, check_tensor
from sao_megatron.algo.masked import metrics_to_floats


def _check_rewards(rewards: Tensor) -> None:
    check_tensor("rewards", rewards)
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"`rewards` must be a non-empty [N] tensor (one per trajectory), got {tuple(rewards.shape)}.")
    check_finite("rewards", rewards)


def _group_index(group_ids: Tensor, n: int) -> tuple[Tensor, Tensor]:
    check_shape("group_ids", group_ids, (n,), like="rewards")
    if group_ids.is_floating_point():
        raise ValueError("`group_ids` must be an integer tensor [N] (same id = same prompt).")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def _group_sum(x: Tensor, inverse: Tensor, n_groups: int) -> Tensor:
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, dict[str, float]]:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``A_i = (r_i - mean_g) / (std_g + eps)``.

    ``mean_g``/``std_g`` over the group of ``i`` (same ``group_ids``), ``std`` unbiased (n - 1, as
    ``torch.std`` in DeepSeekMath/verl); a group of one has std 0 and advantage 0.
    ``normalize_std=False`` gives ``r_i - mean_g`` (Dr. GRPO). Groups of different sizes are allowed.
    """
    _check_rewards(rewards)
    check_nonneg("eps", eps)
    inverse, counts = _group_index(group_ids, rewards.numel())
    r = rewards.to(torch.float64)
    cnt = counts.to(torch.float64)
    mean = _group_sum(r, inverse, cnt.numel()) / cnt
    centered = r - mean[inverse]
    ss = _group_sum(centered * centered, inverse, cnt.numel())
    std = torch.where(cnt > 1, (ss / (cnt - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss))
    adv = centered / (std[inverse] + eps) if normalize_std else centered
    metrics = metrics_to_floats(
        {
            "adv/mean": adv.mean(),
            "adv/std": adv.std(unbiased=False),
            "num_samples": float(r.numel()),
            "num_groups": float(cnt.numel()),
            "zero_std_group_frac": (std == 0).to(torch.float64).mean(),
        }
    )
    return adv.to(rewards.dtype), metrics


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, dict[str, float]]:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): ``A_i = r_i - (sum_g r - r_i) / (n_g - 1)``.

    The baseline is the mean of the *other* members of the group; every group needs >= 2 members.
    """
    _check_rewards(rewards)
    inverse, counts = _group_index(group_ids, rewards.numel())
    if bool((counts < 2).any()):
        raise ValueError("`group_ids` has a group with a single sample; RLOO needs >= 2 samples per group.")
    r = rewards.to(torch.float64)
    total = _group_sum(r, inverse, counts.numel())[inverse]
    adv = r - (total - r) / (counts[inverse].to(torch.float64) - 1)
    metrics = metrics_to_floats(
        {"adv/mean": adv.mean(), "adv/std": adv.std(unbiased=False), "num_samples": float(r.numel())}
    )
    return adv.to(rewards.dtype), metrics


def broadcast_to_tokens(advantages: Tensor, action_mask: Tensor) -> Tensor:
    """One advantage per row [B] -> [B, T] on the action tokens, zeros elsewhere."""
    mask = check_action_mask(action_mask)
    check_shape("advantages", advantages, tuple(mask.shape[:1]), like="action_mask rows ([B])")
    return torch.where(mask, advantages[:, None], torch.zeros((), dtype=advantages.dtype, device=advantages.device))


class PromptRunningMeanBaseline:
    """Per-prompt running mean over the last ``window`` rewards of that prompt (paper ablation: 8).

    ``A_i = r_i - b(p_i)`` where ``b(p)`` is the mean of the stored rewards of prompt ``p`` *before*
    ``r_i`` is inserted (a reward never sees itself); rewards are processed in the order given, so a
    prompt repeated within a batch sees its earlier occurrences. A prompt with no history uses
    ``initial`` (0.0 by default). The history grows with the number of distinct prompts seen.
    """

    def __init__(self, window: int, initial: float = 0.0) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"`window` must be an int >= 1, got {window!r}.")
        self.window = window
        self.initial = float(initial)
        self._history: dict[Hashable, deque[float]] = {}

    def baseline(self, prompt_id: Hashable) -> float:
        hist = self._history.get(prompt_id)
        return sum(hist) / len(hist) if hist else self.initial

    def advantages(self, rewards: Tensor, prompt_ids: Sequence[Hashable]) -> tuple[Tensor, dict[str, float]]:
        """Advantages [N] for ``rewards`` [N] of prompts ``prompt_ids`` (N hashable keys); updates state."""
        _check_rewards(rewards)
        if len(prompt_ids) != rewards.numel():
            raise ValueError(
                f"`prompt_ids` has {len(prompt_ids)} entries for {rewards.numel()} `rewards`; pass one per reward."
            )
        base, fresh = [], 0
        for r, pid in zip(rewards.tolist(), prompt_ids, strict=True):
            fresh += pid not in self._history
            base.append(self.baseline(pid))
            self._history.setdefault(pid, deque(maxlen=self.window)).append(float(r))
        b = torch.tensor(base, dtype=rewards.dtype, device=rewards.device)
        metrics = {
            "baseline/mean": sum(base) / len(base),
            "new_prompt_frac": fresh / len(base),
            "num_prompts": float(len(self._history)),
        }
        return rewards - b, metrics

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "initial": self.initial,
            "history": {k: list(v) for k, v in self._history.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. A different ``window`` (a run resumed with another
        ``algo.running_mean_window``, or an arm continuing a shared start) keeps each prompt's
        most recent ``window`` rewards."""
        self.initial = float(state["initial"])
        self._history = {k: deque(v, maxlen=self.window) for k, v in state["history"].items()}


class GlobalRunningMeanBaseline:
    """Global running mean over the last ``window`` rewards of any prompt (online ablation: 128).

    ``A_i = r_i - mean(last window rewards before r_i)`` (``initial`` when empty), rewards processed
    in order and inserted after their own baseline is taken.
    """

    def __init__(self, window: int, initial: float = 0.0) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"`window` must be an int >= 1, got {window!r}.")
        self.window = window
        self.initial = float(initial)
        self._history: deque[float] = deque(maxlen=window)

    def baseline(self) -> float:
        return sum(self._history) / len(self._history) if self._history else self.initial

    def advantages(self, rewards: Tensor) -> tuple[Tensor, dict[str, float]]:
        _check_rewards(rewards)
        base = []
        for r in rewards.tolist():
            base.append(self.baseline())
            self._history.append(float(r))
        b = torch.tensor(base, dtype=rewards.dtype, device=rewards.device)
        return rewards - b, {"baseline/mean": sum(base) / len(base), "history_len": float(len(self._history))}

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "initial": self.initial, "history": list(self._history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a different ``window`` keeps the most recent ``window`` rewards."""
        self.initial = float(state["initial"])
        self._history = deque(state["history"], maxlen=self.window)
