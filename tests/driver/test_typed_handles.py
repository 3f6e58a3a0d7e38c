"""The driver -> rank boundary is typed: a wrong keyword or argument type is a static error."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PYRIGHT = Path(sys.executable).parent / "pyright"

SNIPPET = """
from sao_megatron.batch import BatchShard
from sao_megatron.driver.roles import ActorGroup, CriticGroup
from sao_megatron.workers.actor import ActorWorker


async def calls(actor: ActorGroup, critic: CriticGroup, shard: BatchShard, adv) -> None:
    await actor.update(shard, adv, version=3)  # fine
    await actor._all(ActorWorker.update, shard, adv, versoin=3)  # line 9: misspelt keyword
    await actor.update(shard, adv, version="3")  # line 10: wrong type
    await critic.update(shard, adv)  # line 11: missing old_values
"""


@pytest.mark.skipif(not PYRIGHT.exists() or shutil.which("node") is None, reason="pyright or node not installed")
def test_wrong_keyword_to_a_worker_method_is_a_static_error(tmp_path):
    src = tmp_path / "calls.py"
    src.write_text(SNIPPET)
    out = subprocess.run(
        [str(PYRIGHT), "--pythonpath", sys.executable, str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYRIGHT_PYTHON_IGNORE_WARNINGS": "1", "PATH": "/usr/bin:/bin"},
    )
    errors = [line for line in out.stdout.splitlines() if " - error: " in line]
    lines = sorted({int(line.split(":")[1]) for line in errors})
    assert lines == [9, 10, 11], out.stdout
    assert "versoin" in out.stdout
