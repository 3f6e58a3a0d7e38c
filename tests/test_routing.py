"""Routing replay's records without an engine: which layers a route row keeps and in what width
(``routing.RouteShape``), SGLang's ``meta_info.routed_experts`` decoded and refused, a trajectory's
routes through a checkpoint's JSON, and the batch's ``routes`` / ``route_mask`` cut into padded,
packed and context-parallel micro-batches exactly like the tokens. The agent loop's side:
``tests/rollout/test_agent_loop_routes.py``; a real engine: ``tests/rollout/test_engine_integration.py``."""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import pytest
import torch

from sao_megatron.batch import MicroBatching, build_batch
from sao_megatron.config import load_config
from sao_megatron.context_parallel import cp_merge, cp_split
from sao_megatron.records import Trajectory, Turn
from sao_megatron.routing import RouteShape, decode_array, encode_array


def sglang_routes(rows: np.ndarray) -> str:
    """What SGLang sends as ``meta_info.routed_experts``: base64 of int32 ``[positions, hidden layers, top-k]``."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype=np.int32).tobytes()).decode("ascii")


def tiny():
    return load_config().model


def deepseek_like(num_experts: int = 256):
    """Eight layers, the first three dense (HF ``first_k_dense_replace`` 3), top-8."""
    return dataclasses.replace(tiny(), num_layers=8, dense_layers=[0, 1, 2], num_experts=num_experts, moe_router_topk=8)


# ---- RouteShape ------------------------------------------------------------------------------


def test_the_tiny_model_routes_every_layer_in_one_byte():
    m = tiny()
    shape = RouteShape.of(m)
    assert shape == RouteShape(m.num_layers, tuple(range(m.num_layers)), m.moe_router_topk, m.num_experts)
    assert shape.dtype == np.uint8
    assert shape.bytes_per_token == m.num_layers * m.moe_router_topk


def test_leading_dense_layers_have_no_routes():
    shape = RouteShape.of(deepseek_like())
    assert shape == RouteShape(8, (3, 4, 5, 6, 7), 8, 256)
    assert shape.bytes_per_token == 5 * 8


def test_moe_layer_freq_counts_as_hf_decoder_sparse_step():
    """``(i + 1) % freq == 0`` is MoE (HF ``decoder_sparse_step``, the builder's pattern); forced dense
    layers (HF ``mlp_only_layers``) drop out of it."""
    m = dataclasses.replace(tiny(), num_layers=8, moe_layer_freq=2)
    assert RouteShape.of(m).moe_layers == (1, 3, 5, 7)
    assert RouteShape.of(dataclasses.replace(m, dense_layers=[3])).moe_layers == (1, 5, 7)


@pytest.mark.parametrize(
    ("experts", "dtype", "width"), [(8, np.uint8, 1), (256, np.uint8, 1), (257, np.int16, 2), (384, np.int16, 2)]
)
def test_one_byte_up_to_256_experts_two_beyond(experts, dtype, width):
    shape = RouteShape.of(deepseek_like(experts))
    assert shape.dtype == dtype
    assert shape.bytes_per_token == 5 * 8 * width
    assert shape.empty(3).shape == (3, 5, 8) and shape.empty(3).dtype == dtype and not shape.empty(3).any()


def test_a_dense_model_has_no_route_shape():
    with pytest.raises(ValueError, match="dense model"):
        RouteShape.of(dataclasses.replace(tiny(), num_experts=0))


def distinct_rows(positions: int, experts: int = 256) -> np.ndarray:
    """``[positions, 8, 8]`` int: SGLang rows of :func:`deepseek_like` whose values encode (position,
    layer, slot), distinct within each layer's top-8; the dense layers hold -1."""
    p, layer, slot = np.meshgrid(np.arange(positions), np.arange(8), np.arange(8), indexing="ij")
    rows = (p * 64 + layer * 8 + slot) % experts
    rows[:, :3] = -1  # dense layers: whatever the engine leaves there is not read
    return rows


@pytest.mark.parametrize("experts", [256, 384])
def test_decode_keeps_the_moe_layers_in_order(experts):
    """Row values encode (position, layer, slot), so a dropped, reordered or shifted layer shows."""
    shape = RouteShape.of(deepseek_like(experts))
    rows = distinct_rows(3, experts)
    out, bad = shape.decode(sglang_routes(rows))
    assert out.dtype == shape.dtype and out.shape == (3, 5, 8)
    np.testing.assert_array_equal(out, rows[:, 3:])
    assert bad.dtype == np.bool_ and not bad.any() and bad.shape == (3,)
    empty, none = shape.decode(sglang_routes(np.zeros((0, 8, 8))))  # no new positions
    assert empty.shape == (0, 5, 8) and none.shape == (0,)


def test_decode_refuses_another_model_shape():
    shape = RouteShape.of(deepseek_like())
    with pytest.raises(ValueError, match=r"holds 65 ids, not a multiple of 8 layers x top-8"):
        shape.decode(sglang_routes(np.zeros(65)))


@pytest.mark.parametrize("fault", ["repeat", -1, 256, 300])
def test_decode_marks_a_row_naming_an_expert_twice_or_outside_the_model(fault):
    """Megatron's dispatcher needs k distinct experts in range per token (a repeat crashed the step in
    ``split_with_sizes``; an id >= 256 would also wrap in uint8): such a row comes back zeroed and
    marked, its neighbours intact. The dense layers' entries are never read, so their -1s mark nothing."""
    shape = RouteShape.of(deepseek_like())
    rows = distinct_rows(4)
    rows[1, 6, 3] = rows[1, 6, 0] if fault == "repeat" else fault
    rows[3, 1, 2] = rows[3, 1, 5]  # a repeat in a dense layer: not read
    out, bad = shape.decode(sglang_routes(rows))
    assert bad.tolist() == [False, True, False, False]
    assert not out[1].any()
    np.testing.assert_array_equal(out[[0, 2, 3]], rows[[0, 2, 3], 3:])


def test_decode_never_marks_top1_rows():
    shape = RouteShape(hidden_layers=2, moe_layers=(0, 1), topk=1, num_experts=4)
    out, bad = shape.decode(sglang_routes(np.array([[[3], [3]], [[0], [1]]])))
    assert not bad.any() and out[:, :, 0].tolist() == [[3, 3], [0, 1]]


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_array_json_round_trip(dtype):
    a = np.arange(24, dtype=dtype).reshape(3, 4, 2) * 7
    again = decode_array(json.loads(json.dumps(encode_array(a))))
    assert again.dtype == dtype and again.shape == a.shape and again.flags.writeable
    np.testing.assert_array_equal(again, a)


# ---- Trajectory ------------------------------------------------------------------------------


def routed(prompt: int, response: int, seed: int, missing=(), dtype=np.uint8, shape=(4, 2), routes=True) -> Trajectory:
    """A trajectory of ``prompt`` + ``response`` tokens (actions), random routes, ``missing`` spans zeroed."""
    rng = np.random.default_rng(seed)
    n = prompt + response
    r = rng.integers(0, 200, size=(n, *shape)).astype(dtype) if routes else None
    for a, b in missing:
        if r is not None:
            r[a:b] = 0
    return Trajectory(
        prompt_id=f"p{seed}",
        prompt_ids=rng.integers(5, 100, size=prompt).tolist(),
        response_ids=rng.integers(5, 100, size=response).tolist(),
        action_mask=[1] * response,
        behavior_logprobs=[-0.5] * response,
        policy_versions=[0] * response,
        turns=[Turn(0, response)],
        reward=1.0,
        status="finished",
        routes=r,
        routes_missing=[Turn(a, b) for a, b in missing] if routes else [],
    )


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_a_trajectorys_routes_survive_a_checkpoint(dtype):
    t = routed(3, 5, seed=1, missing=[(4, 6), (7, 8)], dtype=dtype)
    again = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert again.routes is not None and t.routes is not None
    assert again.routes.dtype == dtype and again.routes.shape == (8, 4, 2)
    np.testing.assert_array_equal(again.routes, t.routes)
    assert again.routes_missing == [Turn(4, 6), Turn(7, 8)]
    assert again.num_routed_positions == 5
    assert isinstance(t.routes, np.ndarray)  # to_dict leaves the record itself as it was


def test_a_trajectory_without_routes_round_trips_as_none():
    t = routed(3, 5, seed=1, routes=False)
    again = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert again.routes is None and again.routes_missing == [] and again.num_routed_positions == 0


def test_routes_need_one_row_per_position():
    t = routed(3, 5, seed=1)
    assert t.routes is not None
    with pytest.raises(ValueError, match="routes has 7 rows for 8 positions"):
        dataclasses.replace(t, routes=t.routes[:-1])


# ---- batch -----------------------------------------------------------------------------------


def test_the_batch_holds_each_rows_routes_and_which_are_known():
    """Row 1 carries no routes (mask 0 throughout); missing spans and padding are 0 in the mask."""
    trajs = [
        routed(3, 5, 1, missing=[(7, 8)]),
        routed(2, 2, 2, routes=False),
        routed(4, 2, 3, missing=[(0, 2), (5, 6)]),
    ]
    batch = build_batch(trajs)
    assert batch.routes is not None and batch.route_mask is not None
    assert batch.routes.dtype == torch.uint8 and batch.routes.shape == (3, 8, 4, 2)
    for i, t in enumerate(trajs):
        n = t.num_context_tokens
        if t.routes is not None:
            assert torch.equal(batch.routes[i, :n], torch.from_numpy(t.routes))
        assert not batch.routes[i, n:].any()
    assert batch.route_mask.tolist() == [
        [1, 1, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0, 0],
    ]


def test_a_batch_without_routes_has_none():
    batch = build_batch([routed(3, 5, 1, routes=False), routed(2, 2, 2, routes=False)])
    assert batch.routes is None and batch.route_mask is None
    assert batch.micro_batch([0, 1], MicroBatching(rows=2)).routes is None


def test_int16_routes_stay_int16_and_shapes_must_agree():
    assert build_batch([routed(3, 5, 1, dtype=np.int16)]).routes.dtype == torch.int16  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"trajectory p2: routes of shape \(3, 2\), others \(4, 2\)"):
        build_batch([routed(3, 5, 1), routed(3, 5, 2, shape=(3, 2))])


