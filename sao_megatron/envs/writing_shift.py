"""writing_shift: the paper's online preference-shift simulation (single turn, no tool).

The user asks for a short piece of writing. The rewarded *style* changes on a schedule
(:class:`StyleSchedule`, default concise -> verbose -> formal -> casual, three switches) of a
``progress`` counter that the caller supplies per episode (training step or episode count; the
caller decides which and passes it consistently). A :class:`Judge` scores the response for the
current style; the default :class:`HeuristicJudge` is a deterministic function of the text so
runs are reproducible, and any object with the same ``score`` method (e.g. an LLM judge)
can replace it. Reward = judge score in [0, 1]; ``correct`` is None.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Protocol

from sao_megatron.envs.base import Env, RewardResult, Sample, Split, StepResult, Task, check_split
from sao_megatron.envs.format import Turn, ensure_end, strip_end
from sao_megatron.envs.registry import register_env

STYLES = ("concise", "verbose", "formal", "casual")
TOPICS = (
    "the team meeting",
    "a new coffee machine",
    "the quarterly report",
    "a broken printer",
    "the office move",
    "a product launch",
    "the holiday schedule",
    "a customer complaint",
    "the training session",
    "a budget review",
    "the website update",
    "a late delivery",
    "the hiring plan",
    "a safety inspection",
    "the parking rules",
    "a software upgrade",
    "the annual party",
    "a server outage",
    "the new intern",
    "a supplier contract",
    "the library hours",
    "a garden project",
    "the bike lanes",
    "a charity run",
    "the school trip",
    "a weather warning",
    "the town festival",
    "a recycling program",
    "the museum visit",
    "a cooking class",
)
AUDIENCES = ("a colleague", "your manager", "a friend", "the whole team", "a new customer", "your neighbours")
FORMS = ("a short note", "a message", "a reply", "an update", "an announcement")

CONTRACTIONS = re.compile(r"\b\w+'(?:t|re|m|s|ll|ve|d)\b", re.IGNORECASE)
SLANG = frozenset("hey cool gonna wanna yeah awesome stuff kinda folks guys lol btw super totally".split())
FORMAL = frozenset(
    "therefore furthermore moreover regarding consequently accordingly sincerely respectfully "
    "kindly additionally please hereby".split()
)


@dataclass(frozen=True)
class StyleSchedule:
    """Rewarded style by progress p: ``styles[i]`` while ``boundaries[i-1] <= p < boundaries[i]``."""

    boundaries: tuple[int, ...] = (100, 200, 300)
    styles: tuple[str, ...] = STYLES

    def __post_init__(self) -> None:
        if len(self.styles) != len(self.boundaries) + 1:
            raise ValueError("StyleSchedule needs exactly one more style than boundaries")
        if list(self.boundaries) != sorted(self.boundaries):
            raise ValueError(f"StyleSchedule boundaries must be increasing, got {self.boundaries}")
        unknown = set(self.styles) - set(STYLES)
        if unknown:
            raise ValueError(f"unknown styles {sorted(unknown)}: use {STYLES}")

    def style_at(self, progress: int) -> str:
        return self.styles[bisect.bisect_right(self.boundaries, progress)]


class Judge(Protocol):
    """Scores a response for a style; must return a float in [0, 1]."""

    def score(self, prompt: str, response: str, style: str) -> float: ...


def _topic(prompt: str) -> str:
    m = re.search(r"about (.+?) for ", prompt)
    return m.group(1) if m else ""


class HeuristicJudge:
    """Deterministic text features per style, times a relevance factor (topic mentioned or not).

    concise: 1.0 for 3..12 words, linearly down to 0 at 36; verbose: words / 80 (capped at 1);
    formal: 0.4 + 0.15 per formal marker (max 4) - 0.2 per contraction / ``!`` / slang word;
    casual: 0.2 + 0.15 per contraction and slang word (max 2 each) + 0.1 for ``!`` - 0.15 per
    formal marker. Responses under 3 words score 0. Relevance factor: 1.0 if the topic's last
    word appears, else 0.5.
    """

    def score(self, prompt: str, response: str, style: str) -> float:
        words = re.findall(r"[A-Za-z']+", response)
        n = len(words)
        if n < 3:
            return 0.0
        lower = [w.lower() for w in words]
        contractions = len(CONTRACTIONS.findall(response))
        slang = sum(w in SLANG for w in lower)
        formal = sum(w in FORMAL for w in lower)
        bang = min(response.count("!"), 3)
        if style == "concise":
            raw = 1.0 if n <= 12 else max(0.0, 1.0 - (n - 12) / 24)
        elif style == "verbose":
            raw = min(1.0, n / 80)
        elif style == "formal":
            raw = 0.4 + 0.15 * min(formal, 4) - 0.2 * (contractions + bang + slang)
        elif style == "casual":
            raw = 0.2 + 0.15 * min(contractions, 2) + 0.15 * min(slang, 2) + 0.1 * (bang > 0) - 0.15 * formal
        else:
            raise ValueError(f"unknown style {style!r}: use {STYLES}")
        topic = _topic(prompt).split()
        relevant = not topic or topic[-1].lower() in lower
        return max(0.0, min(1.0, raw)) * (1.0 if relevant else 0.5)


class WritingTask(Task):
    """Prompts ``Write {form} about {topic} for {audience}.``; split by a hash of the text."""

    def __init__(self, seed: int = 0, heldout_fraction: float = 0.2) -> None:
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        self.seed, self.heldout_fraction = seed, heldout_fraction

    def get(self, split: Split, index: int) -> Sample:
        split = check_split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        rng = random.Random(f"writing_shift:{self.seed}:{split}:{index}")
        while True:
            form, topic, audience = rng.choice(FORMS), rng.choice(TOPICS), rng.choice(AUDIENCES)
            question = f"Write {form} about {topic} for {audience}."
            digest = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
            if (digest % 1_000_000 < self.heldout_fraction * 1_000_000) == (split == "heldout"):
                break
        meta = {"topic": topic, "audience": audience, "form": form, "index": index}
        return Sample(f"writing_shift:{self.seed}:{split}:{index}", question, "", meta)


def example_response(sample: Sample, style: str, seed: int = 0) -> str:
    """A template response in ``style`` (used for SFT data and the tokenizer corpus)."""
    rng = random.Random(f"{sample.prompt_id}:{style}:{seed}")
    topic = str(sample.meta.get("topic", "the topic"))
    if style == "concise":
        return rng.choice((f"Quick update on {topic}: all set for Monday.", f"{topic.capitalize()} is done. Thanks."))
    if style == "formal":
        return (
            f"Dear colleague, regarding {topic}, please note that the arrangements are complete. "
            f"Furthermore, we kindly ask you to review the details. Sincerely, the organising team."
        )
    if style == "casual":
        return rng.choice(
            (
                f"Hey! Just a heads up, {topic} is gonna be awesome. It's all sorted, don't worry! "
                "See you there, folks.",
                f"Hey folks, {topic} is totally sorted and it's looking cool! We're good to go, so no stress, yeah?",
            )
        )
    if style == "verbose":
        filler = " ".join(
            rng.choice(
                (
                    f"We have spent a good deal of time thinking carefully about {topic} and its many details.",
                    "Every part of the plan was discussed at length, and each question was answered in full.",
                    "There were several options on the table, and we compared them one by one before deciding.",
                    "We also wanted to make sure that everyone involved had a chance to share their view.",
                )
            )
            for _ in range(6)
        )
        return f"I would like to share a detailed update about {topic}. {filler} Thank you for reading."
    raise ValueError(f"unknown style {style!r}: use {STYLES}")


@register_env("writing_shift")
class WritingShiftEnv(Env):
    """One single-turn writing episode, judged for the style in force at ``progress``.

    Args:
        progress: the schedule position of this episode (training step or episode count).
        schedule: when the rewarded style changes (default :class:`StyleSchedule`).
        judge: scorer for (prompt, response, style); default :class:`HeuristicJudge`.
        boundaries: the schedule's boundaries (a list, e.g. from ``rollout.env_kwargs``) with the
            default styles; instead of ``schedule``.
        shift_by_prompt_index: a ``train`` episode's progress is its prompt's index (the RL
            cursor: how many prompts came before it), so the rewarded style shifts during one
            ``sao train`` run (the paper's preference-shift simulation). Demonstrations and
            held-out episodes keep ``progress``.
    """

    task_class = WritingTask

    def __init__(
        self,
        progress: int = 0,
        schedule: StyleSchedule | None = None,
        judge: Judge | None = None,
        boundaries: list[int] | None = None,
        shift_by_prompt_index: bool = False,
    ) -> None:
        if schedule is not None and boundaries is not None:
            raise ValueError("writing_shift: give schedule or boundaries, not both")
        self.progress = self.base_progress = progress
        self.schedule = schedule or (StyleSchedule(tuple(boundaries)) if boundaries is not None else StyleSchedule())
        self.judge: Judge = judge or HeuristicJudge()
        self.shift_by_prompt_index = shift_by_prompt_index
        self.style = self.schedule.style_at(progress)
        self.sample: Sample | None = None
        self.response: str | None = None

    def reset(self, sample: Sample) -> str:
        self.sample, self.response = sample, None
        index = sample.meta.get("index")
        if self.shift_by_prompt_index:
            train = ":train:" in sample.prompt_id  # held-out episodes keep the base progress
            self.progress = index if train and isinstance(index, int) else self.base_progress
            self.style = self.schedule.style_at(self.progress)
        return sample.question

    def step(self, action: str) -> StepResult:
        if self.sample is None or self.response is not None:
            raise RuntimeError("step() called before reset() or after the episode ended")
        self.response = strip_end(action) if isinstance(action, str) else ""
        return StepResult(None, True, {"style": self.style})

    def reward(self) -> RewardResult:
        if self.sample is None or self.response is None:
            raise RuntimeError("reward() called before the episode ended")
        score = float(self.judge.score(self.sample.question, self.response, self.style))
        details = {"style": self.style, "progress": self.progress, "words": len(self.response.split())}
        return RewardResult(max(0.0, min(1.0, score)), None, details)

    def demonstration(self, sample: Sample) -> list[Turn]:
        """A template response in the style currently rewarded."""
        return [("assistant", ensure_end(example_response(sample, self.style)))]
