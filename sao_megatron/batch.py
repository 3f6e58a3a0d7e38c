"""Trajectories -> padded training tensors, aligned on the positions that predict each token.

A sequence is ``prompt_ids + response_ids`` (length L). The model's output at position p
(logits, or the critic's value) is computed from tokens ``0..p`` and predicts token ``p + 1``.
Everything per action token therefore lives at position ``p = len(prompt) + j - 1`` for
response token j: its label, behavior logprob, version, value V(s) and advantage. Rows are
right-padded to the longest sequence in the batch; ``action_mask`` is 0 on prompt,
observation and padding positions.

The driver builds one :class:`TrainBatch` per learner step and splits it into one
:class:`BatchShard` per data-parallel replica of a role, balanced by token count
(:func:`balanced_split`). A shard carries the whole batch's token and sequence counts, so every
replica normalises its loss by the *global* batch. Each rank then cuts its shard into
micro-batches (:class:`MicroBatch`, cut as :class:`MicroBatching` says): rows padded to the
micro-batch's longest, or packed into one row with per-sequence segments, under a row count or
a token budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypedDict, Unpack

import torch

from sao_megatron.records import Trajectory


@dataclass
class TrainBatch:
    """``[B, T]`` tensors for B trajectories (T = longest sequence)."""

    tokens: torch.Tensor  # [B, T] int64 input ids (0-padded)
    positions: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T] token predicted at each position (tokens shifted left)
    action_mask: torch.Tensor  # [B, T] float 1 where the label is a model-generated token
    behavior_logprobs: torch.Tensor  # [B, T]
    policy_versions: torch.Tensor  # [B, T] int64, -1 off actions
    rewards: torch.Tensor  # [B] scalar episode reward
    lengths: torch.Tensor  # [B] sequence length L
    routes: torch.Tensor | None = None
    """Routing replay: ``[B, T, moe layers, top-k]`` uint8/int16 expert ids the engine chose for the
    token at each position (``records.Trajectory.routes``); None when not captured."""
    route_mask: torch.Tensor | None = None
    """``[B, T]`` bool, True where ``routes`` holds the engine's routes (False: padding, missing positions)."""

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def value_mask(self) -> torch.Tensor:
        """``[B, T]`` float 1 where the critic's values are read: the action positions and each row's
        last position ``L - 1`` (the state after the sequence's end, where a truncated episode
        bootstraps from, ``algo.truncated``)."""
        mask = self.action_mask.clone()
        mask[torch.arange(self.size), self.lengths - 1] = 1.0
        return mask

    def select(self, rows: slice | list[int]) -> TrainBatch:
        fields: dict = {k: None if v is None else v[rows] for k, v in self.__dict__.items()}
        return TrainBatch(**fields)

    def shard(self, dp_size: int) -> list[BatchShard]:
        """One shard per data-parallel replica, balanced by tokens (:func:`balanced_split`)."""
        if not 1 <= dp_size <= self.size:
            raise ValueError(
                f"cannot split a batch of {self.size} trajectories over {dp_size} DP replicas; "
                f"make algo.batch_size a multiple of the data-parallel size"
            )
        tokens, seqs = float(self.action_mask.sum()), float((self.action_mask.sum(-1) > 0).sum())
        groups = balanced_split(self.lengths.tolist(), dp_size)
        return [BatchShard(self.select(rows), rows, tokens, seqs) for rows in groups]

    def micro_batch(self, rows: list[int], how: MicroBatching, **extras: Unpack[RowExtras]) -> MicroBatch:
        """The model inputs and loss tensors of ``rows`` (this batch's indices) as one micro-batch.

        Padded (``how.pack`` off): ``[len(rows), t]`` with t the longest row rounded up to
        ``how.multiple``. Packed: ``[1, t]``, the rows one after the other, each padded to
        ``how.segment_multiple``, the total to ``how.multiple``; ``spans`` holds each row's
        (offset, length), ``segment_ids`` / ``cu_seqlens`` the segments (trailing padding is a
        segment of its own). No rows (a filler micro-batch, see :func:`spread`): one padding row.

        Padding positions are exact no-ops for the loss: ``action_mask`` 0, labels and tokens 0,
        ``policy_versions`` -1; positions continue their segment's ``arange``. Attention is
        causal (and block-diagonal over packed segments), so padding after a token never changes
        its outputs. ``extras`` (``[B, T]`` each, :class:`RowExtras`) are cut the same way."""
        if how.pack:
            return self._packed(rows, how, extras)
        t = padded_length(int(self.lengths[rows].max()), how.multiple) if rows else how.multiple

        def cut(v: torch.Tensor, fill: int) -> torch.Tensor:
            return pad_columns(v[rows], t, fill) if rows else torch.full((1, t, *v.shape[2:]), fill, dtype=v.dtype)

        positions = torch.arange(t).expand(max(len(rows), 1), t).contiguous()
        return self._cut(cut, extras, positions, list(rows))

    def _packed(self, rows: list[int], how: MicroBatching, extras: RowExtras) -> MicroBatch:
        spans, bounds = [], [0]
        for r in rows:
            spans.append((bounds[-1], int(self.lengths[r])))
            bounds.append(bounds[-1] + padded_length(int(self.lengths[r]), how.segment_multiple))
        t = padded_length(max(bounds[-1], 1), how.multiple)
        if t > bounds[-1]:
            bounds.append(t)  # trailing padding: a segment of its own

        def cut(v: torch.Tensor, fill: int) -> torch.Tensor:
            out = torch.full((1, t, *v.shape[2:]), fill, dtype=v.dtype)
            for r, (offset, n) in zip(rows, spans, strict=True):
                out[0, offset : offset + n] = v[r, :n]
            return out

        cu = torch.tensor(bounds, dtype=torch.int32)
        sizes = (cu[1:] - cu[:-1]).long()
        positions = (torch.arange(t) - torch.repeat_interleave(cu[:-1].long(), sizes)).unsqueeze(0)
        return replace(
            self._cut(cut, extras, positions, list(rows)),
            spans=spans,
            segment_ids=torch.repeat_interleave(torch.arange(len(sizes)), sizes).unsqueeze(0),
            cu_seqlens=cu,
        )

    def _cut(
        self,
        cut: Callable[[torch.Tensor, int], torch.Tensor],
        extras: RowExtras,
        positions: torch.Tensor,
        rows: list[int],
    ) -> MicroBatch:
        """A micro-batch of every ``[B, T]`` field passed through ``cut(field, padding fill)``."""

        def extra(v: torch.Tensor | None) -> torch.Tensor | None:
            return None if v is None else cut(v, 0)

        return MicroBatch(
            tokens=cut(self.tokens, 0),
            positions=positions,
            labels=cut(self.labels, 0),
            action_mask=cut(self.action_mask, 0),
            behavior_logprobs=cut(self.behavior_logprobs, 0),
            policy_versions=cut(self.policy_versions, -1),
            rows=rows,
            advantages=extra(extras.get("advantages")),
            lag=extra(extras.get("lag")),
            returns=extra(extras.get("returns")),
            old_values=extra(extras.get("old_values")),
            routes=extra(self.routes),
            route_mask=extra(self.route_mask),
        )


