"""Checkpoint conversion HF safetensors <-> Megatron distributed checkpoints (``sao convert``).

    HF_DIR --(each rank reads its slices: load_hf_weights)--> Megatron model at TP/PP/EP
           --(dist_checkpoint.save_model, torch_dist)--> MCORE_DIR + model.yaml + hf/ + convert.json
    HF_DIR's multi-token-prediction tensors --(tensor by tensor: hf_mtp)--> MCORE_DIR/hf/mtp/
    MCORE_DIR --(dist_checkpoint.load_model: reshards to any layout)--> Megatron model
              --(save_hf_checkpoint: every rank writes the shards of what it holds)--> HF_DIR

A Megatron checkpoint directory holds the ``torch_dist`` files, ``model.yaml`` (our model
shape, loadable by ``load_config``), ``convert.json`` (dtype, source) and ``hf/`` (the source's
config, generation config and tokenizer files, used as the template of the way back; ``hf/mtp/``
its multi-token-prediction tensors, written back by the export).
Conversions that need N ranks run as a spawned gloo world (:func:`sao_megatron.spawn.run_world`);
outputs are staged next to the target and renamed at the end. Every rank builds its part of the
model on the CPU without random initialisation (``build_gpt(..., for_loading=True)``), so its
resident memory is its shard plus read / write buffers, and reports its peak (``VmHWM``). A
conversion that runs past ``timeout_s`` (default :func:`convert_timeout_s` of its bytes) is
stopped, naming ``--timeout-s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from sao_megatron.config import ModelConfig, ParallelConfig, validate_parallel
from sao_megatron.config import hf as hf_config
from sao_megatron.config.shape import same_shape
from sao_megatron.models import hf_bridge as bridge
from sao_megatron.models import hf_io, hf_mtp
from sao_megatron.models.hf_io import CheckpointError

TEMPLATE_DIR = "hf"
MODEL_YAML = "model.yaml"
CONVERT_JSON = "convert.json"
CONVERT_GB_PER_S = 0.5
"""Stated bandwidth of a conversion (read + write, the whole world) that sizes its default timeout."""
DEFAULT_MTP_SHARD_BYTES = 5 << 30
"""The largest shard of the multi-token-prediction tensors kept in ``hf/mtp``."""
CONVERT_FLOOR_S = 900.0
"""The shortest default conversion timeout (process start-up, imports and model construction included)."""


def convert_timeout_s(nbytes: int) -> float:
    """Default ``--timeout-s`` of a conversion moving ``nbytes``: ``max(900, 3 x nbytes / 0.5 GB/s)``
    (:func:`hf_io.transfer_timeout_s`); 1.48 TB (750B-A40B in bf16): 8880 s."""
    return hf_io.transfer_timeout_s(nbytes, CONVERT_GB_PER_S, CONVERT_FLOOR_S)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``VmHWM`` of ``/proc/self/status``; ``ru_maxrss`` elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class ConvertSummary:
    """One conversion: tensors and bytes moved, wall time and the time of the copy phase alone."""

    direction: str
    tensors: int
    bytes: int
    wall_s: float
    """Whole call: process start-up, imports, model construction and the copy."""
    transfer_s: float
    """The copy alone (slowest rank): read + write of the weights."""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds per phase of the copy (slowest rank), e.g. ``read_hf``, ``save_torch_dist``."""
    peak_rss: list[int] = dataclasses.field(default_factory=list)
    """Per rank: peak resident bytes of its process over the whole conversion (``VmHWM``)."""
    shard_bytes: list[int] = dataclasses.field(default_factory=list)
    """Per rank: bytes of its part of the model (its parameters)."""
    mtp: str = ""
    """What became of the checkpoint's multi-token-prediction layers, one line (empty: the model has none)."""

    @property
    def gb_per_s(self) -> float:
        """Bytes / copy-phase seconds (read + write, no process start-up), in GB/s (1e9)."""
        return self.bytes / max(self.transfer_s, 1e-9) / 1e9


