"""One role's Megatron state on one rank: model, DDP wrapper, optimizer, LR schedule, steps.

Loss normalisation contract: a ``loss_fn`` returns a micro-batch loss that is already divided
by the *global* normaliser (e.g. action tokens in the whole batch over all DP ranks), so that
summing every micro-batch on every DP rank gives the full-batch loss. Megatron's schedule
divides each micro-batch loss by ``num_microbatches`` and DDP averages gradients over DP; the
engine multiplies by both, so the resulting gradient is exactly the full-batch gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sao_megatron.batch import MicroBatch
from sao_megatron.config import ActorConfig, CriticConfig, ModelConfig, OptimizerConfig, ParallelConfig

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from sao_megatron.models.replay import RoutingReplay

LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, float]]]
"""``loss_fn(output, micro_batch) -> (loss, metrics)``: the model's output on the micro-batch
(vocab-parallel logits ``[b, t, V/tp]``, or values ``[b, t, 1]`` for a critic) to its loss, normalised
as the module docstring says, and its metrics (reduced by ``workers.metrics.reduce_metrics``)."""


@dataclass
class OptimizerStep:
    """What one optimizer step reports (reduced over the role's world)."""

    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used for the step."""
    updated: bool
    """False when the optimizer skipped the step (non-finite gradients)."""
    group_norms: dict[str, float] = field(default_factory=dict)
    """``grad_norm/<group>`` and ``grad_rms/<group>`` per module group (before clipping)."""


def _megatron_optimizer_config(o: OptimizerConfig, p: ParallelConfig, bf16: bool):
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=p.use_distributed_optimizer,
    )


class MegatronRole:
    """A model chunk wrapped in Megatron DDP with its optimizer and schedule (this rank's share)."""

    def __init__(
        self,
        model: torch.nn.Module,
        parallel: ParallelConfig,
        optim: OptimizerConfig,
        bf16: bool = False,
        total_steps: int = 1_000_000,
    ):
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from sao_megatron.models import builder
        from sao_megatron.parallel import device

        self.parallel = parallel
        config: TransformerConfig = model.config  # pyright: ignore[reportAssignmentType]  # Megatron modules carry it
        ddp_config = builder.ddp_config(parallel)  # overlap knobs resolved there (None: on with TE)
        self.config = config
        # Megatron's get_model moves each chunk to its device before wrapping it: modules the specs
        # build with torch's defaults (the local spec's torch.nn norms, the value head) start on the
        # CPU even when the linear layers were initialised on the GPU (first GPU check, 2026-12-04).
        self.model = DistributedDataParallel(config, ddp_config, model.to(device()))
        config.finalize_model_grads_func = finalize_model_grads
        if ddp_config.overlap_grad_reduce:  # reduce in the last micro-batch's backward only
            config.no_sync_func = self.model.no_sync
        self.optimizer = get_megatron_optimizer(_megatron_optimizer_config(optim, parallel, bf16), [self.model])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optim.warmup_steps else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.min_lr,
            lr_warmup_steps=optim.warmup_steps,
            lr_decay_steps=max(total_steps, optim.warmup_steps + 1),
            lr_decay_style="constant",
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        self.steps = 0
        self.replay: RoutingReplay | None = None
        """The routers' replay hooks (the actor under ``rollout.routing_replay``), fed before each forward."""

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    def close(self) -> None:
        """Free this role's weights and gradients now; the role is not used again.

        For a process that builds roles in turn (the GPU check, ``sao plan``'s measurement, tests).
        Dropping a role that has stepped does not free it: Megatron 0.19's MoE token dispatcher keeps
        the last forward's routing probabilities (``probs``, with their autograd graph), whose nodes
        reach every parameter's gradient accumulator, whose DDP hook closures hold the DDP wrapper
        and so the model: a cycle through autograd's C++ nodes that Python's gc cannot collect.
        Measured at CPU size: half of the actor's state still live after the role was dropped and
        gc ran. So the storages are released here, whatever still refers to their tensors."""
        self.model.grad_accs.clear()
        for buffer in param_and_grad_buffers(self.model):
            for data in (getattr(buffer, "param_data", None), buffer.grad_data):
                if data is not None:
                    data.untyped_storage().resize_(0)
        for param in self.module.parameters():  # frozen parameters live outside the DDP buffers
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def forward_backward(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn, forward_only: bool = False
    ) -> list[dict[str, float]]:
        """Run the (pipelined) schedule over ``micro_batches``; returns per-micro-batch metrics
        on the last pipeline stage (empty elsewhere). The model reads each micro-batch's
        ``tokens`` and ``positions`` ``[b, t]`` (this context-parallel rank's share of the sequence)
        and its packing (:func:`attention_inputs`); ``loss_fn(output, micro_batch)`` sees the model
        output (vocab-parallel logits, or values for a critic) of the same micro-batch, moved to
        this rank's device. Micro-batches may differ in length; each length must divide by
        ``micro.seq_multiple`` of the layout."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # Megatron divides each micro-batch loss by their number and DDP averages gradients
        # over the data- and context-parallel ranks: undo both (module docstring).
        scale = len(micro_batches) * ps.get_data_parallel_world_size(with_context_parallel=True)

        def forward_step(data_iterator: Iterator[MicroBatch], model):
            micro = to_device(next(data_iterator))
            if self.replay is not None:
                self.replay.feed(micro, training=not forward_only)
            output = model(micro.tokens, micro.positions, **attention_inputs(micro))

            def loss_func(output_tensor):
                loss, metrics = loss_fn(output_tensor, micro)
                return loss * scale, metrics

            return output, loss_func

        if not forward_only:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        # Pipeline stages exchange [s/(tp*cp), b, h] activations. Equal micro-batches: one fixed
        # shape (the schedule divides the full length by TP and CP). Ragged ones: Megatron sends
        # each tensor's shape ahead of it (variable_seq_lengths), on every stage alike.
        shapes = {tuple(m.tokens.shape) for m in micro_batches}
        self.config.variable_seq_lengths = len(shapes) > 1
        rows = max(b for b, _ in shapes)
        seq_length = max(t for _, t in shapes) * ps.get_context_parallel_world_size()
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=rows,
            forward_only=forward_only,
        )

    def step(self) -> OptimizerStep:
        """One optimizer step, skipped (``updated`` False, weights and optimizer state untouched)
        when a gradient is not finite: a non-finite loss or gradient anywhere in the role's world
        (the group norms are reduced over all ranks, so every rank decides alike)."""
        groups = module_group_grad_norms(self.module, self.optimizer)
        if not all(math.isfinite(v) for v in groups.values()):
            lr = self.optimizer.param_groups[0]["lr"]
            return OptimizerStep(grad_norm=float("nan"), lr=float(lr), updated=False, group_norms=groups)
        updated, grad_norm, _ = self.optimizer.step()  # pyright: ignore[reportGeneralTypeIssues]  # Megatron: (bool, norm, zeros)
        if self.model.ddp_config.overlap_param_gather:
            # The overlapped gather would finish in the next forward; weights are exported and
            # checkpointed before that, so gather the other replicas' updated slices now.
            self.model.start_param_sync(force_sync=True)
        lr = self.optimizer.param_groups[0]["lr"]
        if updated:
            self.scheduler.step(increment=1)
            self.steps += 1
        return OptimizerStep(grad_norm=float(grad_norm or 0.0), lr=float(lr), updated=bool(updated), group_norms=groups)

    @torch.no_grad()
    def forward(
        self, micro_batches: list[MicroBatch], fn: Callable[[torch.Tensor, MicroBatch], torch.Tensor]
    ) -> list[torch.Tensor]:
        """Forward-only pass without the pipeline schedule (PP=1); ``fn`` post-processes outputs."""
        self.model.eval()
        try:
            out = []
            for m in map(to_device, micro_batches):
                if self.replay is not None:
                    self.replay.feed(m, training=False)
                out.append(fn(self.model(m.tokens, m.positions, **attention_inputs(m)), m))
            return out
        finally:
            self.model.train()


def param_and_grad_buffers(ddp) -> list:
    """Megatron DDP's parameter-and-gradient buffers, dense and expert (its ``buffers`` list shadows
    ``Module.buffers()``)."""
    return [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]


def to_device(micro: MicroBatch) -> MicroBatch:
    """The one place a micro-batch moves to this rank's device (``parallel.device``)."""
    from sao_megatron.parallel import device

    where = device()
    moved = {
        f.name: v.to(where, non_blocking=True)
        for f in fields(micro)
        if isinstance(v := getattr(micro, f.name), torch.Tensor)
    }
    return replace(micro, **moved)


def attention_inputs(micro: MicroBatch) -> dict[str, object]:
    """Attention arguments of a micro-batch for the model's forward.

    Padded rows: none (each attention layer applies its causal mask). A packed row (``cu_seqlens``
    present, see ``TrainBatch.micro_batch``): Transformer Engine's layers take THD
    ``PackedSeqParams`` (variable-length attention, RoPE restarting per sequence); the local
    layer spec takes a ``[1, 1, t, t]`` mask, True where a token must not attend (another
    segment, or the future). RoPE on a packed row without THD rotates by the row position, and
    attention scores depend only on position differences, so each segment sees what it would
    see alone."""
    cu, seg = micro.cu_seqlens, micro.segment_ids  # both set on a packed row, neither otherwise
    if cu is None or seg is None:
        return {"attention_mask": None}
    from sao_megatron.models.builder import have_transformer_engine

    if have_transformer_engine():
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = cu.to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        return {"attention_mask": None, "packed_seq_params": params}
    seg = seg[0]
    t = seg.shape[0]
    future = torch.ones(t, t, dtype=torch.bool, device=seg.device).triu(1)
    return {"attention_mask": ((seg[:, None] != seg[None, :]) | future)[None, None]}


MODULE_GROUPS = (
    ("attention", ".self_attention."),
    ("experts", ".experts."),
    ("router", ".router."),
    ("shared_experts", ".shared_experts."),
    ("head", "output_layer."),
    ("embedding", "embedding."),
)


def _group_of(name: str) -> str:
    from sao_megatron.models.builder import canonical_name

    name = canonical_name(name)  # TE's fused input norm counts where the local spec's does
    return next((group for group, key in MODULE_GROUPS if key in name), "other")


def _named_optimizer_grads(
    module: torch.nn.Module, optimizer
) -> tuple[list[tuple[str, torch.nn.Parameter, torch.Tensor]], bool]:
    """(name, model parameter, reduced gradient held by this rank's optimizer), and whether the
    gradients are DP shards (distributed optimizer) rather than full replicas."""
    names = {id(p): n for n, p in module.named_parameters()}
    out, sharded = [], False
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.prepare_grads()  # idempotent: copies the reduced grads where the optimizer reads them
        if hasattr(opt, "shard_fp32_groups"):  # DistributedOptimizer: this rank's shard of each param
            sharded = True
            pairs = [
                *zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True),
                *zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True),
            ]
        elif hasattr(opt, "float16_groups"):
            pairs = list(zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True))
        else:
            pairs = [(g["params"], g["params"]) for g in opt.param_groups]
        for model_group, main_group in pairs:
            for model_param, main_param in zip(model_group, main_group, strict=True):
                if main_param.grad is not None and id(model_param) in names:
                    out.append((names[id(model_param)], model_param, main_param.grad))
    return out, sharded


