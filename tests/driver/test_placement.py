"""Placement of role worlds and engines on nodes: rank order over placement-group bundles, the
rendezvous at rank 0's store (a port the OS picks while the store holds it), and engines that
span nodes (their SGLang arguments)."""

import pytest
import torch.distributed as dist

from sao_megatron.driver.engines import engine_nodes
from sao_megatron.driver.roles import rank_order
from sao_megatron.parallel import join_store, open_store
from sao_megatron.rollout.engine import EngineSpec, _command


def test_ranks_follow_bundles_node_by_node_from_rank_zeros_node():
    # Ray spread bundles 0..5 over three nodes in an interleaved way.
    nodes = {0: "b", 1: "a", 2: "b", 3: "c", 4: "a", 5: "b"}
    order = rank_order(nodes)
    assert order == [0, 2, 5, 1, 4, 3]
    assert [nodes[b] for b in order] == ["b", "b", "b", "a", "a", "c"]  # contiguous per node
    assert rank_order({0: "x", 1: "x"}) == [0, 1]


def test_rank_zero_store_holds_its_port_and_others_join_it():
    store = open_store("127.0.0.1", 2)
    assert store.port > 0
    client = join_store("127.0.0.1", store.port, 2, timeout_s=10)
    client.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises((RuntimeError, dist.DistStoreError)):  # the port is held: a second store fails
        open_store("127.0.0.1", 2, port=store.port, timeout_s=2)


def test_engine_nodes():
    assert engine_nodes(8, 0) == (1, 8)  # CPU runs / one node
    assert engine_nodes(4, 8) == (1, 4)
    assert engine_nodes(8, 8) == (1, 8)
    assert engine_nodes(32, 8) == (4, 8)  # the 750B config's TP32 engine: four whole nodes


def test_engine_command_spans_nodes_with_dp_attention():
    spec = EngineSpec(
        model_path="/m",
        port=30000,
        host="10.0.0.2",
        tensor_parallel=32,
        expert_parallel=32,
        mem_fraction_static=0.85,
        dp_attention=4,
        nnodes=4,
        node_rank=2,
        dist_init_addr="10.0.0.1:5000",
    )
    cmd = _command(spec, cpu=False)
    joined = " ".join(cmd)
    assert "--nnodes 4 --node-rank 2 --dist-init-addr 10.0.0.1:5000" in joined
    assert "--dp-size 4 --enable-dp-attention" in joined and "--mem-fraction-static 0.85" in joined
    single = " ".join(_command(EngineSpec(model_path="/m", port=1), cpu=False))
    assert "--nnodes" not in single and "--dp-size" not in single
    with pytest.raises(ValueError, match="dist_init_addr"):
        _command(EngineSpec(model_path="/m", port=1, nnodes=2), cpu=False)


def test_a_role_that_no_node_can_hold_fails_with_what_it_needs(tmp_path):
    """A bundle no node can hold (a resource the cluster lacks) fails within the timeout, naming
    the bundle and what the nodes offer, instead of waiting forever."""
    import asyncio

    import ray

    from sao_megatron.driver.roles import init_ray, wait_placed

    started_here = not ray.is_initialized()  # another test's Ray stays up for the session
    init_ray(num_cpus=1)
    try:
        from ray.util.placement_group import placement_group

        bundle = {"CPU": 0.1, "sao_actor": 1.0}  # no node advertises sao_actor here
        group = placement_group([bundle], strategy="PACK")
        with pytest.raises(RuntimeError, match=r"could not place the actor's 1 ranks within 2 s.*sao_actor"):
            asyncio.run(wait_placed(group, "the actor's 1 ranks", bundle, 2.0))
    finally:
        if started_here:
            ray.shutdown()
