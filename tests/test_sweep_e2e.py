"""A 2-step miniature of a sweep and its comparison with the real trainer (``sao train``: Ray,
Megatron workers, a CPU SGLang engine): one shared SFT + value-pretraining start, a GRPO + DIS arm
that continues from it, then ``sao compare``. One arm, to keep CI under 40 minutes (SAO through the
real trainer: tests/test_pipeline.py and others; several arms sharing one start, and a failed start
failing only its seed's arms: tests/test_sweep.py with a stand-in trainer)."""

from __future__ import annotations

import json
import textwrap

import pytest

from sao_megatron.cli import main
from sao_megatron.observe import read_metrics

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def test_a_miniature_sweep_shares_its_start_and_compares(tmp_path, capsys):
    out = tmp_path / "sweep"
    path = tmp_path / "mini.yaml"
    path.write_text(
        textwrap.dedent(f"""
        config: configs/tiny_cpu.yaml
        overrides: [model.num_layers=2, algo.batch_size=4, rollout.max_concurrent=8, rollout.loop.max_turns=2,
                    "rollout.env_kwargs={{max_turns: 2}}", rollout.loop.max_new_tokens=16, train.steps=2,
                    train.eval_every=2, train.eval_prompts=4, train.eval_samples=1, train.sample_trajectories=0]
        seeds: [7]
        out_dir: {out}
        metric: [eval/accuracy, eval/mean_accuracy@1]
        shared_start: [train.sft_steps=3, train.sft_batch_size=8, train.value_pretrain_steps=1]
        arms:
          grpo_dis: [algo.advantage=grpo, algo.group_size=2, algo.policy_loss=dis, algo.critic_warmup_steps=0]
    """)
    )
    assert main(["sweep", str(path)]) == 0
    table = "\n".join(line for line in capsys.readouterr().out.splitlines() if line.startswith("|"))
    start = read_metrics(out / "_start" / "seed7")
    assert [r["stage"] for r in start if r["stage"] != "value_pretrain"] == ["sft", "eval"]  # no RL step
    initial = next(r for r in start if r["stage"] == "eval")
    for arm in ("grpo_dis",):
        run = out / arm / "seed7"
        assert json.loads((run / "done.json").read_text())["exit"] == 0
        assert "resuming from the complete checkpoint" in (run / "sweep.log").read_text()
        rows = read_metrics(run)
        assert rows[: len(start)] == start  # the shared start's SFT, value pretraining and evaluation
        rl = [r for r in rows[len(start) :] if r["stage"] == "rl"]
        assert [r["step"] for r in rl] == [1, 2] and rl[-1]["policy_version"] == 2
        assert "time/eval_s" in rl[-1] and "eval/mean_accuracy@1" in rl[-1]
        assert "critic/loss" not in rl[0] and "dis/tokens/lag0" in rl[0]  # the arm: GRPO + DIS
        state = json.loads((run / "checkpoint" / "state.json").read_text())
        assert state["initial_eval"] == {k: v for k, v in initial.items() if k.startswith("eval/")}
        assert state["step"] == 2 and state["final_eval"] is not None
    assert "| eval/accuracy | grpo_dis | 1 |" in table and "| eval/accuracy gain | grpo_dis | 1 |" in table
    assert "| eval/mean_accuracy@1 | grpo_dis | 1 |" in table
    metric_rows = [line for line in table.splitlines() if line.startswith("| eval/")]
    assert all(line.split("|")[2].strip() != "_start" for line in metric_rows)  # the start is no arm
    assert "| _start | 1 of 1 |" in table  # its provenance is printed, as each arm's
    assert (out / "compare_mini" / "eval_accuracy.png").stat().st_size > 0

    assert main(["compare", str(out), "--metric", "rollout/reward", "--out", str(tmp_path / "cmp")]) == 0
    assert "| rollout/reward | grpo_dis | 1 |" in capsys.readouterr().out
