"""``sao check --mismatch`` on the tiny config: the real CPU engine and the real actor world at the same
weights. In float32 SGLang's CPU kernels and Megatron's local spec agree to ~1e-7 in logprob
(docs/PERFORMANCE.md), so every routed token's top-k set agrees and replay changes nothing measurable;
the check's job here is to run end to end and report both modes the way a user reads them."""

from __future__ import annotations

import json

import pytest

from sao_megatron.cli import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

ENGINE_TOL = 1e-4
"""|engine - trainer| logprob bound in float32 (tests/rollout/test_engine_integration.py ENGINE_TOL)."""


def test_sao_check_mismatch_reports_both_modes_on_the_tiny_config(tmp_path, capsys):
    rc = main(
        [
            "check",
            "configs/tiny_cpu.yaml",
            f"run.output_dir={tmp_path}",
            "rollout.num_engines=1",
            "rollout.engine_start_timeout_s=900",
            "--mismatch",
            "--episodes",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    (report_path,) = tmp_path.glob("*/mismatch_check.json")
    report = json.loads(report_path.read_text())
    assert report["episodes"] + report["failed"] == 4 and report["episodes"] >= 1
    # every position routed but each trajectory's last (never run through the engine)
    assert report["routed_positions"] == report["positions"] - report["episodes"]
    for mode in ("router", "replay"):
        m = report[mode]
        assert m["mismatch/abs_diff"] <= m["mismatch/abs_diff/max"] <= ENGINE_TOL, (mode, m)
        assert m["routing/agreement"] == 1.0, (mode, m)  # float32: the router agrees on every token
        assert m["routing/replayed"] == 1.0, (mode, m)
    assert "routing/agreement" in out and "replay (engine routes)" in out
