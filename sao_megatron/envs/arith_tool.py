"""arith_tool: a synthetic calculator task a tiny model can learn on CPU.

Question ``What is 37*12+5?``; the intended trajectory is::

    <tool>37*12+5</tool><|end|>  ->  observation 449  ->  <answer>449</answer><|end|>

Prompts are unlimited: ``(seed, split, index)`` seeds a generator (``random.Random`` seeded by a
string, so identical on every machine and Python run). The split is decided by a SHA-256 of the
expression text (``heldout_fraction`` of all expressions are held out), and each split rejects
the other's expressions, so train and heldout never share a question. The calculator is the
exact AST evaluator of :mod:`sao_megatron.envs.safe_eval` (no sandbox needed).
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import random

from sao_megatron.envs.base import RewardResult, Sample, Split, Task, check_split
from sao_megatron.envs.format import Turn
from sao_megatron.envs.registry import register_env
from sao_megatron.envs.safe_eval import calculator, evaluate, format_number
from sao_megatron.envs.tool_env import ToolEnv


def in_heldout(expression: str, heldout_fraction: float) -> bool:
    """Content-based split: the same expression always lands in the same split."""
    digest = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big")
    return digest % 1_000_000 < heldout_fraction * 1_000_000


def operations(expression: str) -> int:
    """Binary operations in ``expression`` (0 when it does not parse: the calculator says why)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return 0
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))


def one_operation_steps(expression: str) -> list[tuple[str, str]]:
    """``expression`` as the calculator calls of one operation each that compute it, in evaluation
    order: ``37*12+5`` -> ``[("37*12", "444"), ("444+5", "449")]`` (a negative operand in parentheses)."""
    steps: list[tuple[str, str]] = []
    symbols = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}

    def operand(value: str) -> str:
        return f"({value})" if value.startswith("-") else value

    def walk(node: ast.AST) -> str:
        if isinstance(node, ast.BinOp) and type(node.op) in symbols:
            call = f"{operand(walk(node.left))}{symbols[type(node.op)]}{operand(walk(node.right))}"
            steps.append((call, calculator(call)))
            return steps[-1][1]
        return format_number(evaluate(ast.unparse(node)))

    walk(ast.parse(expression, mode="eval").body)
    return steps


class ArithTask(Task):
    """Seeded arithmetic prompts with difficulty knobs.

    Args:
        min_operands / max_operands: operand count range (inclusive), >= 2.
        min_digits / max_digits: digit count range of each operand (inclusive), >= 1.
        ops: operator characters to draw from (subset of ``+-*``).
        seed: generator seed; different seeds give different (equally disjoint) streams.
        heldout_fraction: share of expressions reserved for ``heldout``, in (0, 1).
        train_size: 0 (default): every training index is a new problem; ``n > 0``: the training
            split is a pool of ``n`` problems, index ``i`` is problem ``i % n`` (prompts repeat every
            ``n`` indices, as in a small dataset: per-prompt baselines, memorisation). ``heldout``
            is unchanged.
        levels: a mixture of difficulties instead of one range: each prompt draws one level
            uniformly, a dict of any of ``min_operands``, ``max_operands``, ``min_digits``,
            ``max_digits`` (the rest from the arguments above), e.g. ``[{max_operands: 2,
            max_digits: 1}, {min_operands: 4, max_operands: 4, min_digits: 3, max_digits: 3}]``:
            one-digit pairs a tiny model can answer at once beside expressions it cannot do without
            the calculator (the heterogeneous testbed, configs/experiments/hetero.yaml).
    """

    def __init__(
        self,
        min_operands: int = 2,
        max_operands: int = 3,
        min_digits: int = 1,
        max_digits: int = 2,
        ops: str = "+-*",
        seed: int = 0,
        heldout_fraction: float = 0.2,
        train_size: int = 0,
        levels: list[dict] | None = None,
    ) -> None:
        base = {
            "min_operands": min_operands,
            "max_operands": max_operands,
            "min_digits": min_digits,
            "max_digits": max_digits,
        }
        self.levels = [self._level(i, base, level) for i, level in enumerate(levels)] if levels else [base]
        if not 2 <= min_operands <= max_operands:
            raise ValueError(f"need 2 <= min_operands <= max_operands, got {min_operands}, {max_operands}")
        if not 1 <= min_digits <= max_digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 9, got {min_digits}, {max_digits}")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {ops!r}")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        self.min_operands, self.max_operands = min_operands, max_operands
        self.min_digits, self.max_digits = min_digits, max_digits
        if train_size < 0:
            raise ValueError(f"train_size must be >= 0 (0: unlimited), got {train_size}")
        self.ops, self.seed, self.heldout_fraction = ops, seed, heldout_fraction
        self.train_size = train_size

    @staticmethod
    def _level(i: int, base: dict, level: dict) -> dict:
        where = f"rollout.task_kwargs.levels[{i}]"
        if not isinstance(level, dict) or set(level) - set(base):
            raise ValueError(f"{where} must be a mapping of keys among {sorted(base)}; got {level!r}")
        out = base | level
        if not all(isinstance(v, int) for v in out.values()):
            raise ValueError(f"{where}: operand and digit counts are integers; got {level!r}")
        if not 2 <= out["min_operands"] <= out["max_operands"]:
            raise ValueError(f"{where}: need 2 <= min_operands <= max_operands, got {out}")
        if not 1 <= out["min_digits"] <= out["max_digits"] <= 9:
            raise ValueError(f"{where}: need 1 <= min_digits <= max_digits <= 9, got {out}")
        return out

    def size(self, split: Split) -> int | None:
        return self.train_size if check_split(split) == "train" and self.train_size else None

    def _expression(self, rng: random.Random) -> str:
        level = self.levels[rng.randrange(len(self.levels))] if len(self.levels) > 1 else self.levels[0]
        n = rng.randint(level["min_operands"], level["max_operands"])
        parts = []
        for i in range(n):
            digits = rng.randint(level["min_digits"], level["max_digits"])
            lo = 0 if digits == 1 else 10 ** (digits - 1)
            parts.append(str(rng.randint(lo, 10**digits - 1)))
            if i < n - 1:
                parts.append(rng.choice(self.ops))
        return "".join(parts)

    def get(self, split: Split, index: int) -> Sample:
        split = check_split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        cursor = index  # the position in the stream (reward phases), before a pool wraps it
        if split == "train" and self.train_size:
            index %= self.train_size
        rng = random.Random(f"arith_tool:{self.seed}:{split}:{index}")
        want_heldout = split == "heldout"
        while True:
            expr = self._expression(rng)
            if in_heldout(expr, self.heldout_fraction) == want_heldout:
                break
        answer = format_number(evaluate(expr))
        return Sample(
            prompt_id=f"arith_tool:{self.seed}:{split}:{index}",
            question=f"What is {expr}?",
            answer=answer,
            meta={"expression": expr, "index": cursor},
        )