def _batch():
    trajs = [routed(3, 5, 1, missing=[(7, 8)]), routed(2, 2, 2), routed(4, 3, 3, missing=[(2, 4)]), routed(3, 2, 4)]
    return trajs, build_batch(trajs)


def test_padded_micro_batches_cut_routes_like_tokens():
    trajs, batch = _batch()
    rows = [0, 2, 3]
    mb = batch.micro_batch(rows, MicroBatching(rows=3, multiple=4))
    assert mb.routes is not None and mb.route_mask is not None
    assert mb.routes.shape == (3, 8, 4, 2) and mb.route_mask.shape == mb.tokens.shape
    for j, r in enumerate(rows):
        t, n = trajs[r], trajs[r].num_context_tokens
        assert t.routes is not None
        assert mb.tokens[j, :n].tolist() == t.prompt_ids + t.response_ids
        assert torch.equal(mb.routes[j, :n], torch.from_numpy(t.routes))
        assert torch.equal(mb.route_mask[j, :n], batch.route_mask[r, :n])  # type: ignore[index]
        assert not mb.routes[j, n:].any() and not mb.route_mask[j, n:].any()
    filler = batch.micro_batch([], MicroBatching(rows=3, multiple=4))
    assert filler.routes is not None and filler.route_mask is not None
    assert filler.routes.shape == (1, 4, 4, 2) and not filler.routes.any() and not filler.route_mask.any()


