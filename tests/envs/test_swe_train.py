"""``sao train`` on the ``swe`` environment end to end: the tiny model, a real CPU SGLang engine,
real Megatron workers, the environments on two env workers, every tool call in the sandbox.

The tiny model cannot fix a bug (rewards ~0); the test checks the plumbing: multi-turn
trajectories whose tool observations are outside the action spans (no loss on them), the run
completing its steps and evaluations, and every workspace removed.
"""

from __future__ import annotations

import re

import pytest

from sao_megatron.cli import main
from sao_megatron.observe import read_metrics

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]


def test_sao_train_on_swe_with_env_workers(tmp_path):
    workspaces = tmp_path / "workspaces"
    out = tmp_path / "out"
    rc = main(
        [
            "train",
            "rollout.env=swe",
            f"rollout.env_kwargs={{max_turns: 3, max_observation_chars: 160, command_timeout_s: 10, "
            f"test_timeout_s: 60, workspace_root: {workspaces}}}",
            "rollout.env_workers=2",
            "rollout.env_worker_episodes=2",
            "rollout.env_worker_cpus=0.1",
            "model.num_layers=2",
            "algo.batch_size=4",
            "algo.critic_warmup_steps=0",
            "rollout.max_concurrent=4",
            "rollout.loop.max_turns=3",
            "rollout.loop.max_new_tokens=24",
            "rollout.loop.max_response_tokens=512",
            "rollout.loop.max_context_tokens=1000",
            "train.sft_steps=0",
            "train.value_pretrain_steps=0",
            "train.steps=2",
            "train.eval_prompts=2",
            "train.sample_trajectories=4",
            f"run.output_dir={out}",
        ]
    )
    assert rc == 0
    (run_dir,) = [p.parent for p in out.rglob("metrics.jsonl")]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if r["stage"] == "rl"] == [1, 2]
    assert sum(r["stage"] == "eval" for r in records) == 2  # before and after RL
    text = (run_dir / "trajectories.txt").read_text()
    headers = re.findall(r"# prompt (swe:\S+) status=(\w+) .*? turns=(\d+)", text)
    assert headers and all(status != "failed" for _, status, _ in headers), headers
    assert any(int(turns) >= 2 for *_, turns in headers), headers  # multi-turn episodes
    # observations (the tool's replies) sit between action spans, never inside one
    outside = re.sub(r"\[\[A v=[\d,]*\]\].*?\[\[/A\]\]", "", text, flags=re.S)
    assert "ERROR" in outside or "exit code" in outside, text[:2000]
    actions = "".join(re.findall(r"\[\[A v=[\d,]*\]\](.*?)\[\[/A\]\]", text, flags=re.S))
    assert "ERROR: malformed tool call" not in actions
    assert workspaces.is_dir() and not any(workspaces.iterdir()), list(workspaces.iterdir())
