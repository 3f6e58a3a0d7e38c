"""The learners' objectives: what one micro-batch's loss and metrics are, from the model's outputs.

Each takes the micro-batch's tensors (``[b, t]``; a packed micro-batch is one row whose
trajectories ``segment_ids`` tells apart) and the global normalisers of the whole optimizer step,
and returns ``(loss, metrics)``: a 0-d loss already divided by the step's global count, so the sum
over every micro-batch of every data-parallel rank is the full-batch loss
(:mod:`~sao_megatron.algo.aggregation`), and flat python-float metrics. Every metric set carries
``micro_tokens``, the micro-batch's action tokens, the default weight of the metric reduction
across micro-batches and ranks (``workers.metrics.reduce_metrics``: keys with a ``loss``,
``num_tokens`` or ``tokens`` part sum, ``*/max`` take the max, the rest average weighted by their
own ``K#n`` count or by ``micro_tokens``).
"""

from __future__ import annotations

from torch import Tensor

from sao_megatron.algo._checks import check_choice
from sao_megatron.algo.choices import POLICY_LOSSES, LossAgg, PolicyLossName
from sao_megatron.algo.corrections import sequence_mask, truncated_is
from sao_megatron.algo.diagnostics import kept_by_lag
from sao_megatron.algo.masked import masked_mean
from sao_megatron.algo.policy_loss import dis_band, policy_loss
from sao_megatron.algo.value_loss import value_loss


def _normalisers(agg: LossAgg, num_tokens_global: float, num_seqs_global: float) -> tuple[float | None, float | None]:
    """(tokens, sequences): only the one ``agg`` divides by (``loss_weights`` refuses the other)."""
    return (num_tokens_global, None) if agg == "token_mean" else (None, num_seqs_global)