def _packed():
    trajs, batch = _batch()
    mb = batch.micro_batch([1, 0, 2], MicroBatching(pack=True, segment_multiple=4, multiple=8))
    return trajs, batch, mb


def test_packed_micro_batches_cut_routes_like_tokens():
    trajs, batch, mb = _packed()
    assert mb.spans is not None and mb.routes is not None and mb.route_mask is not None
    assert mb.routes.shape == (1, mb.tokens.shape[1], 4, 2)
    held = torch.zeros(mb.tokens.shape[1], dtype=torch.bool)
    for r, (offset, n) in zip([1, 0, 2], mb.spans, strict=True):
        t = trajs[r]
        assert t.routes is not None
        assert mb.tokens[0, offset : offset + n].tolist() == t.prompt_ids + t.response_ids
        assert torch.equal(mb.routes[0, offset : offset + n], torch.from_numpy(t.routes))
        assert torch.equal(mb.route_mask[0, offset : offset + n], batch.route_mask[r, :n])  # type: ignore[index]
        held[offset : offset + n] = True
    assert not mb.routes[0, ~held].any() and not mb.route_mask[0, ~held].any()  # segment and trailing padding


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_cuts_routes_like_tokens(cp):
    """Zigzag over each packed segment: a rank's routes are those of the tokens it holds, and the
    ranks' parts merge back into the micro-batch's routes."""
    trajs, batch = _batch()
    mb = batch.micro_batch([1, 0, 2], MicroBatching(pack=True, segment_multiple=2 * cp, multiple=2 * cp))
    assert mb.cu_seqlens is not None and mb.routes is not None
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
    where = torch.arange(mb.tokens.shape[1]).unsqueeze(0)  # [1, t] the position of each entry
    parts = []
    for rank in range(cp):
        held = cp_split(where, lengths, cp, rank)[0]
        part = cp_split(mb.routes, lengths, cp, rank)
        assert part.shape == (1, mb.tokens.shape[1] // cp, 4, 2) and len(set(held.tolist())) == len(held)
        assert torch.equal(part, mb.routes[:, held])
        assert torch.equal(cp_split(mb.tokens, lengths, cp, rank), mb.tokens[:, held])
        parts.append(part)
    assert torch.equal(cp_merge(parts, lengths), mb.routes)
