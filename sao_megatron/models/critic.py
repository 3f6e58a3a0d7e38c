"""The critic: the actor's Megatron model with a scalar value head and frozen parameters.

The paper trains a separate value network initialised from the same SFT checkpoint as the
policy, with its attention frozen and its MoE projections (experts, router) trained. Here the
critic is built from exactly the actor's spec (``builder.build_gpt``); only the LM head is
replaced by :class:`ValueHead`, and :func:`freeze` applies regexes over parameter names (their
local-spec form, ``builder.canonical_name``, so TE and local builds freeze the same tensors).
:func:`load_trunk` fills the trunk from an HF or Megatron checkpoint, each rank reading only
its own slices (the checkpoint's LM head is not read).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from sao_megatron.config import CriticConfig, ModelConfig, ParallelConfig
from sao_megatron.models.builder import build_gpt, canonical_name


class ValueHead(torch.nn.Module):
    """Drop-in for ``GPTModel.output_layer`` mapping hidden states ``[s, b, h]`` to values ``[s, b, 1]``.

    The weight is replicated on every TP rank. With sequence parallelism the incoming hidden
    states are split along the sequence, so they are gathered first, which makes the value
    head's gradient identical on all TP ranks. Every TP rank then computes the same full-sequence
    loss, so the gather's backward keeps each rank's own sequence chunk of the gradient (a
    reduce-scatter would count the loss TP times and scale the trunk's gradient by TP).

    The head is float32 whatever the trunk's dtype, and so is its matmul (a bf16 trunk's hidden
    states are cast up first): a value is one dot product over ``hidden_size`` terms, which bf16
    (8 mantissa bits) would round to about 3 significant digits, and the head is ``hidden_size + 1``
    parameters. Megatron's bf16 optimizers keep float32 parameters as they are (no master copy).
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool, init: str = "zero"):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=torch.float32))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))
        if init == "normal":
            torch.nn.init.normal_(self.weight, std=hidden_size**-0.5)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None, **kwargs):
        """Values ``[s, b, 1]`` in float32 from hidden states ``[s, b, h]`` of any dtype."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states.float(), self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix, {}, sharded_offsets)


def build_critic(
    m: ModelConfig,
    p: ParallelConfig,
    c: CriticConfig,
    pre_process: bool | None = None,
    post_process: bool | None = None,
):
    """The actor's model with ``output_layer`` replaced by a value head, then frozen per ``c``."""
    model = build_gpt(m, p, bf16=c.bf16, pre_process=pre_process, post_process=post_process)
    if model.post_process:
        # A duck-typed stand-in for the LM head that GPTModel's annotation does not foresee.
        head = ValueHead(m.hidden_size, p.effective_sequence_parallel, c.value_head_init)
        model.output_layer = head  # pyright: ignore[reportAttributeAccessIssue]
    freeze(model, c.freeze_patterns, c.train_patterns)
    return model


def freeze(model: torch.nn.Module, freeze_patterns: Iterable[str], train_patterns: Iterable[str] = ()) -> list[str]:
    """Set ``requires_grad=False`` on parameters matching any ``freeze_patterns`` regex (``re.search``)
    unless they also match a ``train_patterns`` regex. Returns the frozen names (as the model names them).

    Patterns see local-spec names (:func:`~sao_megatron.models.builder.canonical_name`): TE's
    ``self_attention.linear_qkv.layer_norm_weight`` is matched as ``input_layernorm.weight``, so
    the default pattern (attention) freezes the same tensors with and without TE.
    """
    frozen_re = [re.compile(p) for p in freeze_patterns]
    train_re = [re.compile(p) for p in train_patterns]
    frozen = []
    for name, param in model.named_parameters():
        key = canonical_name(name)
        if any(r.search(key) for r in frozen_re) and not any(r.search(key) for r in train_re):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def init_critic_from_actor(critic: torch.nn.Module, actor_state: dict[str, torch.Tensor]) -> list[str]:
    """Copy the trunk of an actor's full-layout state (``layout.gather_full``) into a critic of any layout.

    The LM head (``output_layer.*``) is skipped: the value head keeps its own initialisation.
    Returns the local names copied. Raises ``ValueError`` when a trunk tensor is missing.
    """
    from sao_megatron.models import layout

    trunk = {k: v for k, v in actor_state.items() if not k.startswith("output_layer.")}
    loaded = layout.load_full(critic, trunk, strict=False)
    missing = [n for n, _ in critic.named_parameters() if n not in loaded and not n.startswith("output_layer.")]
    if missing:
        raise ValueError(f"actor state lacks critic trunk tensors {missing[:3]}...; build both from one model config")
    return loaded


@contextlib.contextmanager
def _without_head(model: torch.nn.Module) -> Iterator[None]:
    """Hide the value head (``output_layer``) from ``named_parameters`` / ``sharded_state_dict``."""
    from sao_megatron.models.layout import unwrap

    module = unwrap(model)
    head = getattr(module, "output_layer", None)
    if head is None:
        yield
        return
    module.output_layer = torch.nn.Module()
    try:
        yield
    finally:
        module.output_layer = head


def load_trunk(critic: torch.nn.Module, m: ModelConfig, source: str | Path) -> None:
    """Copy this rank's slices of the trunk (everything but the LM head) of ``source`` into ``critic``.

    ``source``: an HF directory (``config.json`` + safetensors; not a collective) or a Megatron
    distributed checkpoint (``metadata.json``; a collective over the critic's world). The value
    head keeps its own initialisation.
    """
    source = Path(source)
    if (source / "metadata.json").exists():
        _load_megatron_trunk(critic, source)
        return
    from sao_megatron.models.hf_weights import load_hf_weights

    with _without_head(critic):
        load_hf_weights(critic, m, source)


def _load_megatron_trunk(critic: torch.nn.Module, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    from sao_megatron.models.layout import unwrap

    module = unwrap(critic)
    wanted = {k: v for k, v in module.sharded_state_dict().items() if not k.startswith("output_layer.")}
    state = dist_checkpointing.load(wanted, str(directory))
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and not k.startswith("output_layer.")]
    if missing:
        raise KeyError(f"checkpoint {directory} lacks critic trunk tensors {missing[:5]}")
