"""Parameters per rank, analytically: every tensor of a pipeline stage's rank with its Megatron name.

From the model shape and layout alone (no Megatron import): :func:`stage_parameters` lists what one
rank of a stage holds under the local layer spec, with local layer indices. TP, CP, EP and
expert-TP ranks of one stage hold equally many parameters, so one rank per stage is exact.
``tests/test_plan.py`` checks it name by name against the meta-device build
(:mod:`sao_megatron.plan.meta`).
"""

from __future__ import annotations

import re

from sao_megatron.config import CriticConfig, ModelConfig, ParallelConfig
from sao_megatron.models.builder import moe_layer_pattern

StageParams = dict[str, tuple[int, bool]]
"""Parameter name -> (elements on this rank, trainable)."""


def stage_parameters(m: ModelConfig, p: ParallelConfig, stage: int, critic: CriticConfig | None = None) -> StageParams:
    """Every parameter a rank of pipeline ``stage`` holds (Megatron local-spec names, local layer indices)."""
    tp, ep, etp, pp = p.tensor_parallel, p.expert_parallel, p.expert_tensor_parallel, p.pipeline_parallel
    h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    per_stage = m.num_layers // pp
    pattern = moe_layer_pattern(m)
    out: dict[str, int] = {}
    if stage == 0:
        out["embedding.word_embeddings.weight"] = m.vocab_size // tp * h
    for i in range(per_stage):
        pre = f"decoder.layers.{i}."
        out[pre + "input_layernorm.weight"] = h
        if m.family == "deepseek_v3":
            out |= _mla(m, tp, pre)
        else:
            out[pre + "self_attention.linear_proj.weight"] = h * (a * d // tp)
            out[pre + "self_attention.linear_qkv.weight"] = (a + 2 * g) * d // tp * h
            if m.add_qkv_bias:
                out[pre + "self_attention.linear_qkv.bias"] = (a + 2 * g) * d // tp
            if m.qk_layernorm:
                out[pre + "self_attention.q_layernorm.weight"] = d
                out[pre + "self_attention.k_layernorm.weight"] = d
        out[pre + "pre_mlp_layernorm.weight"] = h
        if pattern[stage * per_stage + i]:
            out[pre + "mlp.router.weight"] = m.num_experts * h
            for j in range(m.num_experts // ep):
                expert = f"{pre}mlp.experts.local_experts.{j}."
                out[expert + "linear_fc1.weight"] = 2 * (m.moe_ffn_hidden_size // etp) * h
                out[expert + "linear_fc2.weight"] = h * (m.moe_ffn_hidden_size // etp)
            if m.moe_shared_expert_intermediate_size:
                width = m.moe_shared_expert_intermediate_size // tp
                out[pre + "mlp.shared_experts.linear_fc1.weight"] = 2 * width * h
                out[pre + "mlp.shared_experts.linear_fc2.weight"] = h * width
        else:
            out[pre + "mlp.linear_fc1.weight"] = 2 * (m.ffn_hidden_size // tp) * h
            out[pre + "mlp.linear_fc2.weight"] = h * (m.ffn_hidden_size // tp)
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = h
        if critic is not None:  # critic.ValueHead replaces the LM head
            out["output_layer.weight"] = h
            out["output_layer.bias"] = 1
        elif not m.tie_word_embeddings or pp > 1:  # tied + PP: the last stage keeps a synced copy
            out["output_layer.weight"] = m.vocab_size // tp * h
    frozen = _frozen(out, critic)
    return {name: (n, name not in frozen) for name, n in out.items()}


def _mla(m: ModelConfig, tp: int, pre: str) -> dict[str, int]:
    """Multi-latent attention on the local spec: every projection column-parallel (the down-projections
    too, gathered after), the output row-parallel, the latent norms whole."""
    h, n, q, kv, rope = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    attn = pre + "self_attention."
    return {
        attn + "linear_proj.weight": h * (n * m.v_head_dim // tp),
        attn + "linear_q_down_proj.weight": q // tp * h,
        attn + "linear_q_up_proj.weight": n * (m.head_dim + rope) // tp * q,
        attn + "linear_kv_down_proj.weight": (kv + rope) // tp * h,
        attn + "linear_kv_up_proj.weight": n * (m.head_dim + m.v_head_dim) // tp * kv,
        attn + "q_layernorm.weight": q,
        attn + "kv_layernorm.weight": kv,
    }


def _frozen(names, critic: CriticConfig | None) -> set[str]:
    """``critic.freeze`` semantics: frozen if any freeze regex matches and no train regex does."""
    if critic is None:
        return set()
    freeze = [re.compile(x) for x in critic.freeze_patterns]
    train = [re.compile(x) for x in critic.train_patterns]
    return {n for n in names if any(r.search(n) for r in freeze) and not any(r.search(n) for r in train)}


def analytic_parameters(m: ModelConfig, p: ParallelConfig, critic: CriticConfig | None = None) -> list[StageParams]:
    return [stage_parameters(m, p, s, critic) for s in range(p.pipeline_parallel)]
