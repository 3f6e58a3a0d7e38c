"""Placement of role worlds and engines on nodes: rank order over placement-group bundles, the
rendezvous at rank 0's store (a port the OS picks while the store holds it), and engines that
span nodes (their SGLang arguments)."""

import pytest
import torch.distributed as dist

from sao_megatron.config.cluster import engine_nodes
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
    assert engine_nodes(2, 0, 2) == (2, 1)  # rollout.nodes_per_engine: a CPU TP=2 engine over two nodes
    assert engine_nodes(16, 8, 4) == (4, 4)  # half of each node's GPUs


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
    assert (
        "--attn-dp-size 4" in joined
        and "--enable-dp-attention" not in joined
        and "--mem-fraction-static 0.85" in joined
    )
    single = " ".join(_command(EngineSpec(model_path="/m", port=1), cpu=False))
    assert "--nnodes" not in single and "--attn-dp-size" not in single
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


# ---- GPUs of a run on one node (no cluster.ray_address) ------------------------------------------

ONE_NODE = [  # actor 2 + critic 2 = 4 trainer GPUs, then 2 engines x TP2 on an 8-GPU node
    "cluster.gpus_per_node=8",
    "actor.parallel.world_size=2",
    "critic.parallel.world_size=2",
    "rollout.num_engines=2",
    "rollout.tensor_parallel=2",
]


def test_one_node_run_whose_roles_overflow_the_node_is_refused_naming_the_numbers():
    from sao_megatron.config import ConfigError, load_config
    from sao_megatron.config.cluster import one_node_gpus

    with pytest.raises(
        ConfigError,
        match=r"^cluster\.gpus_per_node=8 < 10 GPUs this run needs on one node \(no cluster\.ray_address\): "
        r"actor\.parallel\.world_size=2 \+ critic\.parallel\.world_size=2 \+ rollout\.num_engines=3 x "
        r"rollout\.tensor_parallel=2; shrink them to fit, or run on several nodes",
    ):
        one_node_gpus(load_config(None, [*ONE_NODE, "rollout.num_engines=3"]))
    # Without a critic (GRPO) the same roles fit: 2 + 3 x 2 = 8.
    gpus = one_node_gpus(
        load_config(None, [*ONE_NODE, "rollout.num_engines=3", "algo.advantage=grpo", "algo.group_size=2"])
    )
    assert gpus is not None and gpus.trainers == 2
    # Ray places every GPU on a cluster; a CPU run has none: no split, no check.
    assert one_node_gpus(load_config(None, [*ONE_NODE, "rollout.num_engines=9", "cluster.ray_address=h:1"])) is None
    assert one_node_gpus(load_config(None, ONE_NODE[1:])) is None


