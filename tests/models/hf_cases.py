"""Fixtures and worker bodies for the HF bridge tests.

The parent (pytest) builds tiny random Qwen3-MoE / Qwen3 models with ``transformers`` (float32,
no downloads), saves them with ``save_pretrained`` and records their logits. The workers (one
spawned 2-rank gloo world) load the checkpoints into Megatron at several layouts, compare
logits, export back to HF and measure resident memory while loading a larger checkpoint.
"""

from __future__ import annotations

import json
import resource
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron.config import ModelConfig, ParallelConfig
from sao_megatron.config import hf as hf_config
from sao_megatron.models import hf_bridge, hf_io
from sao_megatron.models.hf_weights import release_free_memory

VOCAB, SEQ, BATCH = 128, 16, 2
_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
# name -> (HF config kwargs, save_pretrained max_shard_size or None for one file)
SHAPES: dict[str, tuple[dict, str | None]] = {
    "moe_gqa2": (
        dict(
            arch="moe",
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            rope_theta=10000.0,
        ),
        "60KB",
    ),
    "moe_step2_top3": (
        dict(
            arch="moe",
            hidden_size=48,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=3,
            num_hidden_layers=4,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            rope_theta=1000000.0,
        ),
        None,
    ),
    "dense_tied": (
        dict(
            arch="dense",
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            intermediate_size=96,
            num_hidden_layers=2,
            tie_word_embeddings=True,
        ),
        "40KB",
    ),
    "dense_gqa3": (
        dict(
            arch="dense",
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            num_hidden_layers=2,
        ),
        None,
    ),
    # Routing variants (issue 11): one 2-rank layout each besides the single rank.
    "moe_no_renorm": (
        dict(
            arch="moe",
            norm_topk_prob=False,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            layouts=["ep2"],
        ),
        None,
    ),
    "moe_top1": (
        dict(
            arch="moe",
            norm_topk_prob=False,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=1,
            num_hidden_layers=2,
            layouts=["ep2"],
        ),
        None,
    ),
    "moe_top1_renorm": (
        dict(
            arch="moe",
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=1,
            num_hidden_layers=2,
            layouts=["tp2"],
        ),
        None,
    ),
    # Qwen2-MoE: q/k/v biases, no q/k norm, gated shared expert, no renormalisation (its default).
    "qwen2_moe": (
        dict(
            arch="qwen2_moe",
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            decoder_sparse_step=1,
            layouts=["tp2", "ep2"],
        ),
        "20KB",
    ),
    "qwen2_moe_renorm_top1": (
        dict(
            arch="qwen2_moe",
            norm_topk_prob=True,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=1,
            num_hidden_layers=2,
            mlp_only_layers=[0],
            layouts=["ep2"],
        ),
        None,
    ),
}
# Keys of DeepSeek's published config.json that transformers' DeepseekV3Config lacks and SGLang's
# deepseek_v2 class reads (the values DeepSeek-V3 and Kimi-K2 publish; the bridge accepts exactly these).
_DEEPSEEK_PUBLISHED = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
# Issue 31: Mixtral and GLM-4.5 at every 2-rank layout (tests/models/test_hf_families.py, a world of its own).
FAMILY_SHAPES: dict[str, tuple[dict, str | None]] = {
    # Mixtral: softmax top-2 renormalised, GQA, no q/k norm, no biases, every layer MoE.
    "mixtral": (
        dict(
            arch="mixtral",
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            layouts=["tp2", "ep2", "pp2"],
        ),
        "20KB",
    ),
    # GLM-4.5: sigmoid router with expert bias, 4 groups / top-2 groups, score scaling, an ungated
    # shared expert (2 x the expert width), q/k/v biases, RoPE on half of each head, a dense first layer.
    "glm4_moe": (
        dict(
            arch="glm4_moe",
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            attention_bias=True,
            num_hidden_layers=4,
            layouts=["tp2", "ep2", "pp2"],
        ),
        "30KB",
    ),
    # GLM-4.6 style: q/k norm, no groups, top-2 of 4.
    "glm4_moe_qk_norm": (
        dict(
            arch="glm4_moe",
            use_qk_norm=True,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=0,
            attention_bias=True,
            num_hidden_layers=2,
            layouts=["tp2"],
        ),
        None,
    ),
    # DeepSeek-V3 / Kimi-K2: multi-latent attention with a query LoRA (interleaved RoPE on 4 of each
    # head's 12 query/key dims), the GLM-style sigmoid router (8 experts, top-4 in 4 groups / top-2
    # groups, scale 2.5, expert bias), one shared expert, the first layer dense.
    "deepseek_v3": (
        dict(
            arch="deepseek_v3",
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,  # DeepseekV3Config's default is 128 whatever the heads
            **_DEEPSEEK_PUBLISHED,
            q_lora_rank=16,
            kv_lora_rank=12,  # + 4 RoPE dims: 16 rows of kv_a_proj_with_mqa, split over TP 2
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            num_hidden_layers=4,
            layouts=["tp2", "ep2", "pp2"],
        ),
        "30KB",
    ),
    # YaRN (DeepSeek-V3's long-context RoPE): factor 4 over 64 original positions; mscale differs from
    # mscale_all_dim, so both the cos/sin scale and the softmax temperature differ from plain RoPE.
    "deepseek_v3_yarn": (
        dict(
            arch="deepseek_v3",
            rope_extra=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=0.8,
                mscale_all_dim=1.0,
            ),
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,  # DeepseekV3Config's default is 128 whatever the heads
            **_DEEPSEEK_PUBLISHED,
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            first_k_dense_replace=0,
            num_hidden_layers=2,
            layouts=["tp2"],
        ),
        None,
    ),
}
LAYOUTS = {"single": {}, "tp2": {"tensor_parallel": 2}, "ep2": {"expert_parallel": 2}, "pp2": {"pipeline_parallel": 2}}


