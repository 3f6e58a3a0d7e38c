"""Diagnostics of a training batch: per-token policy lag, the DIS band by lag, the critic's
explained variance (all action tokens, and at each trajectory's first), and how much of the reward
variance lies between prompts.

None feeds a loss; all are logged next to the loss metrics (``docs/training.md``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sao_megatron.algo._checks import check_action_mask, check_shape
from sao_megatron.algo.policy_loss import WEIGHT_SUFFIX

EV_MIN_VARIANCE = 1e-12
"""Below this return variance explained variance is undefined (NaN): nothing to explain."""

LAG_BUCKETS: tuple[tuple[int, int, str], ...] = ((0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, 1 << 30, "3+"))
"""Token-lag buckets of :func:`kept_by_lag`: (lowest lag, highest lag, name), inclusive."""


def policy_lag(version: int, policy_versions: Tensor, action_mask: Tensor) -> Tensor:
    """Per-token policy lag ``version - policy_versions``, clamped at 0, and 0 off the action tokens.

    ``version`` is the policy version being trained; ``policy_versions`` [B, T] the weight version
    that sampled each token (any value, e.g. -1, on prompt/observation/padding tokens);
    ``action_mask`` [B, T] 0/1 or bool. A token sampled by a newer version than ``version`` (only
    possible while weights are being swapped) counts as lag 0. Returns [B, T] in the dtype of
    ``policy_versions``.
    """
    mask = check_action_mask(action_mask)
    check_shape("policy_versions", policy_versions, tuple(mask.shape))
    lag = (version - policy_versions).clamp(min=0)
    return torch.where(mask, lag, torch.zeros_like(lag))


def explained_variance(values: Tensor, returns: Tensor, action_mask: Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over all action tokens of the batch (population variances, float64).

    ``values`` [B, T] are the critic's predictions before its update and ``returns`` [B, T] its
    targets. Over the whole batch on purpose: within one trajectory the returns of a terminal reward
    with gamma = lam_critic = 1 are constant, so a per-micro-batch figure is meaningless. NaN when
    fewer than 2 action tokens are selected or ``Var[R] < 1e-12``. 1 is a perfect critic, 0 one no
    better than the batch mean, negative a worse one.
    """
    mask = action_mask > 0
    r, v = returns[mask].double(), values[mask].double()
    if r.numel() < 2:
        return float("nan")
    var_r = r.var(unbiased=False)
    if var_r < EV_MIN_VARIANCE:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


def first_action_explained_variance(values: Tensor, returns: Tensor, action_mask: Tensor) -> float:
    """:func:`explained_variance` over each trajectory's first action token only.

    There the policy has not acted yet, so the critic can only know the prompt: this is the
    critic as a baseline, against the batch mean that a prompt-independent baseline gives. Near 0,
    the prompts give the critic nothing to learn (a running mean is as good); with a terminal
    reward and gamma = lam_critic = 1 the target there is the reward itself. Rows without an
    action token are left out.
    """
    mask = check_action_mask(action_mask)
    has_action = mask.any(dim=-1)
    first = torch.zeros_like(mask)
    rows = torch.nonzero(has_action).squeeze(-1)
    first[rows, mask[rows].int().argmax(dim=-1)] = True  # argmax of 0/1 is the first 1
    return explained_variance(values, returns, first)


def between_prompt_share(groups: list[list[float]]) -> float:
    """Share of reward variance that lies between prompts, from ``k >= 2`` rewards of each prompt.

    One-way random-effects estimate, unbiased in both parts: within-prompt variance ``W`` the mean
    of each prompt's sample variance (``k - 1`` denominator), between-prompt variance
    ``B = Var[prompt means] - W / k`` (prompts' ``n - 1`` denominator, floored at 0); returns
    ``B / (B + W)``. 0: a prompt says nothing about its reward (a global baseline is right);
    1: every sample of a prompt gets the same reward. NaN with fewer than 2 prompts, groups of
    unequal or < 2 size, or no variance at all.
    """
    n = len(groups)
    k = len(groups[0]) if groups else 0
    if n < 2 or k < 2 or any(len(g) != k for g in groups):
        return float("nan")
    r = torch.tensor(groups, dtype=torch.float64)
    within = float(r.var(dim=1, unbiased=True).mean())
    between = max(0.0, float(r.mean(dim=1).var(unbiased=True)) - within / k)
    total = between + within
    return between / total if total > EV_MIN_VARIANCE else float("nan")


