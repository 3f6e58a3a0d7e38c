"""Policy losses over action tokens: DIS (the SAO paper), PPO-clip and vanilla policy gradient.

All losses take ``logprobs`` [B, T] (current policy, with grad), ``behavior_logprobs`` [B, T] (rollout
engine, recorded at generation time), ``advantages`` [B, T] and ``action_mask`` [B, T]; they return
``(loss, metrics)``: a 0-d tensor with grad and a flat ``dict[str, float]`` of python floats (one device
sync per call, in ``metrics_to_floats``). ``behavior_logprobs`` and ``advantages`` are treated as
constants (detached). Non-action positions may hold any finite value; they never reach the loss or
the gradient.

Notation: ``rho_t = exp(logprobs_t - behavior_logprobs_t) = pi(a_t|s_t) / mu(a_t|s_t)`` with ``pi`` the
current policy and ``mu`` the behavior (rollout) policy. ``sg`` = stop-gradient. The aggregation
(``agg``, ``num_tokens_global``, ``num_seqs_global``, ``segment_ids``) is described in
``sao_megatron.algo.aggregation``: the per-token losses below are combined with ``loss = sum_t w_t l_t``.

Metrics (all local to this call; keys are also emitted with suffixes ``/adv_pos`` and ``/adv_neg``
restricted to tokens with ``A > 0`` / ``A < 0``; tokens with ``A == 0`` are in neither):

* ``num_tokens``: action tokens counted (the weight for cross-rank reduction of everything below);
* ``ratio/mean``, ``ratio/p1``, ``ratio/p50``, ``ratio/p99``, ``ratio/max``: of ``rho`` over action tokens;
* ``below_frac`` / ``above_frac``: fraction with ``rho <= 1 - eps_low`` / ``rho >= 1 + eps_high``;
* ``kept_frac`` (dis): fraction inside the open band; ``clip_frac``, ``clip_frac_low``,
  ``clip_frac_high`` (ppo_clip): fraction whose gradient the clip removes (``A < 0, rho < 1 - eps_low``
  and ``A > 0, rho > 1 + eps_high``);
* ``ess``: effective sample size ``(sum w)^2 / sum w^2`` of the importance weights ``w = rho`` over the
  kept tokens (dis) or all action tokens (others); ``ess_frac = ess / count`` in (0, 1];
* ``kl_k3``: ``mean(rho - 1 - log rho)``, the k3 estimator (Schulman, "Approximating KL divergence",
  2020) of ``KL(mu || pi)``. The direction follows from the sampling: tokens were drawn from the
  behavior policy ``mu``, and k3 with ratio ``pi/mu`` is unbiased for ``KL(mu || pi)`` under ``mu``.
  ``kl_k3_rev``: ``mean(rho log rho - rho + 1)`` = importance-weighted k3 (``E_mu[rho k3(mu/pi)]``),
  unbiased for ``KL(pi || mu)``; both are per-token (conditional) KLs averaged over action tokens
  and are >= 0 per token.

Metrics are computed from the float64 log-ratio clamped to +-300 (so ``rho^2`` stays finite). An empty
subset reports 0 with ``num_tokens`` 0. ``segment_ids`` only matters for ``agg="seq_mean"``.

Reduction weights: every metric ``K`` except ``num_tokens*`` comes with ``K#n`` (:data:`WEIGHT_SUFFIX`),
the number of tokens it is computed over (its subset's ``num_tokens``; for ``ess``/``ess_frac`` the
tokens entering the ESS). ``sao_megatron.workers.metrics.reduce_metrics`` combines micro-batches and
ranks with it: ``K#n``-weighted mean (exact for means and fractions, approximate for the quantiles and
ESS), max of ``ratio/max``, sums of ``num_tokens`` and of ``loss`` (the local weighted sum).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sao_megatron.algo._checks import (
    check_action_mask,
    check_choice,
    check_finite,
    check_nonneg,
    check_segment_ids,
    check_shape,
)
from sao_megatron.algo.aggregation import aggregate, loss_weights
from sao_megatron.algo.choices import POLICY_LOSSES, LossAgg, PolicyLossName
from sao_megatron.algo.masked import masked_mean, masked_quantiles, masked_sum, metrics_to_floats

WEIGHT_SUFFIX = "#n"
"""Suffix of the weight entry reported next to each metric (see the module docstring)."""

# PPO-clip only: the log-ratio is clamped to this range before exp so float32 cannot overflow to inf
# (same guard as verl's ``compute_policy_loss``); exp(20) ~ 4.9e8 is far outside any useful band.
PPO_LOG_RATIO_CLAMP = 20.0


def _prepare(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    segment_ids: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validate; return ``mask`` (bool) and logprobs (grad kept), behavior, advantages zeroed off-mask."""
    mask = check_action_mask(action_mask)
    shape = tuple(mask.shape)
    for name, x in (
        ("logprobs", logprobs),
        ("behavior_logprobs", behavior_logprobs),
        ("advantages", advantages),
    ):
        check_shape(name, x, shape)
        check_finite(name, x)
    check_segment_ids(segment_ids, shape)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(mask, logprobs, zero)
    blp = torch.where(mask, behavior_logprobs.detach().to(logprobs.dtype), zero)
    adv = torch.where(mask, advantages.detach().to(logprobs.dtype), zero)
    return mask, lp, blp, adv