def layouts_of(shape: str) -> list[str]:
    """EP only for MoE. No PP for tied embeddings: Megatron moves the last stage's copy of the
    embedding to CUDA at construction (``LanguageModule.setup_embeddings_and_output_layer``),
    which ``megatron_cpu`` does not patch; the tied mapping is covered by the bridge tests.
    A shape's ``layouts`` key picks its 2-rank layouts (the routing variants: one or two each)."""
    kw = {**SHAPES, **FAMILY_SHAPES}[shape][0]
    if "layouts" in kw:
        return ["single", *kw["layouts"]]
    return [
        k for k in LAYOUTS if (k != "ep2" or kw["arch"] == "moe") and (k != "pp2" or not kw.get("tie_word_embeddings"))
    ]


# --------------------------------------------------------------------------------------------
# Parent side: HF models with transformers
# --------------------------------------------------------------------------------------------
def build_hf_model(shape: str, seed: int = 0):
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    kw = dict({**SHAPES, **FAMILY_SHAPES}[shape][0])
    arch = kw.pop("arch")
    kw.pop("layouts", None)
    rope = {"rope_theta": kw.pop("rope_theta", 10000.0), "rope_type": "default"}
    if arch == "glm4_moe":
        rope["partial_rotary_factor"] = 0.5  # GLM's default, stated: rope_parameters replaces the default
    rope.update(kw.pop("rope_extra", {}))
    kw = {**_COMMON, **kw, "rope_parameters": rope}
    if arch == "moe":
        config = Qwen3MoeConfig(**{"norm_topk_prob": True, **kw})
        cls = Qwen3MoeForCausalLM
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(**kw)  # qkv_bias=True, norm_topk_prob=False by default
        cls = Qwen2MoeForCausalLM
    elif arch == "mixtral":
        config = MixtralConfig(**kw)
        cls = MixtralForCausalLM
    elif arch == "glm4_moe":
        config = Glm4MoeConfig(**kw)  # partial_rotary_factor 0.5, norm_topk_prob true by default
        cls = Glm4MoeForCausalLM
    elif arch == "deepseek_v3":
        config = DeepseekV3Config(**kw)  # rope_interleave, norm_topk_prob true; num_key_value_heads = heads
        cls = DeepseekV3ForCausalLM
    else:
        config = Qwen3Config(**kw)
        cls = Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # decisive routing: no near-ties between float32 paths
            elif name.endswith("proj.bias"):
                p.normal_(0.0, 0.3)
            elif name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.3)  # sigmoid gates spread over (0, 1)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: zero unless set (routing must use it)
                b.normal_(0.0, 0.3)
    return model


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def make_checkpoints(root: Path, shapes: dict | None = None) -> dict[str, Path]:
    """Save every shape (of :data:`SHAPES` by default) with ``save_pretrained`` and its logits on
    :func:`tokens` to ``reference.pt``."""
    dirs, reference = {}, {}
    for shape, (_, shard) in (SHAPES if shapes is None else shapes).items():
        model = build_hf_model(shape)
        out = root / "hf" / shape
        model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
        (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
        with torch.no_grad():
            reference[shape] = model(input_ids=tokens()).logits.float()
        dirs[shape] = out
    torch.save(reference, root / "reference.pt")
    return dirs


def write_big_checkpoint(directory: Path, m: ModelConfig, shard_bytes: int = 48 << 20, seed: int = 0) -> int:
    """A random HF checkpoint of ``m`` (float32, sharded) written without transformers; returns bytes."""
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    specs = [hf_io.TensorSpec(n, hf_bridge.hf_shape(n, m), torch.float32) for n in hf_bridge.expected_hf_names(m)]
    writer = hf_io.ShardWriter(directory, specs, shard_bytes)
    for spec in specs:
        writer.write(spec.name, torch.randn(spec.shape, generator=g) * 0.05)
    writer.finish()
    (directory / "config.json").write_text(json.dumps(hf_config.hf_config_from_model(m)))
    return writer.bytes_written


MEMORY_MODEL = ModelConfig(
    name="mem",
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=64,
    ffn_hidden_size=512,
    vocab_size=1024,
    num_experts=16,
    moe_router_topk=2,
    moe_ffn_hidden_size=1024,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


# --------------------------------------------------------------------------------------------
# Worker side (spawned gloo ranks)
# --------------------------------------------------------------------------------------------
def _setup(world: int, **kw) -> ParallelConfig:
    from sao_megatron.parallel import initialize_model_parallel, seed_everything

    p = ParallelConfig(world_size=world, use_distributed_optimizer=False, **kw)
    initialize_model_parallel(p)
    seed_everything(1234)
    return p


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class _PeakRSS:
    """Samples this process's RSS every 2 ms in a thread (tracemalloc does not see torch storage)."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def case_memory(rank, world, hf_dir: str) -> dict:
    """Peak RSS of a rank loading its EP=2 half of a sharded checkpoint, against its shard size."""
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_weights import load_hf_weights

    p = _setup(world, expert_parallel=2)
    base = _rss()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_gpt(MEMORY_MODEL, p)
    shard = sum(q.numel() * q.element_size() for q in model.parameters())
    build_peak = _rss()
    release_free_memory()  # the random initialisation's temporaries, kept by malloc otherwise
    after_build = _rss()
    with _PeakRSS() as peak:
        stats = load_hf_weights(model, MEMORY_MODEL, hf_dir)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checksum = float(sum(q.detach().double().sum() for q in model.parameters()))
    del model
    return {
        "base": base,
        "build_peak": build_peak,
        "after_build": after_build,
        "peak": peak.peak,
        "shard": shard,
        "maxrss_before": maxrss_before,
        "maxrss": maxrss,
        "bytes_read": stats.extra["bytes_read"],
        "checksum": checksum,
        "load_s": stats.seconds,
    }


def _forward_logits(model, p: ParallelConfig, toks: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [B, T, V] (None on a PP stage that is not the last)."""
    from megatron.core import parallel_state as ps

    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    if p.pipeline_parallel > 1:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        captured = []

        def step(data_iterator, model):
            output = model(toks, positions, attention_mask=None)

            def loss_func(logits):
                captured.append(logits.detach())
                return logits.sum() * 0.0, {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            forward_only=True,
        )
        logits = captured[0] if captured else None
    else:
        logits = model(toks, positions, attention_mask=None).detach()
    if logits is None:
        return None
    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits


def case_parity(rank, world, root: str, shape: str, layout_name: str) -> dict:
    """HF checkpoint -> Megatron at a layout: logits vs transformers; then export back to HF."""
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_weights import iter_hf_weights, load_hf_weights, save_hf_checkpoint

    root_path = Path(root)
    hf_dir = root_path / "hf" / shape
    m = hf_config.model_config_from_hf(hf_config.read_hf_config(hf_dir), name=shape)
    p = _setup(world, **LAYOUTS[layout_name])
    model = build_gpt(m, p)
    model.eval()
    load_hf_weights(model, m, hf_dir)
    logits = _forward_logits(model, p, tokens())
    out = {"logits": None}
    if logits is not None:
        reference = torch.load(root_path / "reference.pt")[shape]
        out["logits"] = (logits - reference).abs().max().item()
        if layout_name == "single" and m.moe_router_enable_expert_bias:
            out["logits_without_bias"] = _logits_without_bias(model, p, reference)
    save_hf_checkpoint(
        model, m, root_path / "export" / f"{shape}-{layout_name}", template=hf_dir, max_shard_bytes=50_000
    )
    if layout_name == "pp2":  # the parallel weight sync's stream: each stage to its own sender
        out["per_stage"] = _per_stage_stream(model, m, root_path / "per_stage" / f"{shape}-rank{rank}.pt")
    if layout_name in ("ep2", "tp2"):
        bucket_bytes = 40_000  # above the largest tensor (the 32 KB embedding)
        buckets = list(iter_hf_weights(model, m, bucket_bytes=bucket_bytes))
        if rank == 0:  # what a weight sync hands an engine, bucket by bucket (tests/models/sglang_load.py reads it)
            (root_path / "stream").mkdir(exist_ok=True)
            torch.save(
                [[(n, t.clone()) for n, t in b] for b in buckets], root_path / "stream" / f"{shape}-{layout_name}.pt"
            )
        sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
        over = [s for s in sizes if s > bucket_bytes]
        names = [n for b in buckets for n, _ in b]
        out["buckets"] = {
            "count": len(buckets),
            "nonempty": sum(1 for b in buckets if b),
            "over": over,
            "names": names,
            "unique": len(set(names)) == len(names),
        }
    return out


def _logits_without_bias(model, p: ParallelConfig, reference: torch.Tensor) -> float:
    """Max |logits - reference| with every router's expert bias zeroed, then restored: how much
    routing depends on the bias the loader read."""
    biases = [b for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    saved = [b.clone() for b in biases]
    for b in biases:
        b.zero_()
    logits = _forward_logits(model, p, tokens())
    for b, v in zip(biases, saved, strict=True):
        b.copy_(v)
    assert logits is not None
    return (logits - reference).abs().max().item()


def case_bias_update(rank, world, root: str, mode: str) -> dict:
    """One actor optimizer step of the GLM shape (DP=2) with ``actor.router_bias_update=mode``:
    every router's expert bias before and after, and the bias the HF weight stream then sends."""
    from sao_megatron.batch import MicroBatch
    from sao_megatron.config import ActorConfig, OptimizerConfig
    from sao_megatron.models.hf_weights import iter_hf_weights
    from sao_megatron.workers.role import build_actor_role

    hf_dir = Path(root) / "hf" / "glm4_moe"
    m = hf_config.model_config_from_hf(hf_config.read_hf_config(hf_dir))
    p = _setup(world)
    actor = ActorConfig(parallel=p, optim=OptimizerConfig(lr=1e-4), init_from=str(hf_dir), router_bias_update=mode)
    role = build_actor_role(m, actor)  # type: ignore[arg-type]  # mode is a RouterBiasUpdate value

    def biases() -> dict[str, torch.Tensor]:
        return {n: b.detach().clone() for n, b in role.module.named_buffers() if n.endswith("router.expert_bias")}

    before = biases()
    micro = MicroBatch.of_tokens(tokens(rank))

    def loss_fn(logits, mb):
        return logits.float().pow(2).mean() * 1e-3, {}

    role.model.train()
    role.forward_backward([micro], loss_fn)
    role.step()
    after = biases()
    sent = {n: t.clone() for b in iter_hf_weights(role.module, m) for n, t in b if "e_score_correction_bias" in n}
    return {
        "moved": {n: (after[n] - before[n]).tolist() for n in before},
        "sent": {n: t.tolist() for n, t in sent.items()},
        "after": {n: t.tolist() for n, t in after.items()},
        "sent_dtypes": sorted({str(t.dtype) for t in sent.values()}),
    }


def family_cases(rank, world, root: str) -> dict:
    """Issue 31's cases in one world: Mixtral and GLM-4.5 at every layout, the bias update modes."""
    results = {}
    for shape in FAMILY_SHAPES:
        for layout_name in layouts_of(shape):
            results[f"{shape}/{layout_name}"] = case_parity(rank, world, root, shape, layout_name)
    for mode in ("freeze", "train"):
        results[f"bias_update/{mode}"] = case_bias_update(rank, world, root, mode)
    return results


def _per_stage_stream(model, m, out_file: Path) -> dict:
    """``HFWeightStream(per_stage=True)`` gathering in a thread over a group of its own (as the
    weight sync does); this rank's tensors saved to ``out_file``, its plan and buckets returned."""
    from sao_megatron.models.hf_weights import HFWeightStream
    from sao_megatron.weight_sync import prefetched

    stream = HFWeightStream(model, m, per_stage=True, group=dist.new_group())
    bucket_bytes = 20_000
    plan = stream.bucket_plan(bucket_bytes)
    got = list(prefetched(stream.buckets(bucket_bytes)))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({n: t.clone() for b in got for n, t in b}, out_file)
    return {
        "senders": stream.senders,
        "stage": stream.stage,
        "planned": [[(t.name, list(t.shape), str(t.dtype)) for t in b] for b in plan[stream.stage]],
        "got": [[(n, list(t.shape), str(t.dtype)) for n, t in b] for b in got],
        "other_stages": [[t.name for b in stage for t in b] for stage in plan],
    }


def case_corrupt(rank, world, hf_dir: str) -> dict:
    """A checkpoint with one wrong-shaped tensor fails before any parameter is written."""
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_weights import load_hf_weights

    m = hf_config.model_config_from_hf(hf_config.read_hf_config(hf_dir))
    p = _setup(world, expert_parallel=2)
    model = build_gpt(m, p)
    before = [q.detach().clone() for q in model.parameters()]
    try:
        load_hf_weights(model, m, hf_dir)
        message = None
    except hf_io.CheckpointError as err:
        message = str(err)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return {"message": message, "unchanged": unchanged}


def all_cases(rank, world, root: str) -> dict:
    results = {"memory": case_memory(rank, world, str(Path(root) / "big"))}
    results["corrupt"] = case_corrupt(rank, world, str(Path(root) / "corrupt"))
    for shape in SHAPES:
        for layout_name in layouts_of(shape):
            results[f"{shape}/{layout_name}"] = case_parity(rank, world, root, shape, layout_name)
    return results
