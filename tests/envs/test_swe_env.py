"""The ``swe`` environment driven by scripted agents (no model) through its OpenHands-style tools.

Acceptance of the SWE environment: replaying each shipped task's reference patch through the
tools earns reward 1, doing nothing earns 0, breaking a PASS_TO_PASS test earns 0; hostile tool
calls are contained while 8 episodes run at once and their rewards stay right.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sao_megatron.envs.registry import make_env, make_task
from sao_megatron.envs.swe.env import SWEEnv, SWETaskSet, reference_actions
from sao_megatron.envs.swe.tasks import load_tasks
from sao_megatron.envs.tool_parse import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from tests.envs.test_swe_tasks import SPECS, gen

TASKS = sorted(load_tasks(), key=lambda t: t.instance_id)
pytestmark = pytest.mark.timeout(600)


def sample_of(instance_id: str):
    task_set = SWETaskSet()
    for split in ("train", "heldout"):
        for i in range(task_set.size(split)):
            sample = task_set.get(split, i)
            if sample.prompt_id == f"swe:{instance_id}":
                return sample
    raise KeyError(instance_id)


async def episode(actions, instance_id: str, tool_format: str = "tags", **kwargs):
    """Run scripted ``actions`` (a list, or a callable env -> list) on one task; the reward and
    the observations. The workspace is checked to be gone after close."""
    env = SWEEnv(**kwargs)
    env.use_tool_format(tool_format)  # type: ignore[arg-type]
    sample = sample_of(instance_id)
    await env.areset(sample)
    workspace = env.workspace
    observations: list[str | None] = []
    try:
        for action in actions(env) if callable(actions) else actions:
            step = await env.astep(action)
            observations.append(step.observation)
            if step.done:
                break
        result = await env.areward()
    finally:
        await env.aclose()
    assert workspace is not None and not workspace.exists(), "workspace left behind"
    return result, observations


def breaking(env: SWEEnv, instance_id: str) -> list[str]:
    patch = gen.breaking_patch(SPECS[instance_id])
    script = f"cat > /tmp/break.patch <<'SAO_EOF'\n{patch}SAO_EOF\ngit apply /tmp/break.patch"
    return [env.call_text("execute_bash", {"command": script}), env.finish_text()]


def test_registered_task_set_splits_and_tools():
    task = make_task("swe")
    assert isinstance(task, SWETaskSet)
    train, heldout = task.size("train"), task.size("heldout")
    assert train + heldout == len(TASKS) and heldout == len(TASKS) // 4
    ids = {task.get(s, i).prompt_id for s in ("train", "heldout") for i in range(task.size(s))}
    assert len(ids) == len(TASKS)
    env = make_env("swe")
    assert [t["function"]["name"] for t in env.tools] == ["execute_bash", "str_replace_editor", "finish"]
    sample = task.get("train", 0)
    assert "/workspace" in sample.question and sample.meta["task"].problem_statement in sample.question


@pytest.mark.parametrize("task", TASKS, ids=[t.instance_id for t in TASKS])
def test_reference_fix_nothing_and_broken_pass_to_pass(task):
    async def go():
        return await asyncio.gather(
            episode(lambda env: reference_actions(task, env), task.instance_id),
            episode(lambda env: [env.finish_text()], task.instance_id),
            episode(lambda env: breaking(env, task.instance_id), task.instance_id),
        )

    (fixed, obs), (nothing, _), (broken, _) = asyncio.run(go())
    assert (fixed.reward, fixed.correct, fixed.details["reason"]) == (1.0, True, "resolved"), (
        fixed.details,
        obs,
    )
    assert fixed.details["patch"] and fixed.details["finished"] and fixed.details["tool_str_replace_editor"] >= 1
    assert all(o is None or not o.startswith("ERROR") for o in obs), obs
    assert (nothing.reward, nothing.correct, nothing.details["patch"]) == (0.0, False, "")
    assert broken.reward == 0.0 and broken.correct is False
    outcomes = broken.details["outcomes"]
    assert any(outcomes[t] != "passed" for t in task.pass_to_pass), outcomes


def test_native_json_format_and_bash_replay():
    task = TASKS[0]
    result, obs = asyncio.run(
        episode(lambda env: reference_actions(task, env, via="bash"), task.instance_id, tool_format="json")
    )
    assert result.reward == 1.0, (result.details, obs)
    assert result.details["tool_execute_bash"] == 1 and "[Command finished with exit code 0]" in (obs[0] or "")


def test_malformed_calls_turn_limit_and_path_mapping():
    task = TASKS[0]

    def actions(env: SWEEnv) -> list[str]:
        return [
            "I will look around first",  # tags: neither <tool> nor <answer>
            "<tool>not json</tool>",
            env.call_text("nonexistent_tool", {}),
            env.call_text("str_replace_editor", {"command": "view", "path": "/workspace"}),
            env.call_text("str_replace_editor", {"command": "view", "path": "/etc/passwd"}),
            env.call_text("execute_bash", {"command": "pwd", "timeout": -1}),
        ]

    result, obs = asyncio.run(episode(actions, task.instance_id, max_turns=6))
    assert [o.split(":")[0] if o else o for o in obs[:3]] == ["ERROR"] * 3, obs
    assert "Files and directories" in (obs[3] or "") and "tests/" in (obs[3] or ""), obs[3]
    assert "outside the workspace" in (obs[4] or ""), obs[4]
    assert obs[5] is None  # the sixth action hit max_turns: the episode ended, judged as it stands
    assert result.details["tool_malformed"] == 3 and result.details["finished"] is False
    assert result.reward == 0.0


def test_parallel_calls_run_in_order_with_per_call_errors_and_finish():
    """Native parallel calls: one output per call in call order, the second call seeing the first
    one's file (shared state, so they run one after the other); a malformed block answered in its
    place; the call past max_calls_per_turn refused; a finish after a call ends the episode once
    that call ran."""
    task = TASKS[0]

    def bash(command: str) -> str:
        return f"{TOOL_CALL_OPEN}{json.dumps({'name': 'execute_bash', 'arguments': {'command': command}})}{TOOL_CALL_CLOSE}"

    async def go():
        env = SWEEnv()
        env.use_tool_format("json")
        env.limit_calls_per_turn(3)
        await env.areset(sample_of(task.instance_id))
        try:
            first = await env.astep(
                "\n".join(
                    [
                        bash("echo one > order.txt"),
                        bash("cat order.txt"),
                        f"{TOOL_CALL_OPEN}x{TOOL_CALL_CLOSE}",
                        bash("echo four"),
                    ]
                )
            )
            view = env.call_text("str_replace_editor", {"command": "view", "path": "/workspace/order.txt"})
            last = await env.astep(view + "\n" + env.finish_text())
            return first, last, await env.areward(), env.workspace
        finally:
            await env.aclose()

    first, last, result, workspace = asyncio.run(go())
    outputs = first.outputs
    assert len(outputs) == 4 and first.refused_calls == 1 and first.info["kind"] == "parallel"
    assert outputs[0].endswith("[Command finished with exit code 0]")
    assert outputs[1].startswith("one\n"), outputs[1]
    assert outputs[2].startswith("ERROR: malformed tool call: tool call is not valid JSON")
    assert outputs[3] == "ERROR: call 4 not run: at most 3 tool calls per turn"
    assert last.done and last.observation is None
    assert result.details["finished"] is True and result.details["tool_execute_bash"] == 2
    assert result.details["tool_str_replace_editor"] == 1 and result.details["tool_malformed"] == 1
    assert workspace is not None and not workspace.exists()


HOSTILE = {
    "escape": "cat /root/.bashrc; ls /work/main; touch /etc/sao_pwned; echo x > ../outside; ls /",
    "fork_bomb": ":(){ :|:& };:",
    "network": "python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"",
    "huge_output": "yes sao",
    "never_ends": "sleep 1000",
    "background": "(sleep 1000 &) ; nohup sleep 999 > /dev/null 2>&1 & echo started",
    "delete_repo": "rm -rf /workspace/* /workspace/.git; ls -a /workspace",
}


def test_hostile_calls_are_contained_while_8_episodes_run():
    """Eight concurrent episodes: seven each make one hostile call then apply the reference fix
    (reward 1 whatever the call did, except deleting the repository: 0 with the reason); the
    eighth is a plain reference replay. Nothing leaks to the host."""
    tasks = TASKS[:8]
    names = [*HOSTILE, "plain"]

    def actions_for(kind: str, task):
        def actions(env: SWEEnv) -> list[str]:
            hostile = [] if kind == "plain" else [env.call_text("execute_bash", {"command": HOSTILE[kind]})]
            return [*hostile, *reference_actions(task, env)]

        return actions

    async def go():
        return await asyncio.gather(
            *(
                episode(actions_for(kind, task), task.instance_id, command_timeout_s=5.0)
                for kind, task in zip(names, tasks, strict=True)
            )
        )

    results = dict(zip(names, asyncio.run(go()), strict=True))
    assert not Path("/etc/sao_pwned").exists()
    for kind, (result, obs) in results.items():
        if kind == "delete_repo":
            assert result.reward == 0.0 and "no episode patch" in result.details["reason"], result.details
            continue
        assert result.reward == 1.0, (kind, result.details, obs)
    first = {kind: results[kind][1][0] or "" for kind in HOSTILE}
    assert "timed out" in first["never_ends"].lower(), first["never_ends"]
    assert "output" in first["huge_output"].lower() and len(first["huge_output"]) <= 9000, first["huge_output"][-300:]
    assert "exit code 0" not in first["network"], first["network"]
    assert "started" in first["background"]
    assert "root/.bashrc" in first["escape"] or "No such file" in first["escape"], first["escape"]
    leftovers = [p for p in _sleepers()]
    assert not leftovers, f"sandboxed processes survived their call: {leftovers}"


def _sleepers() -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cmd.startswith("sleep 1000") or cmd.startswith("sleep 999"):
            out.append(f"{proc.name}: {cmd}")
    return out


def test_config_points_at_the_real_environment():
    from sao_megatron.config import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "qwen3_30b_a3b_swe.yaml"), [])
    env = make_env(cfg.rollout.env, **cfg.rollout.env_kwargs)
    assert isinstance(env, SWEEnv)
    assert json.dumps(env.tools)  # schemas serialise for the chat template
