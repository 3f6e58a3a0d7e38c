"""Worker bodies for ``test_init_from``: actor and critic initialised from a checkpoint on each rank.

One spawned 2-rank gloo world: peak RSS while initialising actor + critic from a ~200 MB HF
checkpoint at EP=2 (first, before anything else grows the process), then the tiny ``transformers``
Qwen3-MoE checkpoint at TP=2 and EP=2 (logits against ``transformers``, critic trunk and value
head), then a Megatron checkpoint of the same weights (saved at TP=2, loaded at EP=2).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron.config import ActorConfig, CriticConfig, ModelConfig
from sao_megatron.config import hf as hf_config
from tests.models import hf_cases


def _params_bytes(model: torch.nn.Module) -> int:
    return sum(q.numel() * q.element_size() for q in model.parameters())


def case_memory(big_dir: str) -> dict:
    """Peak RSS (sampled every 2 ms) over building and loading both models, against their shards."""
    from sao_megatron.workers.role import build_actor_model, build_critic_model

    m = hf_cases.MEMORY_MODEL
    p = hf_cases._setup(dist.get_world_size(), expert_parallel=2)
    base = hf_cases._rss()
    with hf_cases._PeakRSS() as peak:
        actor = build_actor_model(m, ActorConfig(parallel=p, init_from=big_dir))
        critic = build_critic_model(m, CriticConfig(parallel=p), big_dir)
    shard = _params_bytes(actor) + _params_bytes(critic)
    out = {
        "base": base,
        "peak": peak.peak,
        "shard": shard,
        "actor_sum": float(sum(q.detach().double().abs().sum() for q in actor.parameters())),
    }
    del actor, critic
    return out


def _head_abs(critic: torch.nn.Module) -> float:
    """Largest magnitude in the value head (``output_layer.weight`` [1, h] and ``.bias``)."""
    head = [q for n, q in critic.named_parameters() if n.startswith("output_layer.")]
    assert len(head) == 2 and head[0].shape[0] == 1, [q.shape for q in head]
    return max(float(q.detach().abs().max()) for q in head)


def _trunk(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.detach().clone() for n, q in model.named_parameters() if not n.startswith("output_layer.")}


def case_layout(hf_dir: Path, m: ModelConfig, layout: str, reference: torch.Tensor) -> dict:
    """Actor logits vs transformers; critic trunk = actor trunk = the checkpoint's slices; zero head."""
    from safetensors import safe_open

    from sao_megatron.workers.role import build_actor_model, build_critic_model

    p = hf_cases._setup(dist.get_world_size(), **hf_cases.LAYOUTS[layout])
    actor = build_actor_model(m, ActorConfig(parallel=p, init_from=str(hf_dir)))
    actor.eval()
    logits = hf_cases._forward_logits(actor, p, hf_cases.tokens())
    critic = build_critic_model(m, CriticConfig(parallel=p), str(hf_dir))
    critic.eval()
    a, c = _trunk(actor), _trunk(critic)
    # One trunk slice straight from the safetensors files: this rank's rows of the embedding.
    emb = c["embedding.word_embeddings.weight"]
    from megatron.core import parallel_state as ps

    rows = emb.shape[0]
    start = ps.get_tensor_model_parallel_rank() * rows
    expected = None
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if "model.embed_tokens.weight" in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                expected = f.get_slice("model.embed_tokens.weight")[start : start + rows]
    with torch.no_grad():
        positions = torch.arange(hf_cases.SEQ).expand(hf_cases.BATCH, hf_cases.SEQ).contiguous()
        values = critic(hf_cases.tokens(), positions, attention_mask=None)
    frozen_names = [n for n, q in critic.named_parameters() if not q.requires_grad]
    same_names = sorted(a) == sorted(c)
    return {
        "logits": None if logits is None else (logits - reference).abs().max().item(),
        "trunk_vs_actor": max((a[n] - c[n]).abs().max().item() for n in a) if same_names else None,
        "embedding_slice": None if expected is None else (emb - expected).abs().max().item(),
        "head_abs": _head_abs(critic),
        "values_abs": float(values.abs().max()),
        "frozen_attention": bool(frozen_names) and all(".self_attention." in n for n in frozen_names),
        "trunk": a,
    }


def case_megatron(root: Path, m: ModelConfig, reference: torch.Tensor, trunk_ep2: dict) -> dict:
    """A Megatron checkpoint (saved at TP=2, with ``model.yaml``) loaded at EP=2 by actor and critic."""
    from sao_megatron.models.dist_checkpoint import save_model
    from sao_megatron.workers.role import build_actor_model, build_critic_model

    mcore = root / "mcore"
    p = hf_cases._setup(dist.get_world_size(), tensor_parallel=2)
    source = build_actor_model(m, ActorConfig(parallel=p, init_from=str(root / "hf" / "moe_gqa2")))
    save_model(source, mcore)
    if dist.get_rank() == 0:
        (mcore / "model.yaml").write_text(hf_config.model_yaml(m))
    dist.barrier()
    del source
    p = hf_cases._setup(dist.get_world_size(), expert_parallel=2)
    actor = build_actor_model(m, ActorConfig(parallel=p, init_from=str(mcore)))
    actor.eval()
    logits = hf_cases._forward_logits(actor, p, hf_cases.tokens())
    critic = build_critic_model(m, CriticConfig(parallel=p), str(mcore))
    c = _trunk(critic)
    return {
        "logits": None if logits is None else (logits - reference).abs().max().item(),
        "trunk_vs_hf": max((trunk_ep2[n] - c[n]).abs().max().item() for n in c),
        "head_abs": _head_abs(critic),
    }


def all_cases(rank: int, world: int, root: str) -> dict:
    root_path = Path(root)
    out = {"memory": case_memory(str(root_path / "big"))}
    hf_dir = root_path / "hf" / "moe_gqa2"
    m = hf_config.model_config_from_hf(hf_config.read_hf_config(hf_dir), name="moe_gqa2")
    reference = torch.load(root_path / "reference.pt")["moe_gqa2"]
    for layout in ("tp2", "ep2"):
        out[layout] = case_layout(hf_dir, m, layout, reference)
    out["megatron"] = case_megatron(root_path, m, reference, out["ep2"]["trunk"])
    for layout in ("tp2", "ep2"):
        del out[layout]["trunk"]
    return out