def test_engines_take_the_gpus_after_the_trainers():
    from sao_megatron.config import load_config
    from sao_megatron.driver.engines import engine_env

    cfg = load_config(None, ONE_NODE)
    # Unset CUDA_VISIBLE_DEVICES: the trainers' Ray hands out 0..3, engines 4,5 and 6,7.
    assert [engine_env(cfg, i, None) for i in (0, 1)] == [
        {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "4,5"},
        {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    # A parent list: ids index into it, as Ray's do for the trainers (which get 7,6,5,4).
    parent = "7,6,5,4,3,2,1,0"
    assert [engine_env(cfg, i, parent)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["3,2", "1,0"]
    uuids = ",".join(f"GPU-{i}" for i in range(8))
    assert engine_env(cfg, 1, uuids)["CUDA_VISIBLE_DEVICES"] == "GPU-6,GPU-7"
    with pytest.raises(
        RuntimeError, match=r"CUDA_VISIBLE_DEVICES='0,1,2,3,4,5' lists 6 GPUs, but engine 1 needs GPUs 6\.\.7"
    ):
        engine_env(cfg, 1, "0,1,2,3,4,5")
    # On a cluster Ray sets the variable for the engine's host; a CPU run sets none.
    assert "CUDA_VISIBLE_DEVICES" not in engine_env(load_config(None, [*ONE_NODE, "cluster.ray_address=h:1"]), 0, None)
    assert "CUDA_VISIBLE_DEVICES" not in engine_env(load_config(None, ONE_NODE[1:]), 0, None)


def test_launched_engines_get_their_gpus_in_their_environment_and_command(tmp_path, monkeypatch):
    """What each engine process is started with, for 2 engines x TP2 after 4 trainer GPUs."""
    from sao_megatron.config import load_config
    from sao_megatron.driver import engines as engines_mod

    started: list = []

    class Recorded(engines_mod.EngineProcess):
        def start(self):
            started.append((self._environment(), self._command()))
            return self

    monkeypatch.setattr(engines_mod, "EngineProcess", Recorded)
    cfg = load_config(None, ONE_NODE)
    for parent, expected in ((None, ["4,5", "6,7"]), ("3,1,4,0,5,2,7,6", ["5,2", "7,6"])):
        started.clear()
        if parent is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
        engines_mod.launch_engines(cfg, tmp_path, tmp_path)
        assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in started] == expected
        for _, cmd in started:
            joined = " ".join(cmd)
            assert "--tp-size 2" in joined and "--base-gpu-id" not in joined  # from GPU 0 of what it sees
            assert "--device cpu" not in joined  # a GPU engine though this driver sees no CUDA
    started.clear()  # a restarted engine gets the same GPUs
    engines_mod.launch_engines(cfg, tmp_path, tmp_path, indices=[1], restart=1)
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in started] == ["7,6"]


def test_engines_run_on_the_cpu_iff_the_config_says_no_gpus(tmp_path, monkeypatch):
    """gpus_per_node=0 on a machine whose driver sees CUDA: CPU engines, as the trainer ranks are."""
    from sao_megatron.config import load_config
    from sao_megatron.driver import engines as engines_mod

    started: list = []

    class Recorded(engines_mod.EngineProcess):
        def start(self):
            started.append(self._command())
            return self

    monkeypatch.setattr(engines_mod, "EngineProcess", Recorded)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    engines_mod.launch_engines(load_config(), tmp_path, tmp_path)
    assert started and all("--device cpu" in " ".join(cmd) for cmd in started)


def test_local_ray_holds_only_the_trainers_gpus():
    from sao_megatron.config import ConfigError, load_config
    from sao_megatron.driver.roles import ray_args

    assert ray_args(load_config(None, ONE_NODE)) == {"num_gpus": 4}
    assert ray_args(load_config(None, [*ONE_NODE, "algo.advantage=grpo", "algo.group_size=2"])) == {"num_gpus": 2}
    assert ray_args(load_config(None, [*ONE_NODE, "cluster.ray_address=10.0.0.1:6379"])) == {"address": "10.0.0.1:6379"}
    assert ray_args(load_config(None, [])) == {}  # CPU: as before
    with pytest.raises(ConfigError, match=r"^cluster\.gpus_per_node=8 < 12 GPUs"):
        ray_args(load_config(None, [*ONE_NODE, "rollout.num_engines=4"]))


def test_trainer_ranks_ask_for_a_gpu_iff_the_config_says_gpus(monkeypatch):
    """Whatever the driver's process sees: a CPU driver of a GPU run still asks for GPUs."""
    import torch

    from sao_megatron.config import load_config
    from sao_megatron.driver.roles import RoleGroup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bundle = RoleGroup("actor", load_config(None, ONE_NODE), None)._bundle()  # type: ignore[arg-type]
    assert bundle["GPU"] == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "GPU" not in RoleGroup("actor", load_config(None, []), None)._bundle()  # type: ignore[arg-type]


def test_a_gpu_rank_that_sees_no_cuda_fails_naming_its_node(monkeypatch):
    import socket

    import torch

    from sao_megatron.workers.rank import check_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError) as err:
        check_cuda(8, "critic rank 3", "10.0.0.7")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"critic rank 3 on host {socket.gethostname()} (10.0.0.7) sees no CUDA device")
    assert "(CUDA_VISIBLE_DEVICES '')" in message and "cluster.gpus_per_node=8" in message
    check_cuda(0, "critic rank 3", "10.0.0.7")  # a CPU run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_cuda(8, "critic rank 3", "10.0.0.7")