def _check_eps(eps_low: float, eps_high: float) -> None:
    check_nonneg("eps_low", eps_low)
    check_nonneg("eps_high", eps_high)


def _subset_metrics(
    lr: Tensor,
    sub: Tensor,
    band: tuple[float, float] | None,
    fractions: dict[str, Tensor],
    ess_mask: Tensor,
) -> dict[str, Tensor]:
    """Metrics over the action tokens in ``sub`` (bool [B, T]); ``lr`` is the float64 log-ratio.

    ``fractions``: named bool masks reported as the share of ``sub`` they cover; ``ess_mask``: the
    tokens whose importance weights enter the effective sample size.
    """
    n = sub.sum().to(torch.float64)
    denom = n.clamp(min=1)
    rho = torch.exp(lr)
    m: dict[str, Tensor] = {"num_tokens": n, "ratio/mean": masked_mean(rho, sub)}
    q = masked_quantiles(rho, sub, (0.01, 0.5, 0.99))
    m["ratio/p1"], m["ratio/p50"], m["ratio/p99"] = q[0], q[1], q[2]
    m["ratio/max"] = torch.where(sub, rho, torch.zeros_like(rho)).max()
    if band is not None:
        m["below_frac"] = (sub & (rho <= band[0])).sum() / denom
        m["above_frac"] = (sub & (rho >= band[1])).sum() / denom
    for name, flag in fractions.items():
        m[name] = (sub & flag).sum() / denom
    w_mask = sub & ess_mask
    s1 = masked_sum(rho, w_mask)
    s2 = masked_sum(rho * rho, w_mask)
    m["ess"] = torch.where(s2 > 0, s1 * s1 / s2.clamp(min=1e-300), torch.zeros_like(s1))
    m["ess_frac"] = m["ess"] / w_mask.sum().clamp(min=1)
    m["kl_k3"] = masked_mean(rho - 1 - lr, sub)
    m["kl_k3_rev"] = masked_mean(rho * lr - rho + 1, sub)
    return m


def _metrics(
    loss: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    band: tuple[float, float] | None,
    fractions: dict[str, Tensor],
    ess_mask: Tensor | None = None,
) -> dict[str, float]:
    """All policy metrics, overall and split by advantage sign, as python floats (one device sync)."""
    # float64 and |log rho| <= 300 so rho, rho^2 and rho*log(rho) stay finite in the metrics.
    lr = log_ratio.detach().to(torch.float64).clamp(-300.0, 300.0)
    ess_mask = mask if ess_mask is None else ess_mask
    out: dict[str, Tensor | float] = {"loss": loss.detach()}
    for suffix, sub in (("", mask), ("/adv_pos", mask & (adv > 0)), ("/adv_neg", mask & (adv < 0))):
        n, n_ess = sub.sum().to(torch.float64), (sub & ess_mask).sum().to(torch.float64)
        for key, value in _subset_metrics(lr, sub, band, fractions, ess_mask).items():
            out[key + suffix] = value
            if key != "num_tokens":  # each value's own count, the weight of its reduction
                out[key + suffix + WEIGHT_SUFFIX] = n_ess if key.startswith("ess") else n
    return metrics_to_floats(out)


