"""Bodies of the GPU check's spawned worlds (one rank, NCCL + bf16 on a GPU, gloo + float32 on CPU).

Each ``*_case(rank, world, spec)`` runs through :func:`sao_megatron.spawn.run_world` and returns
plain JSON. They drive the real workers (``ActorWorker``, ``CriticWorker``) exactly as the
driver does: ``build_batch`` -> ``batch.shard(dp)[dp_rank]`` -> ``update`` / ``logprobs`` /
``values``. ``spec["deadline"]`` (``time.time()`` seconds) stops timing loops early.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
import traceback
from collections.abc import Callable

import torch

from benchmarks.gpu.workload import BatchShape, ragged_trajectories
from sao_megatron.batch import BatchShard, RowOutputs, TrainBatch, assemble_rows, build_batch
from sao_megatron.config import ModelConfig, SAOConfig, load_config
from sao_megatron.config.rank import ActorRankConfig, CriticRankConfig


def run_config(spec: dict, *, bf16: bool, mode: dict | None = None) -> SAOConfig:
    """One-rank actor and critic of ``spec["model"]`` (a full shape, or overrides of tiny_moe).

    ``mode``: ``{"pack": bool, "max_tokens": int, "rows": int}`` (``parallel.pack_sequences``,
    ``max_tokens_per_micro_batch`` and ``micro_batch_size`` of both roles); absent keys keep the
    schema's defaults (``rows``: ``spec["micro_batch_size"]``)."""
    mode = mode or {}
    flag = "true" if bf16 else "false"
    overrides = {
        "actor.parallel.world_size": 1,
        "critic.parallel.world_size": 1,
        "actor.bf16": flag,
        "critic.bf16": flag,
        "actor.parallel.micro_batch_size": mode.get("rows", spec["micro_batch_size"]),
        "critic.parallel.micro_batch_size": mode.get("rows", spec["micro_batch_size"]),
        "critic.value_head_init": "normal",
        "actor.parallel.use_distributed_optimizer": "false",
        "critic.parallel.use_distributed_optimizer": "false",
    }
    # named only when asked for, so a schema without the keys still runs the padded case
    for role in ("actor", "critic"):
        if mode.get("pack"):
            overrides[f"{role}.parallel.pack_sequences"] = "true"
        if mode.get("max_tokens"):
            overrides[f"{role}.parallel.max_tokens_per_micro_batch"] = mode["max_tokens"]
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    model = spec["model"]
    shape = (
        ModelConfig(**model) if "num_layers" in model and "name" in model else dataclasses.replace(cfg.model, **model)
    )
    return dataclasses.replace(cfg, model=shape)


def _batch(spec: dict) -> tuple[TrainBatch, torch.Tensor]:
    """The ragged batch and per-token advantages ``[B, T]`` (a ramp over positions, 0 off actions)."""
    batch = build_batch(ragged_trajectories(BatchShape(**spec["batch"])))
    ramp = torch.linspace(-1, 1, batch.tokens.shape[1]).expand_as(batch.action_mask)
    return batch, torch.where(batch.action_mask > 0, ramp, torch.zeros(()))


def _shard(batch: TrainBatch) -> BatchShard:
    """This rank's data-parallel replica's rows, as the driver places them (a role must exist)."""
    from sao_megatron.workers.rank import coordinates

    c = coordinates()
    return batch.shard(c.dp_size)[c.dp_rank]


def _rows(part: RowOutputs | None, batch: TrainBatch) -> torch.Tensor:
    return assemble_rows([part], batch.size, batch.tokens.shape[1])


def _release(*roles) -> None:
    """Free ``roles`` (``MegatronRole.close``: a stepped role is not freed by dropping it), drop the
    Megatron groups and return the memory before the next role is built."""
    from megatron.core import parallel_state as ps

    for role in roles:
        role.close()
    ps.destroy_model_parallel()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _copy_weights(role) -> dict[str, torch.Tensor]:
    from sao_megatron.models import layout

    return {k: v.detach().float().clone() for k, v in layout.gather_full(role.module).items()}


