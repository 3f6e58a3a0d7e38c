"""Core attention for multi-latent attention (MLA, DeepSeek-V3) on Megatron-Core's local layer spec.

Megatron's MLA (``MLASelfAttention``) hands its core attention queries and keys ``k_channels =
qk_head_dim + qk_pos_emb_head_dim`` wide per head and values ``v_channels = v_head_dim`` wide, and
builds it with those two keywords. Only Transformer Engine's attention takes them: the local spec's
``DotProductAttention`` raises ``TypeError`` on them and sizes its output by ``kv_channels``. This
module is what the local spec needs wherever TE is absent (any device); ``models/builder.layer_spec``
puts it into MLA layer specs.

The computation is ``DotProductAttention``'s (``softmax(scale * q k^T + mask) v`` per head, the same
mask handling and softmax in float32 when configured); only the sizes differ: the output is
``[s, b, heads per TP rank x v_channels]``. The softmax scale is the one MLA passes
(``m(factor, mscale_all_dim)^2 / sqrt(k_channels)`` with YaRN, ``1 / sqrt(k_channels)`` without),
else ``1 / sqrt(k_channels)``.
"""

from __future__ import annotations

import math

from megatron.core.transformer.dot_product_attention import DotProductAttention


class LocalMLACoreAttention(DotProductAttention):
    """``DotProductAttention`` whose keys are ``k_channels`` and values ``v_channels`` wide per head."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        if softmax_scale is None and k_channels is not None:
            softmax_scale = 1.0 / math.sqrt(k_channels)
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            # the context's last dimension: [s, b, heads per partition x v_channels]
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