def kept_by_lag(kept: Tensor, lag: Tensor, advantages: Tensor, mask: Tensor) -> dict[str, float]:
    """Fraction of action tokens inside the DIS band, per token-lag bucket and advantage sign.

    ``kept`` [B, T] bool (:func:`~sao_megatron.algo.policy_loss.dis_band`), ``lag`` [B, T]
    (:func:`policy_lag`), ``advantages`` [B, T], ``mask`` [B, T] bool action tokens. Each fraction
    ``K`` comes with its token count ``K#n`` (:data:`~sao_megatron.algo.policy_loss.WEIGHT_SUFFIX`,
    the weight of its reduction across micro-batches and ranks); ``dis/tokens/lag{b}`` is the
    bucket's token count (summed). Empty buckets and signs report nothing but that count."""
    out = {}
    for lo, hi, name in LAG_BUCKETS:
        sel = mask & (lag >= lo) & (lag <= hi)
        n = int(sel.sum())
        out[f"dis/tokens/lag{name}"] = float(n)
        if n:
            out[f"dis/kept_frac/lag{name}"] = float((kept & sel).sum()) / n
            out[f"dis/kept_frac/lag{name}{WEIGHT_SUFFIX}"] = float(n)
        for sign, sel_sign in (("pos", advantages > 0), ("neg", advantages < 0)):
            both = sel & sel_sign
            if nb := int(both.sum()):
                out[f"dis/kept_frac/lag{name}/adv_{sign}"] = float((kept & both).sum()) / nb
                out[f"dis/kept_frac/lag{name}/adv_{sign}{WEIGHT_SUFFIX}"] = float(nb)
    return out


def mismatch_metrics(logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Training-inference mismatch on the tokens of ``mask`` (the caller passes the action tokens
    trained at the version that generated them, lag 0, where trainer and engine hold the same weights).

    With ``d = logprobs - behavior_logprobs`` and ``r = exp(d)``: ``mismatch/abs_diff`` mean |d| and
    ``mismatch/abs_diff/max`` its max; ``mismatch/k3`` the mean of ``r - 1 - d``, Schulman's k3
    estimate of KL(engine || trainer) from the engine's samples (>= 0, unbiased); ``mismatch/ratio/p1``,
    ``p50``, ``p99`` quantiles of ``r``; ``mismatch/tokens`` the count (summed across micro-batches and
    ranks; the means carry it as their ``#n`` weight, so they reduce exactly, the quantiles approximately).
    ``logprobs``, ``behavior_logprobs`` [B, T]; ``mask`` [B, T] bool. No tokens: only the count."""
    from sao_megatron.algo.masked import masked_quantiles

    check_shape("behavior_logprobs", behavior_logprobs, logprobs.shape)
    mask = mask.bool()
    n = int(mask.sum())
    out = {"mismatch/tokens": float(n)}
    if not n:
        return out
    d = (logprobs.detach().float() - behavior_logprobs.float())[mask]
    ratio = d.exp()
    q = masked_quantiles(ratio, torch.ones_like(ratio, dtype=torch.bool), (0.01, 0.5, 0.99))
    for key, value in (
        ("mismatch/abs_diff", d.abs().mean()),
        ("mismatch/k3", (ratio - 1 - d).mean()),
        ("mismatch/ratio/p1", q[0]),
        ("mismatch/ratio/p50", q[1]),
        ("mismatch/ratio/p99", q[2]),
    ):
        out[key] = float(value)
        out[key + WEIGHT_SUFFIX] = float(n)
    out["mismatch/abs_diff/max"] = float(d.abs().max())
    return out