def check_hf_checkpoint(hf_dir: str | Path, m: ModelConfig) -> tuple[int, int]:
    """Every tensor ``m`` needs is present with its shape and dtype, and nothing else is there.

    Reads headers only. Returns ``(tensors, bytes)``; raises :class:`CheckpointError`.
    """
    with hf_io.HFCheckpoint(hf_dir) as ckpt:
        config_file = Path(hf_dir) / "config.json"
        dtype = hf_io.config_dtype(json.loads(config_file.read_text())) if config_file.exists() else None
        fused = any(n.endswith(bridge.FUSED_GATE_UP) for n in ckpt.names())
        expected = {
            p.hf_name
            for name in bridge.mcore_names(m)
            if bridge.is_exported(name, m)
            for p in bridge.hf_pieces(name, m, fused)
        }
        total = 0
        for name in sorted(expected):
            total += ckpt.check(name, bridge.hf_shape(name, m), None if bridge.keeps_float32(name) else dtype).nbytes
        extra = [n for n in ckpt.names() if n not in expected and not bridge.is_ignored(n, m)]
        if extra:
            raise CheckpointError(
                f"checkpoint {ckpt.source} holds tensors the config does not describe, e.g. "
                f"'{extra[0]}' in {ckpt.files[extra[0]]} ({len(extra)} in all); is config.json "
                "the one of these weights?"
            )
        return len(expected), total


class _Bar:
    """One rich progress bar in bytes: :meth:`advance` by a count, :meth:`total` set later."""

    def __init__(self, bar, task):
        self._bar, self._task = bar, task

    def advance(self, nbytes: int) -> None:
        self._bar.advance(self._task, nbytes)

    def total(self, nbytes: int) -> None:
        self._bar.update(self._task, total=nbytes)


