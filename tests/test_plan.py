"""``sao plan``: per-rank parameters (analytic vs a real meta-device build), memory model, fit checks."""

import dataclasses
import math
from pathlib import Path

import pytest

from sao_megatron import cli, plan
from sao_megatron.config import (
    ConfigError,
    CriticConfig,
    ModelConfig,
    ParallelConfig,
    load_config,
)
from sao_megatron.models.counting import parameter_counts
from sao_megatron.models.logprobs import CHUNK_ELEMENTS

GiB = 2**30
TINY = ModelConfig(
    name="t",
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=96,
    vocab_size=256,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
)
LAYOUTS = [
    ("single", TINY, ParallelConfig()),
    (
        "tp2-pp2-ep2",
        TINY,
        ParallelConfig(world_size=8, tensor_parallel=2, pipeline_parallel=2, expert_parallel=2),
    ),
    (
        "cp2-ep4",
        TINY,
        ParallelConfig(world_size=16, tensor_parallel=2, pipeline_parallel=2, context_parallel=2, expert_parallel=4),
    ),
    (
        "etp2",
        TINY,
        ParallelConfig(world_size=8, tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=2),
    ),
    (
        "shared-expert+dense-layer",
        dataclasses.replace(TINY, moe_shared_expert_intermediate_size=48, dense_layers=[0]),
        ParallelConfig(world_size=4, tensor_parallel=2, pipeline_parallel=2),
    ),
    (
        "moe-every-2nd",
        dataclasses.replace(TINY, moe_layer_freq=2),
        ParallelConfig(world_size=4, pipeline_parallel=2, expert_parallel=2),
    ),
    (
        "dense",
        dataclasses.replace(TINY, num_experts=0),
        ParallelConfig(world_size=4, tensor_parallel=2, pipeline_parallel=2),
    ),
    (
        "dense-tied",
        dataclasses.replace(TINY, num_experts=0, tie_word_embeddings=True),
        ParallelConfig(world_size=2, tensor_parallel=2),
    ),
    (  # GLM-4.5 / Qwen2-MoE: q/k/v biases, split with the projection over TP
        "qkv-bias",
        dataclasses.replace(TINY, add_qkv_bias=True),
        ParallelConfig(world_size=4, tensor_parallel=2, pipeline_parallel=2),
    ),
    (  # DeepSeek-V3: multi-latent attention (column-parallel down-projections), GLM-style MoE layers
        "mla",
        dataclasses.replace(
            TINY,
            family="deepseek_v3",
            num_query_groups=4,
            q_lora_rank=32,
            kv_lora_rank=30,
            qk_rope_head_dim=2,
            v_head_dim=12,
            moe_shared_expert_intermediate_size=32,
            dense_layers=[0],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        ),
        ParallelConfig(world_size=4, tensor_parallel=2, pipeline_parallel=2),
    ),
]


def test_analytic_counts_match_a_meta_device_build_name_by_name():
    """The closed form lists exactly the tensors (names, local sizes, trainable flags) Megatron builds."""
    jobs = [plan.MetaJob(m, p, critic) for _, m, p in LAYOUTS for critic in (None, CriticConfig())]
    built = plan.meta_parameters(jobs)
    for job, stages in zip(jobs, built, strict=True):
        assert plan.analytic_parameters(job.model, job.parallel, job.critic) == stages, job


def test_stage_counts_add_up_to_the_closed_form_model_count():
    mla = next(m for name, m, _ in LAYOUTS if name == "mla")
    for m in (
        dataclasses.replace(TINY, moe_shared_expert_intermediate_size=48, dense_layers=[1], add_qkv_bias=True),
        mla,
    ):
        stages = plan.analytic_parameters(m, ParallelConfig(world_size=2, pipeline_parallel=2))
        assert sum(n for stage in stages for n, _ in stage.values()) == parameter_counts(m)["total"]


def _plan(path: str, *overrides: str) -> plan.Plan:
    return plan.make_plan(load_config(path, list(overrides)), analytic=True)