def _load_weights(role, weights: dict[str, torch.Tensor]) -> None:
    """Same weights as the reference; the optimizer's float32 main copy is refreshed too."""
    from sao_megatron.models import layout

    layout.load_full(role.module, weights)
    role.optimizer.reload_model_params()


def _finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


def _masked_stats(diff: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    d = diff.abs()[mask]
    return {"max": float(d.max()), "mean": float(d.mean())}


def layout_case(rank: int, world: int, spec: dict) -> dict:
    """Ragged batch through actor (logprobs, update, logprobs) and critic (values, update).

    Reference: a float32 build. Under test, for each of ``spec["modes"]`` (name -> micro-batching,
    see :func:`run_config`): the same weights at ``spec["bf16"]``. Reports finiteness,
    bf16-vs-fp32 logprob and value differences on action tokens, and each mode's logprob
    difference from the ``padded`` mode (same precision)."""
    from sao_megatron.workers.actor import ActorWorker
    from sao_megatron.workers.critic import CriticWorker

    batch, advantages = _batch(spec)
    mask = batch.action_mask > 0
    ref_cfg = run_config(spec, bf16=False)
    actor = ActorWorker(ActorRankConfig.of(ref_cfg))
    shard = _shard(batch)
    actor_weights, ref_logprobs = _copy_weights(actor.role), _rows(actor.logprobs(shard), batch)
    _release(actor.role)
    del actor
    critic = CriticWorker(CriticRankConfig.of(ref_cfg), "")
    critic_weights, ref_values = _copy_weights(critic.role), _rows(critic.values(shard), batch)
    _release(critic.role)
    del critic
    out: dict = {
        "lengths": batch.lengths.tolist(),
        "tokens": int(batch.lengths.sum()),
        "action_tokens": int(mask.sum()),
        "micro_batch_size": spec["micro_batch_size"],
        "reference_dtype": "float32",
        "dtype": "bfloat16" if spec["bf16"] else "float32",
        "modes": {},
    }
    kept: dict[str, torch.Tensor] = {}
    for name, mode in spec["modes"].items():
        try:
            summary, kept[name] = _layout_mode(
                spec, mode, (batch, shard, mask, advantages), actor_weights, critic_weights, ref_logprobs, ref_values
            )
            out["modes"][name] = summary
        except Exception:
            out["modes"][name] = {"error": traceback.format_exc()[-3000:]}
            _release()
    for name in kept.keys() - {"padded"} if "padded" in kept else ():
        out["modes"][name]["logprobs_vs_padded"] = _masked_stats(kept[name] - kept["padded"], mask)
    return out


def _layout_mode(
    spec, mode, data, actor_weights, critic_weights, ref_logprobs, ref_values
) -> tuple[dict, torch.Tensor]:
    from sao_megatron import algo
    from sao_megatron.workers.actor import ActorWorker
    from sao_megatron.workers.critic import CriticWorker

    batch, shard, mask, advantages = data
    cfg = run_config(spec, bf16=spec["bf16"], mode=mode)
    actor = ActorWorker(ActorRankConfig.of(cfg))
    _load_weights(actor.role, actor_weights)
    logprobs = _rows(actor.logprobs(shard), batch)
    metrics = actor.update(shard, shard.take(advantages), 1)
    after = _rows(actor.logprobs(shard), batch)
    _release(actor.role)
    del actor
    critic = CriticWorker(CriticRankConfig.of(cfg), "")
    _load_weights(critic.role, critic_weights)
    values = _rows(critic.values(shard), batch)
    _, returns, _ = algo.gae(batch.rewards, values, mask, gamma=1.0, lam=0.95)
    critic_metrics = critic.update(shard, shard.take(returns), shard.take(values))
    _release(critic.role)
    del critic
    finite = {
        "logprobs": bool(logprobs[mask].isfinite().all()),
        "logprobs_after_update": bool(after[mask].isfinite().all()),
        "actor_metrics": _finite(metrics),
        "values": bool(values[mask].isfinite().all()),
        "critic_metrics": _finite(critic_metrics),
    }
    summary = {
        "finite": finite,
        "all_finite": all(finite.values()),
        "logprobs_vs_fp32": _masked_stats(logprobs - ref_logprobs, mask),
        "values_vs_fp32": _masked_stats(values - ref_values, mask),
        "logprob_change_after_update": _masked_stats(after - logprobs, mask),
        "actor": {k: metrics.get(k) for k in ("loss", "grad_norm", "entropy", "updated")},
        "critic": {k: critic_metrics.get(k) for k in ("value_loss", "loss", "grad_norm")},
    }
    return summary, logprobs


# --------------------------------------------------------------------------------------------
# Transformer Engine spec vs local spec, same weights
# --------------------------------------------------------------------------------------------
def _gpt(m: ModelConfig, config, use_te: bool):
    """``builder.build_gpt``'s model with the layer spec chosen explicitly (TE or local)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=m.vocab_size,  # pyright: ignore[reportArgumentType]
        max_sequence_length=m.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(m.rope_theta),
        parallel_output=True,
    )


TE_ONLY_SETTINGS = (
    "moe_grouped_gemm",
    "gradient_accumulation_fusion",
    "apply_rope_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
)
"""``TransformerConfig`` switches that need TE kernels: off for the local-spec twin."""


def _local_config(te_config):
    names = {f.name for f in dataclasses.fields(te_config)}
    off = {k: False for k in TE_ONLY_SETTINGS if k in names}
    return dataclasses.replace(te_config, **off, recompute_granularity=None)


def te_case(rank: int, world: int, spec: dict) -> dict:
    """Logits of a TE-spec GPTModel and a local-spec one holding the same weights (mapped through
    the HF names of ``models.hf_bridge``), float32 and bf16, on a ragged-length token batch."""
    from sao_megatron.config import ParallelConfig
    from sao_megatron.models import hf_bridge, layout
    from sao_megatron.models.builder import transformer_config
    from sao_megatron.workers.rank import init_rank

    cfg = run_config(spec, bf16=False)
    m, p = cfg.model, ParallelConfig()
    init_rank(p, cfg.run.seed)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(6, m.vocab_size, (2, spec["seq_len"]), generator=g).cuda()
    positions = torch.arange(spec["seq_len"]).expand(2, -1).cuda()
    out = {}
    for bf16 in (False, True):
        te_config = transformer_config(m, p, bf16=bf16)
        local_config = _local_config(te_config)
        te_model, local_model = _gpt(m, te_config, True).cuda(), _gpt(m, local_config, False).cuda()
        hf = hf_bridge.mcore_to_hf(layout.gather_full(te_model), m)
        names = [n for n, _ in local_model.named_parameters()]
        layout.load_full(local_model, hf_bridge.hf_to_mcore(hf, m, names))
        with torch.no_grad():
            a = te_model.eval()(tokens, positions, attention_mask=None).float()
            b = local_model.eval()(tokens, positions, attention_mask=None).float()
        lp = torch.log_softmax(a, -1) - torch.log_softmax(b, -1)
        out["bfloat16" if bf16 else "float32"] = {
            "logits_max_abs_diff": float((a - b).abs().max()),
            "logits_scale": float(b.abs().max()),
            "logprobs_max_abs_diff": float(lp.abs().max()),
            "finite": bool(a.isfinite().all() and b.isfinite().all()),
        }
        del te_model, local_model
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------
# Throughput: our RL steps vs a plain Megatron-Core training step of the same model
# --------------------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object]) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def plain_micro_batches(batch: TrainBatch, size: int) -> list[dict]:
    """Rows in groups of ``size``, each trimmed to its longest row (the padding ours uses unpacked)."""
    out = []
    for start in range(0, batch.size, size):
        part = batch.select(slice(start, start + size))
        t = int(part.lengths.max())
        out.append({k: getattr(part, k)[:, :t] for k in ("tokens", "positions", "labels", "action_mask")})
    return out


def plain_megatron_step(role, micro: list[dict], num_tokens: float) -> float:
    """pretrain_gpt's step: ``GPTModel(tokens, positions, labels=...)`` -> per-token cross-entropy,
    masked mean over ``num_tokens``; same DDP wrapper and optimizer as ours. Returns the loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    where = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    micro = [{k: v.to(where) for k, v in mb.items()} for mb in micro]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb["tokens"], mb["positions"], attention_mask=None, labels=mb["labels"])  # [b, s] CE

        def loss_func(per_token):
            loss = (per_token.float() * mb["action_mask"]).sum() / num_tokens
            return loss * len(micro), {"loss": loss.detach()}  # the schedule divides by num_microbatches

        return output, loss_func

    role.model.zero_grad_buffer()
    role.optimizer.zero_grad()
    role.config.variable_seq_lengths = len({tuple(mb["tokens"].shape) for mb in micro}) > 1
    b, seq = max(tuple(mb["tokens"].shape) for mb in micro)
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=[role.model],
        num_microbatches=len(micro),
        seq_length=seq,
        micro_batch_size=b,
        forward_only=False,
    )
    role.optimizer.step()
    return float(sum(float(o["loss"]) for o in out))