def policy_objective(
    logprobs: Tensor,
    entropy: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    lag: Tensor,
    *,
    loss: PolicyLossName,
    eps_low: float,
    eps_high: float,
    detach_ratio: bool,
    agg: LossAgg,
    num_tokens_global: float,
    num_seqs_global: float,
    segment_ids: Tensor | None = None,
    stale_lag: int | None = None,
    seq_mask_low: float | None = None,
    seq_mask_high: float | None = None,
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The actor's loss on one micro-batch: policy loss ``loss`` (:mod:`~sao_megatron.algo.policy_loss`)
    plus its diagnostics.

    ``logprobs`` [b, t] of the current policy (with grad) and ``entropy`` [b, t] (no grad) at each
    label; ``behavior_logprobs``, ``advantages`` [b, t]; ``action_mask`` [b, t] 0/1 or bool;
    ``lag`` [b, t] each token's policy lag (:func:`~sao_megatron.algo.diagnostics.policy_lag`).
    ``eps_low`` / ``eps_high`` bound the DIS and PPO bands (unused by ``vanilla``'s loss and
    metrics), ``detach_ratio`` is DIS's. Normalised by ``num_tokens_global`` (``agg="token_mean"``)
    or ``num_seqs_global`` (``"seq_mean"``), the whole step's counts.

    Metrics: the policy loss's (``loss``, ``ratio/*``, ``kl_k3``, ..., each with ``#n``);
    ``entropy``, the mean over the action tokens; ``micro_tokens``; and, whatever ``loss``, the
    share of tokens inside the DIS band ``1 - eps_low < rho < 1 + eps_high`` per lag bucket and
    advantage sign (:func:`~sao_megatron.algo.diagnostics.kept_by_lag`).

    ``stale_lag`` (``algo.over_lag: mask``): tokens whose lag exceeds it carry no gradient (their
    advantage is zeroed: every loss here is linear in it) and still count in the normalisers, as
    the tokens DIS masks do; ``stale_masked`` is their share of the action tokens.

    Corrections (:mod:`~sao_megatron.algo.corrections`), each a factor on every token's advantage, so
    on its loss and gradient, with any ``loss``: ``seq_mask_low`` / ``seq_mask_high`` (``None``: that
    side open; both ``None``: off) drop every action token of a trajectory whose geometric-mean ratio
    leaves ``[low, high]`` (``seq_mask/*`` metrics); ``tis_cap`` (``None``: off) truncates each token's
    importance weight at ``C`` (``tis/*`` metrics). Both count in the normalisers as masked tokens
    do. With a band holding every trajectory and ``C`` above every ratio, the loss and its gradient
    are exactly those without them (``dis``, ``ppo_clip``; ``vanilla`` gains the weight ``rho``)."""
    check_choice("policy loss", loss, POLICY_LOSSES)
    mask = action_mask > 0
    loss_advantages = advantages
    if stale_lag is not None:
        loss_advantages = advantages * (lag <= stale_lag)
    corrections: dict[str, float] = {}
    if seq_mask_low is not None or seq_mask_high is not None:
        keep, m = sequence_mask(
            logprobs, behavior_logprobs, mask, low=seq_mask_low, high=seq_mask_high, segment_ids=segment_ids
        )
        loss_advantages, corrections = loss_advantages * keep, corrections | m
    if tis_cap is not None:
        factor, m = truncated_is(logprobs, behavior_logprobs, mask, cap=tis_cap, loss_has_ratio=loss != "vanilla")
        loss_advantages, corrections = loss_advantages * factor, corrections | m
    tokens, seqs = _normalisers(agg, num_tokens_global, num_seqs_global)
    bounds = {"eps_low": eps_low, "eps_high": eps_high} if loss != "vanilla" else {}  # vanilla: no band
    extra = {"detach_ratio": detach_ratio} if loss == "dis" else {}
    value, metrics = policy_loss(
        loss,
        logprobs,
        behavior_logprobs,
        loss_advantages,
        mask,
        agg=agg,
        num_tokens_global=tokens,
        num_seqs_global=seqs,
        segment_ids=segment_ids,
        **bounds,
        **extra,
    )
    metrics.update(corrections)
    metrics["entropy"] = masked_mean(entropy, mask.float()).item()
    metrics["micro_tokens"] = float(mask.sum())
    if stale_lag is not None:
        metrics["stale_masked"] = masked_mean((lag > stale_lag).float(), mask.float()).item()
    kept = dis_band(logprobs.detach(), behavior_logprobs, eps_low, eps_high)
    metrics.update(kept_by_lag(kept, lag, advantages, mask))
    return value, metrics


def value_objective(
    values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    old_values: Tensor | None = None,
    *,
    value_clip: float,
    agg: LossAgg,
    num_tokens_global: float,
    num_seqs_global: float,
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The critic's loss on one micro-batch: :func:`~sao_megatron.algo.value_loss.value_loss` of
    ``values`` [b, t] (with grad, computed in float32) against ``returns`` [b, t].

    ``value_clip`` > 0 clips each value to ``old_values +- value_clip`` (PPO2 value clipping; needs
    ``old_values`` [b, t], the values before this step's updates); 0 turns clipping off.
    Normalised as :func:`policy_objective`. Metrics: the value loss's and ``micro_tokens``."""
    mask = action_mask > 0
    clipped = value_clip > 0
    tokens, seqs = _normalisers(agg, num_tokens_global, num_seqs_global)
    loss, metrics = value_loss(
        values.float(),
        returns,
        mask,
        old_values=old_values if clipped else None,
        clip_range=value_clip if clipped else None,
        agg=agg,
        num_tokens_global=tokens,
        num_seqs_global=seqs,
        segment_ids=segment_ids,
    )
    metrics["micro_tokens"] = float(mask.sum())
    return loss, metrics


def sft_nll(logprobs: Tensor, action_mask: Tensor, *, num_tokens_global: float) -> tuple[Tensor, dict[str, float]]:
    """Supervised fine-tuning on demonstrations: ``-sum_t m_t logprobs_t / N``, the negative
    log-likelihood of the action tokens over ``N`` = ``num_tokens_global``, the step's action tokens.

    ``logprobs`` [b, t] with grad; ``action_mask`` [b, t] 0/1. Metrics: ``nll``, this
    micro-batch's mean negative logprob per action token (0 without any), and ``micro_tokens``."""
    n = float(action_mask.sum())
    nll = -(logprobs * action_mask).sum()
    return nll / num_tokens_global, {"nll": (nll / max(n, 1.0)).item(), "micro_tokens": n}