def module_group_grad_norms(module: torch.nn.Module, optimizer) -> dict[str, float]:
    """Gradient L2 norm and per-parameter RMS of each module group, over the role's whole world.

    Reads the reduced gradients the optimizer is about to use (before clipping). Sums of squares
    are summed over all ranks; TP-duplicated parameters count once (as in Megatron's global norm);
    full replicas are divided out (dense: DP x CP size, as context-parallel ranks hold the same
    reduced gradient; experts: expert-DP size, which includes CP); distributed optimizer shards
    are disjoint and need no division. Frozen parameters have no gradient.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from sao_megatron.parallel import device

    names = [g for g, _ in MODULE_GROUPS] + ["other"]
    sums = torch.zeros(2, len(names), dtype=torch.float64, device=device())  # [sum of squares; count]
    grads, sharded = _named_optimizer_grads(module, optimizer)
    for name, param, grad in grads:
        if not param_is_not_tensor_parallel_duplicate(param):
            continue
        i = names.index(_group_of(name))
        sums[0, i] += grad.detach().double().pow(2).sum().to(sums.device)
        sums[1, i] += grad.numel()
    replicas = torch.ones(len(names), dtype=torch.float64)
    if not sharded:
        replicas[:] = ps.get_data_parallel_world_size(with_context_parallel=True)
        replicas[names.index("experts")] = ps.get_expert_data_parallel_world_size()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    sums = sums.cpu() / replicas
    out = {}
    for i, group in enumerate(names):
        if sums[1, i] > 0:
            out[f"grad_norm/{group}"] = float(sums[0, i].sqrt())
            out[f"grad_rms/{group}"] = float((sums[0, i] / sums[1, i]).sqrt())
    return out


def load_weights(model: torch.nn.Module, m: ModelConfig, source: str | Path) -> None:
    """Fill ``model`` (this rank's share, any layout) from an HF directory or a Megatron checkpoint.

    Each rank reads only its own slices: HF safetensors are sliced on read
    (``hf_weights.load_hf_weights``, no communication); a Megatron distributed checkpoint
    reshards on load (``dist_checkpoint.load_model``, a collective over the role's world).
    """
    source = Path(source)
    if (source / "metadata.json").exists():
        from sao_megatron.models.dist_checkpoint import load_model

        load_model(model, source)
    else:
        from sao_megatron.models.hf_weights import load_hf_weights

        load_hf_weights(model, m, source)


def check_context_parallel(p: ParallelConfig, role: str) -> None:
    """Context parallelism runs on Transformer Engine's attention (it exchanges key/value chunks
    between CP ranks); the local layer spec has none, so a CP layout without TE is refused."""
    from sao_megatron.config import ConfigError
    from sao_megatron.models.builder import have_transformer_engine

    if p.context_parallel > 1 and not have_transformer_engine():
        raise ConfigError(
            f"{role}.parallel.context_parallel={p.context_parallel} needs Transformer Engine's "
            "context-parallel attention (a CUDA GPU and the transformer_engine package), which this "
            f"process lacks; set {role}.parallel.context_parallel=1 here"
        )


ROUTER_WEIGHT = r"\.mlp\.router\.weight$"
"""The MoE routers' weights (``actor.freeze_router``), by local-spec name (``builder.canonical_name``)."""


def build_actor_model(m: ModelConfig, actor: ActorConfig, routing_replay: bool = False) -> torch.nn.Module:
    """This rank's policy model, loaded from ``actor.init_from`` when set (random otherwise);
    ``routing_replay``: built for :mod:`~sao_megatron.models.replay` hooks."""
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.hf_weights import release_free_memory

    check_context_parallel(actor.parallel, "actor")
    rate = actor.router_bias_update_rate if actor.router_bias_update == "train" else 0.0
    model = build_gpt(m, actor.parallel, bf16=actor.bf16, router_bias_update_rate=rate, routing_replay=routing_replay)
    if actor.init_from:
        release_free_memory()  # the random initialisation's temporaries, before reading the weights
        load_weights(model, m, actor.init_from)
    if actor.freeze_router:  # before DDP wraps it: frozen parameters stay out of its buffers
        from sao_megatron.models.critic import freeze

        freeze(model, [ROUTER_WEIGHT])
    return model


def build_critic_model(m: ModelConfig, critic: CriticConfig, source: str | Path = "") -> torch.nn.Module:
    """This rank's value model; its trunk from ``source`` (HF or Megatron directory) when given.

    The checkpoint's LM head is not read: the value head keeps ``critic.value_head_init``."""
    from sao_megatron.models.critic import build_critic, load_trunk
    from sao_megatron.models.hf_weights import release_free_memory

    check_context_parallel(critic.parallel, "critic")
    model = build_critic(m, critic.parallel, critic)
    if source:
        release_free_memory()
        load_trunk(model, m, source)
    return model


def build_actor_role(
    m: ModelConfig, actor: ActorConfig, total_steps: int = 1_000_000, routing_replay: bool = False
) -> MegatronRole:
    return MegatronRole(
        build_actor_model(m, actor, routing_replay), actor.parallel, actor.optim, actor.bf16, total_steps
    )


def build_critic_role(
    m: ModelConfig,
    critic: CriticConfig,
    actor_state: dict | None = None,
    total_steps: int = 1_000_000,
    *,
    source: str | Path = "",
) -> MegatronRole:
    """The critic role, its trunk from ``source`` (see :func:`build_critic_model`).

    ``actor_state`` (a full-layout state dict, every tensor whole on this rank) is the older
    whole-model path kept for ``sao check`` (``driver/smoke.py``); training never uses it."""
    model = build_critic_model(m, critic, source)
    if actor_state is not None:
        from sao_megatron.models.critic import init_critic_from_actor

        init_critic_from_actor(model, actor_state)
    return MegatronRole(model, critic.parallel, critic.optim, critic.bf16, total_steps)