@pytest.mark.parametrize(
    "path,total,active",
    [
        # computed from the HF config.json numbers (configs/models/*.yaml, docs/models.md)
        ("configs/qwen3_30b_a3b_math.yaml", 30.532e9, 3.353e9),
        ("configs/qwen3_30b_a3b_swe.yaml", 30.532e9, 3.353e9),
        ("configs/moe_750b_a40b.yaml", 739.82e9, 40.82e9),
        ("configs/deepseek_v3_671b_math.yaml", 671.03e9, 37.55e9),
        ("configs/kimi_k2_1t_math.yaml", 1026.41e9, 32.86e9),
        ("configs/glm4_5_355b_math.yaml", 352.80e9, 33.63e9),
    ],
)
def test_large_configs_print_their_documented_counts(path, total, active):
    result = _plan(path)
    assert abs(result.counts["total"] / total - 1) < 0.01
    assert abs(result.counts["active"] / active - 1) < 0.01
    assert f"{total / 1e9:,.2f} B parameters" in plan.render(result)
    assert not result.failures(), result.failures()


def test_qwen3_counts_match_the_model_cards():
    """Model cards: Qwen3-30B-A3B 30.5B total, 29.9B non-embedding, 3.3B activated; Qwen3-8B 8.2B."""
    m = load_config("configs/qwen3_30b_a3b_math.yaml").model
    counts = parameter_counts(m)
    embeddings = 2 * m.vocab_size * m.hidden_size  # untied: input embedding + LM head
    assert abs(counts["total"] / 30.5e9 - 1) < 0.01
    assert abs((counts["total"] - embeddings) / 29.9e9 - 1) < 0.01
    assert abs(counts["active"] / 3.3e9 - 1) < 0.02  # the card rounds 3.35 down to 3.3
    dense = load_config("configs/tiny_cpu.yaml", ["model=qwen3_8b"]).model
    assert abs(parameter_counts(dense)["total"] / 8.2e9 - 1) < 0.01


def test_memory_model_by_hand():
    """Dense fp32 -> bf16 bytes: weights 2, fp32 grads 4, Adam 12 / DP with the distributed optimizer."""
    overrides = [
        "model=qwen3_8b",
        "actor.bf16=true",
        "actor.parallel.world_size=4",
        "algo.batch_size=8",
        "actor.parallel.micro_batch_size=1",
        "rollout.loop.max_context_tokens=4096",
    ]
    cfg = load_config("configs/tiny_cpu.yaml", overrides)
    stages = plan.analytic_parameters(cfg.model, cfg.actor.parallel)
    n = sum(c for c, _ in stages[0].values())
    mem = plan.role_memory(cfg, "actor", stages, spec="te")
    assert mem.weights == 2 * n and mem.grads == 4 * n
    assert mem.optimizer == pytest.approx(12 * n / 4) and mem.optimizer_alt == 12 * n
    m, seq = cfg.model, 4096
    per_layer = 2 * (2 * seq * m.hidden_size + seq * m.head_dim * (48 + 2 * 40 + 32))  # attention, TP 1
    per_layer += 2 * (2 * seq * m.hidden_size + 3 * seq * m.ffn_hidden_size)  # SwiGLU MLP
    micro_in_flight = 1  # PP 1
    assert mem.activations == pytest.approx(per_layer * m.num_layers * micro_in_flight)
    recompute = 2 * seq * m.hidden_size * m.num_layers + per_layer
    assert mem.activations_alt == pytest.approx(recompute)
    # two bf16 logits-sized tensors, and two float32 chunks of the logprob function's work
    assert mem.logits == plan.LOGIT_COPIES * 2 * seq * m.vocab_size + 2 * 4 * min(CHUNK_ELEMENTS, seq * m.vocab_size)
    assert mem.scores == 0  # flash attention: no score tensors
    assert mem.total == pytest.approx(
        mem.weights + mem.grads + mem.optimizer + mem.activations + mem.logits + plan.RESERVED_GIB * GiB
    )


