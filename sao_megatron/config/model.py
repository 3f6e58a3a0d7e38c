"""The model shape (``configs/models/*.yaml``, the run config's ``model`` key): one dataclass, a
docstring under every field.

Kept apart from :mod:`sao_megatron.config.schema` (which uses it as ``SAOConfig.model``, and
re-exports it) because it is the one section ``sao convert``, ``sao export`` and ``sao plan`` read
without a run; validation is :mod:`sao_megatron.config.shape`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ModelFamily = Literal["qwen", "mixtral", "glm4_moe", "deepseek_v3"]
"""The HF architecture family of a model shape: it names the checkpoint's tensors (``models/hf_bridge.py``)."""
RouterScore = Literal["softmax", "sigmoid"]
"""The MoE router's score function (HF: Qwen and Mixtral softmax, GLM-4.5 sigmoid)."""
RopeType = Literal["default", "yarn"]
"""RoPE frequencies: plain, or YaRN-scaled (DeepSeek-V3's long context; multi-latent attention only)."""


@dataclass
class ModelConfig:
    """Shape of a decoder of a supported HF family: Qwen3-MoE (dense Qwen3 when ``num_experts ==
    0``), Qwen2-MoE, Mixtral, GLM-4.5/4.6 or DeepSeek-V3 / Kimi-K2 (``family``)."""

    name: str = ""
    """Human-readable name, e.g. ``tiny_moe`` or ``qwen3_30b_a3b``."""
    family: ModelFamily = "qwen"
    """The HF architecture the shape maps to, which names the checkpoint's tensors and writes its
    ``config.json``: ``qwen`` (Qwen3, Qwen3-MoE and Qwen2-MoE, told apart by the fields below),
    ``mixtral`` (``MixtralForCausalLM``), ``glm4_moe`` (``Glm4MoeForCausalLM``: GLM-4.5, 4.6) or
    ``deepseek_v3`` (``DeepseekV3ForCausalLM``: DeepSeek-V3, V3.1, Kimi-K2; multi-latent attention)."""
    num_layers: int = 0
    """Transformer layers (HF ``num_hidden_layers``)."""
    hidden_size: int = 0
    """Residual stream width (HF ``hidden_size``)."""
    num_attention_heads: int = 0
    """Query heads (HF ``num_attention_heads``)."""
    num_query_groups: int = 0
    """Key/value heads for GQA (HF ``num_key_value_heads``)."""
    head_dim: int = 0
    """Per-head width (HF ``head_dim``); may differ from hidden_size / heads in Qwen3. With
    multi-latent attention (``deepseek_v3``) the query/key part RoPE does not rotate (HF
    ``qk_nope_head_dim``, Megatron ``qk_head_dim``); a query/key head is ``head_dim +
    qk_rope_head_dim`` wide."""
    q_lora_rank: int = 0
    """Multi-latent attention (``deepseek_v3`` only, 0 elsewhere): the query's low-rank width (HF ``q_lora_rank``)."""
    kv_lora_rank: int = 0
    """Multi-latent attention: the compressed key/value latent's width (HF ``kv_lora_rank``)."""
    qk_rope_head_dim: int = 0
    """Multi-latent attention: the query/key width per head that RoPE rotates, the key's part shared by
    all heads (HF ``qk_rope_head_dim``, Megatron ``qk_pos_emb_head_dim``)."""
    v_head_dim: int = 0
    """Multi-latent attention: per-head value width (HF ``v_head_dim``)."""
    ffn_hidden_size: int = 0
    """Dense MLP width (HF ``intermediate_size``), used by dense layers and dense models."""
    vocab_size: int = 0
    """Embedding rows; must equal the tokenizer's vocabulary (plus any padding you choose)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 builds a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int = 0
    """Expert MLP width (HF ``moe_intermediate_size``)."""
    moe_shared_expert_intermediate_size: int = 0
    """Shared-expert width; 0 means no shared expert (Qwen3-MoE has none; Qwen2-MoE
    ``shared_expert_intermediate_size``)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x @ w)``, ``w`` of shape ``[1, hidden]``
    (Qwen2-MoE ``shared_expert_gate``; Megatron ``moe_shared_expert_gate``)."""
    moe_router_renormalize: bool = True
    """Renormalise the top-k routing weights to sum to 1 (HF ``norm_topk_prob``). False: softmax
    over all experts, then the top-k probabilities as they are (Megatron pre-softmax routing).
    With ``sigmoid`` scores Megatron renormalises exactly when top-k > 1, so it must say so."""
    moe_router_score_function: RouterScore = "softmax"
    """``softmax`` over the experts' logits, or an independent ``sigmoid`` per expert (GLM-4.5,
    DeepSeek-V3); Megatron ``moe_router_score_function``."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing the top-k only, not to the weights
    (aux-loss-free balancing; HF ``e_score_correction_bias``, Megatron ``router.expert_bias``,
    a buffer updated by training unless ``actor.router_bias_update`` is ``freeze``). Sigmoid only."""
    moe_router_topk_scaling_factor: float = 1.0
    """The top-k weights times this, after any renormalisation (HF ``routed_scaling_factor``)."""
    moe_router_num_groups: int = 1
    """Experts split into this many equal groups; a token picks ``moe_router_group_topk`` groups,
    then its top-k experts inside them (HF ``n_group``; 1: no groups). Megatron ranks a group by
    the sum of its best ``topk / group_topk`` scores, HF by its best 2, so groups are built only
    where ``topk / group_topk == 2``."""
    moe_router_group_topk: int = 1
    """Groups each token may use (HF ``topk_group``)."""
    moe_layer_freq: int = 1
    """Every n-th layer is MoE (HF ``decoder_sparse_step``)."""
    dense_layers: list[int] = field(default_factory=list)
    """Layer indices forced dense (HF ``mlp_only_layers``)."""
    moe_aux_loss_coeff: float = 0.001
    """Load-balancing auxiliary loss coefficient (HF ``router_aux_loss_coef``)."""
    max_position_embeddings: int = 4096
    """Longest sequence the RoPE tables are built for."""
    rope_theta: float = 1_000_000.0
    """RoPE base (HF ``rope_theta``)."""
    rotary_percent: float = 1.0
    """Share of each head's dimensions that RoPE rotates, the first ones (HF
    ``partial_rotary_factor``: GLM-4.5 0.5); the rest pass unrotated."""
    rope_type: RopeType = "default"
    """``yarn``: YaRN-scaled RoPE (HF ``rope_scaling`` / ``rope_parameters`` of type ``yarn``; multi-latent
    attention only). The ``rope_*`` / ``yarn_*`` fields below are HF's ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``:
    cos/sin scaled by ``m(factor, yarn_mscale) / m(factor, yarn_mscale_all_dim)``, the softmax by
    ``m(factor, yarn_mscale_all_dim)^2``, ``m(s, a) = 0.1 a ln s + 1``."""
    rope_scaling_factor: float = 1.0
    rope_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (HF ``rms_norm_eps``)."""
    qk_layernorm: bool = True
    """RMSNorm on per-head queries and keys (Qwen3; Qwen2-MoE has none)."""
    add_qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2-MoE ``qkv_bias``, GLM-4.5
    ``attention_bias``)."""
    tie_word_embeddings: bool = False
    """Share input embedding and LM head (Qwen3-MoE: untied)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers the HF checkpoint carries after the decoder (DeepSeek-V3
    ``num_nextn_predict_layers``, ``model.layers.{num_layers}...``): not built, loaded or trained;
    ``sao convert`` / ``sao export`` carry their tensors through unchanged (``models/hf_mtp.py``);
    ``models/counting.py`` counts them apart from the model's total."""
