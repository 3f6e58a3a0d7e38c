"""Per-batch advantages and critic targets from the configured estimator (driver side).

SAO: token-level skip-observation GAE with length-adaptive policy lambda and critic lambda 1.
Baselines: step-level GAE, GRPO, RLOO, running-mean (per prompt or global). Estimators that
use no critic return ``returns=None``.
"""

from __future__ import annotations

import torch

from sao_megatron import algo
from sao_megatron.batch import TrainBatch
from sao_megatron.config import AlgoConfig
from sao_megatron.records import Trajectory


class AdvantageEstimator:
    """Holds the running-mean baselines' state (checkpointed with the run)."""

    def __init__(self, a: AlgoConfig):
        self.a = a
        self.prompt_baseline = algo.PromptRunningMeanBaseline(a.running_mean_window)
        self.global_baseline = algo.GlobalRunningMeanBaseline(a.running_mean_window)

    def __call__(
        self,
        batch: TrainBatch,
        values: torch.Tensor | None,
        trajectories: list[Trajectory],
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """``[B, T]`` advantages, ``[B, T]`` critic targets (None without a critic) and metrics."""
        a = self.a
        mask = batch.action_mask > 0
        if algo.uses_critic(a.advantage):
            if values is None:
                raise ValueError(f"algo.advantage={a.advantage!r} needs the critic's values")
            lam = algo.length_adaptive_lambda(mask, a.lam_alpha) if a.lam == "adaptive" else a.lam
            rewards, bootstrap = self._truncation(batch, values, trajectories)
            if a.advantage == "gae":
                adv, ret, metrics = algo.gae(
                    rewards, values, mask, gamma=a.gamma, lam=lam, lam_critic=a.lam_critic, bootstrap=bootstrap
                )
            else:
                assert a.advantage == "step_mean" or a.advantage == "step_last"
                adv, ret, metrics = algo.step_gae(
                    rewards,
                    values,
                    mask,
                    mode=a.advantage,
                    gamma=a.gamma,
                    lam=lam,
                    lam_critic=a.lam_critic,
                    bootstrap=bootstrap,
                )
        else:
            ret = None
            if a.advantage in ("grpo", "rloo"):
                group_ids = [t.group_id or t.prompt_id for t in trajectories]
                codes = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
                gid = torch.tensor([codes[g] for g in group_ids])
                if a.advantage == "grpo":
                    seq, metrics = algo.grpo_advantages(batch.rewards, gid, normalize_std=a.grpo_std_normalize)
                else:
                    seq, metrics = algo.rloo_advantages(batch.rewards, gid)
            elif a.advantage == "running_mean_prompt":
                seq, metrics = self.prompt_baseline.advantages(batch.rewards, [t.prompt_id for t in trajectories])
            else:
                seq, metrics = self.global_baseline.advantages(batch.rewards)
            adv = algo.broadcast_to_tokens(seq.to(torch.float32), mask)
        if a.whiten_advantages:
            adv, wm = algo.whiten_advantages(adv, mask)
            metrics = {**metrics, **wm}
        return adv.float(), (ret.float() if ret is not None else None), metrics

    def _truncation(
        self, batch: TrainBatch, values: torch.Tensor, trajectories: list[Trajectory]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rewards and bootstrap values ``[B]`` under ``algo.truncated``: a ``truncated`` episode (a turn,
        context or token-budget limit cut it; failed ones never reach the learner) bootstraps from the
        critic's value at each row's last position, the state after its last token (``TrainBatch``:
        position ``L - 1`` predicts the token after the sequence's end)."""
        truncated = torch.tensor([t.status == "truncated" for t in trajectories])
        cut_values = values[torch.arange(batch.size), batch.lengths - 1]  # [B]
        return algo.truncation_targets(batch.rewards, cut_values, truncated, self.a.truncated)

    def state_dict(self) -> dict:
        return {"prompt": self.prompt_baseline.state_dict(), "global": self.global_baseline.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.prompt_baseline.load_state_dict(state["prompt"])
        self.global_baseline.load_state_dict(state["global"])
