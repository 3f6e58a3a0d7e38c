"""Bad inputs are refused before training starts, in one line naming the file/line/key and the fix.

One table: each case builds a bad input under ``tmp_path`` and returns the call that must refuse
it. Most go through the real entry point, ``sao train`` (:func:`sao_megatron.cli.main`), which
must return 2 with ``config error: <one line>`` on stderr and make no run directory; training
itself is replaced by a function that fails the test, so a case the checks miss cannot start a
run. The rest call what reads the input (SWE task files, a dataset's split). The pattern must
match the one-line message (``{tmp}`` stands for the test's ``tmp_path``).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from sao_megatron.cli import main
from sao_megatron.config import ConfigError, load_config
from sao_megatron.config import hf as hf_config
from sao_megatron.config.cluster import one_node_gpus
from sao_megatron.config.loop import AgentLoopConfig
from sao_megatron.config.schema import DEFAULT_RUN_CONFIG, DataConfig
from sao_megatron.tokenizer import TOKENIZER_DIR
from tests.rollout.gateway_fakes import CALCULATOR, MODEL, bad_request

Call = Callable[[], object]
USER = [{"role": "user", "content": "What is 2+3?"}]
Build = Callable[[Path], Call]


def _header(tensors: dict[str, tuple[list[int], int]]) -> bytes:
    """A safetensors header for float32 ``tensors`` (name -> (shape, bytes)), data not included."""
    offset, header = 0, {}
    for name, (shape, size) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw


def _sao_train(tmp: Path, *argv: str) -> Call:
    return lambda: main(["train", *argv, f"run.output_dir={tmp / 'out'}"])


def _yaml(text: str) -> Build:
    """``sao train RUN.yaml`` with ``text`` as the run file."""

    def build(tmp: Path) -> Call:
        (tmp / "run.yaml").write_text(text)
        return _sao_train(tmp, str(tmp / "run.yaml"))

    return build


def _overrides(*overrides: str) -> Build:
    """``sao train configs/tiny_cpu.yaml OVERRIDES``."""
    return lambda tmp: _sao_train(tmp, str(DEFAULT_RUN_CONFIG), *overrides)


TOOLS = "{% if tools %}{{ tools | tojson }}{% endif %}"  # the run's env (arith_tool) declares tools
GOOD_ROW = json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n"


def _data(content: bytes, name: str = "train.jsonl", *overrides: str) -> Build:
    """``sao train ... data.train=FILE`` with ``content`` in FILE (a good held-out file)."""

    def build(tmp: Path) -> Call:
        (tmp / name).write_bytes(content)
        (tmp / "eval.jsonl").write_text(GOOD_ROW)
        return _sao_train(
            tmp, str(DEFAULT_RUN_CONFIG), f"data.train={tmp / name}", f"data.eval={tmp / 'eval.jsonl'}", *overrides
        )

    return build


def _hf_checkpoint(path: Path) -> Path:
    """The tiny_moe shape as an HF directory: config.json, one (header-valid) tensor, the
    in-repo tiny tokenizer. Passes every start-up check."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config.hf_config_from_model(load_config().model)))
    (path / "model.safetensors").write_bytes(_header({"lm_head.weight": ([2], 8)}) + bytes(8))
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    return path


def _checkpoint(mutate: Callable[[Path], object], role: str = "actor") -> Build:
    """``sao train ... {role}.init_from=CKPT`` where CKPT is :func:`_hf_checkpoint` after ``mutate``."""

    def build(tmp: Path) -> Call:
        ckpt = _hf_checkpoint(tmp / "ckpt")
        mutate(ckpt)
        return _sao_train(tmp, str(DEFAULT_RUN_CONFIG), f"{role}.init_from={ckpt}")

    return build


def _config_json(**changes) -> Callable[[Path], object]:
    def mutate(ckpt: Path) -> None:
        config = json.loads((ckpt / "config.json").read_text())
        config.update(changes)
        (ckpt / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))

    return mutate


def _write(name: str, content: str | bytes) -> Callable[[Path], object]:
    def mutate(ckpt: Path) -> None:
        data = content.encode() if isinstance(content, str) else content
        (ckpt / name).write_bytes(data)

    return mutate


def _sharded(ckpt: Path) -> None:
    """model.safetensors -> model-00001-of-00002.safetensors, with an index naming a second shard."""
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {"total_size": 16},
        "weight_map": {
            "lm_head.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors",
        },
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


