"""GPU performance defaults (``parallel.fusions``, ``selective_recompute``, ``overlap_*``) and the
critic's frozen set on both layer specs.

``None`` knobs follow Transformer Engine presence (faked here with ``monkeypatch``; Megatron
refuses fused RoPE and permutation without TE, so the TE-side fusions are checked as the
kwargs handed to ``TransformerConfig``). Frozen-set parity uses the analytic full-layout names
of each spec (``hf_bridge.mcore_names``). Overlapped gradient reduction and parameter gather
run for real in a 2-rank gloo world and must give the non-overlapped weights exactly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sao_megatron.config import ConfigError, CriticConfig, ParallelConfig, load_config
from sao_megatron.config.rank import ActorRankConfig
from sao_megatron.models import builder
from sao_megatron.models.builder import canonical_name, fusion_kwargs, recompute_kwargs, resolved
from sao_megatron.models.critic import freeze
from sao_megatron.models.hf_bridge import mcore_names


def _model(**kw):
    """The tiny MoE model with a dense first layer, so both TE norm fusions occur."""
    return dataclasses.replace(load_config().model, dense_layers=[0], **kw)


def _te(monkeypatch, present: bool, te_version: str = "2.8.0", apex: bool = False) -> None:
    from packaging.version import Version

    monkeypatch.setattr(builder, "have_transformer_engine", lambda: present)
    monkeypatch.setattr(builder, "_te_at_least", lambda v: present and Version(te_version) >= Version(v))
    monkeypatch.setattr(builder, "_have_apex_wgrad_fusion", lambda: apex)


# --- knob resolution ---------------------------------------------------------------------------


@pytest.mark.parametrize("te", [False, True])
def test_none_knobs_follow_transformer_engine(monkeypatch, te):
    _te(monkeypatch, te)
    # The parameter gather stays off unless asked for (the policy is exported after every step).
    assert resolved(ParallelConfig()) == builder.PerfKnobs(te, te, te, te, False)
    # No distributed optimizer: nothing to all-gather, so no overlap of it.
    assert not resolved(ParallelConfig(use_distributed_optimizer=False)).overlap_param_gather
    # Full recompute wins over selective.
    assert not resolved(ParallelConfig(recompute_activations=True)).selective_recompute


def test_explicit_values_override_transformer_engine(monkeypatch):
    _te(monkeypatch, True)
    off = ParallelConfig(
        fusions=False, selective_recompute=False, overlap_grad_reduce=False, overlap_param_gather=False
    )
    assert resolved(off) == builder.PerfKnobs(True, False, False, False, False)
    _te(monkeypatch, False)
    on = ParallelConfig(selective_recompute=True, overlap_grad_reduce=True, overlap_param_gather=True)
    assert resolved(on) == builder.PerfKnobs(False, False, True, True, True)


def test_fusions_true_without_transformer_engine_is_refused(monkeypatch):
    _te(monkeypatch, False)
    with pytest.raises(ConfigError, match=r"parallel\.fusions=true needs Transformer Engine.*null"):
        resolved(ParallelConfig(fusions=True))


def test_fusion_kwargs_under_transformer_engine(monkeypatch):
    m = _model()
    _te(monkeypatch, True)
    assert fusion_kwargs(m, resolved(ParallelConfig())) == dict(
        apply_rope_fusion=True,
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        moe_grouped_gemm=True,
        moe_permute_fusion=True,
        moe_router_fusion=True,
    )
    _te(monkeypatch, True, te_version="2.5.0", apex=True)  # router fusion needs TE >= 2.7
    k = fusion_kwargs(m, resolved(ParallelConfig()))
    assert k["gradient_accumulation_fusion"] and k["moe_permute_fusion"] and not k["moe_router_fusion"]
    assert not any(fusion_kwargs(m, resolved(ParallelConfig(fusions=False))).values())
    dense = fusion_kwargs(_model(num_experts=0), resolved(ParallelConfig()))
    assert not any(v for key, v in dense.items() if key.startswith("moe_"))


def test_recompute_modules(monkeypatch):
    m = _model()
    _te(monkeypatch, True)
    p = ParallelConfig()
    assert recompute_kwargs(m, p, resolved(p), grouped_gemm=True) == dict(
        recompute_granularity="selective", recompute_modules=["layernorm", "moe_act"]
    )
    assert recompute_kwargs(m, p, resolved(p), grouped_gemm=False)["recompute_modules"] == ["layernorm"]
    full = ParallelConfig(recompute_activations=True)
    assert recompute_kwargs(m, full, resolved(full), grouped_gemm=True)["recompute_granularity"] == "full"
    _te(monkeypatch, False)
    sel = ParallelConfig(selective_recompute=True)
    assert recompute_kwargs(m, sel, resolved(sel), grouped_gemm=False)["recompute_modules"] == ["core_attn"]
    assert recompute_kwargs(m, p, resolved(p), grouped_gemm=False) == {}


def test_transformer_config_fields(monkeypatch):
    m = _model()
    fused = (
        "apply_rope_fusion",
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "masked_softmax_fusion",
        "gradient_accumulation_fusion",
        "persist_layer_norm",
        "moe_grouped_gemm",
        "moe_permute_fusion",
        "moe_router_fusion",
    )
    _te(monkeypatch, False)  # CPU defaults: as before these knobs existed
    c = builder.transformer_config(m, ParallelConfig())
    assert not any(getattr(c, f) for f in fused) and c.recompute_granularity is None
    c = builder.transformer_config(m, ParallelConfig(recompute_activations=True))
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "uniform", 1)
    with pytest.warns(UserWarning, match="core_attn"):  # Megatron's note on recomputing attention
        c = builder.transformer_config(m, ParallelConfig(selective_recompute=True))
    assert c.recompute_granularity == "selective" and c.recompute_modules == ["core_attn"]
    _te(monkeypatch, True)  # TE without fusions builds on CPU too; selective recompute stays on
    c = builder.transformer_config(m, ParallelConfig(fusions=False))
    assert not any(getattr(c, f) for f in fused)
    assert c.recompute_granularity == "selective" and c.recompute_modules == ["layernorm"]


@pytest.mark.parametrize("te", [False, True])
def test_ddp_config(monkeypatch, te):
    _te(monkeypatch, te)
    c = builder.ddp_config(ParallelConfig())
    assert (c.overlap_grad_reduce, c.overlap_param_gather, c.use_distributed_optimizer) == (te, False, True)
    assert c.grad_reduce_in_fp32
    c = builder.ddp_config(ParallelConfig(use_distributed_optimizer=False, overlap_grad_reduce=True))
    assert (c.overlap_grad_reduce, c.overlap_param_gather, c.use_distributed_optimizer) == (
        True,
        False,
        False,
    )


def test_config_rejects_impossible_combinations():
    with pytest.raises(
        ConfigError,
        match=r"actor\.parallel\.overlap_param_gather=true needs "
        r"actor\.parallel\.use_distributed_optimizer=true",
    ):
        load_config(
            None,
            ["actor.parallel.overlap_param_gather=true", "actor.parallel.use_distributed_optimizer=false"],
        )
    with pytest.raises(ConfigError, match=r"critic\.parallel\.selective_recompute=true with recompute_activations"):
        load_config(None, ["critic.parallel.selective_recompute=true", "critic.parallel.recompute_activations=true"])
    load_config(None, ["actor.parallel.overlap_param_gather=true", "actor.parallel.fusions=false"])


# --- the critic's frozen set on both layer specs -----------------------------------------------


def _module_with(names: list[str]) -> torch.nn.Module:
    """A module tree whose parameters have exactly ``names``."""
    root = torch.nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(1)))
    return root


def test_canonical_names_map_te_specs_onto_the_local_spec():
    m = _model(add_qkv_bias=True)
    local = mcore_names(m, "local")
    assert [canonical_name(n) for n in local] == local
    for spec in ("te", "te_grouped"):
        assert sorted(canonical_name(n) for n in mcore_names(m, spec)) == sorted(local), spec
    assert canonical_name("module.decoder.layers.3.self_attention.linear_qkv.layer_norm_bias") == (
        "module.decoder.layers.3.input_layernorm.bias"
    )


@pytest.mark.parametrize(
    "critic",
    [
        CriticConfig(),
        CriticConfig(freeze_patterns=[r"\.self_attention\.", r"\.experts\."], train_patterns=["fc2"]),
        CriticConfig(freeze_patterns=["layernorm"]),
    ],
    ids=["default", "experts_fc2", "norms"],
)
def test_frozen_set_is_the_same_on_both_specs(critic):
    m = _model()
    local = freeze(_module_with(mcore_names(m, "local")), critic.freeze_patterns, critic.train_patterns)
    assert local
    for spec in ("te", "te_grouped"):
        te = freeze(_module_with(mcore_names(m, spec)), critic.freeze_patterns, critic.train_patterns)
        assert sorted(map(canonical_name, te)) == sorted(local), spec
    if critic.freeze_patterns == CriticConfig().freeze_patterns:  # the input norm trains on both specs
        assert not any(".input_layernorm." in n for n in local)
        assert "decoder.layers.0.self_attention.q_layernorm.weight" in local


def _local_critic_world(rank, world):
    """Frozen names of a real local-spec critic; actor gradients with selective / full recompute vs none."""
    from sao_megatron.models.critic import build_critic
    from sao_megatron.parallel import initialize_model_parallel, seed_everything

    m = _model()
    p = ParallelConfig()
    initialize_model_parallel(p)
    critic = build_critic(m, p, CriticConfig())
    frozen = sorted(n for n, q in critic.named_parameters() if not q.requires_grad)
    grads = []
    for recompute in ({}, {"selective_recompute": True}, {"recompute_activations": True}):
        seed_everything(0)
        actor = builder.build_gpt(m, dataclasses.replace(p, **recompute))
        tokens = torch.randint(0, m.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        actor(tokens, torch.arange(16).expand(2, 16), attention_mask=None).float().square().mean().backward()
        grads.append({n: q.grad.clone() for n, q in actor.named_parameters() if q.grad is not None})
    diffs = [max((g[n] - grads[0][n]).abs().max().item() for n in grads[0]) for g in grads[1:]]
    return {
        "frozen": frozen,
        "recompute_grad_diffs": diffs,
        "same_params": all(sorted(g) == sorted(grads[0]) for g in grads),
    }


def test_real_local_critic_freezes_the_analytic_set_and_recompute_keeps_gradients():
    from tests.distributed import run_distributed

    (r,) = run_distributed(_local_critic_world, 1)
    m = _model()
    expected = freeze(_module_with(mcore_names(m, "local")), CriticConfig().freeze_patterns)
    assert r["frozen"] == sorted(expected)
    # recompute reruns the same forward kernels on the same inputs: the same gradients, bit for bit
    assert r["same_params"] and r["recompute_grad_diffs"] == [0.0, 0.0], r["recompute_grad_diffs"]


# --- overlapped gradient reduce and parameter gather on CPU (2-rank gloo) ----------------------


def _weights_after_steps(overlap: bool, sizes: tuple[int, ...]) -> tuple[list[dict], list[dict], bool]:
    """Actor weights after each update (read at once, and after a forced parameter all-gather)."""
    from megatron.core import parallel_state as ps

    from sao_megatron.batch import build_batch
    from sao_megatron.models import layout
    from sao_megatron.workers.actor import ActorWorker
    from sao_megatron.workers.rank import coordinates
    from tests.workers.worker_cases import config, trajectories

    knobs = {
        "micro_batch_size": 1,
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": overlap,
        "overlap_param_gather": overlap,
    }
    cfg = config(2, **{f"actor.parallel.{k}": v for k, v in knobs.items()}, **{"actor.optim.clip_grad": 1e6})
    actor = ActorWorker(ActorRankConfig.of(cfg))
    wired = actor.role.config.no_sync_func is not None
    # What MegatronRole must do with overlap_grad_reduce (Megatron-LM's training.py does it too):
    # without it each micro-batch's backward counts as the last one and a step with another
    # number of micro-batches than the first reduces early (wrong gradients) or never (assert).
    actor.role.config.no_sync_func = actor.role.model.no_sync
    raw, synced = [], []
    for n in sizes:  # 1 micro-batch per rank, then 4, then 2
        batch = build_batch(trajectories(n, seed=n))
        c = coordinates()
        shard = batch.shard(c.dp_size)[c.dp_rank]
        t = batch.tokens.shape[1]
        adv = torch.where(batch.action_mask > 0, torch.linspace(-1, 1, t).expand_as(batch.action_mask), 0.0)
        actor.update(shard, shard.take(adv), 0)
        raw.append({k: v.detach().clone() for k, v in layout.gather_full(actor.role.module).items()})
        actor.role.model.start_param_sync(force_sync=True)  # what export / save need after a step
        synced.append({k: v.detach().clone() for k, v in layout.gather_full(actor.role.module).items()})
    ps.destroy_model_parallel()
    return raw, synced, wired


def _overlap_world(rank, world):
    sizes = (2, 8, 4)
    _, ref, _ = _weights_after_steps(False, sizes)
    raw, synced, wired = _weights_after_steps(True, sizes)

    def diff(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in a)

    return {
        "synced": [diff(s, r) for s, r in zip(synced, ref, strict=True)],
        "raw": [diff(s, r) for s, r in zip(raw, ref, strict=True)],
        "wired": wired,
    }


@pytest.fixture(scope="module")
def overlap_results():
    from tests.distributed import run_distributed

    return run_distributed(_overlap_world, 2)


# Exact by construction: overlapping moves when each bucket is reduced, not what is added: on 2 ranks each
# gradient entry is a + b either way, so the weights after every step are the same bit for bit.


def test_overlapped_reduce_and_gather_match_on_cpu_with_the_sync_hooks(overlap_results):
    for r in overlap_results:
        assert max(r["synced"]) == 0.0, r


def test_megatron_role_wires_the_overlap_hooks(overlap_results):
    for r in overlap_results:
        assert r["wired"] and max(r["raw"]) == 0.0, r
