"""``swe``: the software-engineering agent environment (SWE-bench tasks, OpenHands-style tools).

One episode = one task (:class:`~sao_megatron.envs.swe.tasks.SWETask`): the repository is
materialised into a private workspace (a git repository at ``base_commit``), the model reads the
issue and works through three tools named and shaped as in the OpenHands CodeAct scaffold:

==========================  ========================================================================
``execute_bash``            ``command`` (``timeout`` seconds optional): one command in the episode's
                            sandboxed shell (:class:`~sao_megatron.envs.shell.ShellSession`: the
                            workspace at ``/workspace``, no network, rlimits, its own uid); the
                            working directory and exported variables persist between calls
``str_replace_editor``      ``command`` = view / create / str_replace / insert / undo_edit, ``path``
                            and the command's arguments (:class:`~sao_megatron.envs.swe.editor.FileEditor`,
                            confined to the workspace)
``finish``                  ``message`` optional: the episode ends and is judged
==========================  ========================================================================

Calls use the run's tool format: ``json`` (the model's native ``<tool_call>{"name", "arguments"}``,
e.g. Qwen3) or ``tags`` (the tiny template: ``<tool>{"name": .., "arguments": {..}}</tool>``, and
``<answer>..</answer>`` for finish). An action without a call ends the episode like ``finish``;
a malformed one gets an ``ERROR:`` observation and the episode goes on. Several calls in one
action (parallel calls) run one after the other in the order written (the shell and the files are
shared state, so never concurrently), each answered by its own output; a malformed block gets its
``ERROR:`` output, calls beyond ``max_calls_per_turn`` an ``ERROR: call k not run`` output, and a
``finish`` among them ends the episode once the calls before it ran. Observations are clipped
to ``max_observation_chars``; after ``max_turns`` actions the episode ends (judged as it stands).

The reward (:func:`~sao_megatron.envs.swe.reward.compute_reward`) applies the hidden test patch and
runs FAIL_TO_PASS + PASS_TO_PASS inside the same sandbox; the details carry the episode's patch
(``git diff``), each test's outcome and the tool counts. The workspace is removed at
:meth:`SWEEnv.close` (the agent loop calls it after every episode, failed ones included).

Tasks (:class:`SWETaskSet`) come from a JSONL/Parquet file in the SWE-bench instance schema
(default: the 33 bundled tasks, ``tools/make_swe_tasks.py``); held-out tasks are every
``heldout_every``-th instance id in sorted order, so both splits are fixed by the file alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from sao_megatron.envs.base import Env, RewardResult, Sample, Split, StepResult, Task, check_split
from sao_megatron.envs.format import ToolFormat, Turn
from sao_megatron.envs.registry import register_env
from sao_megatron.envs.sandbox import run_blocking
from sao_megatron.envs.shell import ContainerSpec, ShellLimits, ShellSession
from sao_megatron.envs.swe.editor import COMMANDS, FileEditor
from sao_megatron.envs.swe.reward import MODES, Mode, compute_reward
from sao_megatron.envs.swe.tasks import DATA_PATH, SWETask, git, load_tasks, materialise
from sao_megatron.envs.tool_parse import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Answer,
    Malformed,
    NativeCall,
    Parallel,
    ToolCall,
    parse_action,
    parse_native_action,
    refused_call,
)

WORKDIR = ShellSession.WORKDIR


def tool_schemas(workdir: str = WORKDIR) -> list[dict]:
    """The three tools as OpenAI-style schemas; paths are described relative to ``workdir``."""
    return [
        {
            "type": "function",
            "function": {
                "name": "execute_bash",
                "description": (
                    "Run a bash command in the repository's sandboxed shell (no network). The working "
                    "directory and exported variables persist between calls; background processes do not. "
                    "Long output is clipped: filter it (grep, head, sed -n)."
                ),
                "parameters": {
                    "type": "object",
                    "required": ["command"],
                    "properties": {
                        "command": {"type": "string", "description": "The bash command to run."},
                        "timeout": {
                            "type": "number",
                            "description": "Seconds before the command is killed (optional).",
                        },
                    },
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "str_replace_editor",
                "description": (
                    "View, create and edit files. view: a file with line numbers (view_range [start, end], "
                    "end -1 for the last line) or a directory 2 levels deep; create: a new file; str_replace: "
                    "replace old_str, which must occur exactly once, by new_str; insert: new_str after line "
                    "insert_line; undo_edit: revert the last edit of path."
                ),
                "parameters": {
                    "type": "object",
                    "required": ["command", "path"],
                    "properties": {
                        "command": {"type": "string", "enum": list(COMMANDS)},
                        "path": {"type": "string", "description": f"Absolute path under {workdir}, or relative to it."},
                        "file_text": {"type": "string"},
                        "old_str": {"type": "string"},
                        "new_str": {"type": "string"},
                        "insert_line": {"type": "integer"},
                        "view_range": {"type": "array", "items": {"type": "integer"}},
                    },
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "finish",
                "description": "Say that the issue is resolved (or that you give up); the episode ends.",
                "parameters": {
                    "type": "object",
                    "required": [],
                    "properties": {
                        "message": {"type": "string", "description": "A short summary of the change."},
                    },
                },
            },
        },
    ]


TOOLS = tool_schemas()

INSTRUCTIONS = (
    "The repository is checked out at {workdir} (a git repository). Resolve the issue below by editing "
    "the source code. Do not modify the tests: hidden tests will check your change. Use the tools to "
    "explore, edit and run the code; call finish when you are done.\n\n<issue>\n{issue}</issue>\n"
)


class SWETaskSet(Task):
    """The prompts: one per task of ``path``; ``heldout`` is every ``heldout_every``-th id, sorted."""

    def __init__(self, path: str | Path = DATA_PATH, heldout_every: int = 4) -> None:
        if heldout_every < 2:
            raise ValueError(f"heldout_every must be >= 2 (every n-th task is held out), got {heldout_every}")
        tasks = sorted(load_tasks(path), key=lambda t: t.instance_id)
        self.path = Path(path)
        self.splits: dict[str, list[SWETask]] = {
            "train": [t for i, t in enumerate(tasks) if i % heldout_every != heldout_every - 1],
            "heldout": [t for i, t in enumerate(tasks) if i % heldout_every == heldout_every - 1],
        }
        for split, rows in self.splits.items():
            if not rows:
                raise ValueError(
                    f"{self.path}: split {split!r} is empty ({len(tasks)} tasks, "
                    f"heldout_every={heldout_every}); add tasks or change heldout_every"
                )

    def size(self, split: Split) -> int:
        return len(self.splits[check_split(split)])

    def get(self, split: Split, index: int) -> Sample:
        rows = self.splits[check_split(split)]
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        task = rows[index % len(rows)]
        question = INSTRUCTIONS.format(workdir=WORKDIR, issue=task.problem_statement)
        return Sample(prompt_id=f"swe:{task.instance_id}", question=question, answer="", meta={"task": task})


def _task_of(sample: Sample) -> SWETask:
    task = sample.meta.get("task")
    if not isinstance(task, SWETask):
        raise ValueError(
            f"sample {sample.prompt_id!r} carries no SWETask in meta['task']: build samples "
            "with SWETaskSet (rollout.env: swe, no data.train override)"
        )
    return task


@register_env("swe")
class SWEEnv(Env):
    """One repository task through ``execute_bash`` / ``str_replace_editor`` / ``finish``.

    Args:
        max_turns: actions before the episode ends and is judged as it stands.
        max_observation_chars: clip of every tool observation.
        command_timeout_s: default (and largest) time limit of one ``execute_bash`` call.
        test_timeout_s: time limit of the hidden tests at the end.
        reward_mode: ``all`` (SWE-bench resolved), ``fail_to_pass_fraction`` or ``all_tests_fraction``.
        workspace_root: where workspaces are created (default: the system temp dir); use a
            node-local disk on clusters.
        memory_mb / processes: per-command limits of the shell (and the tests).
        require_isolation: refuse to run tools unless namespaces and the uid drop are available.
        container: run every command (and the hidden tests) in the task's container image
            instead of the namespace sandbox: ``{image, runtime, workdir, executable, network,
            env}`` of :class:`~sao_megatron.envs.shell.ContainerSpec`; ``{instance_id}`` in
            ``image`` is the task's id (SWE-bench images: ``docker://swebench/sweb.eval.x86_64.
            {instance_id}:latest``, workdir ``/testbed``, ``env: {PATH: <the testbed env's bin>:...}``).
    """

    task_class = SWETaskSet

    def __init__(
        self,
        max_turns: int = 30,
        max_observation_chars: int = 8000,
        command_timeout_s: float = 30.0,
        test_timeout_s: float = 120.0,
        reward_mode: Mode = "all",
        workspace_root: str = "",
        memory_mb: int = 2048,
        processes: int = 64,
        require_isolation: bool = False,
        container: dict | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if reward_mode not in MODES:
            raise ValueError(f"unknown reward_mode {reward_mode!r}; use one of {', '.join(MODES)}")
        if command_timeout_s <= 0 or test_timeout_s <= 0:
            raise ValueError("command_timeout_s and test_timeout_s must be > 0 (seconds)")
        self.max_turns = max_turns
        self.max_observation_chars = max_observation_chars
        self.command_timeout_s = command_timeout_s
        self.test_timeout_s = test_timeout_s
        self.reward_mode: Mode = reward_mode
        self.workspace_root = workspace_root
        self.limits = ShellLimits(
            wall_s=command_timeout_s,
            memory_bytes=memory_mb << 20,
            processes=processes,
            expose_paths=(sys.prefix,),
            require_isolation=require_isolation,
        )
        self.container = dict(container or {})
        if self.container:  # checked now: a bad spec fails at construction, naming the key
            self._container_for("check")
        self.workdir = str(self.container.get("workdir", "/testbed")) if self.container else WORKDIR
        self.tool_format: ToolFormat = "tags"
        self.task: SWETask | None = None
        self.scratch: Path | None = None  # holds the workspace; removed at close()
        self.workspace: Path | None = None
        self.shell: ShellSession | None = None
        self.editor: FileEditor | None = None
        self.turns = 0
        self.counts = {"execute_bash": 0, "str_replace_editor": 0, "malformed": 0, "timeouts": 0}
        self.finished = False
        self.done = False

    # ---- the interface --------------------------------------------------------------------------
    @property
    def tools(self) -> list[dict]:
        return TOOLS if self.workdir == WORKDIR else tool_schemas(self.workdir)

    @property
    def system_prompt(self) -> str | None:
        if self.tool_format == "tags":
            return None
        return (
            "You are a software engineer working in a repository through tools. Call one tool per "
            "message; call finish when the issue is resolved."
        )

    def use_tool_format(self, tool_format: ToolFormat) -> None:
        super().use_tool_format(tool_format)
        self.tool_format = tool_format

    def reset(self, sample: Sample) -> str:
        """Materialise the task into a fresh workspace and open its shell and editor."""
        self.close()
        self.task = _task_of(sample)
        root = self.workspace_root or None
        if root is not None:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="sao_swe_", dir=root))
        self.workspace = materialise(self.task, self.scratch / "repo")
        spec = self._container_for(self.task.instance_id) if self.container else None
        self.shell = ShellSession(self.workspace, self.limits, container=spec)
        self.workdir = self.shell.workdir  # /workspace, the image's workdir, or the host path
        self.editor = FileEditor(self.workspace, max_chars=self.max_observation_chars)
        self.turns, self.finished, self.done = 0, False, False
        self.counts = dict.fromkeys(self.counts, 0)
        return INSTRUCTIONS.format(workdir=self.workdir, issue=self.task.problem_statement)

    def _container_for(self, instance_id: str) -> ContainerSpec:
        """``container`` (env_kwargs) as a spec; ``{instance_id}`` in ``image`` names the task's image."""
        spec = dict(self.container)
        unknown = sorted(set(spec) - {"image", "runtime", "workdir", "executable", "network", "env"})
        if unknown:
            raise ValueError(
                f"rollout.env_kwargs.container: unknown key(s) {unknown}; use image, runtime, "
                "workdir, executable, network, env"
            )
        try:
            spec["image"] = str(spec.get("image", "")).format(instance_id=instance_id)
            return ContainerSpec(**spec)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"rollout.env_kwargs.container: {err}") from None

    async def areset(self, sample: Sample) -> str:
        return await asyncio.to_thread(self.reset, sample)

    def step(self, action: str) -> StepResult:
        return run_blocking(self.astep(action))

    async def astep(self, action: str) -> StepResult:
        if self.shell is None or self.done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        self.turns += 1
        call = self.parse(action)
        if isinstance(call, Parallel):
            return await self._parallel(call)
        info: dict[str, Any] = {
            "turn": self.turns,
            "kind": "malformed" if isinstance(call, Malformed) else "finish" if isinstance(call, Answer) else call.name,
        }
        if isinstance(call, Answer) or (isinstance(call, NativeCall) and call.name == "finish"):
            self.finished = self.done = True
            return StepResult(None, True, info)
        if self.turns >= self.max_turns:
            self.done = True
            return StepResult(None, True, {**info, "truncated": True})
        if isinstance(call, Malformed):
            self.counts["malformed"] += 1
            return StepResult(f"ERROR: malformed tool call: {call.reason}", False, info)
        observation = await self.run_tool(call.name, call.arguments)
        return StepResult(observation, False, info)  # each tool clips its own output

    async def _parallel(self, action: Parallel[NativeCall]) -> StepResult:
        """Several calls of one action, in order (see the module docstring)."""
        calls = action.calls[: self.max_calls_per_turn]
        refused = len(action.calls) - len(calls)
        info: dict[str, Any] = {"turn": self.turns, "kind": "parallel", "calls": len(action.calls)}
        stop = next((i for i, c in enumerate(calls) if isinstance(c, NativeCall) and c.name == "finish"), None)
        if stop is None and self.turns >= self.max_turns:
            self.done = True
            return StepResult(None, True, {**info, "truncated": True})
        outputs = []
        for call in calls[:stop]:
            if isinstance(call, Malformed):
                self.counts["malformed"] += 1
                outputs.append(f"ERROR: malformed tool call: {call.reason}")
            else:
                outputs.append(await self.run_tool(call.name, call.arguments))
        if stop is not None:
            self.finished = self.done = True
            return StepResult(None, True, info)
        outputs += [f"ERROR: {refused_call(i, self.max_calls_per_turn)}" for i in range(len(calls), len(action.calls))]
        return StepResult(tuple(outputs), False, info, refused_calls=refused)

    def reward(self) -> RewardResult:
        return run_blocking(self.areward())

    async def areward(self) -> RewardResult:
        if self.task is None or self.workspace is None or self.shell is None:
            raise RuntimeError("reward() called before reset()")
        judged = await asyncio.to_thread(
            compute_reward,
            self.workspace,
            self.task,
            mode=self.reward_mode,
            timeout_s=self.test_timeout_s,
            runner=self.shell.runner(),
            python="python",
        )
        result = judged.as_result()
        details = {
            **result.details,
            "instance_id": self.task.instance_id,
            "turns": self.turns,
            "finished": self.finished,
            **{f"tool_{k}": v for k, v in self.counts.items()},
        }
        return RewardResult(result.reward, result.correct, details)

    def close(self) -> None:
        """End the shell (every process of its uid) and remove the workspace."""
        if self.shell is not None:
            run_blocking(self.shell.close())
            self.shell = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    async def aclose(self) -> None:
        if self.shell is not None:
            await self.shell.close()
            self.shell = None
        await asyncio.to_thread(self.close)

    # ---- tools ----------------------------------------------------------------------------------
    def parse(self, action: str) -> NativeCall | Parallel[NativeCall] | Answer | Malformed:
        """The action as tool call(s), a finish (answer) or a malformed action; never raises."""
        if self.tool_format == "json":
            return parse_native_action(action, self.tools)
        parsed = parse_action(action)
        if isinstance(parsed, ToolCall):
            return self._tag_call(parsed)
        if isinstance(parsed, Parallel):
            return Parallel(tuple(c if isinstance(c, Malformed) else self._tag_call(c) for c in parsed.calls))
        return parsed

    def _tag_call(self, call: ToolCall) -> NativeCall | Malformed:
        """A ``<tool>{"name": .., "arguments": ..}</tool>`` body, validated as a native call."""
        native = parse_native_action(f"{TOOL_CALL_OPEN}{call.code}{TOOL_CALL_CLOSE}", self.tools)
        return native if isinstance(native, NativeCall | Malformed) else Malformed("not a single tool call")

    async def run_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """One validated call's observation; bad arguments are observations, never exceptions."""
        assert self.shell is not None and self.editor is not None
        if name == "execute_bash":
            command = arguments["command"]
            if not isinstance(command, str) or not command.strip():
                return "ERROR: command must be a non-empty string"
            timeout = arguments.get("timeout", self.command_timeout_s)
            if not isinstance(timeout, int | float) or timeout <= 0:
                return "ERROR: timeout must be a positive number of seconds"
            self.counts["execute_bash"] += 1
            result = await self.shell.run(command, min(float(timeout), self.command_timeout_s))
            self.counts["timeouts"] += result.status == "timeout"
            return result.observation(self.max_observation_chars)
        self.counts["str_replace_editor"] += 1
        args = {k: v for k, v in arguments.items() if k not in ("command", "path")}
        path = self._host_path(arguments["path"])
        observation = await asyncio.to_thread(self.editor, str(arguments["command"]), path, **args)
        if self.shell.uid is not None:  # a file or directory the editor created belongs to the shell's user
            await asyncio.to_thread(self._own, path, self.shell.uid)
        return observation

    def _own(self, path: str, uid: int) -> None:
        assert self.workspace is not None
        target = Path(path) if Path(path).is_absolute() else self.workspace / path
        if target.is_symlink() or not target.exists():
            return
        target = target.resolve()
        for node in (target, *target.parents):
            if node == self.workspace or self.workspace not in node.parents:
                break
            if node.stat().st_uid != uid:
                os.chown(node, uid, uid, follow_symlinks=False)

    def _host_path(self, path: Any) -> str:
        """``/workspace/...`` (what the shell shows) -> the workspace's host path; others unchanged
        (the editor refuses whatever lies outside the workspace)."""
        assert self.workspace is not None
        if isinstance(path, str) and (path == self.workdir or path.startswith(self.workdir + "/")):
            return str(self.workspace) + path[len(self.workdir) :]
        return path if isinstance(path, str) else ""

    # ---- scripted agents ------------------------------------------------------------------------
    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        """One tool call as the model would write it in the run's format."""
        payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        if self.tool_format == "tags":
            return f"<tool>{payload}</tool>"
        return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"

    def finish_text(self, message: str = "done") -> str:
        if self.tool_format == "tags":
            return f"{ANSWER_OPEN}{message}{ANSWER_CLOSE}"
        return self.call_text("finish", {"message": message})

    def demonstration(self, sample: Sample) -> list[Turn]:
        """The reference fix through the editor (one ``str_replace`` or ``create`` per file), then finish."""
        turns: list[Turn] = []
        self.reset(sample)
        try:
            for action in reference_actions(_task_of(sample), self):
                turns.append(("assistant", action))
                step = self.step(action)
                turns.extend(("tool", output) for output in step.outputs)
        finally:
            self.close()
        return turns


