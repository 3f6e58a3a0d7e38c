"""The prepared GPU check (``benchmarks/gpu``): arguments, carry list, sizing, FLOP arithmetic,
and the ``--cpu-smoke`` run end to end (the same code paths as on a GPU, tiny, gloo, float32)."""

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import carry, check, workload
from benchmarks.gpu.peak import matmul_tflops
from sao_megatron.config import CriticConfig, ModelConfig, ParallelConfig
from sao_megatron.models.counting import parameter_counts
from sao_megatron.plan import MetaJob, meta_parameters
from sao_megatron.plan.params import stage_parameters

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "benchmarks" / "gpu" / "run.sh"


def _run_sh(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(RUN_SH), *args], capture_output=True, text=True, env=full, timeout=timeout)


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------
def test_run_sh_help_names_the_options_and_the_carry_step():
    out = _run_sh("--help")
    assert out.returncode == 0, out.stderr
    for text in ("--budget-s", "--cpu-smoke", "--out", "--sections", "make gpu-wheels"):
        assert text in out.stdout, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget-s", "-3"], "argument --budget-s: expected a positive float, got '-3'"),
        (["--budget-s", "soon"], "expected a positive float, got 'soon'"),
        (["--steps", "0"], "argument --steps: expected a positive int"),
        (["--sections", "layout,warp"], "unknown section(s) ['warp']; choose from environment, memory, matmul_peak"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_fail_clearly_before_anything_is_installed(tmp_path, args, message):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("megatron-core==0.19.2\n")
    site = tmp_path / "site"
    out = _run_sh(*args, env={"GPU_CHECK_WHEELS": str(wheels), "GPU_CHECK_SITE": str(site)})
    assert out.returncode == 2
    assert message in out.stderr, out.stderr
    assert not site.exists()  # nothing was installed


def test_defaults_and_out_from_the_environment(monkeypatch):
    monkeypatch.setenv("OUT", "/somewhere/out")
    args = check.parse_args([])
    assert (args.budget_s, args.steps, args.cpu_smoke, args.out) == (420.0, 3, False, "/somewhere/out")
    assert args.sections == list(check.SECTIONS)
    monkeypatch.delenv("OUT")
    assert check.parse_args(["--out", "x"]).out == "x"
    assert check.parse_args([]).out == "runs/gpu_check"


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the refusal on a machine without CUDA")
def test_the_gpu_mode_refuses_a_machine_without_cuda(tmp_path, capsys):
    assert check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device here; on a machine without a GPU run with --cpu-smoke" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.json").exists()


# --------------------------------------------------------------------------------------------
# Carry
# --------------------------------------------------------------------------------------------
def test_carry_list_is_megatron_core_at_the_venv_version_and_nothing_heavy():
    pins = carry.carry_list()
    assert pins == [f"megatron-core=={version('megatron-core')}"]
    names = {p.split("==")[0] for p in pins} | set(carry.NEEDS)
    assert not names & {"ray", "sglang", "transformers", "transformer-engine", "safetensors"}
    assert {"megatron.core", "yaml", "torch"} <= set(carry.import_names())
    assert carry.missing_imports() == []
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/carry.py"), "--list"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and f"megatron-core=={version('megatron-core')}" in out.stdout, out


def test_carry_size_limit(tmp_path):
    small, big = tmp_path / "a.whl", tmp_path / "b.whl"
    small.write_bytes(b"x" * 1000)
    with big.open("wb") as f:
        f.truncate(64 << 20)
    assert carry.carry_size([small]) == (1000, True)
    assert carry.carry_size([big]) == (64 << 20, True)
    assert carry.carry_size([small, big]) == ((64 << 20) + 1000, False)


