"""What the GPU check runs and how it counts: model shapes, ragged batches, FLOPs and MFU.

Pure (torch and the config schema only; no Megatron), so the arithmetic is unit-tested on CPU.

FLOP formula of one training step (forward + backward), counted as PaLM (Chowdhery et al. 2022,
appendix B) and Megatron-LM (Narayanan et al. 2021) do, with the attention square not halved
for causality::

    flops = 6 * N_matmul * tokens + 12 * num_layers * num_heads * head_dim * sum_i(s_i ** 2)

``N_matmul``: the active parameters per token of :func:`sao_megatron.models.counting.parameter_counts`
(top-k experts, not all) less the input embedding table (a lookup, no matmul); ``tokens``: the
real tokens of the batch (padding excluded); ``s_i``: each sequence's length (QK^T and AV, 4 s^2 h d
per layer forward, x3 with backward). The critic's frozen parameters (attention by default) need
no weight gradient: 4 instead of 6 flops per parameter and token (:func:`critic_step_flops`).
A forward-only pass (logprobs, values) is a third of the step's per-token and attention terms.

MFU = flops / seconds / measured bf16 matmul peak (not the datasheet figure).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from sao_megatron.config import CriticConfig, ModelConfig, ParallelConfig
from sao_megatron.records import Trajectory, Turn

FLOP_FORMULA = (
    "6 * N_matmul * tokens + 12 * num_layers * num_heads * head_dim * sum_i(s_i ** 2) "
    "(N_matmul: active parameters less the input embedding; critic: 4 per frozen parameter)"
)

MOE_1B = ModelConfig(
    name="moe_1b_gpu_check",
    num_layers=12,
    hidden_size=1024,
    num_attention_heads=16,
    num_query_groups=4,
    head_dim=64,
    ffn_hidden_size=2816,
    vocab_size=32768,
    num_experts=48,
    moe_router_topk=4,
    moe_ffn_hidden_size=512,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
)
"""The ~1B-total MoE of the throughput section: 1.005 B parameters, 0.175 B active per token."""

LAYOUT_GPU_MODEL = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "head_dim": 64,
    "moe_ffn_hidden_size": 512,
    "ffn_hidden_size": 1024,
    "vocab_size": 4096,
}
"""Overrides of ``tiny_moe`` for the layout cases on a GPU (wider, so bf16 rounding shows)."""


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """A ragged batch: ``rows`` trajectories of odd lengths in ``[min_len, max_len]``, up to
    ``turns`` (action, observation) turns each; every other row has only 1-token actions."""

    rows: int
    min_len: int
    max_len: int
    turns: int
    vocab: int
    seed: int = 0


THROUGHPUT_GPU = BatchShape(rows=8, min_len=640, max_len=1023, turns=16, vocab=MOE_1B.vocab_size)
"""~6.6K tokens per step (4K-8K), micro-batches of 2 rows."""
THROUGHPUT_CPU = BatchShape(rows=4, min_len=17, max_len=41, turns=4, vocab=512)
LAYOUT_GPU = BatchShape(rows=7, min_len=9, max_len=301, turns=24, vocab=4096, seed=1)
LAYOUT_CPU = BatchShape(rows=5, min_len=5, max_len=31, turns=6, vocab=512, seed=1)


def _composition(total: int, parts: int, g: torch.Generator) -> list[int]:
    """``parts`` positive integers summing to ``total`` (uniform random cuts)."""
    cuts = sorted((torch.randperm(total - 1, generator=g)[: parts - 1] + 1).tolist())
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


def ragged_trajectories(shape: BatchShape) -> list[Trajectory]:
    """Odd sequence lengths, many turns, 1-token actions on every other row (deterministic)."""
    g = torch.Generator().manual_seed(shape.seed)
    out = []
    for i in range(shape.rows):
        length = int(torch.randint(shape.min_len, shape.max_len + 1, (1,), generator=g)) | 1  # odd
        length = min(length, shape.max_len if shape.max_len % 2 else shape.max_len - 1)
        n_prompt = max(1, length // 8)
        n_resp = length - n_prompt
        turns = max(1, min(shape.turns, (n_resp + 1) // 2))
        if i % 2:  # 1-token actions, the observations take the rest
            actions = [1] * turns
            obs = _composition(n_resp - turns, turns - 1, g) if turns > 1 else []
        else:
            spans = _composition(n_resp, 2 * turns - 1, g)
            actions, obs = spans[0::2], spans[1::2]
        prompt = torch.randint(6, shape.vocab, (n_prompt,), generator=g).tolist()
        resp, mask, spans_out = [], [], []
        for t in range(turns):
            spans_out.append(Turn(len(resp), len(resp) + actions[t]))
            n_obs = obs[t] if t < len(obs) else 0
            resp += torch.randint(6, shape.vocab, (actions[t] + n_obs,), generator=g).tolist()
            mask += [1] * actions[t] + [0] * n_obs
        # near a fresh model's uniform logprob, so the DIS band (1 - eps_low < ratio) keeps most tokens
        behavior = (-math.log(shape.vocab) + 0.3 * torch.randn(len(resp), generator=g)).tolist()
        out.append(
            Trajectory(
                prompt_id=f"p{i}",
                prompt_ids=prompt,
                response_ids=resp,
                action_mask=mask,
                behavior_logprobs=[b if m else 0.0 for b, m in zip(behavior, mask, strict=True)],
                policy_versions=[0 if m else -1 for m in mask],
                turns=spans_out,
                reward=float(i % 2),
                status="finished",
            )
        )
    return out


def sequence_lengths(shape: BatchShape) -> list[int]:
    return [len(t.prompt_ids) + len(t.response_ids) for t in ragged_trajectories(shape)]


def parameter_summary(m: ModelConfig, critic: CriticConfig | None = None) -> dict[str, int]:
    """Total and active parameters (``models.counting``) and the per-token matmul parameters.

    ``matmul_trainable`` / ``matmul_frozen``: active matmul parameters split by the critic's
    freeze patterns (``plan.params.stage_parameters``, local-spec names); the actor trains all."""
    from sao_megatron.models.counting import parameter_counts
    from sao_megatron.plan.params import stage_parameters

    counts = parameter_counts(m)
    embed = m.vocab_size * m.hidden_size
    trainable = frozen = 0
    expert_share = m.moe_router_topk / m.num_experts if m.num_experts else 1.0
    for name, (n, train) in stage_parameters(m, ParallelConfig(), 0, critic).items():
        if name.startswith("embedding."):
            continue
        active = n * expert_share if ".experts." in name else n
        if train:
            trainable += round(active)
        else:
            frozen += round(active)
    return {
        "total": counts["total"],
        "active": counts["active"],
        "matmul": counts["active"] - embed,
        "matmul_trainable": trainable,
        "matmul_frozen": frozen,
    }


def attention_flops(m: ModelConfig, lengths: list[int]) -> int:
    """QK^T and AV of one training step (forward + backward), full square: 12 L H d sum(s^2)."""
    return 12 * m.num_layers * m.num_attention_heads * m.head_dim * sum(s * s for s in lengths)


def actor_step_flops(m: ModelConfig, lengths: list[int]) -> int:
    """``6 * N_matmul * tokens + attention`` of one policy training step."""
    return 6 * parameter_summary(m)["matmul"] * sum(lengths) + attention_flops(m, lengths)


def critic_step_flops(m: ModelConfig, critic: CriticConfig, lengths: list[int]) -> int:
    """``(6 * N_trainable + 4 * N_frozen) * tokens + attention``: frozen weights get no weight gradient."""
    p = parameter_summary(m, critic)
    per_token = 6 * p["matmul_trainable"] + 4 * p["matmul_frozen"]
    return per_token * sum(lengths) + attention_flops(m, lengths)


def forward_flops(n_matmul: int, m: ModelConfig, lengths: list[int]) -> int:
    """One forward pass: ``2 * N_matmul * tokens + attention / 3``."""
    return 2 * n_matmul * sum(lengths) + attention_flops(m, lengths) // 3


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the measured peak (None without a peak)."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)


def matmul_flops(n: int) -> int:
    """An ``n x n @ n x n`` product: 2 n^3."""
    return 2 * n**3


MEMORY_GPU = {
    "model": {
        "name": "memory_check",
        "num_layers": 2,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_query_groups": 4,
        "head_dim": 128,
        "ffn_hidden_size": 2816,
        "vocab_size": 151936,
        "num_experts": 8,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 1024,
        "max_position_embeddings": 8192,
    },
    "seq": 8192,
    "logits": [8192, 151936],
}
"""The memory section at GPU size: one 8,192-token sequence per micro-batch with Qwen3's 151,936-token
vocabulary, 1.245e9 logits on the rank (issue 29: the 30B config's logits step is 2.49e9 per rank)."""
MEMORY_CPU = {"model": {"num_layers": 2}, "seq": 128, "logits": [256, 512]}