@contextlib.contextmanager
def _progress(enabled: bool, description: str, total: int | None):
    """A rich progress bar in bytes (rank 0 only), yielding a :class:`_Bar` or None."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns) as bar:
        yield _Bar(bar, bar.add_task(description, total=total))


def _setup(p: ParallelConfig) -> None:
    from sao_megatron.parallel import initialize_model_parallel, seed_everything

    initialize_model_parallel(p)
    seed_everything(0)


# --------------------------------------------------------------------------------------------
# HF -> Megatron
# --------------------------------------------------------------------------------------------
def _hf_to_mcore_rank(rank, world, hf_dir, stage, m_dict, p_dict, bf16, progress):
    import torch.distributed as dist

    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.dist_checkpoint import save_model
    from sao_megatron.models.hf_weights import load_hf_weights

    m, p = ModelConfig(**m_dict), ParallelConfig(**p_dict)
    _setup(p)
    model = build_gpt(m, p, bf16=bf16, for_loading=True)
    local_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    dist.barrier()
    t0 = time.perf_counter()
    with _progress(progress and rank == 0, f"rank 0 of {world}: reading HF slices", local_bytes) as bar:
        stats = load_hf_weights(model, m, hf_dir, progress=bar.advance if bar else None)
    t_save = time.perf_counter()
    save_model(model, stage)
    return {
        **stats.as_dict(),
        "load_s": t_save - t0,
        "save_s": time.perf_counter() - t_save,
        "copy_s": time.perf_counter() - t0,
        "peak_rss": peak_rss_bytes(),
        "shard_bytes": local_bytes,
    }


def hf_to_mcore(
    hf_dir: str | Path,
    out_dir: str | Path,
    p: ParallelConfig,
    *,
    bf16: bool | None = None,
    overwrite: bool = False,
    progress: bool = False,
    timeout_s: float = 0.0,
) -> ConvertSummary:
    """Convert an HF checkpoint into a Megatron ``torch_dist`` checkpoint using ``p.world_size`` ranks.

    ``bf16`` None keeps the HF checkpoint's dtype (bf16 checkpoints give bf16 Megatron weights).
    ``timeout_s`` 0: :func:`convert_timeout_s` of the checkpoint's bytes.
    """
    from sao_megatron.spawn import run_world

    t0 = time.perf_counter()
    hf_dir = Path(hf_dir)
    hf = hf_config.read_hf_config(hf_dir)
    m = hf_config.model_config_from_hf(hf, name=hf_dir.name)
    validate_parallel(p, m, "convert")
    tensors, nbytes = check_hf_checkpoint(hf_dir, m)
    if bf16 is None:
        bf16 = hf_io.config_dtype(hf) == "BF16"
    with hf_io.staging_dir(out_dir, overwrite) as stage:
        results = run_world(
            _hf_to_mcore_rank,
            p.world_size,
            str(hf_dir.resolve()),
            str(stage),
            dataclasses.asdict(m),
            dataclasses.asdict(p),
            bf16,
            progress,
            backend="gloo",
            timeout_s=timeout_s or convert_timeout_s(nbytes),
            timeout_key="--timeout-s",
        )
        (stage / MODEL_YAML).write_text(hf_config.model_yaml(m, source=str(hf_dir)))
        (stage / TEMPLATE_DIR).mkdir()
        hf_io.copy_non_weight_files(hf_dir, stage / TEMPLATE_DIR)
        mtp_tensors = hf_mtp.copy_to_template(hf_dir, m, stage / TEMPLATE_DIR, DEFAULT_MTP_SHARD_BYTES)
        meta = {
            "bf16": bf16,
            "source": str(hf_dir.resolve()),
            "saved_layout": dataclasses.asdict(p),
            "hf_tensors": tensors,
            "hf_bytes": nbytes,
            "mtp_tensors": mtp_tensors,
        }
        (stage / CONVERT_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    phases = {
        "read_hf": max(r["load_s"] for r in results),
        "save_torch_dist": max(r["save_s"] for r in results),
    }
    copy_s = max(r["copy_s"] for r in results)
    mtp = (
        f"kept {mtp_tensors} multi-token-prediction tensors in {Path(out_dir) / TEMPLATE_DIR / hf_mtp.TEMPLATE_SUBDIR}"
    )
    return ConvertSummary(
        "hf-to-mcore",
        tensors,
        nbytes,
        time.perf_counter() - t0,
        copy_s,
        phases,
        *_memory(results),
        mtp=mtp if mtp_tensors else "",
    )


def _memory(results: list[dict]) -> tuple[list[int], list[int]]:
    """Per rank: peak RSS and shard bytes."""
    return [r["peak_rss"] for r in results], [r["shard_bytes"] for r in results]


# --------------------------------------------------------------------------------------------
# Megatron -> HF
# --------------------------------------------------------------------------------------------
def read_mcore_dir(mcore_dir: str | Path) -> tuple[ModelConfig, dict]:
    """The model shape and conversion metadata stored next to a Megatron checkpoint."""
    mcore_dir = Path(mcore_dir)
    if not (mcore_dir / MODEL_YAML).exists():
        raise CheckpointError(
            f"{mcore_dir} has no {MODEL_YAML}; convert with `sao convert hf-to-mcore` or put "
            "the model's shape file there"
        )
    meta_file = mcore_dir / CONVERT_JSON
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    return hf_config.load_model_yaml(mcore_dir / MODEL_YAML), meta


def _mcore_to_hf_rank(
    rank,
    world,
    mcore_dir,
    out_dir,
    m_dict,
    p_dict,
    bf16,
    template,
    dtype_name,
    max_shard_bytes,
    overwrite,
    progress,
    timeout_s,
    timeout_key,
    mtp_from,
):
    import torch.distributed as dist

    from sao_megatron.models.builder import build_gpt
    from sao_megatron.models.dist_checkpoint import load_model
    from sao_megatron.models.hf_weights import save_hf_checkpoint

    m, p = ModelConfig(**m_dict), ParallelConfig(**p_dict)
    _setup(p)
    model = build_gpt(m, p, bf16=bf16, for_loading=True)
    dist.barrier()
    t0 = time.perf_counter()
    load_model(model, mcore_dir)
    t_export = time.perf_counter()
    dtype = hf_io.torch_dtype(dtype_name) if dtype_name else None
    with _progress(progress and rank == 0, f"rank 0 of {world}: writing its HF shards", None) as bar:
        stats = save_hf_checkpoint(
            model,
            m,
            out_dir,
            template=template,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
            progress=bar.advance if bar else None,
            progress_total=bar.total if bar else None,
            timeout_s=timeout_s,
            timeout_key=timeout_key,
            mtp_from=mtp_from,
        )
    return {
        **stats.as_dict(),
        "load_s": t_export - t0,
        "export_s": time.perf_counter() - t_export,
        "copy_s": time.perf_counter() - t0,
        "peak_rss": peak_rss_bytes(),
        "shard_bytes": sum(q.numel() * q.element_size() for q in model.parameters()),
    }


def _hf_bytes(m: ModelConfig, template: str | Path | None, dtype: str | None, bf16: bool) -> int:
    """Bytes of the HF checkpoint an export of ``m`` writes: ``dtype``, else the template's, else the weights'."""
    name = dtype or (hf_io.config_dtype(hf_config.read_hf_config(template)) if template else None)
    size = hf_io.torch_dtype(name).itemsize if name else (2 if bf16 else 4)
    return sum(hf_io._numel(bridge.hf_shape(n, m)) for n in bridge.expected_hf_names(m)) * size


def mcore_to_hf(
    mcore_dir: str | Path,
    out_dir: str | Path,
    p: ParallelConfig | None = None,
    *,
    template: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: bool = False,
    timeout_s: float = 0.0,
) -> ConvertSummary:
    """Convert a Megatron checkpoint written by :func:`hf_to_mcore` (or with a ``model.yaml``) to HF.

    ``template``: an HF directory whose config and tokenizer files are copied (default: the
    ``hf/`` copy stored at conversion time; without either, ``config.json`` is generated).
    ``dtype`` (``float32`` / ``bfloat16``) defaults to the template's. ``p`` defaults to one rank.
    The template's multi-token-prediction tensors (``hf/mtp``, or an HF checkpoint's own) are written
    too (:mod:`hf_mtp`).
    ``timeout_s`` 0: :func:`convert_timeout_s` of the HF checkpoint's bytes.
    """
    from sao_megatron.spawn import run_world

    t0 = time.perf_counter()
    mcore_dir, out_dir = Path(mcore_dir), Path(out_dir)
    m, meta = read_mcore_dir(mcore_dir)
    if template is None and (mcore_dir / TEMPLATE_DIR / "config.json").exists():
        template = mcore_dir / TEMPLATE_DIR
    if template is not None:
        diff = same_shape(hf_config.model_config_from_hf(hf_config.read_hf_config(template)), m)
        if diff:
            raise CheckpointError(
                f"--hf-template {template}: config.json disagrees with {mcore_dir / MODEL_YAML} on {diff}"
            )
    if out_dir.exists() and not overwrite and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose another directory")
    if dtype is not None:
        hf_io.torch_dtype(dtype)
    p = p or ParallelConfig()
    validate_parallel(p, m, "convert")
    bf16 = bool(meta.get("bf16", False))
    timeout = timeout_s or convert_timeout_s(_hf_bytes(m, template, dtype, bf16))
    results = run_world(
        _mcore_to_hf_rank,
        p.world_size,
        str(mcore_dir.resolve()),
        str(out_dir.resolve()),
        dataclasses.asdict(m),
        dataclasses.asdict(p),
        bf16,
        str(template) if template else None,
        dtype,
        max_shard_bytes,
        overwrite,
        progress,
        timeout,
        "--timeout-s",
        str(template) if template else None,
        backend="gloo",
        timeout_s=timeout,
        timeout_key="--timeout-s",
    )
    return _export_summary("mcore-to-hf", results, t0, _mtp_note(m, template, results))


def _mtp_note(m: ModelConfig, source: str | Path | None, results: list[dict], missing: str = "") -> str:
    """The summary's line on multi-token-prediction layers (``missing``: why none could be carried)."""
    carried = results[0].get("mtp_tensors", 0)
    if carried:
        return f"carried {carried} multi-token-prediction tensors from {source} (num_nextn_predict_layers set to match)"
    if m.mtp_layers:
        why = missing or f"{source or 'no HF template'} holds none"
        return f"no multi-token-prediction layer written ({why}); config.json says num_nextn_predict_layers: 0"
    return ""