class RowExtras(TypedDict, total=False):
    """Per-role ``[B, T]`` tensors of a shard's rows, cut into micro-batches with the batch's own
    (:meth:`TrainBatch.micro_batch`); each becomes the :class:`MicroBatch` field of its name."""

    advantages: torch.Tensor
    lag: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a shard (:meth:`TrainBatch.micro_batch`): the model's inputs and the
    loss's tensors, aligned as in :class:`TrainBatch` (position p predicts token p + 1).

    Padded: ``[b, t]`` for b of the shard's rows, t their longest length rounded up to the
    layout's multiple. Packed: ``[1, t]``, the rows end to end (``spans``, ``segment_ids`` and
    ``cu_seqlens`` set). Under context parallelism each rank holds ``t / cp`` positions of every
    sequence (``workers.micro.split_context``; ``cp_lengths`` set). The role extras are set only
    where the role's step passed them (:class:`RowExtras`)."""

    tokens: torch.Tensor  # [b, t] int64 input ids, 0 on padding
    positions: torch.Tensor  # [b, t] int64 position ids, restarting at each packed segment
    labels: torch.Tensor  # [b, t] int64 token predicted at each position, 0 on padding
    action_mask: torch.Tensor  # [b, t] float 1 where the label is a model-generated token
    behavior_logprobs: torch.Tensor  # [b, t] float the engine's logprob of each label, 0 off actions
    policy_versions: torch.Tensor  # [b, t] int64 weight version that sampled each label, -1 off actions
    rows: list[int]
    """The shard's row indices held, in order (empty for a filler micro-batch)."""
    advantages: torch.Tensor | None = None  # [b, t] float; the actor's update
    lag: torch.Tensor | None = None  # [b, t] int64 policy lag per action token; the actor's update
    returns: torch.Tensor | None = None  # [b, t] float value targets; the critic's update
    old_values: torch.Tensor | None = None  # [b, t] float V(s) before the update; the critic's update
    routes: torch.Tensor | None = None  # [b, t, moe layers, top-k] uint8/int16 engine routes; routing replay
    route_mask: torch.Tensor | None = None  # [b, t] bool, True where ``routes`` is known
    spans: list[tuple[int, int]] | None = None
    """Packed: (offset, length) of each row in the packed row."""
    segment_ids: torch.Tensor | None = None  # packed: [1, t] int64 segment of each position
    cu_seqlens: torch.Tensor | None = None  # packed: [segments + 1] int32 segment bounds, whole under CP
    cp_lengths: list[int] | None = None
    """Context parallel: the (padded) sequence lengths the split cut (``workers.micro.full_sequence``)."""

    @classmethod
    def of_tokens(cls, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> MicroBatch:
        """Padded rows of model inputs only, for checks and tests that bring their own loss:
        every position an action whose label is the next token (the last wraps round to the
        first), behaviour logprobs 0, versions 0; ``positions`` default to each row's arange."""
        b, t = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t).contiguous()
        return cls(
            tokens=tokens,
            positions=positions,
            labels=torch.roll(tokens, -1, 1),
            action_mask=torch.ones(b, t, device=tokens.device),
            behavior_logprobs=torch.zeros(b, t, device=tokens.device),
            policy_versions=torch.zeros(b, t, dtype=torch.long, device=tokens.device),
            rows=list(range(b)),
        )


