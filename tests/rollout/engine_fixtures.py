"""Tiny random Qwen3-MoE HF checkpoints (tiny_moe shape, our tokenizer) and a CPU SGLang engine; a port
squatter."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def squatter(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """A port held by an HTTP server of ``handler`` while the context lasts (its port is yielded): what
    can take a probe-and-release port (``spawn.free_port``) before a server binds it."""
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def make_tiny_hf(out_dir: Path, seed: int = 0, std: float = 0.05) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from sao_megatron.config import load_config
    from sao_megatron.tokenizer import load_tokenizer

    m = load_config().model
    tok = load_tokenizer()
    cfg = Qwen3MoeConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=False,
        num_experts=m.num_experts,
        num_experts_per_tok=m.moe_router_topk,
        moe_intermediate_size=m.moe_ffn_hidden_size,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_epsilon,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