def reference_actions(task: SWETask, env: SWEEnv, via: str = "editor") -> list[str]:
    """Actions that apply ``task.patch``: per file a ``str_replace`` of its whole text (or a
    ``create``) with ``via="editor"``, or one ``git apply`` heredoc with ``via="bash"``; then finish."""
    if via == "bash":
        script = (
            f"cat > /tmp/fix.patch <<'SAO_EOF'\n{task.patch}SAO_EOF\ngit apply /tmp/fix.patch && git status --short"
        )
        return [env.call_text("execute_bash", {"command": script}), env.finish_text()]
    if via != "editor":
        raise ValueError(f"via must be 'editor' or 'bash', got {via!r}")
    with tempfile.TemporaryDirectory(prefix="sao_swe_ref_") as tmp:
        repo = materialise(task, Path(tmp) / "repo")
        applied = git(["apply", "-"], repo, input=task.patch)
        if applied.returncode != 0:
            raise RuntimeError(f"{task.instance_id}: reference patch does not apply: {applied.stderr.strip()}")
        changed = git(["status", "--porcelain", "-uall"], repo).stdout.splitlines()
        actions = []
        for line in changed:
            path = line[3:]
            after = (repo / path).read_text(encoding="utf-8") if (repo / path).exists() else None
            before = task.files.get(path)
            target = f"{env.workdir}/{path}"
            if before is None and after is not None:
                actions.append(
                    env.call_text("str_replace_editor", {"command": "create", "path": target, "file_text": after})
                )
            elif before is not None and after is None:
                actions.append(env.call_text("execute_bash", {"command": f"rm -- {shlex.quote(target)}"}))
            elif before:
                actions.append(
                    env.call_text(
                        "str_replace_editor",
                        {"command": "str_replace", "path": target, "old_str": before, "new_str": after},
                    )
                )
            elif before is not None:  # an empty file: nothing to replace, insert at the top
                actions.append(
                    env.call_text(
                        "str_replace_editor", {"command": "insert", "path": target, "insert_line": 0, "new_str": after}
                    )
                )
    return [*actions, env.finish_text()]
