import pytest
import torch

from sao_megatron.logs import filterwarnings_lines, quiet_third_party


def pytest_configure(config):
    # The known third-party notices of sao_megatron/logs.py, the single list: as ini filters
    # (re-applied around every test, after the project's own "error::...:sao_megatron.*" lines)
    # and process-wide for what runs outside a test (collection-time imports, logging records).
    for line in filterwarnings_lines():
        config.addinivalue_line("filterwarnings", line)
    quiet_third_party()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
