"""Per-step metrics: the learner's outcome, the batch, the buffer and the rollout throughput.

Names are ``group/name``: ``adv/``, ``critic/``, ``actor/``, ``dis/``, ``rollout/``, ``lag/``,
``buffer/``, ``select/``, ``time/``; values are python floats (see ``observe.RunLog``).
"""

from __future__ import annotations

import time
from typing import get_args

import torch

from sao_megatron import algo
from sao_megatron.buffer import ReadyBuffer
from sao_megatron.driver.learner import StepOutcome
from sao_megatron.records import EndCause, Trajectory
from sao_megatron.rollout.manager import RolloutManager


def learner_metrics(o: StepOutcome) -> dict[str, float]:
    out = {f"adv/{k}": v for k, v in o.advantages.items()}
    out |= {f"critic/{k}": v for k, v in o.critic.items()}
    if o.values is not None and o.returns is not None:
        out["critic/explained_var"] = algo.explained_variance(o.values, o.returns, o.batch.action_mask)
        out["critic/explained_var_first"] = algo.first_action_explained_variance(
            o.values, o.returns, o.batch.action_mask
        )
    out |= {(k if k.startswith("dis/") else f"actor/{k}"): v for k, v in o.actor.items()}
    out |= o.sync
    out["time/step_s"] = o.seconds
    return out


def batch_metrics(
    trajectories: list[Trajectory], token_lag: torch.Tensor, action_mask: torch.Tensor, taken_at: float
) -> dict[str, float]:
    """Reward, accuracy, lengths, turns and policy lag of a training batch.

    ``token_lag`` ``[B, T]``: :func:`algo.policy_lag` against the policy the batch trained;
    ``taken_at``: when the learner took the batch (``time.time()``): ``buffer/wait_s`` is each
    trajectory's time from finishing to being taken, not counting the step that trained it.
    ``rollout/prompt_index``: the batch's mean prompt index (the data cursor's position): without
    ``algo.max_batches_ahead`` the engines run ahead of the learner and the surplus is dropped as
    stale, so the cursor advances faster than steps x batch size."""
    n = len(trajectories)
    mask = action_mask > 0
    lags = token_lag.amax(dim=-1).float()  # a trajectory's lag is its oldest action token's
    indices = [t.sample_index for t in trajectories if t.sample_index is not None]  # the prompt cursor's
    out = {
        "rollout/batch_size": float(n),
        "rollout/reward": sum(t.reward for t in trajectories) / n,
        "rollout/accuracy": sum(bool(t.correct) for t in trajectories) / n,
        "rollout/response_tokens": sum(len(t.response_ids) for t in trajectories) / n,
        "rollout/action_tokens": sum(t.num_action_tokens for t in trajectories) / n,
        "rollout/turns": sum(t.num_turns for t in trajectories) / n,
        "rollout/truncated": sum(t.status == "truncated" for t in trajectories) / n,
        "rollout/multi_version": sum(len(set(t.action_versions)) > 1 for t in trajectories) / n,
        "rollout/prompt_index": sum(indices) / len(indices) if indices else float("nan"),
        "rollout/episode_s": sum(t.finished_at - t.started_at for t in trajectories) / n,
        "buffer/wait_s": sum(max(0.0, taken_at - t.finished_at) for t in trajectories) / n,
        "lag/mean": float(lags.mean()),
        "lag/max": float(lags.max()),
        "lag/token_mean": float(token_lag[mask].float().mean()) if mask.any() else 0.0,
    }
    for k in range(4):
        sel = lags >= 3 if k == 3 else lags == k
        out[f"lag/hist{k if k < 3 else '3+'}"] = float(sel.float().mean())
    return out


END_CAUSES: tuple[str, ...] = tuple(c for c in get_args(EndCause) if c != "failed")
"""Why trained episodes end (failed ones are never in a batch: ``buffer/dropped_failed/*``)."""