def dis_band(logprobs: Tensor, behavior_logprobs: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """The tokens DIS keeps: ``1 - eps_low < rho < 1 + eps_high`` (strict) with ``rho = exp(logprobs -
    behavior_logprobs)``; a bool tensor of their common shape, no gradient.

    The log-ratio is taken in the dtype of ``logprobs`` (``behavior_logprobs`` cast to it) and
    exponentiated in float64, so a huge ratio compares as ``inf`` (dropped) instead of overflowing.
    Apply the action mask yourself: every position is tested, padding included.
    """
    _check_eps(eps_low, eps_high)
    check_shape("behavior_logprobs", behavior_logprobs, tuple(logprobs.shape), like="logprobs")
    log_ratio = logprobs.detach() - behavior_logprobs.detach().to(logprobs.dtype)
    rho = torch.exp(log_ratio.to(torch.float64))
    return (rho > 1.0 - eps_low) & (rho < 1.0 + eps_high)


def dis_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    detach_ratio: bool = True,
    agg: LossAgg = "token_mean",
    num_tokens_global: float | int | Tensor | None = None,
    num_seqs_global: float | int | Tensor | None = None,
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Direct double-sided importance sampling (SAO paper, part 2).

    ``keep_t = [1 - eps_low < rho_t < 1 + eps_high]`` (strict on both sides) and

    * ``detach_ratio=True`` (default, ours): ``l_t = -keep_t * sg(rho_t) * A_t * logprobs_t``, the
      truncated-IS score-function estimator; ``d l_t / d logprobs_t = -keep_t * rho_t * A_t``;
    * ``detach_ratio=False`` (the paper's literal formula): ``l_t = -keep_t * rho_t * A_t * logprobs_t``;
      its gradient is ``-keep_t * rho_t * A_t * (1 + logprobs_t)``.

    Out-of-band tokens get exactly zero gradient whatever the sign of ``A`` (unlike PPO-clip). The
    denominator is the engine's own logprob: no old-policy recomputation. Paper thresholds:
    math ``eps_low=0.3, eps_high=5.0``; SWE ``eps_low=0.8, eps_high=3.0``.
    """
    _check_eps(eps_low, eps_high)
    mask, lp, blp, adv = _prepare(logprobs, behavior_logprobs, advantages, action_mask, segment_ids)
    w = loss_weights(
        mask,
        agg,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        segment_ids=segment_ids,
        dtype=torch.float64,
    )
    log_ratio = lp - blp  # [B, T], grad through logprobs
    keep = mask & dis_band(lp, blp, eps_low, eps_high)  # [B, T]
    # exp of the kept log-ratios only: out-of-band entries may be huge, and where() must not see inf.
    rho = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    coef = rho.detach() if detach_ratio else rho
    per_token = -(coef * adv * lp)
    loss = aggregate(per_token, w, keep)
    band = (1.0 - eps_low, 1.0 + eps_high)
    return loss, _metrics(loss, log_ratio, adv, mask, band, {"kept_frac": keep}, ess_mask=keep)


def ppo_clip_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    agg: LossAgg = "token_mean",
    num_tokens_global: float | int | Tensor | None = None,
    num_seqs_global: float | int | Tensor | None = None,
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher (DAPO: separate low/high bounds).

    ``l_t = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)`` with the behavior policy as
    the old policy (no recomputation). The clip zeroes the gradient only on one side per sign:
    ``A > 0, rho > 1 + eps_high`` and ``A < 0, rho < 1 - eps_low``; an ``A > 0`` token with a tiny ratio
    still receives gradient ``-rho * A``. ``log rho`` is clamped to +-20 before exp (overflow guard).
    """
    _check_eps(eps_low, eps_high)
    mask, lp, blp, adv = _prepare(logprobs, behavior_logprobs, advantages, action_mask, segment_ids)
    w = loss_weights(
        mask,
        agg,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        segment_ids=segment_ids,
        dtype=torch.float64,
    )
    log_ratio = lp - blp
    ratio = torch.exp(log_ratio.clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP))
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(surr1, surr2)
    loss = aggregate(per_token, w, mask)
    r = ratio.detach()
    low = (adv < 0) & (r < 1.0 - eps_low)
    high = (adv > 0) & (r > 1.0 + eps_high)
    extra = {"clip_frac": low | high, "clip_frac_low": low, "clip_frac_high": high}
    return loss, _metrics(loss, log_ratio, adv, mask, (1.0 - eps_low, 1.0 + eps_high), extra)


def vanilla_pg_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    agg: LossAgg = "token_mean",
    num_tokens_global: float | int | Tensor | None = None,
    num_seqs_global: float | int | Tensor | None = None,
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE-style policy gradient with no off-policy correction: ``l_t = -A_t * logprobs_t``.

    ``behavior_logprobs`` only feeds the staleness metrics; ``eps_low``/``eps_high``, if given, only add
    the ``below_frac``/``above_frac`` diagnostics (how many tokens DIS would drop).
    """
    band = None
    if eps_low is not None or eps_high is not None:
        if eps_low is None or eps_high is None:
            raise ValueError("Pass both `eps_low` and `eps_high` (diagnostics only) or neither.")
        _check_eps(eps_low, eps_high)
        band = (1.0 - eps_low, 1.0 + eps_high)
    mask, lp, blp, adv = _prepare(logprobs, behavior_logprobs, advantages, action_mask, segment_ids)
    w = loss_weights(
        mask,
        agg,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        segment_ids=segment_ids,
        dtype=torch.float64,
    )
    loss = aggregate(-(adv * lp), w, mask)
    return loss, _metrics(loss, lp - blp, adv, mask, band, {})


_LOSSES = {"dis": dis_loss, "ppo_clip": ppo_clip_loss, "vanilla": vanilla_pg_loss}
"""One function per :data:`~sao_megatron.algo.choices.PolicyLossName`."""


def policy_loss(
    name: PolicyLossName,
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    **kwargs: object,
) -> tuple[Tensor, dict[str, float]]:
    """Dispatch on ``name``, one of :data:`~sao_megatron.algo.choices.PolicyLossName`; kwargs as the target."""
    check_choice("policy loss name", name, POLICY_LOSSES)
    fn = _LOSSES[name]
    return fn(logprobs, behavior_logprobs, advantages, action_mask, **kwargs)  # type: ignore[arg-type]
