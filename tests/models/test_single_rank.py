"""Single-process model tests: logprobs/entropy, parameter counts, freezing, the CPU patch guard."""

import pytest
import torch

from sao_megatron import megatron_cpu
from sao_megatron.config import CriticConfig, ParallelConfig, load_config
from sao_megatron.models.logprobs import vocab_parallel_logprobs
from tests.tolerance import log_softmax_atol, sum_rtol


def test_logprobs_and_entropy_match_log_softmax_with_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    logprobs, entropy = vocab_parallel_logprobs(logits, labels, temperature=0.7)
    ref_all = torch.log_softmax(logits / 0.7, dim=-1)
    ref = ref_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(ref_all.exp() * ref_all).sum(-1)
    x = logits.detach() / 0.7
    atol = log_softmax_atol(x)
    assert (logprobs - ref).abs().max() <= atol
    # H = -sum_v p_v log p_v: each log p_v within atol moves it by at most atol * (1 + H); our sum of
    # p_v (x_v - max) (V terms, sum |terms| <= 2 max|x|) adds its own summation bound
    h = ref_entropy.max().item()
    assert (entropy - ref_entropy).abs().max() <= atol * (1 + h) + sum_rtol(50) * 2 * x.abs().max().item()
    assert not entropy.requires_grad
    weights = torch.randn(3, 7)
    (grad,) = torch.autograd.grad((logprobs * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    # d logprob / d logit_v = (1[v = y] - p_v) / T per token, times its weight: p_v = exp(log p_v) differs
    # by at most p_v (atol + eps) <= atol + eps
    eps = torch.finfo(torch.float32).eps
    assert (grad - ref_grad).abs().max() <= weights.abs().max().item() / 0.7 * (atol + 2 * eps)


def test_logprobs_reject_bad_shapes():
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0)


def test_cpu_patch_refuses_other_megatron_versions(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "_applied", False)
    monkeypatch.setattr(megatron_cpu, "megatron_version", lambda: "0.99.0")
    monkeypatch.setattr(megatron_cpu, "needed", lambda: True)
    with pytest.raises(RuntimeError, match="supports megatron-core 0.19.2 only, found 0.99.0"):
        megatron_cpu.apply()


def _one_rank_world(rank, world):
    from sao_megatron.models.builder import build_gpt, count_parameters
    from sao_megatron.models.counting import parameter_counts
    from sao_megatron.models.critic import build_critic
    from sao_megatron.parallel import initialize_model_parallel, seed_everything

    cfg = load_config()
    p = ParallelConfig()
    initialize_model_parallel(p)
    seed_everything(0)
    actor = build_gpt(cfg.model, p)
    critic = build_critic(
        cfg.model,
        p,
        CriticConfig(freeze_patterns=[r"\.self_attention\.", r"\.experts\."], train_patterns=[r"linear_fc2"]),
    )
    trainable = [n for n, q in critic.named_parameters() if q.requires_grad]
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    values = critic(tokens, positions, attention_mask=None)
    bf16_actor = build_gpt(cfg.model, p, bf16=True)
    bf16_critic = build_critic(cfg.model, p, CriticConfig(bf16=True))
    return {
        "bf16_actor_dtypes": sorted({str(q.dtype) for q in bf16_actor.parameters()}),
        "bf16_critic_not_bf16": sorted(n for n, q in bf16_critic.named_parameters() if q.dtype != torch.bfloat16),
        "built": count_parameters(actor)["total"],
        "formula": parameter_counts(cfg.model)["total"],
        "values_shape": list(values.shape),
        "values_zero": float(values.abs().max()),
        "attention_trainable": [n for n in trainable if ".self_attention." in n],
        "fc1_trainable": [n for n in trainable if "experts" in n and "linear_fc1" in n],
        "fc2_trainable": len([n for n in trainable if "experts" in n and "linear_fc2" in n]),
    }


def test_counts_critic_head_and_freeze_patterns():
    from tests.distributed import run_distributed

    (r,) = run_distributed(_one_rank_world, 1)
    assert r["built"] == r["formula"]
    assert r["values_shape"] == [2, 16, 1] and r["values_zero"] == 0.0  # zero-initialised head
    assert r["attention_trainable"] == [] and r["fc1_trainable"] == []
    assert r["fc2_trainable"] == 4 * 8  # train_patterns re-enable expert fc2 in 4 layers x 8 experts
    # bf16 means every parameter, the local spec's torch.nn norms too (Megatron's Float16Module casts
    # them; TE builds them in params_dtype), except the critic's float32 value head
    assert r["bf16_actor_dtypes"] == ["torch.bfloat16"], r["bf16_actor_dtypes"]
    assert r["bf16_critic_not_bf16"] == ["output_layer.bias", "output_layer.weight"], r["bf16_critic_not_bf16"]


def _roles_on_a_gpu_world(rank, world):
    from benchmarks.gpu.cases import run_config
    from sao_megatron.parallel import initialize_model_parallel
    from sao_megatron.workers.role import build_actor_role, build_critic_role

    cfg = run_config({"model": {"num_layers": 2}, "micro_batch_size": 2}, bf16=True)
    initialize_model_parallel(cfg.actor.parallel)
    off = {}
    for name, role in (
        ("actor", build_actor_role(cfg.model, cfg.actor)),
        ("critic", build_critic_role(cfg.model, cfg.critic)),
    ):
        tensors = [*role.model.named_parameters(), *role.model.named_buffers()]
        off[name] = [f"{n}: {t.device}" for n, t in tensors if t.device.type != "cuda"]
    return off


@pytest.mark.gpu
def test_roles_on_a_gpu_hold_every_parameter_and_buffer_there():
    """The first GPU check (2026-12-04) found the local spec's torch.nn norms and the value head on the
    CPU beside CUDA linear layers (the optimizer refused them); MegatronRole moves the chunk first."""
    from sao_megatron.spawn import run_world

    (off,) = run_world(_roles_on_a_gpu_world, 1, backend="nccl", timeout_s=300)
    assert off == {"actor": [], "critic": []}, off


def _live_tensor_bytes() -> int:
    import gc

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _closed_role_world(rank, world):
    from sao_megatron.batch import MicroBatch
    from sao_megatron.models.logprobs import vocab_parallel_logprobs
    from sao_megatron.parallel import initialize_model_parallel, seed_everything
    from sao_megatron.workers.role import build_actor_role

    cfg = load_config(None, ["actor.parallel.world_size=1", "actor.parallel.use_distributed_optimizer=true"])
    initialize_model_parallel(cfg.actor.parallel)
    seed_everything(0)
    before = _live_tensor_bytes()
    role = build_actor_role(cfg.model, cfg.actor)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    role.forward_backward(
        [MicroBatch.of_tokens(tokens)], lambda logits, mb: (-vocab_parallel_logprobs(logits, mb.labels)[0].mean(), {})
    )
    role.step()
    held = _live_tensor_bytes() - before
    role.close()
    del role
    return {"held": held, "after": _live_tensor_bytes() - before}


def test_a_closed_role_frees_its_memory_after_a_step():
    """A stepped MoE role, dropped, stayed half alive (Megatron's token dispatcher keeps the last routing
    probabilities with their graph, which reaches DDP's hook closures): the GPU check's critic step was
    measured on top of the actor's leftovers. ``close`` releases the storages."""
    from tests.distributed import run_distributed

    (r,) = run_distributed(_closed_role_world, 1)
    assert r["held"] > 1 << 20, r  # weights, gradient buffers, optimizer state: megabytes
    assert r["after"] < 0.01 * r["held"], r