def episode_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Context accounting, tool calls and why episodes ended, over a training batch.

    Per episode (means): ``prompt_tokens``, ``observation_tokens``, ``context_tokens`` (prompt +
    response; ``context_tokens_max`` the batch's longest), ``refused_calls``, ``clipped_outputs``.
    Per turn: ``tool_outputs_per_turn``, ``parallel_turns`` (share of actions with two or more
    calls answered). ``end/<cause>``: share of episodes that ended so (every cause, every step);
    ``end_turn/<cause>``: the mean turn they ended at (causes present in the batch only).
    Weight syncs (``rollout.update_policy``): ``stale_kv_tokens`` (share of the action tokens sampled
    on stale KV), and, summed over the batch (with one sync per step, about one sync's worth),
    ``prefill_recomputed`` (context tokens the engines prefilled again) and ``resubmitted``
    (aborted generations resubmitted as continuations). Routing replay: ``routes_invalid``, positions
    of the batch whose engine route row was unfit to replay (a repeated or out-of-range expert id),
    recorded as missing (the routers routed them)."""
    n = len(trajectories)
    turns = max(1, sum(t.num_turns for t in trajectories))
    out = {
        "rollout/prompt_tokens": sum(t.num_prompt_tokens for t in trajectories) / n,
        "rollout/observation_tokens": sum(t.num_observation_tokens for t in trajectories) / n,
        "rollout/context_tokens": sum(t.num_context_tokens for t in trajectories) / n,
        "rollout/context_tokens_max": float(max(t.num_context_tokens for t in trajectories)),
        "rollout/tool_outputs_per_turn": sum(t.stats.tool_outputs for t in trajectories) / turns,
        "rollout/parallel_turns": sum(t.stats.parallel_turns for t in trajectories) / turns,
        "rollout/refused_calls": sum(t.stats.refused_calls for t in trajectories) / n,
        "rollout/clipped_outputs": sum(t.stats.clipped_outputs for t in trajectories) / n,
        "rollout/stale_kv_tokens": sum(t.num_stale_kv_tokens for t in trajectories)
        / max(1, sum(t.num_action_tokens for t in trajectories)),
        "rollout/prefill_recomputed": float(sum(t.stats.prefill_recomputed for t in trajectories)),
        "rollout/resubmitted": float(sum(t.stats.resubmitted for t in trajectories)),
        "rollout/routes_invalid": float(sum(t.stats.routes_invalid for t in trajectories)),
    }
    for cause in END_CAUSES:
        ended = [t.num_turns for t in trajectories if t.stats.end == cause]
        out[f"rollout/end/{cause}"] = len(ended) / n
        if ended:
            out[f"rollout/end_turn/{cause}"] = sum(ended) / len(ended)
    return out


def buffer_metrics(buffer: ReadyBuffer, groups_since: int = 0) -> dict[str, float]:
    """``buffer/*``: trajectories waiting, drops since the start of the run by cause (too stale,
    failed, no action token; failed ones also per reason, ``buffer/dropped_failed/<reason>``), and
    the mean group wait (first member finished -> last member finished) of the GRPO groups handed
    out since the ``groups_since``-th (GRPO groups only)."""
    b = buffer.stats
    out = {
        "buffer/waiting": float(len(buffer)),
        "buffer/dropped_stale": float(b.dropped_stale),
        "buffer/dropped_failed": float(sum(b.dropped_failed.values())),
        "buffer/dropped_no_actions": float(b.dropped_no_actions),
        "buffer/dropped_group": float(b.dropped_group),
        "buffer/kept_stale": float(b.kept_stale),
    }
    for reason, n in sorted(b.dropped_failed.items()):  # engine, environment, reward, task, ...
        out[f"buffer/dropped_failed/{reason.replace(' ', '_')}"] = float(n)
    if waits := b.group_waits_s[groups_since:]:
        out["buffer/group_wait_s"] = sum(waits) / len(waits)
    return out


class StepObserver:
    """Assembles one step's metrics; keeps the counters that rates are computed from."""

    def __init__(self, manager: RolloutManager, buffer: ReadyBuffer, num_engines: int):
        self.manager = manager
        self.buffer = buffer
        self.num_engines = max(num_engines, 1)
        self._last = self._counters()
        self._groups_seen = len(buffer.stats.group_waits_s)

    def _counters(self) -> tuple[float, int, int, float, float]:
        m = self.manager
        return (
            time.monotonic(),
            m.stats.finished,
            m.stats.generated_tokens,
            m.busy_seconds(),
            m.generating_seconds(),
        )

    def step(self, o: StepOutcome, waited_s: float, in_flight: int, taken_at: float) -> dict[str, float]:
        """``waited_s``: how long the learner waited for this batch; ``taken_at``: when it got it
        (``time.time()``)."""
        lag = algo.policy_lag(o.trained_from, o.batch.policy_versions, o.batch.action_mask)
        out = learner_metrics(o) | batch_metrics(o.trajectories, lag, o.batch.action_mask, taken_at)
        out |= episode_metrics(o.trajectories)
        out |= buffer_metrics(self.buffer, self._groups_seen)
        self._groups_seen = len(self.buffer.stats.group_waits_s)
        out |= self.buffer.selection.metrics()  # finished and stale-dropped since the last step
        self.buffer.selection.window.clear()
        out |= self.manager.engines.metrics()  # engine restarts and drops, episode retries (cumulative)
        gateway = getattr(self.manager, "gateway", None)
        if gateway is not None:  # rollout.env=openai_agent: sessions admitted / finished / dropped, segments
            out |= gateway.metrics()
        out |= {
            "time/learner_wait_s": waited_s,
            "rollout/in_flight_at_take": float(in_flight),
            "policy_version": float(o.version),
        }
        now = self._counters()
        dt = max(now[0] - self._last[0], 1e-9)
        out["rollout/trajectories_per_s"] = (now[1] - self._last[1]) / dt
        out["rollout/tokens_per_s"] = (now[2] - self._last[2]) / dt
        out["time/interval_s"] = dt
        # occupancy: an episode in flight (tool calls and weight-update pauses included);
        # generating: a /generate call in flight outside pauses (a restarted engine's client starts at 0)
        out["rollout/engine_occupancy"] = (now[3] - self._last[3]) / (dt * self.num_engines)
        out["rollout/engine_generating"] = max(0.0, now[4] - self._last[4]) / (dt * self.num_engines)
        self._last = now
        return out