# Tiny Mixtral and GLM-4.5 config.json files (issue 31): each refusal row changes one key.
_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "sliding_window": None,
}
_GLM = {
    "architectures": ["Glm4MoeForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}

_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 12,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}


def _config_of(base: dict, **changes) -> Callable[[Path], object]:
    """Replace config.json with ``base`` changed by ``changes``."""
    return _write("config.json", json.dumps({**base, **changes}))


def _swe_tasks(content: str) -> Build:
    from sao_megatron.envs.swe.tasks import load_tasks

    def build(tmp: Path) -> Call:
        (tmp / "tasks.jsonl").write_text(content)
        return lambda: load_tasks(tmp / "tasks.jsonl")

    return build


def _swe_row_without(key: str) -> str:
    from sao_megatron.envs.swe.tasks import REQUIRED

    return json.dumps({k: "x" for k in REQUIRED if k != key}) + "\n"


def _split(tmp: Path) -> Call:
    from sao_megatron.envs.dataset import DatasetTask

    (tmp / "train.jsonl").write_text(GOOD_ROW)
    task = DatasetTask(DataConfig(train=str(tmp / "train.jsonl")))
    return lambda: task.get("validation", 0)  # type: ignore[arg-type]  # the wrong split is the point


# fmt: off
CASES: list[tuple[str, Build, str]] = [
    # ---- the run file and overrides
    ("unknown-top-level-key", _yaml("model: tiny_moe\ntrian:\n  steps: 3\n"),
     r"^{tmp}/run\.yaml: unknown config key 'trian'; did you mean 'train'\?$"),
    ("unknown-nested-key-close-match", _yaml("actor:\n  optim:\n    lrr: 1.0e-5\n"),
     r"^{tmp}/run\.yaml: unknown config key 'actor\.optim\.lrr'; did you mean 'lr'\?$"),
    ("key-one-section-too-high", _yaml("rollout:\n  max_new_tokens: 8\n"),
     r"unknown config key 'rollout\.max_new_tokens'; it is 'rollout\.loop\.max_new_tokens'$"),
    ("wrong-type", _yaml("algo:\n  batch_size: eight\n"),
     r"^{tmp}/run\.yaml: algo\.batch_size: expected an integer, got 'eight'$"),
    ("string-not-quoted", _overrides("run.name=[a, b]"),
     r"^override 'run\.name=\[a, b\]': run\.name: expected a string, got \['a', 'b'\]; quote it$"),
    ("zero-micro-batch", _overrides("actor.parallel.micro_batch_size=0"),
     r"^actor\.parallel\.micro_batch_size must be >= 1 \(got 0\)$"),
    ("negative-engines", _overrides("rollout.num_engines=-1"), r"^rollout\.num_engines must be >= 1 \(got -1\)$"),
    ("negative-lr-names-the-role", _overrides("critic.optim.lr=-0.1"), r"^critic\.optim\.lr=-0\.1 must be >= 0$"),
    ("world-size-not-a-multiple", _overrides("critic.parallel.world_size=3", "critic.parallel.tensor_parallel=2"),
     r"^critic\.parallel\.world_size=3 is not a multiple of tensor_parallel\*pipeline_parallel\*context_parallel=2; "
     r"change world_size or the layout$"),
    ("tp-does-not-divide-heads", _overrides("actor.parallel.world_size=3", "actor.parallel.tensor_parallel=3"),
     r"^actor\.parallel\.tensor_parallel=3 does not divide model\.num_attention_heads=4 and "
     r"model\.num_query_groups=2; use one of \[1, 2\]$"),
    ("ep-does-not-divide-experts", _overrides("actor.parallel.world_size=3", "actor.parallel.expert_parallel=3"),
     r"^actor\.parallel\.expert_parallel=3 does not divide model\.num_experts=8; use one of \[1, 2, 4, 8\]$"),
    ("batch-not-a-multiple-of-group", _overrides("algo.batch_size=10", "algo.group_size=4"),
     r"^algo\.batch_size=10 must be a positive multiple of algo\.group_size=4$"),
    ("bad-policy-loss", _overrides("algo.policy_loss=ppo2"), r"^override 'algo\.policy_loss=ppo2': algo\.policy_loss: 'ppo2' is not one of 'dis', "),
    ("bad-advantage", _overrides("algo.advantage=gea"), r"^override 'algo\.advantage=gea': algo\.advantage: 'gea' is not one of 'gae', "),
    ("over-lag-mask-without-a-bound", _overrides("algo.over_lag=mask", "algo.max_policy_lag=null"),
     r"^algo\.over_lag=mask masks tokens past algo\.max_policy_lag, which is null: set a bound$"),
    ("bad-over-lag", _overrides("algo.over_lag=keep"), r"^override 'algo\.over_lag=keep': algo\.over_lag: 'keep' is not one of 'drop', 'mask'"),
    ("bad-batch-order", _overrides("algo.batch_order=oldest"), r"^override 'algo\.batch_order=oldest': algo\.batch_order: 'oldest' is not one of 'finish', 'start'"),
    ("yaml-syntax-error-line", _yaml("run:\n  name: x\nactor: {optim: {lr: 1e-5}\ncritic: {}\n"),
     r"^{tmp}/run\.yaml:4:1: invalid YAML \(expected ',' or '\}', but got '<scalar>'; while parsing a flow "
     r"mapping started at line 3\); fix the syntax there$"),
    ("yaml-top-level-not-a-mapping", _yaml("- model: tiny_moe\n"), r"^{tmp}/run\.yaml: top level must be a mapping"),
    ("override-without-equals", _overrides("actor.optim.lr"),
     r"^override 'actor\.optim\.lr' is not key=value; write e\.g\. actor\.optim\.lr=1e-5$"),
    ("override-as-first-argument-without-equals", lambda tmp: _sao_train(tmp, "actor.optim.lr"),
     r"^config file actor\.optim\.lr not found; pass an existing YAML file \(an override is written key=value\)$"),
    ("override-value-not-yaml", _overrides("run.name=[x"), r"^override 'run\.name=\[x': value is not valid YAML; quote it$"),
    ("model-from-unknown-name", _yaml("model:\n  from: tiny_mo\n"),
     r"^{tmp}/run\.yaml: model 'tiny_mo' not found in .*configs/models; available: \[.*'tiny_moe'.*\]$"),
    ("model-file-missing", _yaml("model: models/nope.yaml\n"),
     r"^{tmp}/run\.yaml: model file models/nope\.yaml not found; set 'model' to an existing YAML file or a name in "),
    ("bad-regex", _overrides("critic.freeze_patterns=['(']"), r"^critic\.freeze_patterns/train_patterns: bad regex '\('"),
    ("negative-export-timeout", _overrides("run.export_timeout_s=-1"),
     r"^run\.export_timeout_s=-1\.0 must be >= 0 \(0: sized from the bytes moved\)$"),
    ("zero-export-bandwidth", _overrides("run.export_gb_per_s=0"), r"^run\.export_gb_per_s=0\.0 must be > 0 \(GB/s\)$"),
    ("zero-export-inflight", _overrides("run.export_inflight_mb=0"), r"^run\.export_inflight_mb=0 must be >= 1 \(MiB\)$"),
    ("engine-env-sets-gpus", _overrides("cluster.gpus_per_node=4", "rollout.engine_env={CUDA_VISIBLE_DEVICES: '0'}"),
     r"^rollout\.engine_env\.CUDA_VISIBLE_DEVICES is set on a GPU run \(cluster\.gpus_per_node=4\): the run assigns "
     r"each engine its GPUs .*; remove it"),
    ("zero-engine-start-timeout", _overrides("rollout.engine_start_timeout_s=0"),
     r"^rollout\.engine_start_timeout_s=0\.0 must be > 0 seconds, e\.g\. 300$"),
    ("engine-args-not-a-list", _overrides("rollout.engine_args='--chunked-prefill-size 8192'"),
     r"rollout\.engine_args: expected a list, got '--chunked-prefill-size 8192'; write it as \[a, b, \.\.\.\]$"),
    ("engine-args-number", _overrides("rollout.engine_args=[--chunked-prefill-size, 8192]"),
     r"rollout\.engine_args\[1\]: expected a string, got 8192; quote it$"),
    ("expert-parallel-cpu-engine", _overrides("rollout.tensor_parallel=2", "rollout.expert_parallel=2"),
     r"^rollout\.expert_parallel=2 on CPU engines \(cluster\.gpus_per_node=0\): SGLang's CPU MoE "
     r"\(moe_forward_native\) .*'index -1 is out of bounds'\); use rollout\.expert_parallel=1 on CPU$"),
    ("dp-attention-cpu-engine", _overrides("rollout.tensor_parallel=2", "cluster.engine_dp_attention=2"),
     r"^cluster\.engine_dp_attention=2 on CPU engines \(cluster\.gpus_per_node=0\): SGLang's CPU engine dies on "
     r"its first batch with attention DP \('TorchNativeAttnBackend' object has no attribute "
     r"'get_cpu_graph_seq_len_fill_value'\); use cluster\.engine_dp_attention=1 on CPU$"),
    ("engine-nodes-not-dividing-tp", _overrides("rollout.tensor_parallel=2", "rollout.nodes_per_engine=3"),
     r"^rollout\.nodes_per_engine=3 must be 0 \(derived\) or divide rollout\.tensor_parallel=2: an engine's "
     r"ranks split evenly over its nodes$"),
    ("engine-nodes-without-rollout-nodes",
     _overrides("rollout.tensor_parallel=2", "rollout.nodes_per_engine=2", "cluster.actor_nodes=1",
                "cluster.critic_nodes=1", "cluster.rollout_nodes=1"),
     r"^rollout\.nodes_per_engine=2 needs cluster\.rollout_nodes >= 2 \(an engine's nodes are distinct nodes "
     r"of the rollout group; got 1\); set it, or rollout\.nodes_per_engine=0$"),
    ("engine-nodes-over-a-gpu-node",
     _overrides("cluster.gpus_per_node=8", "rollout.tensor_parallel=16", "rollout.nodes_per_engine=1"),
     r"^rollout\.nodes_per_engine=1: 16 ranks per node \(rollout\.tensor_parallel=16\) exceed "
     r"cluster\.gpus_per_node=8; use 2 or more nodes, or 0 \(derived\)$"),
    ("zero-sync-bucket", _overrides("rollout.weight_sync_bucket_mb=0"),
     r"^rollout\.weight_sync_bucket_mb=0 must be >= 1 \(MiB\), e\.g\. 1024$"),
    ("zero-sync-timeout", _overrides("rollout.weight_sync_timeout_s=0"),
     r"^rollout\.weight_sync_timeout_s=0\.0 must be > 0 \(seconds\), e\.g\. 120$"),
    ("zero-sync-senders", _overrides("rollout.weight_sync_senders=0"),
     r"^rollout\.weight_sync_senders=0 must be >= 1, e\.g\. 8$"),
    ("bad-update-policy", _overrides("rollout.update_policy=keep"),
     r"^override 'rollout\.update_policy=keep': rollout\.update_policy: 'keep' is not one of 'retract', 'in_place', "
     r"'abort'$"),
    ("update-policy-with-disk-sync", _overrides("rollout.weight_sync=disk", "rollout.update_policy=in_place"),
     r"^rollout\.update_policy=in_place has no effect with rollout\.weight_sync=disk \(the disk sync does not pause: "
     r"each engine finishes its requests, then loads\); use rollout\.weight_sync=distributed or leave update_policy "
     r"at retract$"),
    # A cluster config has no ray_address until its launcher adds it: checked where the local Ray starts.
    ("one-node-gpus-overflow", lambda tmp: lambda: one_node_gpus(load_config(None, ["cluster.gpus_per_node=2"])),
     r"^cluster\.gpus_per_node=2 < 3 GPUs this run needs on one node \(no cluster\.ray_address\): "
     r"actor\.parallel\.world_size=1 \+ critic\.parallel\.world_size=1 \+ rollout\.num_engines=1 x "
     r"rollout\.tensor_parallel=1; shrink them to fit, or run on several nodes"),
    # ---- datasets (every row is read at start-up)
    ("data-line-not-json", _data((GOOD_ROW + "{prompt: 1}\n").encode()),
     r"^{tmp}/train\.jsonl:2: bad JSON \(.* at column 2\); write one JSON object per line$"),
    ("data-row-not-an-object", _data(b"[1, 2]\n"), r"^{tmp}/train\.jsonl:1: the row is a JSON list, not an object"),
    ("data-missing-prompt-field", _data(GOOD_ROW.encode() + b'{"question": "q", "answer": "1"}\n'),
     r"^{tmp}/train\.jsonl:2: no field 'prompt' \(the row has: answer, question\); set data\.prompt_field to the "
     r"row's field or add it to the row$"),
    ("data-renamed-prompt-field", _data(GOOD_ROW.encode(), "train.jsonl", "data.prompt_field=question"),
     r"^{tmp}/train\.jsonl:1: no field 'question' .*set data\.prompt_field"),
    ("data-empty-file", _data(b"\n\n"), r"^{tmp}/train\.jsonl: no rows \(the file is empty\); write one JSON object per line$"),
    ("data-not-utf8", _data(GOOD_ROW.encode() + b'{"prompt": "caf\xe9", "answer": "1"}\n'),
     r"^{tmp}/train\.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\); re-encode the file as UTF-8$"),
    ("data-file-missing", _overrides("data.train=/nonexistent/train.jsonl", "data.eval=/nonexistent/eval.jsonl"),
     r"^/nonexistent/train\.jsonl: data file not found; fix data\.train / data\.eval"),
    ("data-eval-missing", _overrides("data.train=train.jsonl"), r"^data\.train is set but data\.eval is empty; set data\.eval=FILE"),
    ("data-prompt-is-messages", _data(b'{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}\n'),
     r"^{tmp}/train\.jsonl:1: data\.prompt_field='prompt' is a list \(chat messages\?\), not a non-empty string; .*"
     r"set data\.prompt_format=messages"),
    ("data-bad-prompt-format", _overrides("data.prompt_format=chat"),
     r"^override 'data\.prompt_format=chat': data\.prompt_format: 'chat' is not one of 'text', 'messages'$"),
    ("data-parquet-unreadable", _data(b"not parquet", "train.parquet"), r"^{tmp}/train\.parquet: not a readable Parquet file"),
    ("data-wrong-split", _split, r"^unknown split 'validation': use one of \('train', 'heldout'\)$"),
    # ---- checkpoints (actor.init_from / critic.init_from)
    ("init-from-missing-directory", lambda tmp: _sao_train(tmp, str(DEFAULT_RUN_CONFIG), f"actor.init_from={tmp}/nope"),
     r"^actor\.init_from={tmp}/nope: no such directory; point it at an HF model directory"),
    ("critic-init-from-missing-config-json", _checkpoint(lambda c: (c / "config.json").unlink(), "critic"),
     r"^critic\.init_from={tmp}/ckpt is neither an HF checkpoint \(config\.json \+ \*\.safetensors\) nor a Megatron"),
    ("config-json-not-json", _checkpoint(_write("config.json", '{"architectures": ["Qwen3MoeForCausalLM"],\n}')),
     r"^actor\.init_from={tmp}/ckpt: {tmp}/ckpt/config\.json:2: not valid JSON \(.*\); fix the file or re-download"),
    ("config-json-shape-disagrees", _checkpoint(_config_json(num_hidden_layers=2)),
     r"^model 'tiny_moe' and actor\.init_from={tmp}/ckpt disagree on num_layers=4 vs 2; drop 'model' from the run "
     r"file \(the checkpoint's shape is used\) or fix it$"),
    ("config-json-missing-field", _checkpoint(_config_json(hidden_size=None)),
     r"^actor\.init_from={tmp}/ckpt: config\.json lacks 'hidden_size', which Qwen3MoeForCausalLM needs"),
    ("config-json-unsupported-architecture", _checkpoint(_config_json(architectures=["LlamaForCausalLM"])),
     r"^actor\.init_from={tmp}/ckpt: architectures=\['LlamaForCausalLM'\] is not supported"),
    ("safetensors-truncated", _checkpoint(_write("model.safetensors", _header({"lm_head.weight": ([4], 16)}) + bytes(4))),
     r"^actor\.init_from: {tmp}/ckpt/model\.safetensors is truncated \(\d+ bytes; its header needs \d+\); "
     r"re-download or re-copy the checkpoint$"),
    ("safetensors-not-safetensors", _checkpoint(_write("model.safetensors", b"<html>404 Not Found</html>")),
     r"^actor\.init_from: {tmp}/ckpt/model\.safetensors is truncated or not a safetensors file"),
    ("safetensors-corrupt-header", _checkpoint(_write("model.safetensors", (6).to_bytes(8, "little") + b"{oops}")),
     r"^actor\.init_from: {tmp}/ckpt/model\.safetensors has a corrupt safetensors header \(not JSON\)"),
    ("safetensors-index-missing-shard", _checkpoint(_sharded),
     r"^actor\.init_from: {tmp}/ckpt/model\.safetensors\.index\.json maps 'model\.norm\.weight' to the shard "
     r"model-00002-of-00002\.safetensors, which is missing from {tmp}/ckpt; copy the whole checkpoint directory$"),
    ("safetensors-index-not-json", _checkpoint(_write("model.safetensors.index.json", "{")),
     r"^actor\.init_from: {tmp}/ckpt/model\.safetensors\.index\.json is not a safetensors index"),
    ("safetensors-without-a-loadable-name", _checkpoint(lambda c: (c / "model.safetensors").rename(c / "weights.safetensors")),
     r"^actor\.init_from={tmp}/ckpt has neither model\.safetensors\.index\.json nor model\.safetensors"),
    # Mixtral and GLM-4.5 (issue 31): what the bridge does not map, named
    ("config-json-unknown-rope-type", _checkpoint(_config_of(_GLM, rope_scaling={"rope_type": "yarn", "factor": 4.0})),
     r"^actor\.init_from={tmp}/ckpt: rope_scaling=\{'rope_type': 'yarn', 'factor': 4\.0\} is not supported \(only plain "
     r"RoPE\); remove it or convert a checkpoint without RoPE scaling$"),
    ("config-json-group-topk-hf-and-megatron-disagree", _checkpoint(_config_of(_GLM, n_group=4, topk_group=1)),
     r"^actor\.init_from={tmp}/ckpt: n_group=4, topk_group=1 with num_experts_per_tok=4 is not supported: HF ranks "
     r"an expert group by its best 2 scores, Megatron by its best topk // topk_group = 4; .*== 2 \(or n_group == 1\)$"),
    ("config-json-glm-not-renormalised", _checkpoint(_config_of(_GLM, norm_topk_prob=False)),
     r"^actor\.init_from={tmp}/ckpt: norm_topk_prob=false with num_experts_per_tok=4 is not supported: Megatron "
     r"renormalises sigmoid top-k weights exactly when top-k > 1$"),
    ("config-json-glm-unknown-key", _checkpoint(_config_of(_GLM, scoring_func="softmax")),
     r"^actor\.init_from={tmp}/ckpt: config\.json key 'scoring_func' is not known to the Glm4MoeForCausalLM bridge, "
     r"which cannot tell whether it changes the model; remove it if it does not"),
    ("config-json-mixtral-sliding-window", _checkpoint(_config_of(_MIXTRAL, sliding_window=256)),
     r"^actor\.init_from={tmp}/ckpt: sliding_window=256 < max_position_embeddings=1024 is not supported: Megatron's "
     r"local attention builds its sliding-window mask in place of the mask it is given"),
    ("config-json-mixtral-router-jitter", _checkpoint(_config_of(_MIXTRAL, router_jitter_noise=0.01)),
     r"^actor\.init_from={tmp}/ckpt: router_jitter_noise=0\.01 is not supported: .*; set it to 0\.0$"),
    ("config-json-quantized-weights", _checkpoint(_config_json(quantization_config={"quant_method": "fp8"})),
     r"^actor\.init_from={tmp}/ckpt: quantization_config \(quant_method='fp8', fmt='e4m3', weight_block_size=None\) is not "
     r"supported: only DeepSeek's FP8 block scaling is read .*; convert the checkpoint to bf16 first$"),
    # DeepSeek-V3 / Kimi-K2 (issue 31): multi-latent attention, YaRN, the sigmoid router
    ("config-json-deepseek-mla-without-query-lora", _checkpoint(_config_of(_DEEPSEEK, q_lora_rank=None)),
     r"^actor\.init_from={tmp}/ckpt: q_lora_rank=null \(multi-latent attention without a query LoRA, DeepSeek-V2-Lite "
     r"style\) is not supported: .*norm\+linear module its local layer spec lacks; use a checkpoint with q_lora_rank set$"),
    ("config-json-deepseek-unknown-rope-type",
     _checkpoint(_config_of(_DEEPSEEK, rope_scaling={"type": "dynamic", "factor": 2.0})),
     r"^actor\.init_from={tmp}/ckpt: rope_scaling rope type 'dynamic' is not supported for DeepseekV3ForCausalLM \(only "
     r"plain RoPE and 'yarn'.*\); convert a checkpoint without it$"),
    ("config-json-deepseek-group-topk-hf-and-megatron-disagree", _checkpoint(_config_of(_DEEPSEEK, n_group=4, topk_group=1)),
     r"^actor\.init_from={tmp}/ckpt: n_group=4, topk_group=1 with num_experts_per_tok=4 is not supported: HF ranks "
     r"an expert group by its best 2 scores, Megatron by its best topk // topk_group = 4; .*\(or n_group == 1\)$"),
    ("config-json-deepseek-rope-not-interleaved", _checkpoint(_config_of(_DEEPSEEK, rope_interleave=False)),
     r"^actor\.init_from={tmp}/ckpt: rope_interleave=False is not supported for DeepseekV3ForCausalLM: the bridge maps "
     r"DeepSeek-V3's rope_interleave=True"),
    ("config-json-deepseek-yarn-attention-factor",
     _checkpoint(_config_of(_DEEPSEEK, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                                      "attention_factor": 1.1})),
     r"^actor\.init_from={tmp}/ckpt: rope_scaling\.attention_factor=1\.1 is not mapped to Megatron's YaRN"),
    ("model-field-outside-its-family", _overrides("model.moe_router_score_function=sigmoid"),
     r"^model\.moe_router_score_function='sigmoid' is not expressible in model\.family=qwen's HF architecture "
     r"\(it has 'softmax'\); change the field or the family$"),
    ("negative-router-bias-update-rate", _overrides("actor.router_bias_update_rate=-0.001"),
     r"^actor\.router_bias_update_rate=-0\.001 must be >= 0$"),
    ("bad-router-bias-update", _overrides("actor.router_bias_update=sync"),
     r"^override 'actor\.router_bias_update=sync': actor\.router_bias_update: 'sync' is not one of 'freeze', 'train'$"),
    ("negative-moe-aux-loss-coeff", _overrides("actor.moe_aux_loss_coeff=-0.01"),
     r"^actor\.moe_aux_loss_coeff=-0\.01 must be >= 0 \(0 turns it off\)$"),
    ("freeze-router-on-a-dense-model", _overrides("model.num_experts=0", "actor.freeze_router=true"),
     r"^actor\.freeze_router=true but the model is dense \(model\.num_experts=0\); set it false$"),
    # ---- corrections beside the policy loss (algo.seq_mask_low/high, algo.tis_cap)
    ("seq-mask-band-above-1", _overrides("algo.seq_mask_low=1.2", "algo.seq_mask_high=3"),
     r"^algo\.seq_mask_low=1\.2 must be in \(0, 1\): the band must hold 1, an on-policy trajectory; use null for no lower bound$"),
    ("seq-mask-band-below-1", _overrides("algo.seq_mask_high=0.9"),
     r"^algo\.seq_mask_high=0\.9 must be > 1: the band must hold 1, an on-policy trajectory; use null for no upper bound$"),
    ("seq-mask-low-zero", _overrides("algo.seq_mask_low=0"), r"^algo\.seq_mask_low=0\.0 must be in \(0, 1\)"),
    ("seq-mask-low-above-high", _overrides("algo.seq_mask_low=2", "algo.seq_mask_high=1.5"), r"^algo\.seq_mask_low=2\.0 must be in \(0, 1\)"),
    ("seq-mask-with-context-parallel", _overrides("algo.seq_mask_low=0.5", "actor.parallel.world_size=2", "actor.parallel.context_parallel=2"),
     r"^algo\.seq_mask_low/seq_mask_high with actor\.parallel\.context_parallel=2: a trajectory is split over the "
     r"context-parallel ranks, so its geometric mean is not known on one; turn the sequence mask off \(null\) or use context_parallel 1$"),
    ("tis-cap-zero", _overrides("algo.tis_cap=0"),
     r"^algo\.tis_cap=0\.0 must be >= 1 \(a cap below 1 down-weights on-policy tokens, rho = 1\); use null to turn truncated IS off$"),
    ("tis-cap-negative", _overrides("algo.tis_cap=-2"), r"^algo\.tis_cap=-2\.0 must be >= 1 "),
    ("tis-cap-above-the-dis-band", _overrides("algo.tis_cap=7", "algo.eps_high=5"),
     r"^algo\.tis_cap=7\.0 truncates nothing with algo\.policy_loss=dis: DIS drops every token with rho >= 1 \+ "
     r"algo\.eps_high = 6\.0; set tis_cap below it or null$"),
    # ---- tokenizers next to an HF checkpoint
    ("tokenizer-json-missing", _checkpoint(lambda c: (c / "tokenizer.json").unlink()),
     r"^actor\.init_from={tmp}/ckpt: the checkpoint has no tokenizer \(needs tokenizer\.json and "
     r"tokenizer_config\.json\); copy the tokenizer files"),
    ("tokenizer-json-corrupt", _checkpoint(_write("tokenizer.json", '{"model": {"vocab": {"a": 0,}}}')),
     r"^actor\.init_from={tmp}/ckpt: cannot read its tokenizer files \(JSONDecodeError in {tmp}/ckpt/tokenizer\.json: "
     r".* at line 1 column 29\); re-save them with tokenizer\.save_pretrained\(DIR\)$"),
    ("chat-template-syntax-error", _checkpoint(_write("chat_template.jinja", TOOLS + "{% for m in messages %}\n{{ m['content'] }}")),
     r"^actor\.init_from={tmp}/ckpt: the chat template in {tmp}/ckpt/chat_template\.jinja is not valid Jinja \(.*"
     r"'endfor'.*, template line 2\); fix it or use the tokenizer files of the model it came from$"),
    ("chat-template-fails-to-render", _checkpoint(_write("chat_template.jinja", "{{ raise_exception('no tools') }}")),
     r"^actor\.init_from={tmp}/ckpt: the chat template in {tmp}/ckpt/chat_template\.jinja fails to render a "
     r"user/assistant conversation with tools \(TemplateError: no tools\); fix it"),
    ("chat-template-type-error", _checkpoint(_write("chat_template.jinja", TOOLS + "{{ messages[0]['content'] + 1 }}")),
     r"^actor\.init_from={tmp}/ckpt: the chat template in .*chat_template\.jinja fails to render .*\(TypeError: "),
    # ---- SWE task files
    ("swe-task-line-not-json", _swe_tasks('{"instance_id": "a"\n'),
     r"^{tmp}/tasks\.jsonl:1: bad JSON \(.*\); write one JSON object per line$"),
    ("swe-task-missing-fail-to-pass", _swe_tasks(_swe_row_without("FAIL_TO_PASS")),
     r"^{tmp}/tasks\.jsonl:1: no field 'FAIL_TO_PASS' \(the row has: .*\); an SWE task needs .*FAIL_TO_PASS"),
    ("swe-task-file-empty", _swe_tasks(""), r"^{tmp}/tasks\.jsonl: no tasks \(the file is empty\)"),
    # ---- numeric settings out of range (every numeric field: tests/config/test_ranges.py)
    ("loop-temperature-negative", _overrides("rollout.loop.temperature=-1"),
     r"^rollout\.loop\.temperature=-1\.0 must be >= 0 \(0: greedy\); set it to e\.g\. 1\.0$"),
    ("train-steps-negative", _overrides("train.steps=-5"),
     r"^train\.steps=-5 must be >= 0 \(0: no RL step, the stages before it only\); set it to e\.g\. 100$"),
    ("eval-every-negative", _overrides("train.eval_every=-1"),
     r"^train\.eval_every=-1 must be >= 0 \(0: evaluate only before the first step and after the last\); "),
    ("learning-rate-nan", _overrides("actor.optim.lr=.nan"),
     r"^actor\.optim\.lr=nan is not a finite number; set it to e\.g\. 1e-06$"),
    # ---- routing replay (rollout.routing_replay)
    ("routing-replay-on-a-dense-model", _overrides("model.num_experts=0", "rollout.routing_replay=on"),
     r"^rollout\.routing_replay=on needs an MoE model, but model\.num_experts=0 \(dense: no routers to replay\); "
     r"set rollout\.routing_replay=off$"),
    ("routing-replay-unknown-mode", _overrides("rollout.routing_replay=replay"),
     r"^override 'rollout\.routing_replay=replay': rollout\.routing_replay: 'replay' is not one of 'off', 'record', 'on'$"),
    # ---- the OpenAI-compatible gateway (rollout.env=openai_agent): config, then requests (OpenAI error JSON)
    ("openai-agent-without-an-agent", _overrides("rollout.env=openai_agent"),
     r"^rollout\.env=openai_agent needs exactly one of rollout\.agent\.entry_point \(got ''\) and rollout\.agent\.command "),
    ("openai-agent-with-groups", _overrides("rollout.env=openai_agent", "rollout.agent.entry_point=m:f", "algo.group_size=4"),
     r"^rollout\.env=openai_agent with algo\.group_size=4: a session's segments have no group to share a baseline with; "),
    ("openai-agent-entry-point-on-env-workers",
     _overrides("rollout.env=openai_agent", "rollout.agent.entry_point=m:f", "rollout.env_workers=2"),
     r"^rollout\.agent\.entry_point='m:f' with rollout\.env_workers=2: an entry point runs in the rollout process, "
     r"beside the gateway; give the agent as rollout\.agent\.command \(run on the env workers\) or set rollout\.env_workers=0$"),
    ("openai-agent-env-workers-gateway-on-loopback",
     _overrides("rollout.env=openai_agent", "rollout.agent.command=[python, a.py]", "rollout.env_workers=2",
                "cluster.ray_address=10.0.0.1:6379"),
     r"^rollout\.gateway\.host=127\.0\.0\.1 with rollout\.env_workers=2 on a cluster: agents on the env workers' nodes "
     r"cannot reach loopback; set rollout\.gateway\.host=0\.0\.0\.0 "),
    ("openai-agent-sandbox-require-with-entry-point",
     _overrides("rollout.env=openai_agent", "rollout.agent.entry_point=m:f", "rollout.agent.sandbox=require"),
     r"^rollout\.agent\.sandbox=require with rollout\.agent\.entry_point='m:f': an entry point runs in the rollout "
     r"process and cannot be sandboxed; give the agent as rollout\.agent\.command or set rollout\.agent\.sandbox=auto$"),
    ("openai-agent-memory-limit",
     _overrides("rollout.env=openai_agent", "rollout.agent.command=[python, a.py]", "rollout.agent.memory_mb=10"),
     r"^rollout\.agent\.memory_mb=10 must be >= 64 \(a sandboxed agent's limit\)$"),
    ("gateway-port-out-of-range", _overrides("rollout.gateway.port=70000"),
     r"^rollout\.gateway\.port=70000 must be in \[0, 65535\] \(0: a free port\)$"),
    ("gateway-unknown-model", lambda tmp: bad_request({"model": "gpt-4o", "messages": USER}),
     r"^404 model_not_found model: the model 'gpt-4o' does not exist; this gateway serves 'sao-policy'$"),
    ("gateway-message-role", lambda tmp: bad_request({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}),
     r"^400 invalid_value messages\[0\]\.role: messages\[0\]\.role='robot': use one of system, developer, user, "),
    ("gateway-undeclared-tool-call", lambda tmp: bad_request({"model": MODEL, "tools": [CALCULATOR], "messages": [
        *USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]}]}),
     r"^400 unknown_tool messages\[1\]\.tool_calls\[0\]\.function\.name: a call of 'shell', which tools does not declare$"),
    ("gateway-tool-result-without-its-call", lambda tmp: bad_request({"model": MODEL, "messages": [
        *USER, {"role": "tool", "tool_call_id": "c9", "content": "5"}]}),
     r"^400 invalid_value messages\[1\]\.tool_call_id: tool_call_id 'c9' answers no earlier tool call$"),
    ("gateway-context-too-long", lambda tmp: bad_request({"model": MODEL, "messages": USER},
                                                         cfg=AgentLoopConfig(max_context_tokens=4)),
     r"^400 context_length_exceeded messages: the conversation is \d+ tokens, beyond rollout\.loop\.max_context_tokens=4"),
    ("gateway-unknown-session", lambda tmp: bad_request({"model": MODEL, "messages": USER}, path="unknown"),
     r"^404 session_not_found session: unknown session 'nosuchsession'$"),
    ("gateway-closed-session", lambda tmp: bad_request({"model": MODEL, "messages": USER}, path="closed"),
     r"^409 session_closed session: session '[0-9a-f]+' is closed \(rewarded or ended\)$"),
    ("gateway-missing-key", lambda tmp: bad_request({"model": MODEL, "messages": USER}, key=None),
     r"^401 missing_api_key Authorization: no API key: send the session's key as 'Authorization: Bearer <key>'$"),
    ("gateway-wrong-key", lambda tmp: bad_request({"model": MODEL, "messages": USER}, key="sk-other"),
     r"^401 invalid_api_key Authorization: the API key is not session '[0-9a-f]+''s$"),
    ("gateway-no-session", lambda tmp: bad_request({"model": MODEL, "messages": USER}, path="header"),
     r"^400 missing_session X-SAO-Session: no session: use /sessions/\{id\}/v1 as base_url or send X-SAO-Session$"),
    ("gateway-two-choices", lambda tmp: bad_request({"model": MODEL, "messages": USER, "n": 2}),
     r"^400 invalid_value n: n=2: the gateway samples one choice per request \(n=1\)$"),
    ("gateway-temperature-out-of-range", lambda tmp: bad_request({"model": MODEL, "messages": USER, "temperature": 3}),
     r"^400 invalid_value temperature: temperature=3 is outside \[0\.0, 2\.0\]$"),
    ("gateway-temperature-nan", lambda tmp: bad_request({"model": MODEL, "messages": USER, "temperature": float("nan")}),
     r"^400 invalid_value temperature: temperature=nan is not a finite number$"),
    ("gateway-regex-does-not-compile", lambda tmp: bad_request({"model": MODEL, "messages": USER, "regex": "([a-z"}),
     r"^400 invalid_value regex: regex '\(\[a-z' does not compile: "),
    ("gateway-tool-calls-not-a-list", lambda tmp: bad_request({"model": MODEL, "messages": [
        *USER, {"role": "assistant", "tool_calls": 5}]}),
     r"^400 invalid_value messages\[1\]\.tool_calls: tool_calls must be a list, on an assistant message; got 5 "),
    ("gateway-stream-options-not-an-object", lambda tmp: bad_request({"model": MODEL, "messages": USER, "stream": True,
                                                                     "stream_options": 5}),
     r"^400 invalid_type stream_options: stream_options must be an object such as \{\"include_usage\": true\}, got 5$"),
    ("gateway-n-true", lambda tmp: bad_request({"model": MODEL, "messages": USER, "n": True}),
     r"^400 invalid_type n: n must be an integer, got True$"),
    ("gateway-max-tokens-not-an-integer", lambda tmp: bad_request({"model": MODEL, "messages": USER,
                                                                  "max_completion_tokens": 8, "max_tokens": 8.5}),
     r"^400 invalid_type max_tokens: max_tokens must be an integer, got 8\.5$"),
    ("gateway-image-content", lambda tmp: bad_request({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
     r"^400 invalid_value messages\[0\]\.content\[0\]: content part .* only text parts "),
    ("gateway-role-the-template-cannot-render", lambda tmp: bad_request({"model": MODEL, "messages": [
        {"role": "developer", "content": "Be brief."}, *USER]}),  # the tiny template renders neither it nor system
     r"^400 unsupported_role messages\[0\]\.role: messages\[0\]\.role='developer': the checkpoint's chat template "
     r"does not render a developer message first in the conversation; put its text into a user message$"),
]
# fmt: on


@pytest.fixture
def no_training(monkeypatch):
    """A case the start-up checks miss fails here instead of starting a run."""
    import sao_megatron.pipeline

    def train(*args, **kwargs):
        raise AssertionError("training started: the bad input was not refused at start-up")

    monkeypatch.setattr(sao_megatron.pipeline, "train", train)


@pytest.mark.parametrize(("build", "pattern"), [pytest.param(b, p, id=i) for i, b, p in CASES])
def test_a_bad_input_is_refused_before_training_in_one_line(tmp_path, capsys, no_training, build, pattern):
    call = build(tmp_path)
    capsys.readouterr()
    try:
        rc = call()
    except (ConfigError, ValueError) as err:  # a reader called directly
        message = str(err)
    else:
        err_text = capsys.readouterr().err
        assert rc == 2, f"exit status {rc}, stderr {err_text!r}"
        assert err_text.startswith("config error: ") and err_text.count("\n") == 1, err_text
        message = err_text.removeprefix("config error: ").rstrip("\n")
        assert not (tmp_path / "out").exists(), "a run directory was made"
    assert "\n" not in message, message
    assert re.search(pattern.replace("{tmp}", re.escape(str(tmp_path))), message), message


def test_the_table_is_big_enough_and_its_good_checkpoint_passes(tmp_path, capsys, no_training):
    """The unmutated checkpoint (and a sharded one) pass every start-up check, so each checkpoint
    case fails for its own mutation; a good dataset reaches training."""
    assert len(CASES) >= 20 and len({i for i, _, _ in CASES}) == len(CASES)
    ckpt = _hf_checkpoint(tmp_path / "ckpt")
    with pytest.raises(AssertionError, match="training started"):
        _sao_train(tmp_path, str(DEFAULT_RUN_CONFIG), f"actor.init_from={ckpt}")()
    _sharded(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").write_bytes(_header({"model.norm.weight": ([2], 8)}) + bytes(8))
    with pytest.raises(AssertionError, match="training started"):
        _sao_train(tmp_path, str(DEFAULT_RUN_CONFIG), f"actor.init_from={ckpt}")()
    with pytest.raises(AssertionError, match="training started"):
        _data(GOOD_ROW.encode())(tmp_path)()