def _memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def throughput_case(rank: int, world: int, spec: dict) -> dict:
    """Seconds per actor step (ours and plain Megatron, interleaved), per logprob pass, per critic
    values pass and critic step; one untimed warm-up of each first. Each role is built, timed
    and released in turn (only one holds GPU memory at a time)."""
    cfg = run_config(spec, bf16=spec["bf16"])
    batch, advantages = _batch(spec)
    out: dict = {
        "lengths": batch.lengths.tolist(),
        "tokens": int(batch.lengths.sum()),
        "action_tokens": int(batch.action_mask.sum()),
    }
    out.update(_time_actor(spec, cfg, batch, advantages))
    _release()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    out.update(_time_critic(spec, cfg, batch))
    _release()
    return out


def _time_actor(spec: dict, cfg: SAOConfig, batch: TrainBatch, advantages: torch.Tensor) -> dict:
    from sao_megatron.workers.actor import ActorWorker

    actor = ActorWorker(ActorRankConfig.of(cfg))
    shard = _shard(batch)
    adv, tokens = shard.take(advantages), float(batch.action_mask.sum())
    micro = plain_micro_batches(shard.batch, spec["micro_batch_size"])

    def ours() -> None:
        actor.update(shard, adv, 1)

    def plain() -> None:
        plain_megatron_step(actor.role, micro, tokens)

    out: dict = {
        "warmup_s": {"ours": _timed(ours), "plain": _timed(plain)},
        "actor_step_s": [],
        "plain_step_s": [],
    }
    for _ in range(spec["steps"]):
        if (
            out["actor_step_s"]
            and time.time() + 3 * (out["actor_step_s"][-1] + out["plain_step_s"][-1]) > spec["deadline"]
        ):
            break  # leave room for the critic
        out["actor_step_s"].append(_timed(ours))
        out["plain_step_s"].append(_timed(plain))
    out["logprobs_s"] = _timed(lambda: actor.logprobs(shard))
    out["actor_peak_gib"] = _memory_gib()
    # one profiled step of each (up to ~3x slower under the profiler), only where the critic keeps the
    # room the timed loop leaves it (3 steps)
    step_s = out["actor_step_s"][-1] + out["plain_step_s"][-1] if out["actor_step_s"] else 0.0
    if spec.get("profile") and time.time() + 6 * step_s < spec["deadline"]:
        out["profile"] = {"ours": profiled(ours), "plain": profiled(plain)}
    actor.role.close()
    return out


