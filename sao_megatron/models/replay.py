"""Rollout routing replay on the actor's Megatron routers (``rollout.routing_replay``).

Each MoE router of this rank's model gets a :class:`ReplaySlot`, a Megatron ``RouterReplay`` (the hook
``topk_routing_with_score_function`` calls for the top-k choice). Before every forward of a
micro-batch, :meth:`RoutingReplay.feed` hands each slot the engine's top-k ids of the tokens its
router will see; the slot then

* computes the router's own top-k (Megatron's RECORD: the trainer's choice in the same forward) and
  counts, per MoE layer, the tokens whose top-k *set* equals the engine's (route agreement);
* under ``on``, returns the engine's ids, with the scores gathered at them (the router's probabilities
  are still computed from its logits at those ids, so its gradients flow); tokens without known routes
  (padding, missing positions) keep the router's own choice and are counted as fallbacks; so do tokens
  whose given ids name an expert twice or one outside the model (Megatron's dispatcher fails inside the
  step on them; the rollout already records such rows as missing, ``routing.RouteShape.decode``, so
  these come only from routes stored otherwise, e.g. a checkpoint written before that check), counted
  apart (``routing/invalid``).

Which tokens a router sees: the micro-batch's ``[b, t]`` (this context-parallel rank's share), sequence
first as Megatron's hidden states ``[t, b, h]`` are, and under sequence parallelism only this
tensor-parallel rank's ``t / tp`` chunk; a pipeline stage holds only its own layers (each slot knows its
global MoE-layer index from the router's ``layer_number``). Expert parallelism dispatches after the
router, so it changes nothing here.

Activation recompute that runs a router again during the backward (full recompute,
``recompute_activations``; or selective recompute with ``moe`` among Megatron's ``recompute_modules``,
which checkpoints the whole MoE layer, router included): the pipeline schedules run backwards in
forward order, so each slot keeps a first-in-first-out queue of the targets of micro-batches whose
backward is still to come, and a call that is not the forward :meth:`feed` prepared is a recompute
(Megatron's REPLAY_BACKWARD; its own action flag would have to be flipped around every backward).
Whether to queue is read from the built model's ``TransformerConfig`` (:func:`reruns_routers`), not
from our settings, so a recompute module list that gains ``moe`` still replays its recompute.

Megatron's fused top-k (``moe_router_fusion``, TE >= 2.7) bypasses the hook, so a replaying model is
built without it (``builder.transformer_config``). The critic never replays: it is a separate network
whose router trains on its own objective.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from sao_megatron.batch import MicroBatch


class ReplaySlot(RouterReplay):
    """One router's replay state (installed as ``router.router_replay``)."""

    def __init__(self, moe_index: int, replay: bool, recompute: bool):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # ours are held by RoutingReplay alone
        self.moe_index = moe_index
        self.replay = replay
        self.recompute = recompute
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """The next forward's ``(ids [n, k] int64, known [n] bool, lag0 [n] bool)``."""
        self.queue: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        """Targets of forwards whose recompute (in the backward) is still to come."""
        self.counts: torch.Tensor | None = None
        """``[tokens with known routes, of which the router's own top-k set agrees with them; the same for
        the tokens that predict a lag-0 action token (see :meth:`RoutingReplay.feed`); tokens with known
        routes whose experts used (replayed or the router's) are the engine's; tokens given as known whose
        ids are unfit (a repeated expert or one outside the model), routed by the router and not counted
        as known]``, on the router's device (no host sync per layer; :meth:`RoutingReplay.take_counts`
        moves them)."""

    def prepare(self, ids: torch.Tensor, known: torch.Tensor, lag0: torch.Tensor, training: bool) -> None:
        self.pending = (ids, known, lag0)
        if self.recompute and training:
            self.queue.append((ids, known))

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None  # Megatron always passes its own top-k
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        lag0 = None
        if self.pending is not None:
            ids, known, lag0 = self.pending
            self.pending = None
        elif self.queue:  # a recompute in the backward
            ids, known = self.queue.popleft()
        else:  # a forward nothing was fed for (no routes)
            return own_scores, own
        if ids.shape[0] != own.shape[0]:
            raise RuntimeError(
                f"routing replay: MoE layer {self.moe_index} routes {own.shape[0]} tokens but was given routes "
                f"for {ids.shape[0]}; the micro-batch and the model disagree on the tokens this rank holds"
            )
        ids, known = ids.to(own.device), known.to(own.device)
        ordered = ids.sort(dim=1).values
        fit = (ordered[:, 0] >= 0) & (ordered[:, -1] < scores.shape[1]) & (ordered[:, 1:] != ordered[:, :-1]).all(1)
        unfit = known & ~fit
        known = known & fit
        chosen = torch.where(known[:, None], ids, own) if self.replay else own
        if lag0 is not None:  # the forward (not a recompute): count agreement once
            with torch.no_grad():
                same = (own.sort(dim=1).values == ordered).all(dim=1) & known
                used = (chosen.sort(dim=1).values == ordered).all(dim=1) & known
                lag0 = lag0.to(own.device) & known
                parts = torch.stack([known.sum(), same.sum(), lag0.sum(), (same & lag0).sum(), used.sum(), unfit.sum()])
                self.counts = parts.double() if self.counts is None else self.counts + parts
        if not self.replay:
            return own_scores, own
        return scores.gather(1, chosen), chosen