@register_env("arith_tool")
class ArithToolEnv(ToolEnv):
    """Calculator tool + answer; reward 1.0 iff the answer equals the exact value.

    The answer must be the integer (``449``; ``+449``/`` 449 `` are accepted, ``449.0`` is not).
    Using the tool is not required for the reward; the demonstrations use it, except a
    ``demo_tool_free`` share of them (chosen by the prompt, the same on every machine), which answer
    at once, without the calculator (with a ``train_size`` pool, drawn anew each time a prompt comes
    round again): still correct, so supervised learning cannot tell them apart,
    but a tiny model cannot do the arithmetic itself, and imitating them costs accuracy that only
    a reward shows (the RL-headroom testbed, configs/experiments/headroom_*.yaml).

    ``reward_phases`` makes the rewarded *behaviour* change during training (online adaptation,
    configs/experiments/adaptation.yaml): ``tool`` rewards a correct answer reached with at least one
    calculator call, ``direct`` one given without any, ``any`` every correct answer (the default).
    Phase ``i`` holds for the training prompts from ``phase_boundaries[i-1]`` (a prompt index of the
    RL cursor) to ``phase_boundaries[i]``; held-out prompts are graded by the last phase. A boundary
    is a prompt index, not a step: uncapped engines run ahead of the learner (the lag bound drops
    the surplus), so set ``algo.max_batches_ahead`` for a switch at a known step.
    ``correct`` stays the arithmetic's truth whatever the phase (held-out accuracy).

    ``calculator_ops`` (0: any) caps the operations one calculator call may hold; a call with more
    is answered ``error: at most N operation(s) per call``. Demonstrations then make one call per
    operation, in evaluation order (``37*12`` -> 444, ``444+5`` -> 449, then the answer), so a
    4-operand problem takes four actions: episodes long enough for a turn limit to cut
    (``algo.truncated``, configs/experiments/truncation.yaml).
    """

    PHASES = ("any", "tool", "direct")

    task_class = ArithTask
    tool_name = "calculator"
    tool_description = "Evaluate an arithmetic expression of integers with + - * and parentheses exactly."
    tool_argument = "expression"
    tool_argument_description = "The expression, e.g. 37*12+5."
    calls_independent = True  # a pure function of the expression

    def __init__(
        self,
        max_turns: int = 3,
        format_penalty: float = 0.0,
        max_observation_chars: int = 64,
        concurrent_calls: bool = False,
        demo_tool_free: float = 0.0,
        reward_phases: list[str] | None = None,
        phase_boundaries: list[int] | None = None,
        calculator_ops: int = 0,
    ) -> None:
        super().__init__(max_turns, format_penalty, max_observation_chars, concurrent_calls)
        if not isinstance(calculator_ops, int) or isinstance(calculator_ops, bool) or calculator_ops < 0:
            raise ValueError(
                f"rollout.env_kwargs.calculator_ops is the most operations one calculator call may hold "
                f"(0: any), an integer >= 0; got {calculator_ops!r}"
            )
        self.calculator_ops = calculator_ops
        self.reward_phases = list(reward_phases or ["any"])
        self.phase_boundaries = list(phase_boundaries or [])
        bad = [p for p in self.reward_phases if p not in self.PHASES]
        if bad:
            raise ValueError(f"rollout.env_kwargs.reward_phases: {bad} not among {list(self.PHASES)}")
        bounds = self.phase_boundaries
        if len(bounds) != len(self.reward_phases) - 1 or any(not isinstance(b, int) for b in bounds):
            raise ValueError(
                f"rollout.env_kwargs.phase_boundaries={bounds}: give one prompt index (an integer) per switch, "
                f"{len(self.reward_phases) - 1} for reward_phases={self.reward_phases}"
            )
        if bounds != sorted(set(bounds)) or (bounds and bounds[0] <= 0):
            raise ValueError(f"rollout.env_kwargs.phase_boundaries={bounds} must rise strictly from above 0")
        if not 0.0 <= demo_tool_free <= 1.0:
            raise ValueError(
                f"rollout.env_kwargs.demo_tool_free is a share of demonstrations, in [0, 1]; got {demo_tool_free}"
            )
        self.demo_tool_free = demo_tool_free

    def run_tool(self, code: str) -> str:
        if self.calculator_ops and operations(code) > self.calculator_ops:
            return f"error: at most {self.calculator_ops} operation(s) per call"
        return calculator(code.strip())

    def phase(self, sample: Sample) -> str:
        """The rewarded behaviour for ``sample`` (its training prompt index against the boundaries)."""
        index = sample.meta.get("index")
        if ":train:" not in sample.prompt_id or not isinstance(index, int):
            return self.reward_phases[-1]
        return self.reward_phases[bisect.bisect_right(self.phase_boundaries, index)]

    def reward(self) -> RewardResult:
        result = super().reward()
        if self.sample is None or self.reward_phases == ["any"]:
            return result
        phase = self.phase(self.sample)
        behaved = phase == "any" or (self.tool_calls > 0) == (phase == "tool")
        reward = (1.0 if result.correct and behaved else 0.0) - (self.format_penalty if self.malformed else 0.0)
        return RewardResult(reward, result.correct, {**result.details, "phase": phase})

    def check(self, answer: str, sample: Sample) -> bool:
        text = answer.strip().lstrip("+")
        return text == sample.answer

    @staticmethod
    def _demo_key(sample: Sample) -> str:
        """The prompt's own key; a pool prompt that comes round again (``train_size``: its cursor
        index is past the pool's) draws anew, so SFT sees both behaviours on the same problem."""
        index = sample.meta.get("index")
        if isinstance(index, int) and not sample.prompt_id.endswith(f":{index}"):
            return f"demo_tool_free:{sample.prompt_id}@{index}"
        return f"demo_tool_free:{sample.prompt_id}"

    def demonstration(self, sample: Sample) -> list[Turn]:
        expr = str(sample.meta["expression"])
        if random.Random(self._demo_key(sample)).random() < self.demo_tool_free:
            return [("assistant", self.answer_text(sample.answer))]
        if not self.calculator_ops:
            steps = [(expr, calculator(expr))]
        else:  # a call per operation, whatever the limit: one demonstration for every limit
            steps = one_operation_steps(expr)
            if len(steps) + 1 > self.max_turns:
                raise ValueError(
                    f"rollout.env_kwargs.max_turns={self.max_turns} is below the {len(steps) + 1} actions that "
                    f"a demonstration of {expr!r} takes with calculator_ops={self.calculator_ops} (a call per "
                    "operation, then the answer): raise max_turns to the most operands of the task"
                )
        turns: list[Turn] = []
        for call, result in steps:
            turns.append(("assistant", self.call_text(call)))
            turns.append(("tool", result))
        return [*turns, ("assistant", self.answer_text(sample.answer))]
