"""Multi-token-prediction (MTP) layers carried beside the model: converted and exported, never trained.

GLM-4.5 and DeepSeek-V3 checkpoints hold MTP layers (``model.layers.{num_layers}.*``, HF
``num_nextn_predict_layers``) that the trainer does not build (:func:`hf_bridge.is_mtp`). They
travel unchanged, tensor by tensor (at 671B the MTP layer is ~14B parameters; one tensor is in
memory at a time):

    HF_DIR --(sao convert hf-to-mcore: copy_to_template)--> MCORE_DIR/hf/mtp/  (an HF checkpoint
             of the MTP tensors alone; FP8 ones dequantised to the checkpoint's dtype, the rest as stored)
    MCORE_DIR/hf/mtp (sao convert mcore-to-hf), or the run's actor.init_from (sao export)
             --(write_shards, in the export's dtype)--> OUT_DIR/model-mtp-*.safetensors + index

FP8 block-scaled tensors are dequantised by :class:`HFCheckpoint.read`, as the loader's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from sao_megatron.config import ModelConfig
from sao_megatron.models import hf_bridge as bridge
from sao_megatron.models import hf_io
from sao_megatron.models.hf_io import HFCheckpoint, TensorSpec

TEMPLATE_SUBDIR = "mtp"
"""Where ``sao convert hf-to-mcore`` keeps the MTP tensors inside the ``hf/`` template."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MTPSource:
    """The MTP tensors of one HF checkpoint directory (``names`` in the checkpoint's order)."""

    def __init__(self, ckpt: HFCheckpoint, names: list[str]):
        self.ckpt, self.names = ckpt, names

    @property
    def directory(self) -> Path:
        return self.ckpt.directory

    @property
    def layers(self) -> int:
        """Distinct MTP layers (HF ``num_nextn_predict_layers``)."""
        return len({_LAYER.match(n).group(1) for n in self.names})  # type: ignore[union-attr]  # is_mtp matched it

    def specs(self, dtype: torch.dtype | None) -> list[TensorSpec]:
        """Each tensor's name, shape and written dtype: ``dtype`` (float32 for what HF keeps in
        float32), or when None the stored one (FP8: the checkpoint's dtype, float32 without one)."""
        specs = []
        for name in self.names:
            info = self.ckpt.info(name)
            if bridge.keeps_float32(name):
                out = torch.float32
            elif dtype is not None:
                out = dtype
            elif info.dtype in hf_io.FP8_CODES:
                out = self._fp8_target
            else:
                out = hf_io.torch_dtype(info.dtype)
            specs.append(TensorSpec(name, info.shape, out))
        return specs

    @property
    def _fp8_target(self) -> torch.dtype:
        config = self.directory / "config.json"
        code = hf_io.config_dtype(json.loads(config.read_text())) if config.is_file() else None
        return hf_io.torch_dtype(code) if code else torch.float32

    def write_shards(
        self, directory: Path, specs: list[TensorSpec], max_shard_bytes: int, files=None
    ) -> dict[str, str]:
        """Stream ``specs`` (from :meth:`specs`) into safetensors shards under ``directory``, one tensor
        read at a time; ``files``: the shard names (default ``save_pretrained``'s, with an index when
        several). Returns tensor -> file."""
        writer = hf_io.ShardWriter(directory, specs, max_shard_bytes, files=files)
        try:
            with torch.no_grad(), self.ckpt:
                for spec in specs:
                    tensor = self.ckpt.read(bridge.Read(spec.name, 0, spec.shape[0]))
                    writer.write(spec.name, tensor.to(spec.dtype))
                    del tensor
            writer.finish()
        finally:
            writer.abort()
        return writer.weight_map


def find(directory: str | Path, m: ModelConfig) -> MTPSource | None:
    """The MTP tensors of ``m`` (GLM, DeepSeek-V3) kept under ``directory``: a converted checkpoint
    (``directory/hf/mtp``), its ``hf/`` template (``directory/mtp``) or an HF checkpoint holding
    them; None when there are none (or the directory is gone)."""
    d = Path(directory)
    for candidate in (d / "hf" / TEMPLATE_SUBDIR, d / TEMPLATE_SUBDIR, d):
        if (candidate / hf_io.INDEX_FILE).is_file() or (candidate / hf_io.SINGLE_FILE).is_file():
            ckpt = HFCheckpoint(candidate)
            names = [n for n in ckpt.names() if bridge.is_mtp(n, m)]
            return MTPSource(ckpt, names) if names else None
    return None


def copy_to_template(hf_dir: str | Path, m: ModelConfig, template: Path, max_shard_bytes: int) -> int:
    """``sao convert hf-to-mcore``: the MTP tensors of ``hf_dir`` into ``template/mtp`` (FP8 ones
    dequantised to the checkpoint's dtype, the rest unchanged); how many (0: none, nothing written)."""
    source = find(hf_dir, m)
    if source is None:
        return 0
    out = template / TEMPLATE_SUBDIR
    out.mkdir()
    source.write_shards(out, source.specs(None), max_shard_bytes)
    return len(source.names)


def export_files(n: int) -> list[str]:
    """An export's MTP shard names, apart from the model's: ``model-mtp-0000i-of-0000N.safetensors``."""
    return [f"model-mtp-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