def balanced_split(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices in ``parts`` groups of near-equal total length, each in ascending order.

    Longest row first, each to the group with the fewest tokens so far (then the fewest rows):
    every group gets at least one row when ``len(lengths) >= parts``."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(parts), key=lambda g: (load[g], len(groups[g]), g))
        groups[g].append(i)
        load[g] += lengths[i]
    return [sorted(g) for g in groups]


@dataclass(frozen=True)
class MicroBatching:
    """How a rank cuts its shard into micro-batches (see :meth:`TrainBatch.micro_batch`)."""

    rows: int = 1
    """Rows per micro-batch without a token budget."""
    max_tokens: int = 0
    """Token budget per micro-batch, padding included (0: ``rows`` rows each instead)."""
    multiple: int = 1
    """What each micro-batch's length must divide by (``workers.micro.seq_multiple``)."""
    segment_multiple: int = 1
    """What each packed sequence's length must divide by (2 * CP under context parallelism)."""
    pack: bool = False
    """Pack the rows of a micro-batch into one row."""

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens a micro-batch of sequences of ``lengths`` computes, padding included."""
        if self.pack:
            return padded_length(sum(padded_length(n, self.segment_multiple) for n in lengths), self.multiple)
        return len(lengths) * padded_length(max(lengths), self.multiple)

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Row indices of each micro-batch: consecutive runs of ``rows`` rows, or under a token
        budget the longest rows first, each into the first micro-batch it fits (a row longer
        than the budget gets its own)."""
        n = len(lengths)
        if not self.max_tokens:
            return [list(range(s, min(s + self.rows, n))) for s in range(0, n, self.rows)]
        bins: list[list[int]] = []
        for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
            fit = next(
                (b for b in bins if self.cost([lengths[j] for j in b] + [lengths[i]]) <= self.max_tokens),
                None,
            )
            if fit is None:
                bins.append([i])
            else:
                fit.append(i)
        return [sorted(b) for b in bins]

    def padding_fraction(self, lengths: Sequence[int]) -> float:
        """Share of the computed tokens that are padding when ``lengths`` are cut by :meth:`plan`."""
        computed = sum(self.cost([lengths[i] for i in b]) for b in self.plan(lengths))
        return 1.0 - sum(lengths) / computed if computed else 0.0


def spread(plan: list[list[int]], count: int) -> list[list[int]]:
    """``plan`` grown to ``count`` micro-batches (every rank of an expert-parallel or pipeline
    world must run the same number): the largest micro-batch is halved until there are enough,
    then empty ones (filler micro-batches of padding) are added."""
    plan = [list(b) for b in plan]
    while len(plan) < count:
        k = max(range(len(plan)), key=lambda k: len(plan[k]))
        if len(plan[k]) < 2:
            plan.append([])
            continue
        half = len(plan[k]) // 2
        plan[k : k + 1] = [plan[k][:half], plan[k][half:]]
    return plan


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def pad_columns(v: torch.Tensor, t: int, fill: float = 0) -> torch.Tensor:
    """``v`` ``[B, T', ...]`` trimmed or right-padded with ``fill`` to ``[B, t, ...]``."""
    if v.shape[1] >= t:
        return v[:, :t]
    pad = torch.full((v.shape[0], t - v.shape[1], *v.shape[2:]), fill, dtype=v.dtype, device=v.device)
    return torch.cat([v, pad], dim=1)


def build_batch(trajectories: list[Trajectory]) -> TrainBatch:
    if not trajectories:
        raise ValueError("build_batch needs at least one trajectory")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    b, width = len(trajectories), max(lengths)
    tokens = torch.zeros(b, width, dtype=torch.long)
    labels = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width)
    behavior = torch.zeros(b, width)
    versions = torch.full((b, width), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        if not t.prompt_ids:
            raise ValueError(f"trajectory {t.prompt_id} has an empty prompt")
        seq = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        n, p = len(seq), len(t.prompt_ids) - 1  # first response token is predicted at position p
        tokens[i, :n] = seq
        labels[i, : n - 1] = seq[1:]
        r = len(t.response_ids)
        mask[i, p : p + r] = torch.tensor(t.action_mask, dtype=torch.float32)
        behavior[i, p : p + r] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
        versions[i, p : p + r] = torch.tensor(t.policy_versions, dtype=torch.long)
    positions = torch.arange(width).unsqueeze(0).expand(b, width).contiguous()
    return TrainBatch(
        tokens,
        positions,
        labels,
        mask,
        behavior,
        versions,
        torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        torch.tensor(lengths, dtype=torch.long),
        *_routes(trajectories, width),
    )


def _routes(trajectories: list[Trajectory], width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``routes`` ``[B, T, moe layers, top-k]`` and ``route_mask`` ``[B, T]`` of the trajectories that
    carry routes (the others' rows: mask 0), or (None, None) when none does."""
    shaped = [t.routes for t in trajectories if t.routes is not None]
    if not shaped:
        return None, None
    first = shaped[0]
    routes = torch.zeros(len(trajectories), width, *first.shape[1:], dtype=torch.from_numpy(first[:0]).dtype)
    known = torch.zeros(len(trajectories), width, dtype=torch.bool)
    for i, t in enumerate(trajectories):
        if t.routes is None:
            continue
        if t.routes.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"trajectory {t.prompt_id}: routes of shape {t.routes.shape[1:]}, others {first.shape[1:]}"
            )
        n = len(t.routes)
        routes[i, :n] = torch.from_numpy(t.routes)
        known[i, :n] = True
        for span in t.routes_missing:
            known[i, span.start : span.end] = False
    return routes, known


@dataclass
class BatchShard:
    """The rows of a :class:`TrainBatch` that one data-parallel replica trains on."""

    batch: TrainBatch
    """This replica's rows, ``[b, T]`` (T of the whole batch)."""
    rows: list[int]
    """Their indices in the whole batch (to put per-row outputs back in place)."""
    num_tokens_global: float
    """Action tokens of the whole batch (all replicas): the ``token_mean`` normaliser."""
    num_seqs_global: float
    """Trajectories with at least one action token in the whole batch: the ``seq_mean`` normaliser."""

    def take(self, per_row: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a whole-batch ``[B, ...]`` tensor (advantages, returns, values)."""
        return per_row[self.rows]


@dataclass
class RowOutputs:
    """Per-position outputs (logprobs, values) of some rows, returned by one rank."""

    rows: list[int]
    values: torch.Tensor  # [len(rows), t] with t <= T


def assemble_rows(parts: Sequence[RowOutputs | None], size: int, width: int) -> torch.Tensor:
    """``[size, width]`` from the row outputs of the ranks that hold them (others give None)."""
    out = torch.zeros(size, width)
    seen: set[int] = set()
    for part in parts:
        if part is None:
            continue
        out[part.rows, : part.values.shape[1]] = part.values.float()
        seen.update(part.rows)
    if len(seen) != size:
        raise RuntimeError(f"row outputs cover {len(seen)} of {size} rows; a data-parallel replica reported nothing")
    return out
