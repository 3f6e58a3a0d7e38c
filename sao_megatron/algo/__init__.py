"""Pure-math layer of SAO: policy/value losses and the learners' objectives built on them, advantage
estimators, baselines, masked reductions, batch diagnostics, and the named choices (``choices``: ``Literal`` types the config validates with).

Tensors and scalars in, ``(tensor(s), metrics)`` out; metrics are flat ``dict[str, float]`` of python
floats. Imports only torch and the standard library: no Megatron, Ray, SGLang or CUDA at import time.
See docs/algo.md for every formula, default and how metrics reduce across data-parallel ranks.
"""

from sao_megatron.algo._segments import segment_ids_from_cu_seqlens
from sao_megatron.algo.advantages import (
    gae,
    gae_reference,
    length_adaptive_lambda,
    reverse_discounted_cumsum,
    step_gae,
    truncation_targets,
    whiten_advantages,
)
from sao_megatron.algo.aggregation import count_sequences, loss_weights
from sao_megatron.algo.baselines import (
    GlobalRunningMeanBaseline,
    PromptRunningMeanBaseline,
    broadcast_to_tokens,
    grpo_advantages,
    rloo_advantages,
)
from sao_megatron.algo.choices import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    CRITIC_ESTIMATORS,
    GROUP_ESTIMATORS,
    POLICY_LOSSES,
    STEP_MODES,
    TRUNCATIONS,
    AdvantageName,
    LossAgg,
    PolicyLossName,
    StepMode,
    Truncation,
    uses_critic,
)
from sao_megatron.algo.diagnostics import (
    LAG_BUCKETS,
    between_prompt_share,
    explained_variance,
    first_action_explained_variance,
    kept_by_lag,
    mismatch_metrics,
    policy_lag,
)
from sao_megatron.algo.masked import (
    masked_mean,
    masked_quantiles,
    masked_sum,
    masked_var,
    masked_whiten,
    metrics_to_floats,
)
from sao_megatron.algo.objectives import policy_objective, sft_nll, value_objective
from sao_megatron.algo.policy_loss import (
    dis_band,
    dis_loss,
    policy_loss,
    ppo_clip_loss,
    vanilla_pg_loss,
)
from sao_megatron.algo.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "CRITIC_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "LAG_BUCKETS",
    "POLICY_LOSSES",
    "STEP_MODES",
    "TRUNCATIONS",
    "AdvantageName",
    "GlobalRunningMeanBaseline",
    "LossAgg",
    "PolicyLossName",
    "PromptRunningMeanBaseline",
    "StepMode",
    "Truncation",
    "between_prompt_share",
    "broadcast_to_tokens",
    "count_sequences",
    "dis_band",
    "dis_loss",
    "explained_variance",
    "first_action_explained_variance",
    "gae",
    "gae_reference",
    "grpo_advantages",
    "kept_by_lag",
    "mismatch_metrics",
    "length_adaptive_lambda",
    "loss_weights",
    "masked_mean",
    "masked_quantiles",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "metrics_to_floats",
    "policy_lag",
    "policy_loss",
    "policy_objective",
    "ppo_clip_loss",
    "reverse_discounted_cumsum",
    "rloo_advantages",
    "segment_ids_from_cu_seqlens",
    "sft_nll",
    "step_gae",
    "truncation_targets",
    "uses_critic",
    "vanilla_pg_loss",
    "value_loss",
    "value_objective",
    "whiten_advantages",
]
