"""The critic's value head stays float32 on a bf16 trunk: its weight, its matmul, its optimizer step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sao_megatron.models.critic import ValueHead
from tests.distributed import run_distributed
from tests.tolerance import sum_rtol


def test_values_from_bf16_hidden_states_are_the_float32_dot_product():
    """One value is ``h . w + b``: ``hidden_size + 1`` terms. In float32 it is within
    ``sum_rtol(h + 1) * sum |terms|`` of the exact (float64) value from the same bf16 inputs; a bf16
    matmul would round the result to 8 mantissa bits, ~2^-9 relative, hundreds of times more."""
    h = 256
    g = torch.Generator().manual_seed(0)
    head = ValueHead(h, sequence_parallel=False, init="normal")
    with torch.no_grad():
        head.bias.fill_(0.25)
    hidden = torch.randn(16, 3, h, generator=g).to(torch.bfloat16)  # [s, b, h] from a bf16 trunk
    values, _ = head(hidden)
    assert head.weight.dtype == head.bias.dtype == values.dtype == torch.float32
    assert values.shape == (16, 3, 1)
    w, b = head.weight.detach().double(), head.bias.detach().double()
    exact = hidden.double() @ w.T + b  # [s, b, 1]
    abs_sum = hidden.double().abs() @ w.abs().T + b.abs()
    assert ((values.double() - exact).abs() <= sum_rtol(h + 1) * abs_sum).all()
    bf16_matmul = torch.nn.functional.linear(hidden, head.weight.bfloat16(), head.bias.bfloat16()).double()
    assert not ((bf16_matmul - exact).abs() <= sum_rtol(h + 1) * abs_sum).all()  # what the bound rules out


def _bf16_critic_step(rank: int, world: int) -> dict:
    from sao_megatron.batch import MicroBatch
    from sao_megatron.config import load_config
    from sao_megatron.parallel import initialize_model_parallel, seed_everything
    from sao_megatron.workers.role import build_critic_role

    cfg = load_config(
        None,
        [
            "critic.bf16=true",
            "critic.parallel.use_distributed_optimizer=true",
            "critic.value_head_init=normal",
            "critic.parallel.micro_batch_size=2",
        ],
    )
    m = dataclasses.replace(cfg.model, num_layers=2)
    initialize_model_parallel(cfg.critic.parallel)
    seed_everything(cfg.run.seed)
    role = build_critic_role(m, cfg.critic)
    head = role.module.output_layer
    optimizers = getattr(role.optimizer, "chained_optimizers", [role.optimizer])
    kept_fp32 = [p for o in optimizers for group in o.model_fp32_groups for p in group]
    tokens = torch.randint(0, m.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(values: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        value_loss = ((values.squeeze(-1) - 1.0) ** 2).mean()
        return value_loss, {"value_loss": value_loss.item(), "float32": float(values.dtype == torch.float32)}

    before = head.weight.detach().clone()
    out = role.forward_backward([MicroBatch.of_tokens(tokens)], loss)
    step = role.step()
    return {
        "trunk_dtype": str(role.module.decoder.layers[0].self_attention.linear_qkv.weight.dtype),
        "head_dtypes": [str(head.weight.dtype), str(head.bias.dtype)],
        "head_kept_fp32": [any(p is q for q in kept_fp32) for p in (head.weight, head.bias)],
        "values_float32": out[0]["float32"],
        "updated": step.updated,
        "head_changed": not torch.equal(before, head.weight.detach()),
        "head_grad_norm": step.group_norms.get("grad_norm/head", 0.0),
    }


@pytest.fixture(scope="module")
def bf16_step():
    return run_distributed(_bf16_critic_step, 1)[0]


def test_a_bf16_critic_keeps_its_head_float32_through_an_optimizer_step(bf16_step):
    """Megatron's distributed optimizer keeps a float32 parameter of a bf16 model as it is (its
    ``model_fp32_groups``, no master copy) and steps it. The non-distributed bf16 optimizer
    (``Float16OptimizerWithFloat16Params``) does not build on CPU at all (it accepts only
    ``torch.cuda.*`` tensor types), so only the distributed one runs here."""
    r = bf16_step
    assert r["trunk_dtype"] == "torch.bfloat16"
    assert r["head_dtypes"] == ["torch.float32", "torch.float32"]
    assert r["head_kept_fp32"] == [True, True]
    assert r["values_float32"] == 1.0
    assert r["updated"] and r["head_changed"] and r["head_grad_norm"] > 0
