"""math_python: tool-integrated math. The model writes Python in ``<tool>...</tool>``; the sandbox
(:mod:`sao_megatron.envs.sandbox`) runs it and its stdout (truncated) is the observation.
The final ``<answer>`` is graded by :func:`sao_megatron.envs.answer_check.answers_match`.

The bundled dataset ``data/math_python.jsonl`` has one JSON object per line:
``{"id", "question", "answer", "solution", "split"}`` where ``solution`` is Python code whose
stdout, given as the answer, is graded correct (the demonstration and the dataset test use it).
Any JSONL file with the same fields can replace it (``path=...``).
"""

from __future__ import annotations

import json
from pathlib import Path

from sao_megatron.envs.answer_check import answers_match
from sao_megatron.envs.base import SPLITS, Sample, Split, Task, check_split
from sao_megatron.envs.format import Turn
from sao_megatron.envs.registry import register_env
from sao_megatron.envs.sandbox import SandboxLimits, arun_python, run_python
from sao_megatron.envs.tool_env import ToolEnv

DATA_PATH = Path(__file__).with_name("data") / "math_python.jsonl"
_FIELDS = ("id", "question", "answer", "split")


class MathPythonTask(Task):
    """Problems from a JSONL file; each split is finite and ``get`` wraps around its size."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else DATA_PATH
        self._rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                missing = [k for k in _FIELDS if k not in row]
                if missing or row["split"] not in SPLITS:
                    raise ValueError(f"{self.path}:{lineno}: need fields {_FIELDS} with split in {SPLITS}")
                self._rows[row["split"]].append(row)
        for split, rows in self._rows.items():
            if not rows:
                raise ValueError(f"{self.path}: split {split!r} is empty; every split needs a problem")

    def size(self, split: Split) -> int:
        return len(self._rows[check_split(split)])

    def get(self, split: Split, index: int) -> Sample:
        rows = self._rows[check_split(split)]
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        row = rows[index % len(rows)]
        meta = {"solution": row.get("solution", ""), "source": str(self.path.name)}
        return Sample(
            prompt_id=f"math_python:{row['id']}",
            question=row["question"],
            answer=str(row["answer"]),
            meta=meta,
        )


@register_env("math_python")
class MathPythonEnv(ToolEnv):
    """Python tool in the sandbox + graded answer. Reward 1.0 iff the answer matches.

    Args:
        max_turns: actions per episode before truncation.
        format_penalty: subtracted from the reward when any action was malformed.
        max_observation_chars: observation text cap (stdout head + error line).
        limits: sandbox limits per tool call (default: 5 s wall, 512 MiB, 64 KiB output).
        concurrent_calls: run the calls of one action (parallel calls) at once, each in its own
            sandbox, instead of one after the other.
    """

    task_class = MathPythonTask
    tool_name = "python"
    tool_description = (
        "Run Python 3 code (standard library only) in a sandbox and return its stdout; print the values you need."
    )
    tool_argument = "code"
    tool_argument_description = "The Python code to run."
    calls_independent = True  # every call is a fresh sandbox

    def __init__(
        self,
        max_turns: int = 8,
        format_penalty: float = 0.0,
        max_observation_chars: int = 1024,
        limits: SandboxLimits | None = None,
        concurrent_calls: bool = False,
    ) -> None:
        super().__init__(max_turns, format_penalty, max_observation_chars, concurrent_calls)
        self.limits = limits or SandboxLimits()

    def run_tool(self, code: str) -> str:
        return run_python(code, self.limits).observation(self.max_observation_chars)

    async def arun_tool(self, code: str) -> str:
        return (await arun_python(code, self.limits)).observation(self.max_observation_chars)

    def check(self, answer: str, sample: Sample) -> bool:
        return answers_match(answer, sample.answer)

    def demonstration(self, sample: Sample) -> list[Turn]:
        """Run the reference solution in the sandbox and answer with the ground truth."""
        code = str(sample.meta.get("solution", ""))
        if not code:
            return [("assistant", self.answer_text(sample.answer))]
        return [
            ("assistant", self.call_text(code)),
            ("tool", self.run_tool(code)),
            ("assistant", self.answer_text(sample.answer)),
        ]
