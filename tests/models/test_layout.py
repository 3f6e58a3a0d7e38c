"""``layout.gather_full`` gathers shards on their own device; expert weights that expert TP splits
must say so (their ``tensor_model_parallel`` / ``partition_dim`` attributes).

No GPU here: the device test runs under ``FakeTensorMode`` (tensors with a device and a shape, no
data), so a parameter can sit on ``cuda`` on this CPU machine, with recording stand-ins for the
process groups. The gathered values themselves are checked in real gloo worlds
(tests/models/test_parallel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sao_megatron.models import layout


class _Model(torch.nn.Module):
    """A TP-sharded weight (split along dim 0 over a TP group of 2) and a replicated one."""

    def __init__(self, device: str):
        super().__init__()
        self.output_layer = torch.nn.Module()
        self.output_layer.weight = torch.nn.Parameter(torch.empty(4, 3, device=device))
        self.output_layer.weight.tensor_model_parallel, self.output_layer.weight.partition_dim = True, 0
        self.norm = torch.nn.Parameter(torch.empty(3, device=device))


def _fake_world(monkeypatch) -> list[tuple[str, torch.device]]:
    """Rank 0 of a TP=2 world (every other group of size 1); returns the collectives it saw."""
    seen: list[tuple[str, torch.device]] = []
    ps = SimpleNamespace(
        get_tensor_model_parallel_group=lambda: "tp",
        get_expert_model_parallel_group=lambda: "ep",
        get_pipeline_model_parallel_group=lambda: "pp",
        get_data_parallel_rank=lambda with_context_parallel=False: 0,
        get_expert_data_parallel_rank=lambda: 0,
        get_tensor_model_parallel_rank=lambda: 0,
        get_expert_tensor_parallel_rank=lambda: 0,
    )

    def all_gather(parts, tensor, group=None):
        seen.append(("all_gather", tensor.device))
        for part in parts:
            part.copy_(tensor)

    def gather(tensor, parts, dst=0, group=None):
        seen.append(("gather", tensor.device))
        for part in parts:
            part.copy_(tensor)

    monkeypatch.setattr(layout, "_groups", lambda: ps)
    monkeypatch.setattr(layout.dist, "get_world_size", lambda group=None: 2 if group == "tp" else 1)
    monkeypatch.setattr(layout.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(layout.dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(layout.dist, "all_gather", all_gather)
    monkeypatch.setattr(layout.dist, "gather", gather)
    return seen


@pytest.mark.parametrize("rank0_only", [False, True])
def test_shards_are_gathered_on_their_device_and_the_full_tensors_returned_on_cpu(monkeypatch, rank0_only):
    """NCCL gathers only GPU tensors: the shard must reach the collective on the parameter's
    device, and only the gathered tensor is copied to CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = _fake_world(monkeypatch)
    with FakeTensorMode():
        full = layout.gather_full(_Model("cuda"), rank0_only=rank0_only)
    assert seen == [("gather" if rank0_only else "all_gather", torch.device("cuda", 0))]
    assert {k: (tuple(v.shape), v.device.type) for k, v in full.items()} == {
        "output_layer.weight": ((8, 3), "cpu"),  # two [4, 3] shards along dim 0
        "norm": ((3,), "cpu"),
    }


def test_an_expert_weight_without_tp_attributes_is_refused_when_expert_tp_splits_it():
    """A fake model named like TE's grouped GEMM experts (``...experts.linear_fc1.weight<i>``)."""
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.experts = torch.nn.Module()
    model.decoder.experts.linear_fc1 = torch.nn.Module()
    weights = [torch.nn.Parameter(torch.zeros(4, 2)) for _ in range(2)]
    weights[0].tensor_model_parallel, weights[0].partition_dim = True, 0  # weight1 lacks them
    for i, w in enumerate(weights):
        model.decoder.experts.linear_fc1.register_parameter(f"weight{i}", w)
    model.decoder.norm = torch.nn.Parameter(torch.zeros(2))  # not an expert weight: replicated is fine

    with pytest.raises(RuntimeError) as err:
        layout.check_expert_tp_attributes(model, expert_tensor_parallel=2)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "expert weight 'decoder.experts.linear_fc1.weight1' lacks Megatron's tensor_model_parallel/partition_dim"
    )
    assert "expert_tensor_parallel=2" in message
    layout.check_expert_tp_attributes(model, expert_tensor_parallel=1)  # nothing is split: nothing to say
    weights[1].tensor_model_parallel = True  # the flag without the dimension is as bad
    with pytest.raises(RuntimeError, match="'decoder.experts.linear_fc1.weight1'"):
        layout.check_expert_tp_attributes(model, expert_tensor_parallel=2)
    weights[1].partition_dim = 0
    layout.check_expert_tp_attributes(model, expert_tensor_parallel=2)
