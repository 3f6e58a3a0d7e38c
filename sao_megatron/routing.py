"""Routes: the top-k experts an engine chose for every position of a trajectory, kept compactly.

With ``rollout.routing_replay`` on (or ``record``), every ``/generate`` asks SGLang for the routes of
the positions new to that request (``return_routed_experts``, ``routed_experts_start_len``). SGLang
answers ``meta_info.routed_experts``: base64 of int32 ``[positions, hidden layers, top-k]`` for
positions ``[start, prompt + output - 1)`` (the last sampled token is never run through the model),
read from a host buffer indexed by KV-cache slot, so a prefix-cache hit returns the routes computed
when that KV was computed. Only MoE layers are kept (DeepSeek-V3's leading dense layers have none).

Storage: ``[positions, moe layers, top-k]`` uint8 for up to 256 experts, int16 beyond
(:attr:`RouteShape.dtype`); one array per trajectory (``Trajectory.routes``) plus the spans of
positions whose routes are unknown (``Trajectory.routes_missing``: not returned, or a row naming an
expert twice or one outside the model, :meth:`RouteShape.decode`), which the actor's routers route
themselves. Bytes per token: MoE layers x top-k x width (:meth:`RouteShape.bytes_per_token`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RouteShape:
    """What a route row holds for one model."""

    hidden_layers: int
    """Decoder layers of the model (SGLang's rows have one entry per layer, dense ones included)."""
    moe_layers: tuple[int, ...]
    """Indices of the MoE layers among them, in order."""
    topk: int
    num_experts: int

    @classmethod
    def of(cls, m) -> RouteShape:
        """The shape of ``m`` (a :class:`~sao_megatron.config.model.ModelConfig`)."""
        if not m.num_experts:
            raise ValueError("a dense model has no routes")
        dense = set(m.dense_layers)
        moe = tuple(i for i in range(m.num_layers) if i not in dense and (i + 1) % m.moe_layer_freq == 0)
        return cls(m.num_layers, moe, m.moe_router_topk, m.num_experts)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.int16)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position's routes take (all MoE layers)."""
        return len(self.moe_layers) * self.topk * self.dtype.itemsize

    def decode(self, encoded: str) -> tuple[np.ndarray, np.ndarray]:
        """SGLang's ``meta_info.routed_experts`` -> ``(rows, bad)``: ``rows`` ``[positions, moe layers,
        top-k]`` of :attr:`dtype`, and ``bad`` ``[positions]`` bool, the rows unfit to replay (zeros in
        ``rows``; the caller records them as missing). A row is unfit when one of its MoE layers names an
        expert twice or one outside ``[0, num_experts)``: Megatron's dispatcher assumes k distinct
        in-range experts per token and fails inside the step on such a row (``split_with_sizes``), so
        the router routes those positions itself. A payload of the wrong size is another model shape
        and raises ``ValueError``."""
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        per_row = self.hidden_layers * self.topk
        if flat.size % per_row:
            raise ValueError(
                f"routed_experts holds {flat.size} ids, not a multiple of {self.hidden_layers} layers x "
                f"top-{self.topk}: the engine serves another model shape"
            )
        rows = flat.reshape(-1, self.hidden_layers, self.topk)[:, list(self.moe_layers)]  # [n, L, k] int32
        ordered = np.sort(rows, axis=-1)
        bad = ((ordered[..., 0] < 0) | (ordered[..., -1] >= self.num_experts)).any(axis=-1)
        bad |= (ordered[..., 1:] == ordered[..., :-1]).any(axis=(-2, -1))
        return np.where(bad[:, None, None], 0, rows).astype(self.dtype), bad

    def empty(self, n: int) -> np.ndarray:
        """``n`` positions of unknown routes (zeros; their span is recorded as missing)."""
        return np.zeros((n, len(self.moe_layers), self.topk), dtype=self.dtype)


def encode_array(a: np.ndarray) -> dict:
    """A JSON-safe form of an array (checkpoints keep the buffer's trajectories as JSON)."""
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()
