"""Parameters per rank, exactly: the role's real Megatron model built on torch's ``meta`` device.

``builder.build_gpt`` or ``critic.build_critic`` (local layer spec) is built one rank per pipeline
stage, inside a one-process ``torch.distributed`` world of the role's size made with torch's
``fake`` backend, so ``parallel_state.initialize_model_parallel`` sees the real layout. No weights
are allocated and no other process or GPU is involved; it runs in a child process
(``python -m sao_megatron.plan SPEC RESULT``, ``CUDA_VISIBLE_DEVICES=""``) so Megatron's global
state never leaks into the caller.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sao_megatron.config import CriticConfig, ModelConfig, ParallelConfig
from sao_megatron.plan.params import StageParams


@dataclass
class MetaJob:
    """One role to build on the meta device: its model, layout, critic settings (None: actor)."""

    model: ModelConfig
    parallel: ParallelConfig
    critic: CriticConfig | None = None
    bf16: bool = True


def meta_parameters(jobs: list[MetaJob], timeout_s: float = 900.0) -> list[list[StageParams]]:
    """Build each role on the meta device in a fake world of its ``world_size`` ranks, one rank per stage.

    All jobs run in one child process with CUDA hidden (local spec, CPU initialisation path:
    nothing is allocated on a GPU even on a GPU node); returns per job one :data:`StageParams`
    per pipeline stage."""
    spec = [dataclasses.asdict(job) for job in jobs]
    with tempfile.TemporaryDirectory(prefix="sao-plan-") as tmp:
        spec_path, result = Path(tmp) / "jobs.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(
            [sys.executable, "-m", "sao_megatron.plan", str(spec_path), str(result)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"meta-device build failed (exit {proc.returncode}):\n{tail}")
        built = json.loads(result.read_text())
    return [[{name: (n, bool(t)) for name, (n, t) in stage.items()} for stage in job] for job in built]


def _meta_build_main(spec_path: str, result_path: str) -> None:
    """Child process of :func:`meta_parameters`."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from sao_megatron import megatron_cpu
    from sao_megatron.config.parse import build
    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.critic import build_critic

    megatron_cpu.apply()
    results = []
    for job in json.loads(Path(spec_path).read_text()):
        m = build(ModelConfig, job["model"], "model")
        p = build(ParallelConfig, job["parallel"], "parallel")
        critic = build(CriticConfig, job["critic"], "critic") if job["critic"] is not None else None
        if p.context_parallel > 1:  # the local spec refuses CP (TE only); CP ranks hold what DP ranks hold
            p = dataclasses.replace(p, context_parallel=1)
        stages = []
        for stage in range(p.pipeline_parallel):
            rank = stage * (p.world_size // p.pipeline_parallel)  # Megatron order tp-cp-ep-dp-pp: PP outermost
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p.world_size)
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tensor_parallel,
                pipeline_model_parallel_size=p.pipeline_parallel,
                context_parallel_size=p.context_parallel,
                expert_model_parallel_size=p.expert_parallel,
                expert_tensor_parallel_size=p.expert_tensor_parallel,
                create_gloo_process_groups=False,
            )
            assert ps.get_pipeline_model_parallel_rank() == stage, "unexpected Megatron rank order"
            with torch.device("meta"):
                model = build_critic(m, p, critic) if critic is not None else build_gpt(m, p, bf16=job["bf16"])
            stages.append({n: (t.numel(), t.requires_grad) for n, t in model.named_parameters()})
            del model
            ps.destroy_model_parallel()
            dist.destroy_process_group()
        results.append(stages)
    Path(result_path).write_text(json.dumps(results))
