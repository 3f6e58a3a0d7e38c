"""Per-batch advantages and critic targets from the configured estimator (driver side).

SAO: token-level skip-observation GAE with length-adaptive policy lambda and critic lambda 1.
Baselines: step-level GAE, GRPO, RLOO, running-mean (per prompt or global). Estimators that
use no critic return ``returns=None``.
"""

from __future__ import annotations

import torch

from sao_megatron import algo
from sao_megatron.config import AlgoConfig
from sao_megatron.batch import TrainBatch

CRITIC_ESTIMATORS = ("gae", "step_mean", "step_last")


def uses_critic(a: AlgoConfig) -> bool:
    return a.advantage in CRITIC_ESTIMATORS


def explained_variance(values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over all action tokens of the batch (values before the update).

    Over the whole batch on purpose: within one trajectory the returns of a terminal reward with
    gamma = lambda_critic = 1 are constant, so a per-micro-batch figure is meaningless."""
    mask = action_mask > 0
    r, v = returns[mask].double(), values[mask].double()
    var_r = r.var(unbiased=False)
    if r.numel() < 2 or var_r < 1e-12:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


class Advantages:
    """Holds the running-mean baselines' state (checkpointed with the run)."""

    def __init__(self, a: AlgoConfig):
        self.a = a
        self.prompt_baseline = algo.PromptRunningMeanBaseline(a.running_mean_window)
        self.global_baseline = algo.GlobalRunningMeanBaseline(a.running_mean_window)

    def __call__(self, batch: TrainBatch, values: torch.Tensor | None, prompt_ids: list[str],
                 group_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:  # fmt: skip
        a = self.a
        mask = batch.action_mask > 0
        if uses_critic(a):
            lam = algo.length_adaptive_lambda(mask, a.lam_alpha) if a.lam < 0 else a.lam
            if a.advantage == "gae":
                adv, ret, metrics = algo.gae(batch.rewards, values, mask, gamma=a.gamma, lam=lam,
                                             lambda_critic=a.lam_critic)  # fmt: skip
            else:
                adv, ret, metrics = algo.step_gae(batch.rewards, values, mask, mode=a.advantage, gamma=a.gamma,
                                                  lam=lam, lambda_critic=a.lam_critic)  # fmt: skip
        else:
            ret = None
            if a.advantage in ("grpo", "rloo"):
                codes = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
                gid = torch.tensor([codes[g] for g in group_ids])
                if a.advantage == "grpo":
                    seq, metrics = algo.grpo_advantages(
                        batch.rewards, gid, normalize_std=a.grpo_std_normalize
                    )
                else:
                    seq, metrics = algo.rloo_advantages(batch.rewards, gid)
            elif a.advantage == "running_mean_prompt":
                seq, metrics = self.prompt_baseline.advantages(batch.rewards, prompt_ids)
            else:
                seq, metrics = self.global_baseline.advantages(batch.rewards)
            adv = algo.broadcast_to_tokens(seq.to(torch.float32), mask)
        if a.whiten_advantages:
            adv, wm = algo.whiten_advantages(adv, mask)
            metrics = {**metrics, **wm}
        return adv.float(), (ret.float() if ret is not None else None), metrics

    def state_dict(self) -> dict:
        return {"prompt": self.prompt_baseline.state_dict(), "global": self.global_baseline.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.prompt_baseline.load_state_dict(state["prompt"])
        self.global_baseline.load_state_dict(state["global"])