def test_engine_kv_cache_by_hand():
    result = _plan("configs/qwen3_30b_a3b_math.yaml")
    e, m = result.engine, result.cfg.model
    attn_tp = result.cfg.rollout.tensor_parallel // result.cfg.cluster.engine_dp_attention
    assert e.kv_bytes_per_token == m.num_layers * 2 * (m.num_query_groups / attn_tp) * m.head_dim * 2
    assert abs(e.tokens_per_pool - math.floor((0.85 * 80 * GiB - e.weights) / e.kv_bytes_per_token)) <= 1
    assert e.sync_bytes == 2 * result.counts["total"]


def test_a_role_that_does_not_fit_is_rejected_with_the_gb_it_is_short(capsys):
    args = [
        "plan",
        "--analytic",
        "configs/qwen3_30b_a3b_math.yaml",
        "actor.parallel.recompute_activations=false",
    ]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    result = _plan("configs/qwen3_30b_a3b_math.yaml", "actor.parallel.recompute_activations=false")
    actor = next(r for r in result.roles if r.role == "actor")
    short = (actor.total - 80 * GiB) / GiB
    assert short > 1
    assert f"plan error: actor does not fit: {actor.total / GiB:.1f} GB per GPU needed on 80 GB GPUs" in err
    assert f"short by {short:.1f} GB" in err and "recompute_activations=true" in err
    assert "critic does not fit" not in err


def test_an_engine_that_cannot_hold_its_weights_is_rejected(capsys):
    assert (
        cli.main(
            [
                "plan",
                "--analytic",
                "configs/moe_750b_a40b.yaml",
                "rollout.tensor_parallel=8",
                "rollout.expert_parallel=8",
                "cluster.engine_dp_attention=1",
            ]
        )
        == 1
    )
    assert "plan error: rollout does not fit" in capsys.readouterr().err


def test_bigger_gpus_fit(capsys):
    args = [
        "plan",
        "--analytic",
        "configs/qwen3_30b_a3b_math.yaml",
        "actor.parallel.recompute_activations=false",
        "cluster.gpu_memory_gb=1000",
    ]
    assert cli.main(args) == 0
    assert "| yes |" in capsys.readouterr().out


def test_cpu_configs_are_not_checked_against_gpu_memory():
    result = _plan("configs/tiny_cpu.yaml", "rollout.loop.max_context_tokens=100000000")
    assert not result.failures()
    assert "n/a (CPU)" in plan.render(result)


def test_node_groups_follow_the_cluster_section():
    cfg = load_config("configs/moe_750b_a40b.yaml")
    assert plan.role_nodes(cfg) == {"actor": 32, "critic": 32, "rollout": 32}
    cfg = load_config("configs/moe_750b_a40b.yaml", ["cluster.critic_nodes=40"])
    assert plan.role_nodes(cfg)["critic"] == 40
    assert plan.role_nodes(load_config("configs/tiny_cpu.yaml")) == {"actor": 0, "critic": 0, "rollout": 0}


def test_cpu_runs_take_explicit_node_groups():
    """A CPU-only multi-node cluster (CI's .ci/slurm_multinode.sh) names every role's nodes."""
    groups = ["cluster.actor_nodes=2", "cluster.critic_nodes=1", "cluster.rollout_nodes=1"]
    assert plan.role_nodes(load_config("configs/tiny_cpu.yaml", groups)) == {
        "actor": 2,
        "critic": 1,
        "rollout": 1,
    }
    with pytest.raises(ConfigError, match=r"cluster.critic_nodes=0 on a CPU-only run"):
        load_config("configs/tiny_cpu.yaml", groups[::2])


@pytest.mark.parametrize(
    "override,key",
    [
        ("cluster.critic_nodes=2", "cluster.critic_nodes=2"),
        ("cluster.engine_dp_attention=3", "cluster.engine_dp_attention=3"),
        ("cluster.engine_mem_fraction=1.5", "cluster.engine_mem_fraction=1.5"),
        ("rollout.tensor_parallel=3", "rollout.tensor_parallel=3"),
    ],
)
def test_cluster_section_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/moe_750b_a40b.yaml", [override])