def _export_summary(direction: str, results: list[dict], t0: float, mtp: str = "") -> ConvertSummary:
    r0 = results[0]  # every rank reports the export's totals
    phases = {
        "load_torch_dist": max(r["load_s"] for r in results),
        "export_hf": max(r["export_s"] for r in results),
    }
    copy_s = max(r["copy_s"] for r in results)
    return ConvertSummary(
        direction, r0["tensors"], r0["bytes"], time.perf_counter() - t0, copy_s, phases, *_memory(results), mtp=mtp
    )


def parallel_config(world: int | None, tp: int, pp: int, ep: int) -> ParallelConfig:
    """A conversion layout; ``world`` defaults to the smallest that fits TP, PP and EP."""
    from math import lcm

    return ParallelConfig(
        world_size=world or pp * lcm(tp, ep),
        tensor_parallel=tp,
        pipeline_parallel=pp,
        expert_parallel=ep,
        use_distributed_optimizer=False,
    )


class ExportError(ValueError):
    """A run directory that cannot be exported, stated in one line with the fix."""


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    *,
    world: int | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: str | None = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: bool = False,
    timeout_s: float = 0.0,
) -> ConvertSummary:
    """The run's actor (``RUN_DIR/checkpoint/actor``) as an HF checkpoint in ``out_dir``.

    Reuses ``sao convert mcore-to-hf``'s rank body: a spawned gloo world of ``world`` ranks at
    TP/PP/EP builds the run's model (``RUN_DIR/config.yaml``), loads only the model tensors of the
    role checkpoint (which also holds optimizer state) and every rank writes the safetensors
    shards of what it holds (``timeout_s`` 0: :func:`convert_timeout_s` of the export's bytes).
    Config, generation config, tokenizer files and chat template come from the run's last policy
    export ``RUN_DIR/hf/policy`` when present, else config.json is generated and the tokenizer
    files of ``actor.init_from`` (an HF directory) or of the bundled ``sao_megatron/tokenizer``
    are copied. Multi-token-prediction layers (GLM, DeepSeek-V3; not trained) come from
    ``actor.init_from`` as it is at export time: a converted checkpoint's ``hf/mtp`` or the HF
    directory's own tensors (the summary says when it holds none). Runs keep only their latest
    checkpoint, so ``step`` must equal its step (``checkpoint/state.json``)."""
    from sao_megatron.config import load_config
    from sao_megatron.spawn import run_world

    t0 = time.perf_counter()
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml); pass the directory sao train wrote")
    actor_dir = run_dir / "checkpoint" / "actor"
    if not (actor_dir / "metadata.json").is_file():
        raise ExportError(
            f"{run_dir} has no actor checkpoint ({actor_dir} is missing); runs write it every "
            "train.save_every steps and at the end: resume with 'sao train --resume RUN_DIR'"
        )
    state_file = run_dir / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    saved = state.get("step")
    if step is not None and saved is None:
        raise ExportError(f"{state_file} is missing, so the checkpoint's step is unknown; export without --step")
    if step is not None and step != saved:
        raise ExportError(
            f"{run_dir} keeps only its latest checkpoint (stage {state.get('stage', '?')}, step "
            f"{saved}; {state_file}); step {step} is not stored: export without --step, or set "
            "train.save_every and copy checkpoint/ aside to keep earlier steps"
        )
    cfg = load_config(run_dir / "config.yaml", ["cluster.ray_address="])
    m = cfg.model
    template = run_dir / "hf" / "policy"
    if not (template / "config.json").is_file():
        template = None
    else:
        diff = same_shape(hf_config.model_config_from_hf(hf_config.read_hf_config(template)), m)
        if diff:
            raise ExportError(
                f"{template}/config.json disagrees with {run_dir / 'config.yaml'} on {diff}; "
                "remove the stale hf/policy directory"
            )
    if out_dir.exists() and not overwrite and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose another directory or pass --overwrite")
    p = parallel_config(world, tp, pp, ep)
    validate_parallel(p, m, "export")
    timeout = timeout_s or convert_timeout_s(_hf_bytes(m, template, dtype, cfg.actor.bf16))
    mtp_from = cfg.actor.init_from or None
    results = run_world(
        _mcore_to_hf_rank,
        p.world_size,
        str(actor_dir.resolve()),
        str(out_dir.resolve()),
        dataclasses.asdict(m),
        dataclasses.asdict(p),
        cfg.actor.bf16,
        str(template) if template else None,
        dtype,
        max_shard_bytes,
        overwrite,
        progress,
        timeout,
        "--timeout-s",
        mtp_from,
        backend="gloo",
        timeout_s=timeout,
        timeout_key="--timeout-s",
    )
    if template is None:  # no policy export yet (stopped during SFT): the run's tokenizer source
        from sao_megatron.tokenizer import copy_tokenizer_files

        copy_tokenizer_files(cfg.actor.init_from, out_dir)
    missing = "" if mtp_from else "actor.init_from is empty: the run started from random weights"
    if mtp_from and not Path(mtp_from).is_dir():
        missing = f"actor.init_from={mtp_from} no longer exists; the run's directories keep no copy of them"
    return _export_summary("run actor -> HF", results, t0, _mtp_note(m, mtp_from, results, missing))
