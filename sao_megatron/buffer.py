"""The ready buffer: finished trajectories wait here until the learner takes a batch.

Admission bounds staleness: a trajectory whose oldest action token was generated more than
``max_policy_lag`` versions before the current policy is dropped (and counted); with ``over_lag=
"mask"`` only one whose newest action token is that old is dropped, and the actor masks the
too-old tokens of the others (counted as ``kept_stale``). Failed
episodes are dropped with their reason, and so are trajectories without a single action token
(e.g. a prompt already over the context budget: status ``truncated`` and nothing generated), which
carry no learning signal and would break GAE (``dropped_no_actions``). Batches:

- SAO (``group_size == 1``): the first ``batch_size`` admitted trajectories, each from a
  distinct prompt, in admission order (no barrier: whatever finished first trains first), or, with
  ``batch_order="start"``, the waiting ones that started first (long episodes before they go stale).
  Distinct means distinct ``prompt_id``: when the cursor wraps around a small dataset, a second
  rollout of a row already in the batch waits for a later batch.
- GRPO baselines (``group_size == G``): ``batch_size / G`` complete groups; a group is
  eligible once all G siblings are admitted, and the time its first finished member waited
  for the last one is recorded as *group wait*. Groups of a batch have distinct prompts too. A
  group with a dropped member (failed, no action token, too stale) can never be complete: its
  waiting siblings and every later one are dropped too (``dropped_group``), so no sibling waits
  forever for a member that will not come.

What is dropped is not a uniform sample of what finished (long episodes are the old ones):
:class:`Selection` keeps, per learner step, the finished and the stale-dropped trajectories' size
and reward, and over the run the stale-drop rate by response length.

The learner awaits :meth:`get` (no polling): admission wakes it once a batch is complete.
A trajectory is handed out at most once (checked). :meth:`state_dict` captures everything
needed to resume: waiting trajectories, incomplete groups and counters.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from sao_megatron import algo
from sao_megatron.algo.choices import BatchOrder, OverLag
from sao_megatron.records import Trajectory


@dataclass
class BufferStats:
    """Counters since the start of the run (checkpointed)."""

    admitted: int = 0
    handed_out: int = 0
    dropped_stale: int = 0
    dropped_failed: Counter = field(default_factory=Counter)
    group_waits_s: list[float] = field(default_factory=list)
    dropped_no_actions: int = 0
    dropped_group: int = 0
    """Siblings dropped because another member of their GRPO group was."""
    kept_stale: int = 0
    """Admitted past the lag bound (``over_lag="mask"``): the actor masks their too-old tokens."""


LENGTH_BINS = 4
"""Response length bins of :class:`Selection`: quarters of the response budget."""


@dataclass
class Selection:
    """What finished vs what the lag bound dropped. ``window``: since the learner's last step (it
    resets it), fate -> [count, response tokens, turns, reward] sums, fates ``finished`` (every
    trajectory that reached admission), ``dropped_stale`` (at admission or while waiting) and
    ``kept_stale`` (admitted past the bound, ``over_lag="mask"``).
    ``by_length`` (checkpointed): since the start of the run, per quarter of ``response_budget``
    tokens, [finished, dropped as stale]."""

    response_budget: int
    window: dict[str, list[float]] = field(default_factory=dict)
    by_length: list[list[int]] = field(default_factory=lambda: [[0, 0] for _ in range(LENGTH_BINS)])

    def bin(self, t: Trajectory) -> int:
        return min(LENGTH_BINS - 1, LENGTH_BINS * len(t.response_ids) // max(1, self.response_budget))

    def add(self, fate: str, t: Trajectory) -> None:
        sums = self.window.setdefault(fate, [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((1, len(t.response_ids), t.num_turns, t.reward)):
            sums[i] += v
        if fate in ("finished", "dropped_stale"):
            self.by_length[self.bin(t)][fate == "dropped_stale"] += 1

    def metrics(self) -> dict[str, float]:
        """``select/<fate>/{n,response_tokens,turns,reward}`` of the window (means; absent when none),
        ``select/drop_rate/len<k>`` (stale drops / finished in length quarter k, whole run)."""
        out: dict[str, float] = {}
        for fate in ("finished", "dropped_stale", "kept_stale"):
            n, tokens, turns, reward = self.window.get(fate, [0.0] * 4)
            out[f"select/{fate}/n"] = n
            if n:
                out |= {f"select/{fate}/response_tokens": tokens / n, f"select/{fate}/turns": turns / n}
                out[f"select/{fate}/reward"] = reward / n
        for k, (finished, dropped) in enumerate(self.by_length):
            if finished:
                out[f"select/drop_rate/len{k}"] = dropped / finished
        return out


class ReadyBuffer:
    def __init__(
        self,
        batch_size: int,
        group_size: int = 1,
        max_policy_lag: int | None = None,
        response_budget: int = 1,
        over_lag: OverLag = "drop",
        batch_order: BatchOrder = "finish",
    ):
        """``max_policy_lag`` None: no staleness bound. ``response_budget``: the response token limit
        (``rollout.loop.max_response_tokens``), for :class:`Selection`'s length bins. ``over_lag``:
        ``drop`` a trajectory past the bound, or ``mask`` (drop only when every action token is).
        ``batch_order``: take waiting groups in the order they ``finish``ed or ``start``ed."""
        if batch_size < 1 or group_size < 1 or batch_size % group_size:
            raise ValueError(f"batch_size={batch_size} must be a positive multiple of group_size={group_size}")
        if max_policy_lag is not None and max_policy_lag < 0:
            raise ValueError(f"max_policy_lag={max_policy_lag} must be >= 0 or None (unbounded)")
        self.batch_size = batch_size
        self.group_size = group_size
        self.max_policy_lag = max_policy_lag
        self.over_lag = over_lag
        self.batch_order = batch_order
        self.stats = BufferStats()
        self.selection = Selection(response_budget)
        self._groups: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self._group_first_finish: dict[str, float] = {}
        self._handed: set[tuple[str, str, int]] = set()
        self._broken: dict[str, int] = {}
        """GRPO groups with a dropped member -> members accounted for so far (forgotten at G)."""
        self._admitted = asyncio.Event()

    @staticmethod
    def key(t: Trajectory) -> tuple[str, str, int]:
        """Identity of one rollout: (group or prompt, prompt id, position in group)."""
        return (t.group_id or t.prompt_id, t.prompt_id, int(t.reward_details.get("group_index", 0)))

    def lag(self, t: Trajectory, current_version: int, newest: bool = False) -> int:
        """Versions between the oldest (``newest``: the newest) action token and the current policy
        (:func:`algo.policy_lag`)."""
        versions, mask = torch.tensor([t.policy_versions]), torch.tensor([t.action_mask])  # [1, T]
        token_lag = algo.policy_lag(current_version, versions, mask)[mask > 0]
        if not token_lag.numel():
            return 0
        return int(token_lag.min() if newest else token_lag.max())

    def _too_stale(self, t: Trajectory, current_version: int) -> bool:
        """Past the bound: by its oldest action token (``drop``) or its newest (``mask``)."""
        bound = self.max_policy_lag
        return bound is not None and self.lag(t, current_version, newest=self.over_lag == "mask") > bound

    def admit(self, t: Trajectory, current_version: int) -> bool:
        """Add a finished trajectory; False when it is dropped (failed, no action token, too stale,
        or a sibling of a dropped GRPO group member)."""
        group = t.group_id or t.prompt_id
        self.selection.add("finished", t)
        if group in self._broken:
            self.stats.dropped_group += 1
            self._account(group, 1)
            return False
        if t.status == "failed":
            self.stats.dropped_failed[t.status_reason.split(":")[0] or "unknown"] += 1
            return self._break(group)
        if not any(t.action_mask):
            self.stats.dropped_no_actions += 1
            return self._break(group)
        if self._too_stale(t, current_version):
            self.stats.dropped_stale += 1
            self.selection.add("dropped_stale", t)
            return self._break(group)
        if self.max_policy_lag is not None and self.lag(t, current_version) > self.max_policy_lag:
            self.stats.kept_stale += 1  # mask: its newer tokens train
            self.selection.add("kept_stale", t)
        if self.key(t) in self._handed:
            raise ValueError(f"trajectory {self.key(t)} was already handed to the learner")
        self._groups.setdefault(group, []).append(t)
        self._group_first_finish.setdefault(group, t.finished_at or time.time())
        self.stats.admitted += 1
        self._admitted.set()
        return True

    def _break(self, group: str, dropped: int = 1) -> bool:
        """``dropped`` members of ``group`` were dropped: in GRPO mode its waiting siblings go too,
        and later ones on arrival. Returns False (the admission's answer)."""
        if self.group_size > 1:
            siblings = self._groups.pop(group, [])
            self._group_first_finish.pop(group, None)
            self.stats.dropped_group += len(siblings)
            self._account(group, dropped + len(siblings))
        return False

    def _account(self, group: str, n: int) -> None:
        seen = self._broken.get(group, 0) + n
        if seen >= self.group_size:
            self._broken.pop(group, None)  # every member accounted for: forget the group
        else:
            self._broken[group] = seen

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def _batch_groups(self) -> list[str]:
        """The next batch's groups: the first complete ones (admission or start order), one per prompt
        (a repeat of a prompt already chosen waits), at most ``batch_size / group_size``."""
        needed, chosen, prompts = self.batch_size // self.group_size, [], set()
        groups = list(self._groups.items())
        if self.batch_order == "start":  # stable: admission order among equals
            groups.sort(key=lambda item: min(t.started_at for t in item[1]))
        for group, members in groups:
            if len(members) >= self.group_size and members[0].prompt_id not in prompts:
                chosen.append(group)
                prompts.add(members[0].prompt_id)
                if len(chosen) == needed:
                    break
        return chosen

    def ready(self) -> bool:
        return len(self._batch_groups()) * self.group_size >= self.batch_size

    def take(self) -> list[Trajectory] | None:
        """The next batch, or None when not enough complete groups of distinct prompts are waiting."""
        chosen = self._batch_groups()
        if len(chosen) * self.group_size < self.batch_size:
            return None
        batch: list[Trajectory] = []
        for group in chosen:
            members = self._groups.pop(group)[: self.group_size]
            first = self._group_first_finish.pop(group)
            if self.group_size > 1:
                self.stats.group_waits_s.append(max(m.finished_at for m in members) - first)
            batch.extend(members)
        for t in batch:
            k = self.key(t)
            if k in self._handed:
                raise AssertionError(f"trajectory {k} handed out twice")
            self._handed.add(k)
        self.stats.handed_out += len(batch)
        return batch

    def put_back(self, batch: list[Trajectory]) -> None:
        """Undo :meth:`take` for a batch that was never trained (a stop arrived in between)."""
        groups: OrderedDict[str, list[Trajectory]] = OrderedDict()
        for t in batch:
            self._handed.discard(self.key(t))
            groups.setdefault(t.group_id or t.prompt_id, []).append(t)
            self._group_first_finish.setdefault(t.group_id or t.prompt_id, t.finished_at)
        for group, members in self._groups.items():
            groups.setdefault(group, []).extend(members)
        self._groups = groups
        self.stats.handed_out -= len(batch)

    async def get(self) -> list[Trajectory]:
        """The next batch, as soon as enough complete groups are waiting."""
        while (batch := self.take()) is None:
            self._admitted.clear()
            await self._admitted.wait()
        return batch

    def discard_stale(self, current_version: int) -> int:
        """Drop waiting trajectories that became too stale while they waited; returns how many."""
        if self.max_policy_lag is None:
            return 0
        dropped = 0
        for group in list(self._groups):
            keep = []
            for t in self._groups[group]:
                if not self._too_stale(t, current_version):
                    keep.append(t)
                else:
                    self.selection.add("dropped_stale", t)
            stale = len(self._groups[group]) - len(keep)
            dropped += stale
            if keep and not (stale and self.group_size > 1):
                self._groups[group] = keep
            elif keep:  # GRPO: the group lost members, its siblings go too
                self._groups[group] = keep
                self._break(group, dropped=stale)
            else:
                del self._groups[group]
                self._group_first_finish.pop(group, None)
                if self.group_size > 1:
                    self._account(group, stale)
        self.stats.dropped_stale += dropped
        return dropped

    def waiting(self) -> list[Trajectory]:
        return [t for members in self._groups.values() for t in members]

    def state_dict(self) -> dict:
        return {
            "waiting": [t.to_dict() for t in self.waiting()],
            "first_finish": dict(self._group_first_finish),
            "handed": sorted(list(k) for k in self._handed),
            "stats": {
                "admitted": self.stats.admitted,
                "handed_out": self.stats.handed_out,
                "dropped_stale": self.stats.dropped_stale,
                "dropped_failed": dict(self.stats.dropped_failed),
                "group_waits_s": list(self.stats.group_waits_s),
                "dropped_no_actions": self.stats.dropped_no_actions,
                "dropped_group": self.stats.dropped_group,
                "kept_stale": self.stats.kept_stale,
            },
            "broken": dict(self._broken),
            "drops_by_length": [list(b) for b in self.selection.by_length],
        }

    def load_state_dict(self, state: dict) -> None:
        self._groups.clear()
        for data in state["waiting"]:
            t = Trajectory.from_dict(data)
            self._groups.setdefault(t.group_id or t.prompt_id, []).append(t)
        self._group_first_finish = dict(state["first_finish"])
        self._handed = {tuple(k) for k in state["handed"]}
        s = state["stats"]
        self.stats = BufferStats(
            s["admitted"],
            s["handed_out"],
            s["dropped_stale"],
            Counter(s["dropped_failed"]),
            list(s["group_waits_s"]),
            s.get("dropped_no_actions", 0),
            s.get("dropped_group", 0),
            s.get("kept_stale", 0),
        )
        self._broken = dict(state.get("broken", {}))
        if "drops_by_length" in state:  # checkpoints from before it have none: counts start there
            self.selection.by_length = [list(b) for b in state["drops_by_length"]]