def test_the_check_imports_only_the_carried_closure():
    """What the check and its spawned cases import: no ray, sglang, transformers or safetensors,
    and every third-party package is one the carry list or the device image provides."""
    code = """
import sys
from sao_megatron.megatron_cpu import apply
apply()
import benchmarks.gpu.check, benchmarks.gpu.cases, benchmarks.gpu.peak
import sao_megatron.workers.actor, sao_megatron.workers.critic, sao_megatron.models.hf_bridge, sao_megatron.spawn
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
print(",".join(sorted({m.split(".")[0] for m in sys.modules})))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = set(out.stdout.strip().split(","))
    assert not loaded & {"ray", "sglang", "transformers", "safetensors", "transformer_engine"}, loaded
    assert {"megatron", "yaml", "torch"} <= loaded


# --------------------------------------------------------------------------------------------
# Sizing and arithmetic
# --------------------------------------------------------------------------------------------
def test_the_1b_moe_is_about_a_billion_parameters_counted_two_ways():
    m = workload.MOE_1B
    p = workload.parameter_summary(m)
    assert 0.8e9 <= p["total"] <= 1.3e9, p
    assert 0.1e9 <= p["active"] < p["total"] / 4, p
    assert p["matmul"] == p["active"] - m.vocab_size * m.hidden_size
    per_name = stage_parameters(m, ParallelConfig(), 0)  # the plan's name-by-name count
    assert sum(n for n, _ in per_name.values()) == parameter_counts(m)["total"] == p["total"]
    # Megatron accepts the shape and builds exactly that many (meta device, local spec), and the
    # critic's frozen share is what the FLOP count assumes
    actor, critic = meta_parameters([MetaJob(m, ParallelConfig()), MetaJob(m, ParallelConfig(), CriticConfig())])
    assert sum(n for stage in actor for n, _ in stage.values()) == p["total"]
    frozen = sum(n for stage in critic for n, trainable in stage.values() if not trainable)
    assert frozen == workload.parameter_summary(m, CriticConfig())["matmul_frozen"] > 0
    lengths = workload.sequence_lengths(workload.THROUGHPUT_GPU)
    assert 4096 <= sum(lengths) <= 8192, sum(lengths)


SMALL = ModelConfig(
    name="hand",
    num_layers=2,
    hidden_size=4,
    num_attention_heads=2,
    num_query_groups=1,
    head_dim=2,
    ffn_hidden_size=8,
    vocab_size=10,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=3,
)


def test_parameter_counts_and_flops_by_hand():
    # per layer: attention 4*2*(2+2) + 2*2*4 = 48, + input norm 4 + q/k norms 2+2 = 56;
    # router 4*4 + pre-MLP norm 4 = 20; expert 3*4*3 = 36 (4 in total, 2 active).
    # embeddings 2*10*4 + final norm 4 = 84. Input table 40 is no matmul.
    p = workload.parameter_summary(SMALL)
    assert (p["total"], p["active"], p["matmul"]) == (
        2 * (56 + 20 + 4 * 36) + 84,
        2 * (56 + 20 + 72) + 84,
        340,
    )
    assert p["matmul_frozen"] == 0
    lengths = [3, 5]
    assert workload.attention_flops(SMALL, lengths) == 12 * 2 * 2 * 2 * (9 + 25) == 3264
    assert workload.actor_step_flops(SMALL, lengths) == 6 * 340 * 8 + 3264
    assert workload.forward_flops(340, SMALL, lengths) == 2 * 340 * 8 + 3264 // 3
    # critic: attention frozen (qkv 32 + proj 16 + q/k norms 4 = 52 per layer); trainable: norms 4 + 4,
    # router 16, 2 active experts 72 per layer, final norm 4, value head 4 + bias 1.
    c = workload.parameter_summary(SMALL, CriticConfig())
    assert (c["matmul_trainable"], c["matmul_frozen"]) == (2 * 96 + 4 + 5, 2 * 52)
    assert workload.critic_step_flops(SMALL, CriticConfig(), lengths) == (6 * 201 + 4 * 104) * 8 + 3264


def test_mfu_and_matmul_arithmetic():
    assert workload.mfu(1e12, 2.0, 1.0) == pytest.approx(0.5)
    assert workload.mfu(7.5e14, 1.5, 1000.0) == pytest.approx(0.5)
    assert workload.mfu(1e12, 2.0, None) is None
    assert workload.matmul_flops(8192) == 2 * 8192**3
    out = matmul_tflops(64, torch.float32, "cpu", warmup=1, reps=2)
    assert out.n == 64 and out.dtype == "float32" and out.tflops > 0 and out.reps == 2


def test_throughput_figures_on_known_numbers():
    data = {
        "lengths": [3, 5],
        "tokens": 8,
        "actor_step_s": [2.0, 1.0, 3.0],
        "plain_step_s": [1.8],
        "critic_step_s": [0.5, 0.5],
        "logprobs_s": 0.25,
        "values_s": 0.0,
    }
    out = check.throughput_figures(SMALL, data, peak_tflops=1e-8)  # a 10 kFLOP/s "peak"
    actor = out["rates"]["actor_step"]
    assert actor["seconds"] == 2.0  # the median
    assert actor["tokens_per_s"] == 4.0
    assert actor["mfu"] == pytest.approx((6 * 340 * 8 + 3264) / 2.0 / 1e4)
    assert out["rates"]["plain_step"]["mfu"] == pytest.approx(19584 / 1.8 / 1e4)
    assert out["rates"]["critic_step"]["tflops"] == pytest.approx(16240 / 0.5 / 1e12)
    assert out["plain_over_ours"] == pytest.approx(0.9)
    assert out["rates"]["values"]["mfu"] is None and out["rates"]["values"]["tokens_per_s"] is None
    assert check.throughput_figures(SMALL, data, None)["rates"]["actor_step"]["mfu"] is None


def test_ragged_batches_have_odd_lengths_one_token_actions_and_many_turns():
    for shape in (workload.LAYOUT_CPU, workload.LAYOUT_GPU, workload.THROUGHPUT_GPU):
        trajs = workload.ragged_trajectories(shape)
        assert [len(t.prompt_ids) + len(t.response_ids) for t in trajs] == workload.sequence_lengths(shape)
        assert all((len(t.prompt_ids) + len(t.response_ids)) % 2 == 1 for t in trajs)
        ones = [t for t in trajs if all(turn.end - turn.start == 1 for turn in t.turns)]
        assert len(ones) >= shape.rows // 2
        assert max(len(t.turns) for t in trajs) >= min(shape.turns, 6)
        for t in trajs:
            assert sum(t.action_mask) == sum(turn.end - turn.start for turn in t.turns)


# --------------------------------------------------------------------------------------------
# Budget and failure handling (no spawned world)
# --------------------------------------------------------------------------------------------
def test_sections_that_do_not_fit_the_budget_are_skipped_with_the_reason(tmp_path):
    assert check.main(["--cpu-smoke", "--budget-s", "5", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = doc["sections"]
    assert set(sections) == set(check.SECTIONS)
    assert sections["environment"]["status"] == "measured"
    for name in ("layout", "moe_1b"):
        assert sections[name]["status"] == "skipped"
        assert "left of --budget-s" in sections[name]["reason"], sections[name]


def test_a_failing_section_is_reported_and_fails_the_run(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("layout exploded")

    monkeypatch.setattr(check, "layout_section", broken)
    assert check.main(["--cpu-smoke", "--sections", "environment,layout", "--out", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["ok"] is False
    assert doc["sections"]["layout"]["status"] == "failed"
    assert "layout exploded" in doc["sections"]["layout"]["reason"]
    assert doc["sections"]["moe_1b"]["reason"] == "skipped: not in --sections"


# --------------------------------------------------------------------------------------------
# --cpu-smoke end to end, through run.sh
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("gpu_check")
    no_wheels = tmp_path_factory.mktemp("no_wheels")
    out = _run_sh("--cpu-smoke", "--out", str(out_dir), env={"GPU_CHECK_WHEELS": str(no_wheels)}, timeout=300)
    return out, out_dir


@pytest.mark.slow
def test_cpu_smoke_writes_every_section_measured_or_skipped_with_a_reason(smoke):
    out, out_dir = smoke
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((out_dir / "gpu_check.json").read_text())
    assert doc["mode"] == "cpu-smoke" and doc["ok"] is True
    sections = doc["sections"]
    assert list(sections) == list(check.SECTIONS)
    for name, s in sections.items():
        assert s["status"] in ("measured", "skipped"), (name, s["reason"][-2000:])
        assert s["status"] == "measured" or s["reason"], name
    assert sections["matmul_peak"]["reason"] == sections["te_vs_local"]["reason"] == "skipped: no GPU"
    assert {p.name for p in (out_dir / "logs").iterdir()} == {
        "memory_rank0.log",
        "layout_rank0.log",
        "moe_1b_rank0.log",
        "replay_rank0.log",
    }
    for line in (
        "environment   measured",
        "memory        measured",
        "layout        measured",
        "moe_1b        measured",
        "replay        measured",
        "JSON:",
    ):
        assert line in out.stdout, line


@pytest.mark.slow
def test_cpu_smoke_layout_cases_are_finite_and_match_the_reference(smoke):
    _, out_dir = smoke
    layout = json.loads((out_dir / "gpu_check.json").read_text())["sections"]["layout"]
    data = layout["data"]
    assert data["dtype"] == data["reference_dtype"] == "float32"
    assert all(n % 2 == 1 for n in data["lengths"])
    padded = data["modes"]["padded"]
    # the check's own float32 thresholds: model-level (a whole forward in another layout or packing)
    assert padded["all_finite"] and padded["logprobs_vs_fp32"]["max"] <= check.LOGPROB_TOL["float32"]
    assert padded["logprob_change_after_update"]["max"] > 1e-4  # the update moved the policy
    assert padded["actor"]["updated"] == 1.0 and padded["actor"]["loss"] != 0.0
    assert set(data["modes"]) == {"padded", "packed", "packed_dynamic"}
    for name in ("packed", "packed_dynamic"):
        mode = data["modes"][name]
        assert mode.get("all_finite") or mode.get("skipped"), mode  # measured, or the named hook's reason
        if "all_finite" in mode:
            tol = check.PACKED_TOL["float32"]
            assert mode["logprobs_vs_padded"]["max"] <= tol and mode["logprobs_vs_fp32"]["max"] <= tol
    assert all(c["ok"] for c in layout["checks"].values()), layout["checks"]


@pytest.mark.slow
def test_cpu_smoke_memory_section_measures_logprobs_and_both_roles_against_the_plan(smoke):
    _, out_dir = smoke
    memory = json.loads((out_dir / "gpu_check.json").read_text())["sections"]["memory"]
    data = memory["data"]
    lp = data["logprob_bytes_per_logit"]
    # float32 on CPU: our peak beyond the logits is their gradient (4) plus a float32 chunk of 1/8 (0.5)
    assert lp["ours"] <= check.LOGPROB_BYTES_MAX < lp["old"], lp
    for role in ("actor", "critic"):
        r = data[role]
        assert r["measured_bytes"] > r["weights"] + r["grads"] + r["optimizer"] > 0, r
        assert abs(r["plan_over_measured"] - 1) <= check.PLAN_TOL, r
    assert all(c["ok"] for c in memory["checks"].values()), memory["checks"]


@pytest.mark.slow
def test_cpu_smoke_throughput_reports_rates_flops_and_the_plain_ratio(smoke):
    _, out_dir = smoke
    data = json.loads((out_dir / "gpu_check.json").read_text())["sections"]["moe_1b"]["data"]
    m = ModelConfig(**data["model"])
    assert data["tokens"] == sum(data["lengths"])
    assert data["flops"]["actor_step"] == workload.actor_step_flops(m, data["lengths"])
    for name in ("actor_step", "plain_step", "critic_step", "logprobs", "values"):
        rate = data["rates"][name]
        assert rate["seconds"] > 0 and rate["tokens_per_s"] > 0, name
        assert rate["mfu"] is None  # no bf16 peak on CPU
    assert data["plain_over_ours"] > 0
    assert len(data["actor_step_s"]) == len(data["plain_step_s"]) >= 1


def test_gpu_tests_section_finds_the_marked_modules_and_reads_pytests_counts(tmp_path):
    assert "tests/models/test_single_rank.py" in check.gpu_test_files()
    assert "tests/benchmarks/test_gpu_check.py" not in check.gpu_test_files()  # it reruns the check
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "sub" / "test_a.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_x(): ...\n")
    (tmp_path / "tests" / "test_b.py").write_text("def test_y(): ...\n")
    assert check.gpu_test_files(tmp_path) == ["tests/sub/test_a.py"]
    counts = check.pytest_counts(
        "..F\nFAILED tests/x.py::t - 2 passed\n2 passed, 1 failed, 1 skipped, 2 errors in 4.1s\n"
    )
    assert counts == {"passed": 2, "failed": 1, "errors": 2, "skipped": 1, "deselected": 0}
    assert check.pytest_counts("3 passed, 1597 deselected in 9.0s")["passed"] == 3
    assert check.pytest_counts("ImportError while loading conftest")["passed"] == 0


@pytest.mark.gpu
def test_the_check_runs_on_a_gpu(tmp_path):
    out = _run_sh(
        "--out", str(tmp_path), "--sections", "environment,matmul_peak,layout", "--budget-s", "300", timeout=400
    )
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out.returncode == 0, out.stdout[-3000:]
    assert doc["sections"]["matmul_peak"]["data"]["tflops"] > 100
    assert doc["sections"]["layout"]["data"]["dtype"] == "bfloat16"
