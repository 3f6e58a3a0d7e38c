"""Feed the trainer's HF weight stream to SGLang's own model class on the CPU, without a server.

``python -m tests.models.sglang_load OUT.json HF_DIR STREAM.pt [HF_DIR STREAM.pt ...]`` (run by
``test_hf_families`` and ``test_sglang_buckets`` in a subprocess; OUT.json maps each STREAM.pt to its result:
SGLang takes over ``torch.distributed`` and its process-wide context, and needs the ``sgl_kernel`` stand-in on
``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``). For each stream: SGLang's class for ``config.json``'s
architecture (``sglang.srt.models.qwen3_moe``, ``mixtral``, ``glm4_moe``, ``deepseek_v2``) is built in float32
at TP=1 with every parameter NaN, and its ``load_weights`` is called once per bucket of the stream (a list of
buckets, each a list of ``(name, tensor)`` in stream order: what one ``/update_weights_from_distributed``
hands it; a loader that pairs tensors within one call drops a tensor whose partner came in another), and every
parameter is compared with the tensor ``transformers`` holds for it after ``from_pretrained(HF_DIR)``:
SGLang's fused ``qkv_proj`` / ``gate_up_proj`` are the concatenation of transformers' projections, its
experts' ``w13_weight`` / ``w2_weight`` transformers' fused ``gate_up_proj`` / ``down_proj``, Mixtral's
``block_sparse_moe`` transformers' ``mlp``, DeepSeek's ``fused_qkv_a_proj_with_mqa`` the concatenation of
``q_a_proj`` and ``kv_a_proj_with_mqa``. For DeepSeek-V3 the per-head key and value up-projections SGLang's
MLA derives from ``kv_b_proj`` after loading (``w_kc``, ``w_vc``, plain attributes) are checked against
transformers' ``kv_b_proj`` too. No forward runs (SGLang's CPU MLA needs sgl-kernel ops the stand-in lacks).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch


def _init_sglang(model_path: str) -> None:
    """SGLang's process groups (world 1, gloo) and its published server args, as its own layer tests do
    (``sglang.test.layer_ut_utils.init_single_process_dist``, which imports benchmark-only packages)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    args = ServerArgs(model_path=model_path, tp_size=1, ep_size=1, pp_size=1, device="cpu", dtype="float32")
    publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def _sglang_class(architecture: str):
    if architecture == "Qwen3MoeForCausalLM":
        from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    if architecture == "MixtralForCausalLM":
        from sglang.srt.models.mixtral import MixtralForCausalLM

        return MixtralForCausalLM
    if architecture == "Glm4MoeForCausalLM":
        from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM

        return Glm4MoeForCausalLM
    if architecture == "DeepseekV3ForCausalLM":
        from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM
    raise ValueError(f"no SGLang class mapped for {architecture}")


def _transformers_tensor(name: str, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor SGLang's parameter ``name`` must hold, from transformers' state dict ``hf``."""
    n = name.replace(".block_sparse_moe.", ".mlp.")
    for kind in ("weight", "bias"):
        if n.endswith(f"qkv_proj.{kind}"):
            base = n.removesuffix(f"qkv_proj.{kind}")
            return torch.cat([hf[f"{base}{x}_proj.{kind}"] for x in "qkv"])
    if n.endswith("fused_qkv_a_proj_with_mqa.weight"):  # DeepSeek's q and kv down-projections
        base = n.removesuffix("fused_qkv_a_proj_with_mqa.weight")
        return torch.cat([hf[f"{base}q_a_proj.weight"], hf[f"{base}kv_a_proj_with_mqa.weight"]])
    if n.endswith("gate_up_proj.weight"):  # dense MLP, shared experts
        base = n.removesuffix("gate_up_proj.weight")
        return torch.cat([hf[f"{base}gate_proj.weight"], hf[f"{base}up_proj.weight"]])
    if n.endswith("experts.w13_weight"):
        return hf[n.replace("w13_weight", "gate_up_proj")]
    if n.endswith("experts.w2_weight"):
        return hf[n.replace("w2_weight", "down_proj")]
    return hf[n]


def check(hf_dir: str, stream_file: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    model = _sglang_class(config.architectures[0])(config, quant_config=None)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    buckets: list[list[tuple[str, torch.Tensor]]] = torch.load(stream_file)
    for bucket in buckets:
        model.load_weights(iter(bucket))
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    unloaded, mismatched, compared = [], [], 0
    for name, param in model.named_parameters():
        if param.isnan().any():
            unloaded.append(name)
            continue
        compared += 1
        expected = _transformers_tensor(name, reference)
        if param.shape != expected.shape or not torch.equal(param.detach(), expected):
            mismatched.append(name)
    return {
        "mla_absorbed": _mla_absorbed(model, config, reference),
        "class": type(model).__module__,
        "stream": sum(len(b) for b in buckets),
        "buckets": len(buckets),
        "compared": compared,
        "unloaded": unloaded,
        "mismatched": mismatched,
        "bias": [n for n, _ in model.named_parameters() if n.endswith("e_score_correction_bias")],
    }


def _mla_absorbed(model, config, hf: dict[str, torch.Tensor]) -> dict[str, int] | None:
    """DeepSeek: how many layers' ``w_kc`` / ``w_vc`` (SGLang's split of ``kv_b_proj`` per head, made
    by ``post_load_weights``) equal transformers' ``kv_b_proj`` split alike; None for other classes."""
    if not hasattr(config, "kv_lora_rank"):
        return None
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    out = {"layers": 0, "equal": 0}
    for i, layer in enumerate(model.model.layers):
        w = hf[f"model.layers.{i}.self_attn.kv_b_proj.weight"]  # [heads x (nope + v), kv_lora_rank]
        w_kc, w_vc = w.unflatten(0, (-1, nope + v)).split([nope, v], dim=1)
        attn = layer.self_attn
        out["layers"] += 1
        if torch.equal(attn.w_kc, w_kc) and torch.equal(attn.w_vc, w_vc.transpose(1, 2)):
            out["equal"] += 1
    return out


def main(argv: list[str]) -> None:
    out, pairs = Path(argv[0]), list(zip(argv[1::2], argv[2::2], strict=True))
    torch.set_default_dtype(torch.float32)
    _init_sglang(pairs[0][0])
    out.write_text(json.dumps({stream: check(hf_dir, stream) for hf_dir, stream in pairs}))


if __name__ == "__main__":
    main(sys.argv[1:])
