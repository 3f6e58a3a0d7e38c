"""``models/counting.py`` against transformers, exactly: the published DeepSeek-V3, Kimi-K2 and GLM-4.5
config.json files (copies in test_hf_config_deepseek / test_hf_config) built as transformers models on
the meta device (no memory), whose parameter numels must sum to ``parameter_counts(m)["total"]``.

transformers 5.19 builds no multi-token-prediction layer (``counting`` reports it apart, as ``mtp``)
and keeps the expert bias (``e_score_correction_bias``) and RoPE frequencies as buffers, not parameters;
neither count includes them. FP8 ``quantization_config`` is dropped: it changes the storage, not the model.
"""

from __future__ import annotations

import pytest
import torch

from sao_megatron.config.hf import model_config_from_hf
from sao_megatron.models.counting import parameter_counts
from tests.models.test_hf_config import GLM_45
from tests.models.test_hf_config_deepseek import DEEPSEEK_V3, KIMI_K2

PUBLISHED = {"deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2, "glm4_5": GLM_45}
_NOT_CONFIG = ("architectures", "model_type", "quantization_config", "auto_map")


@pytest.mark.parametrize("name", PUBLISHED)
def test_total_equals_a_transformers_meta_build_parameter_for_parameter(name):
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

    hf = PUBLISHED[name]
    config_class = Glm4MoeConfig if hf["architectures"] == ["Glm4MoeForCausalLM"] else DeepseekV3Config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_class(**{k: v for k, v in hf.items() if k not in _NOT_CONFIG}))
    assert not [n for n, _ in model.named_parameters() if f".layers.{hf['num_hidden_layers']}." in n]  # no MTP layer
    assert parameter_counts(model_config_from_hf(hf))["total"] == sum(p.numel() for p in model.parameters())