def profiled(fn: Callable[[], object], top: int = 10) -> dict:
    """One call of ``fn`` under ``torch.profiler``: wall seconds, the time the device ran any kernel
    (the union of the kernels' intervals), their ratio (how busy the GPU was; low means the step
    waits on the host: launches, syncs), the kernel count, the kernels with the most device time and
    the ops with the most self host time. Device figures are 0 on a CPU. A profiler failure is
    returned as ``{"error": ...}``: it must not cost the section its timings."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        _sync()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            fn()
            _sync()
            wall = time.perf_counter() - start
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy_us, reach = 0.0, float("-inf")
        for a, b in spans:
            busy_us += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        per_kernel: dict[str, list[float]] = {}
        for e in kernels:
            per_kernel.setdefault(e.name[:80], []).append(e.time_range.elapsed_us() / 1e6)
        by_kernel = sorted(per_kernel.items(), key=lambda kv: sum(kv[1]), reverse=True)[:top]
        by_host = sorted(prof.key_averages(), key=lambda o: o.self_cpu_time_total, reverse=True)[:top]
    except Exception as e:  # the profiler is a diagnostic; the timings above stand without it
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    return {
        "wall_s": wall,
        "device_busy_s": busy_us / 1e6,
        "device_busy": busy_us / 1e6 / wall if wall else None,
        "kernels": len(kernels),
        "by_kernel": [{"kernel": k, "calls": len(v), "device_s": sum(v)} for k, v in by_kernel],
        "by_host_time": [
            {"op": o.key[:80], "calls": o.count, "self_host_s": o.self_cpu_time_total / 1e6} for o in by_host
        ],
    }


def _time_critic(spec: dict, cfg: SAOConfig, batch: TrainBatch) -> dict:
    from sao_megatron.workers.critic import CriticWorker

    critic = CriticWorker(CriticRankConfig.of(cfg), "")
    shard = _shard(batch)
    values = _rows(critic.values(shard), batch)
    returns = shard.take(values + 0.1 * batch.action_mask)
    old = shard.take(values)

    def step() -> None:
        critic.update(shard, returns, old)

    out: dict = {
        "critic_warmup_s": _timed(step),
        "values_s": _timed(lambda: critic.values(shard)),
        "critic_step_s": [],
    }
    for _ in range(spec["steps"]):
        if out["critic_step_s"] and time.time() + 2 * out["critic_step_s"][-1] > spec["deadline"]:
            break
        out["critic_step_s"].append(_timed(step))
    out["critic_peak_gib"] = _memory_gib()
    critic.role.close()
    return out


def _old_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The logprob algorithm before issue 29 (single rank): a float32 copy, ``exp`` and the softmax as
    full-size tensors, the softmax saved for backward. Kept here only as the GPU check's baseline."""
    x = logits.float()
    shifted = x - x.max(dim=-1, keepdim=True).values
    exp = torch.exp(shifted)
    probs = exp / exp.sum(dim=-1, keepdim=True)
    logp = torch.log(probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1))
    _entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1).detach()  # the old path computed it too
    return logp


