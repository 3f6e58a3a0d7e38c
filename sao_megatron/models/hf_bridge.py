"""HF <-> Megatron-Core parameter mapping, in the full layout: Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5,
DeepSeek-V3 (multi-latent attention).

Pure functions over names, shapes and tensors: no process groups, no files. Megatron names are
those of the full (single-rank) layout (:mod:`sao_megatron.models.layout`): global layer and
expert indices, unsplit tensors. Per-rank slicing is :func:`local_reads` (checkpoint loading)
or ``layout.shard``; gathering is ``layout.gather_full`` or the streaming iterator in
:mod:`sao_megatron.models.hf_weights`.

Every Megatron tensor is a concatenation along dim 0 of row ranges of HF tensors (a
:class:`Piece` list); columns are never split. ``L = model.layers.{i}.`` below; the HF names
depend on ``ModelConfig.family`` where the table says so:

==========================================================  ====================================
Megatron (local spec | TE spec)                             HF
==========================================================  ====================================
embedding.word_embeddings.weight                            model.embed_tokens.weight
output_layer.weight                                         lm_head.weight (embed_tokens if tied;
                                                            not exported when tied)
decoder.final_layernorm.weight                              model.norm.weight
input_layernorm.weight | linear_qkv.layer_norm_weight       L input_layernorm.weight
self_attention.linear_qkv.weight                            per query group g: q heads of g,
  ``[ng, (np/ng + 2), head_dim, hidden]``                     k head g, v head g (q/k/v_proj)
self_attention.linear_qkv.bias (``add_qkv_bias``)           the same rows of q/k/v_proj.bias
self_attention.q_layernorm / k_layernorm                    L self_attn.q_norm / k_norm
self_attention.linear_proj.weight                           L self_attn.o_proj.weight
self_attention.linear_q_down_proj / q_layernorm /           L self_attn.q_a_proj / q_a_layernorm /
  linear_q_up_proj (DeepSeek-V3; TE: the norm is              q_b_proj, each whole
  linear_q_up_proj.layer_norm_weight)
self_attention.linear_kv_down_proj / kv_layernorm /         L self_attn.kv_a_proj_with_mqa /
  linear_kv_up_proj (TE: linear_kv_up_proj.layer_norm_)       kv_a_layernorm / kv_b_proj, whole
pre_mlp_layernorm.weight | mlp.linear_fc1.layer_norm_weight L post_attention_layernorm.weight
mlp.linear_fc1.weight (dense) ``[gate; up]``                L mlp.gate_proj ; L mlp.up_proj
mlp.linear_fc2.weight (dense)                               L mlp.down_proj.weight
mlp.router.weight                                           L mlp.gate.weight (Mixtral:
                                                            L block_sparse_moe.gate.weight)
mlp.router.expert_bias (a buffer; GLM)                      L mlp.gate.e_score_correction_bias
mlp.experts.local_experts.{e}.linear_fc1.weight             L mlp.experts.{e}.gate_proj ; up_proj
  | mlp.experts.linear_fc1.weight{e} (TE grouped GEMM)        (Mixtral: L block_sparse_moe.
                                                              experts.{e}.w1 ; w3; or fused
                                                              ``mlp.experts.gate_up_proj[e]``)
mlp.experts.local_experts.{e}.linear_fc2.weight             L mlp.experts.{e}.down_proj.weight
  | mlp.experts.linear_fc2.weight{e}                          (Mixtral: ...experts.{e}.w2; or
                                                              fused ``experts.down_proj[e]``)
mlp.shared_experts.linear_fc1 / linear_fc2                  L mlp.shared_expert.gate_proj ;
                                                            up_proj / down_proj (Qwen2-MoE;
                                                            GLM: L mlp.shared_experts.*)
mlp.shared_experts.gate_weight                              L mlp.shared_expert_gate.weight
==========================================================  ====================================

Qwen3-MoE and Mixtral have no shared experts; Qwen2-MoE has one per MoE layer, gated by a
sigmoid of ``shared_expert_gate`` (Megatron ``gate_weight`` ``[1, hidden]``, not TP-split); GLM
one ungated. The QKV bias is split over TP like the QKV weight's rows. The expert bias is a
float32 buffer of the router, replicated like the router's weight; :func:`is_buffer` names it,
so that loaders and streams take it along with the parameters (``layout.named_weights``). HF
checkpoints on disk (hub files, and ``save_pretrained`` in transformers 5.19) store experts per
expert (``experts.{e}.gate_proj.weight``, Mixtral ``block_sparse_moe.experts.{e}.w1.weight``);
transformers 5.19 fuses them in memory into ``mlp.experts.gate_up_proj [E, 2I, H]`` (= ``[gate;
up]`` per expert, Megatron's fc1 layout) and ``mlp.experts.down_proj [E, H, I]`` and renames
Mixtral's ``block_sparse_moe`` to ``mlp``. Both forms are read; the per-expert form is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from sao_megatron.config import ModelConfig
from sao_megatron.models.builder import moe_layer_pattern


class MappingError(KeyError):
    """A Megatron or HF name outside the mapping of the model's family."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of HF tensor ``hf_name`` (of its slab ``expert`` when 3-D fused)."""

    hf_name: str
    start: int
    stop: int
    expert: int | None = None

    @property
    def rows(self) -> int:
        return self.stop - self.start


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> HF per-layer suffix, for tensors that map one to one (all families).
_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# Multi-latent attention (deepseek_v3), local spec | TE spec (whose q/kv latent norms are fused into
# the up-projections, ``linear_{q,kv}_up_proj.layer_norm_weight``). Every tensor maps whole: Megatron
# keeps HF's row order (per head ``[nope; rope]`` queries, ``[nope; v]`` keys/values, ``[latent;
# rope]`` for the key/value down-projection).
_MLA_ONE_TO_ONE = {
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
EXPERT_BIAS = "mlp.router.expert_bias"
"""The Megatron suffix of the one buffer the bridge maps (the router's expert bias)."""
FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"


@dataclass(frozen=True)
class _Names:
    """One family's HF per-layer suffixes for the MoE block."""

    router: str
    experts: str  # prefix of the per-expert tensors, before ``{e}.``
    gate: str  # the expert's fc1 halves and fc2, after ``{e}.``
    up: str
    down: str
    shared: str = ""  # prefix of the shared expert's gate_proj / up_proj / down_proj


_FAMILY_NAMES = {
    "qwen": _Names(
        "mlp.gate.weight",
        "mlp.experts.",
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
        "mlp.shared_expert.",
    ),
    "glm4_moe": _Names(
        "mlp.gate.weight",
        "mlp.experts.",
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
        "mlp.shared_experts.",
    ),
    "mixtral": _Names(
        "block_sparse_moe.gate.weight", "block_sparse_moe.experts.", "w1.weight", "w3.weight", "w2.weight"
    ),
}
_FAMILY_NAMES["deepseek_v3"] = _FAMILY_NAMES["glm4_moe"]  # its MoE block is GLM's; attention is MLA
_FUSED_ROUTER = "mlp.gate.weight"
"""The router in transformers' in-memory (fused) naming, every family (Mixtral's ``block_sparse_moe`` renamed)."""


def _names(m: ModelConfig) -> _Names:
    return _FAMILY_NAMES[m.family]


def _one_to_one(m: ModelConfig, fused: bool = False) -> dict[str, str]:
    n = _names(m)
    extra = {
        "mlp.router.weight": _FUSED_ROUTER if fused else n.router,
        EXPERT_BIAS: "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    }
    if n.shared:
        extra["mlp.shared_experts.linear_fc2.weight"] = f"{n.shared}down_proj.weight"
    if is_mla(m):
        extra |= _MLA_ONE_TO_ONE
    return _ONE_TO_ONE | extra


def _glu(m: ModelConfig) -> dict[str, tuple[str, str]]:
    """SwiGLU fc1 = [gate; up]."""
    glu = {"mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
    shared = _names(m).shared
    if shared:
        glu["mlp.shared_experts.linear_fc1.weight"] = (f"{shared}gate_proj.weight", f"{shared}up_proj.weight")
    return glu


def is_mla(m: ModelConfig) -> bool:
    """Multi-latent attention (the ``deepseek_v3`` family)."""
    return m.family == "deepseek_v3"


def is_buffer(name: str) -> bool:
    """A mapped Megatron tensor that is a module buffer, not a parameter (the router's expert bias)."""
    return name.endswith("." + EXPERT_BIAS)


def keeps_float32(hf_name: str) -> bool:
    """HF tensors kept in float32 whatever the checkpoint's dtype (transformers'
    ``_keep_in_fp32_modules_strict``; Megatron keeps the expert bias in float32 too): written,
    streamed and accepted in float32, so that engines route with the trainer's exact bias."""
    return hf_name.endswith(".mlp.gate.e_score_correction_bias")


def is_ignored(hf_name: str, m: ModelConfig) -> bool:
    """HF tensors a checkpoint may hold that are not part of the model: the tied LM head, rotary
    tables, and GLM's and DeepSeek-V3's multi-token-prediction layers (:func:`is_mtp`)."""
    if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and m.tie_word_embeddings):
        return True
    return is_mtp(hf_name, m)


def is_mtp(hf_name: str, m: ModelConfig) -> bool:
    """A multi-token-prediction layer's tensor (GLM, DeepSeek-V3: ``model.layers.{i}`` past
    ``num_layers``, HF ``num_nextn_predict_layers``): not loaded (transformers 5.19 ignores them
    too); conversions and exports carry them through unchanged (:mod:`hf_mtp`)."""
    layer = _HF_LAYER_RE.match(hf_name)
    return m.family in ("glm4_moe", "deepseek_v3") and layer is not None and int(layer.group(1)) >= m.num_layers


def _family_label(m: ModelConfig) -> str:
    return {
        "qwen": "Qwen3 / Qwen3-MoE / Qwen2-MoE",
        "mixtral": "Mixtral",
        "glm4_moe": "GLM-4.5",
        "deepseek_v3": "DeepSeek-V3",
    }[m.family]


def hf_shape(hf_name: str, m: ModelConfig) -> tuple[int, ...]:
    """Expected shape of an HF tensor of model ``m`` (raises :class:`MappingError` if unknown)."""
    h, hd, v = m.hidden_size, m.head_dim, m.vocab_size
    top = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    if hf_name in top:
        return top[hf_name]
    match = _HF_LAYER_RE.match(hf_name)
    if not match:
        raise MappingError(f"'{hf_name}' is not a {_family_label(m)} tensor")
    suffix = match.group(2)
    n = _names(m)
    i, e, s = m.moe_ffn_hidden_size, m.num_experts, m.moe_shared_expert_intermediate_size
    if suffix.startswith(n.experts) and suffix.count(".") == n.experts.count(".") + 2:
        expert = suffix[len(n.experts) :].split(".", 1)
        if expert[0].isdigit():
            if int(expert[0]) >= e:
                raise MappingError(f"'{hf_name}': expert {expert[0]} >= num_experts={e}")
            suffix = f"E.{expert[1]}"
    f = m.ffn_hidden_size
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (m.num_attention_heads * hd, h),
        "self_attn.k_proj.weight": (m.num_query_groups * hd, h),
        "self_attn.v_proj.weight": (m.num_query_groups * hd, h),
        "self_attn.o_proj.weight": (h, m.num_attention_heads * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "self_attn.q_proj.bias": (m.num_attention_heads * hd,),
        "self_attn.k_proj.bias": (m.num_query_groups * hd,),
        "self_attn.v_proj.bias": (m.num_query_groups * hd,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        n.router: (e, h),
        _FUSED_ROUTER: (e, h),
        f"E.{n.gate}": (i, h),
        f"E.{n.up}": (i, h),
        f"E.{n.down}": (h, i),
        FUSED_GATE_UP: (e, 2 * i, h),
        FUSED_DOWN: (e, h, i),
    }
    if m.moe_router_enable_expert_bias:
        shapes["mlp.gate.e_score_correction_bias"] = (e,)
    if is_mla(m):  # no q/k/v projections or per-head q/k norms
        shapes = {k: v for k, v in shapes.items() if not k.startswith("self_attn.")} | _mla_shapes(m)
    if n.shared:
        shapes |= {
            f"{n.shared}gate_proj.weight": (s, h),
            f"{n.shared}up_proj.weight": (s, h),
            f"{n.shared}down_proj.weight": (h, s),
        }
    if m.moe_shared_expert_gate:
        shapes["mlp.shared_expert_gate.weight"] = (1, h)
    if suffix not in shapes:
        raise MappingError(f"'{hf_name}' is not a {_family_label(m)} tensor")
    return shapes[suffix]


def _mla_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF per-layer shapes of multi-latent attention (``o_proj`` reads ``heads x v_head_dim``)."""
    h, n, q, kv, rope = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    shapes = {
        "self_attn.q_a_proj.weight": (q, h),
        "self_attn.q_a_layernorm.weight": (q,),
        "self_attn.q_b_proj.weight": (n * (m.head_dim + rope), q),
        "self_attn.kv_a_proj_with_mqa.weight": (kv + rope, h),
        "self_attn.kv_a_layernorm.weight": (kv,),
        "self_attn.kv_b_proj.weight": (n * (m.head_dim + m.v_head_dim), kv),
        "self_attn.o_proj.weight": (h, n * m.v_head_dim),
    }
    return shapes


def _qkv_pieces(prefix: str, m: ModelConfig, kind: str = "weight") -> list[Piece]:
    """Megatron's fused QKV interleaves per query group: ``[q heads of g; k_g; v_g]`` for each g
    (the weight's rows, or the bias's entries with ``kind="bias"``)."""
    hd, ng = m.head_dim, m.num_query_groups
    q_rows = m.num_attention_heads // ng * hd
    pieces = []
    for g in range(ng):
        pieces.append(Piece(f"{prefix}self_attn.q_proj.{kind}", g * q_rows, (g + 1) * q_rows))
        pieces.append(Piece(f"{prefix}self_attn.k_proj.{kind}", g * hd, (g + 1) * hd))
        pieces.append(Piece(f"{prefix}self_attn.v_proj.{kind}", g * hd, (g + 1) * hd))
    return pieces


def _expert_pieces(prefix: str, expert: int, fc: str, m: ModelConfig, fused: bool) -> list[Piece]:
    i, h = m.moe_ffn_hidden_size, m.hidden_size
    if fused:
        if fc == "linear_fc1":
            return [
                Piece(f"{prefix}{FUSED_GATE_UP}", 0, i, expert),
                Piece(f"{prefix}{FUSED_GATE_UP}", i, 2 * i, expert),
            ]
        return [Piece(f"{prefix}{FUSED_DOWN}", 0, h, expert)]
    n = _names(m)
    base = f"{prefix}{n.experts}{expert}."
    if fc == "linear_fc1":
        return [Piece(f"{base}{n.gate}", 0, i), Piece(f"{base}{n.up}", 0, i)]
    return [Piece(f"{base}{n.down}", 0, h)]


def _whole(hf_name: str, m: ModelConfig) -> list[Piece]:
    return [Piece(hf_name, 0, hf_shape(hf_name, m)[0])]


def hf_pieces(name: str, m: ModelConfig, fused_experts: bool = False) -> list[Piece]:
    """The HF row ranges whose concatenation (dim 0) is Megatron full-layout tensor ``name``.

    ``fused_experts`` reads experts from transformers' in-memory 3-D form instead of per-expert
    tensors. A tied ``output_layer.weight`` (last PP stage) reads the input embedding.
    """
    if name == "embedding.word_embeddings.weight":
        return _whole("model.embed_tokens.weight", m)
    if name == "output_layer.weight":
        return _whole("model.embed_tokens.weight" if m.tie_word_embeddings else "lm_head.weight", m)
    if name == "decoder.final_layernorm.weight":
        return _whole("model.norm.weight", m)
    match = _LAYER_RE.match(name)
    if not match:
        raise MappingError(f"Megatron parameter '{name}' has no HF counterpart")
    layer, suffix = int(match.group(1)), match.group(2)
    if layer >= m.num_layers:
        raise MappingError(f"Megatron parameter '{name}': layer {layer} >= num_layers={m.num_layers}")
    prefix = f"model.layers.{layer}."
    if suffix == "self_attention.linear_qkv.weight":
        return _qkv_pieces(prefix, m)
    if suffix == "self_attention.linear_qkv.bias":
        if not m.add_qkv_bias:
            raise MappingError(f"Megatron parameter '{name}': the model config has add_qkv_bias=false")
        return _qkv_pieces(prefix, m, "bias")
    if suffix == EXPERT_BIAS and not m.moe_router_enable_expert_bias:
        raise MappingError(f"Megatron tensor '{name}': the model config has moe_router_enable_expert_bias=false")
    one_to_one, glu = _one_to_one(m, fused_experts), _glu(m)
    if suffix in one_to_one:
        return _whole(prefix + one_to_one[suffix], m)
    if suffix in glu:
        gate, up = glu[suffix]
        rows = hf_shape(prefix + gate, m)[0]
        return [Piece(prefix + gate, 0, rows), Piece(prefix + up, 0, rows)]
    if local := _LOCAL_EXPERT_RE.match(suffix):
        expert, fc = int(local.group(1)), local.group(2)
    elif grouped := _GROUPED_EXPERT_RE.match(suffix):
        expert, fc = int(grouped.group(2)), grouped.group(1)
    else:
        raise MappingError(f"Megatron parameter '{name}' has no HF counterpart")
    if expert >= m.num_experts:
        raise MappingError(f"Megatron parameter '{name}': expert {expert} >= num_experts={m.num_experts}")
    return _expert_pieces(prefix, expert, fc, m, fused_experts)


def full_shape(name: str, m: ModelConfig) -> tuple[int, ...]:
    """Shape of Megatron full-layout tensor ``name`` (rows of its pieces x the HF columns)."""
    pieces = hf_pieces(name, m)
    return (sum(p.rows for p in pieces), *hf_shape(pieces[0].hf_name, m)[1:])


def is_exported(name: str, m: ModelConfig) -> bool:
    """False for the tied LM head copy (the HF checkpoint holds the embedding once)."""
    return not (name == "output_layer.weight" and m.tie_word_embeddings)


def hf_names(name: str, m: ModelConfig) -> list[str]:
    """HF tensors written for Megatron tensor ``name`` (in order; empty for the tied LM head)."""
    if not is_exported(name, m):
        return []
    return list(dict.fromkeys(p.hf_name for p in hf_pieces(name, m)))


def to_hf(name: str, full: torch.Tensor, m: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """Split a Megatron full-layout tensor into its HF tensors (per-expert on-disk names)."""
    if not is_exported(name, m):
        return []
    pieces = hf_pieces(name, m)
    if full.shape[0] != sum(p.rows for p in pieces):
        raise ValueError(f"'{name}': {full.shape[0]} rows, the mapping expects {sum(p.rows for p in pieces)}")
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    offset = 0
    for p in pieces:
        parts.setdefault(p.hf_name, []).append((p.start, full[offset : offset + p.rows]))
        offset += p.rows
    return [
        (hf, torch.cat([t for _, t in sorted(rows, key=lambda r: r[0])]) if len(rows) > 1 else rows[0][1])
        for hf, rows in parts.items()
    ]


def from_hf(name: str, m: ModelConfig, get: Callable[[str], torch.Tensor], fused_experts: bool = False) -> torch.Tensor:
    """Assemble Megatron full-layout tensor ``name`` from HF tensors returned by ``get(hf_name)``."""
    parts = []
    for p in hf_pieces(name, m, fused_experts):
        tensor = get(p.hf_name)
        if p.expert is not None:
            tensor = tensor[p.expert]
        parts.append(tensor[p.start : p.stop])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


# --------------------------------------------------------------------------------------------
# Per-rank reads: which HF rows / columns a TP rank's slice of a Megatron tensor consists of.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Read:
    """Read rows ``[start, stop)`` and columns ``cols`` of ``hf_name`` (slab ``expert`` if fused)."""

    hf_name: str
    start: int
    stop: int
    cols: tuple[int, int] | None = None
    expert: int | None = None


def local_row_ranges(rows: int, tp_size: int, tp_rank: int, glu: bool) -> list[tuple[int, int]]:
    """Rows of the full tensor held by a TP rank split along dim 0 (``layout.shard``'s rule).

    Plain: chunk ``tp_rank`` of ``tp_size``. SwiGLU fc1 ``[gate; up]``: chunk ``tp_rank`` of
    gate followed by chunk ``tp_rank`` of up.
    """
    if glu:
        half = rows // 2
        step = half // tp_size
        return [(tp_rank * step, (tp_rank + 1) * step), (half + tp_rank * step, half + (tp_rank + 1) * step)]
    step = rows // tp_size
    return [(tp_rank * step, (tp_rank + 1) * step)]


def local_reads(
    pieces: list[Piece], full: tuple[int, ...], partition_dim: int | None, tp_size: int, tp_rank: int, glu: bool
) -> list[Read]:
    """HF slices whose dim-0 concatenation is a TP rank's slice of a Megatron tensor.

    ``partition_dim`` None (or ``tp_size`` 1) means the rank holds the full tensor; 0 splits
    rows (``glu`` for SwiGLU fc1), 1 splits columns.
    """
    rows = full[0]
    ranges, cols = [(0, rows)], None
    if partition_dim is not None and tp_size > 1:
        if partition_dim == 0:
            if rows % (2 * tp_size if glu else tp_size):
                raise ValueError(f"{rows} rows do not split over TP={tp_size}")
            ranges = local_row_ranges(rows, tp_size, tp_rank, glu)
        elif partition_dim == 1:
            if full[1] % tp_size:
                raise ValueError(f"{full[1]} columns do not split over TP={tp_size}")
            step = full[1] // tp_size
            cols = (tp_rank * step, (tp_rank + 1) * step)
        else:
            raise ValueError(f"partition_dim={partition_dim} is not supported")
    reads = []
    for lo, hi in ranges:
        offset = 0
        for p in pieces:
            a, b = max(lo, offset), min(hi, offset + p.rows)
            if a < b:
                reads.append(Read(p.hf_name, p.start + a - offset, p.start + b - offset, cols, p.expert))
            offset += p.rows
    return reads


def mcore_names(m: ModelConfig, spec: str = "local") -> list[str]:
    """Full-layout names of ``m``'s mapped tensors in order (parameters and the expert-bias
    buffers, :func:`is_buffer`): ``local`` spec, ``te`` or ``te_grouped``."""
    if spec not in ("local", "te", "te_grouped"):
        raise ValueError(f"spec={spec!r}; use local, te or te_grouped")
    te = spec != "local"
    names = ["embedding.word_embeddings.weight"]
    for layer, is_moe in enumerate(moe_layer_pattern(m)):
        pre = f"decoder.layers.{layer}."
        names += [pre + s for s in (_mla_names(te) if is_mla(m) else _attention_names(m, te))]
        if not is_moe:
            norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
            names += [pre + s for s in (norm, "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
            continue
        names += [pre + "pre_mlp_layernorm.weight", pre + "mlp.router.weight"]
        if m.moe_router_enable_expert_bias:
            names.append(pre + EXPERT_BIAS)
        for fc in ("linear_fc1", "linear_fc2") if spec == "te_grouped" else ():
            names += [f"{pre}mlp.experts.{fc}.weight{e}" for e in range(m.num_experts)]
        for e in range(m.num_experts) if spec != "te_grouped" else ():
            names += [f"{pre}mlp.experts.local_experts.{e}.{fc}.weight" for fc in ("linear_fc1", "linear_fc2")]
        if m.moe_shared_expert_intermediate_size:
            names += [
                pre + "mlp.shared_experts.linear_fc1.weight",
                pre + "mlp.shared_experts.linear_fc2.weight",
            ]
            if m.moe_shared_expert_gate:
                names.append(pre + "mlp.shared_experts.gate_weight")
    names.append("decoder.final_layernorm.weight")
    if not m.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def _attention_names(m: ModelConfig, te: bool) -> list[str]:
    attn = ["self_attention.linear_qkv.layer_norm_weight"] if te else ["input_layernorm.weight"]
    attn += ["self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"]
    if m.add_qkv_bias:
        attn.append("self_attention.linear_qkv.bias")
    if m.qk_layernorm:
        attn += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    return attn


def _mla_names(te: bool) -> list[str]:
    """Multi-latent attention's parameters in Megatron's order (TE fuses the latent norms into the
    up-projections and keeps the input norm apart)."""
    names = ["input_layernorm.weight", "self_attention.linear_proj.weight"]
    names += [f"self_attention.linear_{x}_proj.weight" for x in ("q_down", "q_up", "kv_down", "kv_up")]
    if te:
        return names + [f"self_attention.linear_{x}_up_proj.layer_norm_weight" for x in ("q", "kv")]
    return names + ["self_attention.q_layernorm.weight", "self_attention.kv_layernorm.weight"]


def expected_hf_names(m: ModelConfig) -> list[str]:
    """Every tensor an on-disk (per-expert) HF checkpoint of ``m`` holds, in export order."""
    return [hf for name in mcore_names(m) for hf in hf_names(name, m)]


def mcore_to_hf(full_state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole full-layout Megatron state (e.g. ``layout.gather_full``) as HF tensors."""
    return {hf: t for name, full in full_state.items() for hf, t in to_hf(name, full, m)}


def hf_to_mcore(
    hf_state: dict[str, torch.Tensor], m: ModelConfig, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Full-layout Megatron tensors ``names`` (default: the local spec's) from an HF state."""
    fused = any(k.endswith(FUSED_GATE_UP) for k in hf_state)  # transformers' in-memory names

    def get(hf_name: str) -> torch.Tensor:
        if hf_name not in hf_state:
            raise MappingError(f"HF state lacks '{hf_name}'")
        return hf_state[hf_name]

    return {n: from_hf(n, m, get, fused) for n in (names if names is not None else mcore_names(m))}