ROOT = Path(__file__).resolve().parents[1]
CLUSTER_CONFIGS = sorted(
    str(path.relative_to(ROOT))
    for path in (ROOT / "configs").glob("*.yaml")
    if load_config(str(path)).cluster.gpus_per_node
)
"""Every run config that targets GPU nodes (``configs/*.yaml`` with ``cluster.gpus_per_node``)."""


@pytest.mark.parametrize("path", CLUSTER_CONFIGS)
def test_every_cluster_config_fits_its_gpus(path):
    """The production configs are laid out for 80 GB H100s; a ``*_h200.yaml`` variant for 141 GB H200s."""
    result = _plan(path)
    assert result.cfg.cluster.gpu_memory_gb == (141 if path.endswith("_h200.yaml") else 80), path
    assert not result.failures(), result.failures()


def test_cluster_configs_include_the_large_moe_runs_and_their_h200_variants():
    for name in ("deepseek_v3_671b_math", "kimi_k2_1t_math", "glm4_5_355b_math"):
        assert {f"configs/{name}.yaml", f"configs/{name}_h200.yaml"} <= set(CLUSTER_CONFIGS)


LARGE_RUN_CONFIGS = [
    "configs/qwen3_30b_a3b_math.yaml",
    "configs/moe_750b_a40b.yaml",
    "configs/deepseek_v3_671b_math.yaml",
    "configs/kimi_k2_1t_math.yaml",
    "configs/glm4_5_355b_math.yaml",
]


@pytest.mark.slow
@pytest.mark.parametrize("path", LARGE_RUN_CONFIGS)
def test_plan_cli_meta_build_of_the_large_configs_matches_the_closed_form(capsys, path):
    assert cli.main(["plan", path]) == 0
    captured = capsys.readouterr()
    assert "per-rank counts by meta-device build" in captured.out
    assert "disagrees" not in captured.err


def test_routing_replay_bytes_by_hand_for_deepseek_v3():
    """DeepSeek-V3: 61 layers, the first 3 dense (``first_k_dense_replace``), 256 experts (uint8 ids), top-8;
    128 trajectories of 131,072 tokens; actor DP 8; micro-batches of one 131,072-token budget."""
    off = _plan("configs/deepseek_v3_671b_math.yaml", "rollout.routing_replay=off")
    on = _plan("configs/deepseek_v3_671b_math.yaml", "rollout.routing_replay=on")
    r = plan.route_memory(on.cfg)
    assert plan.route_memory(off.cfg) is None
    assert r is not None
    per_token = 58 * 8 * 1 + 1  # MoE layers x top-k x uint8, plus the validity flag
    assert (r.moe_layers, r.width, r.bytes_per_token) == (58, 1, 465) == (58, 1, per_token)
    assert r.per_trajectory == 465 * 131072 == 60_948_480
    assert r.per_batch == 128 * 60_948_480
    assert r.per_actor_rank == 16 * 60_948_480  # 128 trajectories over DP 8
    assert r.device == 131072 * 58 * 8 * 8  # one micro-batch's ids as int64
    actor_off, actor_on = off.roles[0], on.roles[0]
    assert actor_on.total - actor_off.total == r.device
    assert on.roles[1].total == off.roles[1].total  # the critic never replays
    assert "465 B/token; 58.1 MB per 131,072-token trajectory; 7.3 GB per batch of 128" in plan.render(on)


@pytest.mark.parametrize(
    "path,per_token",
    [
        ("configs/qwen3_30b_a3b_math.yaml", 48 * 8 * 1 + 1),  # 128 experts: uint8
        ("configs/moe_750b_a40b.yaml", 64 * 8 * 1 + 1),  # 256 experts: still uint8
        ("configs/kimi_k2_1t_math.yaml", 60 * 8 * 2 + 1),  # 384 experts: int16; layer 0 dense
    ],
)
def test_routing_replay_bytes_per_token(path, per_token):
    r = plan.route_memory(load_config(path, ["rollout.routing_replay=on"]))
    assert r is not None and r.bytes_per_token == per_token