def reruns_routers(config) -> bool:
    """Whether a model built with Megatron ``config`` (its ``TransformerConfig``) runs its routers again
    in the backward: full recompute, or selective recompute of the whole MoE layer (``moe``; Megatron's
    ``moe_layer_recompute`` adds it too). ``moe_act`` recomputes only the experts' activation."""
    granularity = getattr(config, "recompute_granularity", None)
    modules = getattr(config, "recompute_modules", None) or ()
    return granularity == "full" or (granularity == "selective" and "moe" in modules)


class RoutingReplay:
    """The slots of one model (this rank's pipeline stage) and what feeds them."""

    def __init__(self, model: torch.nn.Module, moe_layers: list[int], replay: bool):
        """``moe_layers``: the model's MoE layer indices (0-based over all decoder layers), in order;
        ``replay``: route by the engine's ids (else only measure agreement)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        index = {layer: i for i, layer in enumerate(moe_layers)}
        recompute = reruns_routers(model.config)
        self.num_moe_layers = len(moe_layers)
        self.slots: list[ReplaySlot] = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                assert module.layer_number is not None  # set by its TransformerLayer when built
                slot = ReplaySlot(index[module.layer_number - 1], replay, recompute)
                module.router_replay = slot
                self.slots.append(slot)
        self.sequence_parallel = bool(getattr(model.config, "sequence_parallel", False))
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()

    def feed(self, micro: MicroBatch, training: bool) -> None:
        """Prepare every slot for the forward of ``micro`` (its ``routes`` ``[b, t, moe layers, k]``;
        nothing without them: the routers route by themselves)."""
        if micro.routes is None or micro.route_mask is None:
            return
        # lag 0: the position predicts an action token sampled at the weights being trained (the update
        # passes ``lag``); its routes were computed in that same engine forward.
        lag0 = (
            (micro.action_mask > 0) & (micro.lag == 0) if micro.lag is not None else torch.zeros_like(micro.route_mask)
        )
        per_token = [micro.route_mask.bool(), lag0.bool()]  # [b, t] each
        routes = micro.routes.transpose(0, 1)  # [t, b, L, k]: Megatron's sequence-first token order
        per_token = [m.transpose(0, 1) for m in per_token]
        if self.sequence_parallel and self.tp_size > 1:
            chunk = slice(
                self.tp_rank * routes.shape[0] // self.tp_size, (self.tp_rank + 1) * routes.shape[0] // self.tp_size
            )
            routes, per_token = routes[chunk], [m[chunk] for m in per_token]
        tokens = routes.shape[0] * routes.shape[1]
        routes = routes.reshape(tokens, *routes.shape[2:])
        known, lag0 = (m.reshape(tokens) for m in per_token)
        for slot in self.slots:
            slot.prepare(routes[:, slot.moe_index].long(), known, lag0, training)

    def set_replay(self, replay: bool) -> None:
        """Route by the engine's ids (``on``) or only count agreement (``record``) from the next forward."""
        for slot in self.slots:
            slot.replay = replay

    def take_counts(self) -> torch.Tensor:
        """``[moe layers, 6]`` this rank's counts since the last call (see :attr:`ReplaySlot.counts`),
        then reset; a leftover target (a forward that never ran) is dropped."""
        out = torch.zeros(self.num_moe_layers, 6, dtype=torch.float64)
        for slot in self.slots:
            if slot.counts is not None:
                out[slot.moe_index] += slot.counts.cpu()
            slot.counts = None
            slot.pending = None
            slot.queue.clear()
        return out


def routing_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Metrics from :meth:`RoutingReplay.take_counts` summed over the role's world (a layer's counts come
    from the ranks that hold its tokens; ranks holding the same tokens scale both counts alike):
    ``routing/agreement`` the share of tokens with engine routes whose router top-k set equals the
    engine's, ``routing/replayed`` the share whose experts used are the engine's (1 under replay: the
    hook took effect; the agreement without it), ``routing/agreement/lag0`` the same over the positions predicting lag-0 action tokens
    (same weights in engine and trainer), per MoE layer ``routing/agreement/lag0/layer{i}``, and
    ``routing/invalid`` the share of tokens given with routes whose ids were unfit to replay (a repeated
    expert or one outside the model; the router routed them), only when there were any."""
    out: dict[str, float] = {}
    total = counts.sum(0)
    if total[0] > 0:
        out["routing/agreement"] = float(total[1] / total[0])
        out["routing/replayed"] = float(total[4] / total[0])
    if total[5] > 0:
        out["routing/invalid"] = float(total[5] / (total[0] + total[5]))
    if total[2] > 0:
        out["routing/agreement/lag0"] = float(total[3] / total[2])
        for i, (_, _, n, same, _, _) in enumerate(counts.tolist()):
            if n > 0:
                out[f"routing/agreement/lag0/layer{i}"] = same / n
    return out