def _logprob_peak(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape: list[int], bf16: bool) -> float:
    """Peak bytes per logit beyond the logits themselves for one forward and backward of ``fn``."""
    from sao_megatron.plan.measure import PeakTracker

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, vocab = shape
    dtype = torch.bfloat16 if bf16 else torch.float32
    logits = torch.randn(1, tokens, vocab, device=device, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), device=device)
    numel = logits.numel()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(logits, labels).sum().backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    else:
        tracker = PeakTracker()
        tracker.track(logits, labels)  # there before: a view of them is not new memory
        with tracker:
            fn(logits, labels).sum().backward()
        extra = tracker.peak - tracker.live_bytes_of(logits, labels)
    del logits, labels
    _release()
    return extra / numel


def memory_case(rank: int, world: int, spec: dict) -> dict:
    """The logprob function's peak beyond the logits (ours vs :func:`_old_logprobs`), then one actor and
    one critic step at ``spec``'s shape (distributed optimizer, one rank) measured by
    :func:`sao_megatron.plan.measure.measure_role_step` beside ``sao plan``'s figure for the same config
    (local layer spec: what this check builds)."""
    from sao_megatron.models.logprobs import CHUNK_ELEMENTS, vocab_parallel_logprobs
    from sao_megatron.plan.measure import measure_role_step
    from sao_megatron.plan.memory import stage_memory
    from sao_megatron.plan.params import stage_parameters

    bf16 = spec["bf16"]
    count = math.prod(spec["logits"])
    # at least 8 chunks, as at GPU size (1.2e9 logits / 2**24 per chunk = 74): the CPU smoke is small
    chunk = min(CHUNK_ELEMENTS, count // 8)
    out: dict = {"logits": spec["logits"], "logits_count": count, "chunk_elements": chunk}
    out["logprob_bytes_per_logit"] = {
        "ours": _logprob_peak(
            lambda x, y: vocab_parallel_logprobs(x, y, chunk_elements=chunk)[0], spec["logits"], bf16
        ),
        "old": _logprob_peak(_old_logprobs, spec["logits"], bf16),
    }
    cfg = run_config(spec, bf16=bf16)
    seq = spec["seq"]
    parallel = dataclasses.replace(cfg.actor.parallel, micro_batch_size=1, use_distributed_optimizer=True)
    cfg = dataclasses.replace(
        cfg,
        actor=dataclasses.replace(cfg.actor, parallel=parallel),
        critic=dataclasses.replace(cfg.critic, parallel=parallel),
        algo=dataclasses.replace(cfg.algo, batch_size=2),
        rollout=dataclasses.replace(cfg.rollout, loop=dataclasses.replace(cfg.rollout.loop, max_context_tokens=seq)),
    )
    out["step_logits_count"] = seq * cfg.model.vocab_size
    for role in ("actor", "critic"):
        got = measure_role_step(rank, world, cfg, role, [(1, seq, 1)] * 2)
        rc = getattr(cfg, role)
        plan = stage_memory(
            cfg, role, 0, stage_parameters(cfg.model, rc.parallel, 0, rc if role == "critic" else None), "local"
        )
        out[role] = {"measured_bytes": got["total"], "plan_bytes": plan.total - plan.reserved, **got}
        _release()
    return out


def random_routes(batch: TrainBatch, num_moe_layers: int, topk: int, num_experts: int, seed: int = 0) -> TrainBatch:
    """``batch`` with a random routing of every real position (distinct experts per token, as an
    engine routes), the compact dtype of ``routing.RouteShape`` and padding unrouted."""
    g = torch.Generator().manual_seed(seed)
    b, t = batch.tokens.shape
    ids = torch.rand(b, t, num_moe_layers, num_experts, generator=g).argsort(-1)[..., :topk]
    known = torch.arange(t)[None, :] < batch.lengths[:, None]
    dtype = torch.uint8 if num_experts <= 256 else torch.int16
    return dataclasses.replace(batch, routes=ids.to(dtype), route_mask=known)


def replay_case(rank: int, world: int, spec: dict) -> dict:
    """Routing replay's cost, side by side in one process: seconds per actor update and per logprob
    pass with the batch's routes replayed and without routes (the same role; the routers route
    themselves), interleaved; the bytes the routes add to the batch the driver ships each step."""
    from sao_megatron.routing import RouteShape
    from sao_megatron.workers.actor import ActorWorker

    cfg = run_config(spec, bf16=spec["bf16"])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, routing_replay="on"))
    batch, advantages = _batch(spec)
    shape = RouteShape.of(cfg.model)
    routed = random_routes(batch, len(shape.moe_layers), shape.topk, shape.num_experts)
    actor = ActorWorker(ActorRankConfig.of(cfg))
    shards = {"replay": _shard(routed), "plain": _shard(batch)}
    adv = shards["plain"].take(advantages)
    steps: dict[str, list[float]] = {"replay": [], "plain": []}
    passes: dict[str, list[float]] = {"replay": [], "plain": []}
    for shard in shards.values():  # warm-up
        _timed(lambda s=shard: actor.update(s, adv, 1))
    for _ in range(spec["steps"]):
        for name, shard in shards.items():
            steps[name].append(_timed(lambda s=shard: actor.update(s, adv, 1)))
            passes[name].append(_timed(lambda s=shard: actor.logprobs(s)))
    agreement = actor.update(shards["replay"], adv, 1)  # replay took effect: routing/replayed is 1
    tensors = [v for v in dataclasses.asdict(batch).values() if isinstance(v, torch.Tensor)]
    out = {
        "tokens": int(batch.lengths.sum()),
        "update_s": steps,
        "logprobs_s": passes,
        "update_ratio": statistics.median(steps["replay"]) / statistics.median(steps["plain"]),
        "logprobs_ratio": statistics.median(passes["replay"]) / statistics.median(passes["plain"]),
        "route_bytes": routed.routes.nbytes + routed.route_mask.nbytes,  # pyright: ignore[reportOptionalMemberAccess]
        "batch_bytes": sum(v.nbytes for v in tensors),
        "bytes_per_token": shape.bytes_per_token,
        "replayed": agreement.get("routing/replayed"),
        "peak_gib": _memory_gib(),
    }
    actor.role.close()
    return out
