"""sao_megatron.logs: per-process log files and the single list of known third-party notices."""

import importlib
import logging
import subprocess
import sys
import warnings

import pytest

from sao_megatron import logs
from sao_megatron.logs import KNOWN_WARNINGS, quiet_third_party

# Emitted at import of megatron.core.optimizer on a machine without Transformer Engine or Apex.
MEGATRON_NOTICE = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."

WRITER = """
import os, subprocess, sys
from sao_megatron.logs import redirect_process_output
redirect_process_output(sys.argv[1])
print("print line")
sys.stderr.write("stderr line\\n")
os.write(2, b"fd2 line\\n")
os.write(1, b"fd1 line\\n")
subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"])
raise SystemExit(3)
"""


def _warn(message: str, module: str, category=UserWarning) -> None:
    warnings.warn_explicit(message, category, f"/site-packages/{module.replace('.', '/')}.py", 25, module=module)


def test_redirect_process_output_sends_everything_to_the_file_and_appends(tmp_path):
    path = tmp_path / "logs" / "actor_rank0.log"  # the parent directory does not exist yet
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", WRITER, str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 3
        assert (out.stdout, out.stderr) == ("", "")
    text = path.read_text()
    for line in ("print line", "stderr line", "fd2 line", "fd1 line", "child out", "child err"):
        assert text.count(line + "\n") == 2, (line, text)
    assert text.count("---- pid ") == 2  # one header per start: a restarted rank appends


def test_quiet_third_party_hides_known_megatron_notices_only():
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        quiet_third_party()
        quiet_third_party()  # idempotent
        _warn(MEGATRON_NOTICE, "megatron.core.optimizer")
        _warn(MEGATRON_NOTICE, "sao_megatron.workers.actor")  # ours: same text still shows
        _warn("our own notice", "sao_megatron.workers.actor")
        _warn("some other Megatron warning", "megatron.core.optimizer")
        ours = [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None]
        assert len(ours) == len(KNOWN_WARNINGS)
    assert [(str(w.message), w.filename.split("site-packages/")[-1]) for w in caught] == [
        (MEGATRON_NOTICE, "sao_megatron/workers/actor.py"),
        ("our own notice", "sao_megatron/workers/actor.py"),
        ("some other Megatron warning", "megatron/core/optimizer.py"),
    ]


def test_pytest_uses_the_same_list_and_still_fails_on_our_warnings():
    # conftest feeds logs.KNOWN_WARNINGS to pytest's filterwarnings; pyproject keeps ours errors.
    with warnings.catch_warnings(record=True) as caught:
        _warn(MEGATRON_NOTICE, "megatron.core.optimizer")
        with pytest.raises(UserWarning, match="our own notice"):
            _warn("our own notice", "sao_megatron.workers.actor")
    assert caught == []
    assert all(":" not in w.message for w in KNOWN_WARNINGS)


def test_quiet_third_party_drops_known_log_records_only(caplog):
    quiet_third_party()
    quiet_third_party()
    megatron = logging.getLogger("megatron.core.models.gpt.gpt_model")
    with caplog.at_level(logging.INFO):
        megatron.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features.")
        megatron.warning("a real Megatron problem")
        megatron.info("megatron progress at INFO")
        logging.getLogger("torch.utils.cpp_extension").warning(
            "No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local"
        )
        logging.getLogger("sao_megatron.driver").warning("GPTModel IS DEPRECATED. (ours)")
    assert [r.getMessage() for r in caplog.records] == [
        "a real Megatron problem",
        "GPTModel IS DEPRECATED. (ours)",
    ]
    assert len([f for f in megatron.filters if isinstance(f, logs._DropKnown)]) == 1


def test_ray_worker_setup_hook_names_quiet_third_party():
    module, _, name = logs.RAY_WORKER_SETUP_HOOK.rpartition(".")
    assert getattr(importlib.import_module(module), name) is quiet_third_party


def test_run_world_log_to_needs_a_rank_placeholder(tmp_path):
    from sao_megatron.spawn import run_world

    with pytest.raises(ValueError, match="rank"):
        run_world(print, 1, log_to=tmp_path / "world.log")
