"""Every figure of the README's results table recomputes from the committed reduced metrics
(``benchmarks/results/sweeps/``) by the command the row quotes, to the digits it prints.

Each row's ``sao compare`` command (``the same compare``: the row above's) is parsed by the CLI's
own parser and run in-process (:func:`sao_megatron.cli.compare_options`,
:func:`sao_megatron.sweep.compare_rows`). Every figure of the row's figure column written as
``mean [+- s.e.] [low, high]`` must be one row of that table: mean, interval and, where given,
standard error, each within half a unit of the last digit the README prints. The claim column's
measured figures (gates, staleness) come from other commands, those RESULTS.md quotes beside them:
:data:`CLAIM_FIGURES` names each with its command. :data:`EXEMPT` lists what is not recomputed and
why; each of its phrases must still be in its row, so the table cannot drift from the README.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from functools import cache

import pytest

from sao_megatron.cli import build_parser, compare_options
from sao_megatron.config import REPO_ROOT
from sao_megatron.observe import read_metrics
from sao_megatron.sweep import ArmStats, compare_rows, group_runs

README = REPO_ROOT / "README.md"
NUMBER = r"[+-]?\d+(?:\.\d+)?"
FIGURE = re.compile(rf"(?P<mean>{NUMBER})(?: \+- (?P<se>{NUMBER}))? \[(?P<lo>{NUMBER}), (?P<hi>{NUMBER})\]")


@dataclass(frozen=True)
class ClaimFigure:
    """Numbers in a row's claim column and where they come from: the n-th number of ``text`` is
    ``reduce`` (min or max) of the means of the (label, arm) rows of ``picks[n]`` in the table of
    ``command``, times ``scale`` (100 for a percentage)."""

    row: str
    text: str
    command: str
    picks: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
    scale: float = 1.0


TRUNCATION_ARMS = ("trunc_terminal", "trunc_bootstrap")
ONECALC, HETERO = "benchmarks/results/sweeps/claim_onecalc", "benchmarks/results/sweeps/hetero"
CLAIM_FIGURES = (
    ClaimFigure(
        "one-operation calculator under a 3-action limit",
        "between-prompt share 0.28, the critic's first-token explained variance 0.22 after value pretraining",
        f"sao compare {ONECALC}/_start --metric eval/between_prompt_share --metric critic/explained_var_first",
        (
            ("min", (("eval/between_prompt_share", "_start"),)),
            ("min", (("critic/explained_var_first", "_start"),)),
        ),
    ),
    ClaimFigure(
        "one-operation calculator under a 3-action limit",
        "and 0.30 in RL",
        f"sao compare {ONECALC} --metric critic/explained_var_first --window 1-30",
        (("min", (("critic/explained_var_first steps 1-30", "sao"),)),),
    ),
    ClaimFigure(
        "heterogeneous prompts",
        "explained variance there 0.03 after value pretraining",
        f"sao compare {HETERO}/_start --metric critic/explained_var_first",
        (("min", (("critic/explained_var_first", "_start"),)),),
    ),
    ClaimFigure(
        "heterogeneous prompts",
        "0.06 in RL",
        f"sao compare {HETERO} --metric critic/explained_var_first --window 1-30",
        (("min", (("critic/explained_var_first steps 1-30", "sao"),)),),
    ),
    ClaimFigure(
        "heterogeneous prompts",
        "mean lag 3.5 vs 2.2-2.3",
        f"sao compare {HETERO} --metric lag/mean --window 1-30 --paired-with sao",
        (
            ("min", (("lag/mean steps 1-30", "sao"),)),
            ("min", (("lag/mean steps 1-30", "single_running_mean"), ("lag/mean steps 1-30", "grpo_dis"))),
            ("max", (("lag/mean steps 1-30", "single_running_mean"), ("lag/mean steps 1-30", "grpo_dis"))),
        ),
    ),
    ClaimFigure(
        "over 200 RL steps",
        "mean lag 3.8 vs 1.8-2.0",
        "sao compare benchmarks/results/sweeps/long --metric lag/mean --window 1-200 --paired-with sao_long",
        (
            ("min", (("lag/mean steps 1-200", "sao_long"),)),
            ("min", (("lag/mean steps 1-200", "grpo_dis_long"), ("lag/mean steps 1-200", "grpo_clip_higher_long"))),
            ("max", (("lag/mean steps 1-200", "grpo_dis_long"), ("lag/mean steps 1-200", "grpo_clip_higher_long"))),
        ),
    ),
    ClaimFigure(
        "episodes cut by a turn limit",
        "15-25% of each batch cut",
        "sao compare benchmarks/results/sweeps/truncation --metric rollout/truncated --window 1-5 --window 26-30",
        tuple(
            (reduce, tuple((f"rollout/truncated steps {w}", a) for w in ("1-5", "26-30") for a in TRUNCATION_ARMS))
            for reduce in ("min", "max")
        ),
        scale=100.0,
    ),
)

EXEMPT = {
    # row (a phrase of its claim cell) -> (a phrase of the row that is not recomputed, why)
    "`make run`'s regime": (
        "30 RL steps and a 256-prompt evaluation",
        "settings of the sweep file, not measurements",
    ),
    "over 200 RL steps": (
        "the testbed saturates near 0.9 by step ~100",
        "read off the curves, approximate by its wording; RESULTS.md gives the per-step table",
    ),
    "online adaptation": (
        "the reward falls ~0.4 at each, gate passed",
        "approximate by its wording; RESULTS.md gives the gate's figures (0.444, 0.421) and the "
        "one-line command that computes them from window means",
    ),
}


def results_rows() -> list[dict[str, str]]:
    """The README's results table: claim, figure, seeds, command and code of each row."""
    text = README.read_text()
    section = text.split("## Results (what holds on current code)", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["claim", "figure (95% CI)", "seeds", "command", "code"], header
    assert set(lines[1]) <= set("|-: "), f"not the header's separator: {lines[1]}"
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        assert len(cells) == len(header), f"README results row has {len(cells)} cells: {line[:80]}"
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def compare_commands(rows: list[dict[str, str]]) -> list[str]:
    """Each row's quoted ``sao compare`` command; "the same compare" is the row above's."""
    out, last = [], None
    for row in rows:
        quoted = [c for c in re.findall(r"`([^`]+)`", row["command"]) if c.startswith("sao compare ")]
        assert len(quoted) <= 1, f"row {row['claim'][:60]!r} quotes {len(quoted)} compare commands"
        if quoted:
            last = quoted[0]
        else:
            assert "the same compare" in row["command"] and last, f"row {row['claim'][:60]!r} quotes no compare"
        out.append(last)
    return out


@cache
def table(command: str) -> tuple[tuple[str, ArmStats], ...]:
    """The rows ``command`` (``sao compare ...``, run from the repository) tabulates."""
    words = shlex.split(command)
    assert words[:2] == ["sao", "compare"], command
    options = compare_options(build_parser().parse_args(words[1:]))
    paths = [p if p.is_absolute() else REPO_ROOT / p for p in options["paths"]]
    groups = group_runs(paths)
    records = {arm: [read_metrics(r) for r in runs] for arm, runs in groups.items()}
    return tuple(
        compare_rows(
            groups, records, options["metrics"], options["windows"], options["paired_with"], options["recoveries"]
        )
    )


def printed_as(value: float, text: str) -> bool:
    """``value`` rounds to ``text`` at the digits ``text`` shows (a tie either way)."""
    decimals = len(text.partition(".")[2])
    return abs(value - float(text)) <= 0.5 * 10**-decimals + 1e-9


def matches(figure: re.Match, s: ArmStats) -> bool:
    ok = printed_as(s.mean, figure["mean"]) and printed_as(s.mean - s.ci95, figure["lo"])
    ok = ok and printed_as(s.mean + s.ci95, figure["hi"])
    return ok and (figure["se"] is None or printed_as(s.stderr, figure["se"]))


def figure_mismatches(rows: list[dict[str, str]]) -> list[str]:
    """One message per figure of the figure column that no row of its command's table gives."""
    problems = []
    for row, command in zip(rows, compare_commands(rows), strict=True):
        figures = list(FIGURE.finditer(row["figure (95% CI)"].replace("**", "")))
        if not figures:
            problems.append(f"row {row['claim'][:60]!r}: no figure 'mean [+- s.e.] [low, high]' in its figure cell")
        stats = table(command)
        for figure in figures:
            if not any(matches(figure, s) for _, s in stats):
                near = sorted(stats, key=lambda r: abs(r[1].mean - float(figure["mean"])))[:3]
                computed = "; ".join(
                    f"{label} / {s.arm}: {s.mean:.6g} +- {s.stderr:.3g} [{s.mean - s.ci95:.6g}, {s.mean + s.ci95:.6g}]"
                    for label, s in near
                )
                problems.append(
                    f"row {row['claim'][:60]!r}: figure {figure[0]!r} is not what `{command}` computes "
                    f"(nearest: {computed})"
                )
    return problems


def claim_mismatches(rows: list[dict[str, str]], figures: tuple[ClaimFigure, ...] = CLAIM_FIGURES) -> list[str]:
    """One message per number of :data:`CLAIM_FIGURES` that its command does not compute."""
    problems = []
    for fig in figures:
        row = one_row(rows, fig.row)
        if fig.text not in row["claim"]:
            problems.append(f"row {fig.row!r}: its claim no longer says {fig.text!r}; update CLAIM_FIGURES")
            continue
        numbers = re.findall(r"\d+(?:\.\d+)?", fig.text)
        assert len(numbers) == len(fig.picks), f"{fig.text!r}: {len(numbers)} numbers, {len(fig.picks)} picks"
        stats = {(label, s.arm): s for label, s in table(fig.command)}
        for number, (reduce, picks) in zip(numbers, fig.picks, strict=True):
            missing = [p for p in picks if p not in stats]
            assert not missing, f"`{fig.command}` has no row {missing}"
            value = (min if reduce == "min" else max)(stats[p].mean for p in picks) * fig.scale
            if not printed_as(value, number):
                problems.append(
                    f"row {fig.row!r}: {number} in {fig.text!r} is {value:.4g} by `{fig.command}` ({reduce} of {picks})"
                )
    return problems


def one_row(rows: list[dict[str, str]], phrase: str) -> dict[str, str]:
    found = [r for r in rows if phrase in r["claim"]]
    assert len(found) == 1, f"{len(found)} README results rows have {phrase!r} in their claim"
    return found[0]


def test_every_figure_of_the_readme_results_table_recomputes_from_the_committed_metrics():
    rows = results_rows()
    assert len(rows) >= 10
    problems = figure_mismatches(rows) + claim_mismatches(rows)
    assert not problems, "README results table:\n" + "\n".join(problems)


def test_the_exempt_phrases_are_still_in_their_rows():
    rows = results_rows()
    for phrase, (text, why) in EXEMPT.items():
        assert text in one_row(rows, phrase)["claim"], f"{phrase!r}: {text!r} ({why}) is gone; update EXEMPT"


@pytest.mark.parametrize(
    ("written", "wrong"),
    [
        ("+0.040 +- 0.008 [0.016, 0.063]", "+0.041 +- 0.008 [0.016, 0.063]"),  # the mean
        ("+0.040 +- 0.008 [0.016, 0.063]", "+0.040 +- 0.009 [0.016, 0.063]"),  # the standard error
        ("-1.4 +- 0.6 [-3.07, 0.27]", "-1.4 +- 0.6 [-3.07, 0.28]"),  # an interval's end
    ],
)
def test_an_altered_figure_fails_naming_the_row_the_figure_and_the_command(written, wrong):
    rows = results_rows()
    row = next(r for r in rows if written in r["figure (95% CI)"])
    row["figure (95% CI)"] = row["figure (95% CI)"].replace(written, wrong)
    problems = figure_mismatches(rows)
    assert len(problems) == 1 and wrong in problems[0] and "`sao compare benchmarks/results/sweeps/" in problems[0]
    assert row["claim"][:60] in problems[0]


def test_an_altered_claim_figure_fails():
    rows = results_rows()
    row = one_row(rows, "heterogeneous prompts")
    fig = next(f for f in CLAIM_FIGURES if f.text == "mean lag 3.5 vs 2.2-2.3")
    wrong = ClaimFigure(fig.row, "mean lag 3.5 vs 2.2-2.4", fig.command, fig.picks)
    row["claim"] = row["claim"].replace(fig.text, wrong.text)
    problems = claim_mismatches(rows, (wrong,))
    assert len(problems) == 1 and "2.4 in 'mean lag 3.5 vs 2.2-2.4' is 2.285" in problems[0], problems
    assert fig.command in problems[0]
