"""Write the bundled SWE task set, ``sao_megatron/envs/data/swe/tasks.jsonl``, deterministically.

Each task is a tiny Python repository with one real bug, an issue text describing the symptom,
the hidden reference fix (``patch``), and the tests that judge it (``test_patch``), in the
SWE-bench instance schema (see :mod:`sao_megatron.envs.swe.tasks`). A :class:`Spec` below is
the buggy snapshot, the fix as exact text replacements, the new tests appended to one test
file, and a *breaking* edit (applied on top of the fix) that makes a PASS_TO_PASS test fail
while the fix still stands: the reward tests use it to check that breaking working code
earns 0. FAIL_TO_PASS are the new tests, PASS_TO_PASS every test already in the repository.

Usage::

    python tools/make_swe_tasks.py                 # (re)write the shipped file
    python tools/make_swe_tasks.py --check         # exit 1 if the shipped file differs
    python tools/make_swe_tasks.py --verify        # also run every task's tests (about 1 s a task)
    python tools/make_swe_tasks.py --out DIR --parquet   # write elsewhere, plus tasks.parquet

``--verify`` materialises each task, applies ``test_patch`` and checks that FAIL_TO_PASS fail and
PASS_TO_PASS pass, then applies ``patch`` and checks all pass, then the breaking edit and checks
that a PASS_TO_PASS test fails while FAIL_TO_PASS still pass.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sao_megatron.envs.swe.reward import local_runner, parse_outcomes, pytest_command  # noqa: E402
from sao_megatron.envs.swe.tasks import (  # noqa: E402
    DATA_PATH,
    SWETask,
    git,
    materialise,
    parse_task,
    snapshot_commit,
    unified_diff,
)

OWNER = "sao-tasks"
COMMON = {
    ".gitignore": "__pycache__/\n*.pyc\n.pytest_cache/\n",
    "pytest.ini": "[pytest]\ntestpaths = tests\n",
}
Edit = tuple[str, str, str]  # (path, old text, new text): old must occur exactly once


def d(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str
    problem: str
    files: dict[str, str]
    """Source files and the existing tests (all pass before and after the fix)."""
    test_file: str
    new_tests: str
    """Appended to ``test_file`` by the test patch; every ``def test_*`` in it is FAIL_TO_PASS."""
    fix: list[Edit]
    breaks: list[Edit] = field(default_factory=list)
    """Applied after ``fix``: makes a PASS_TO_PASS test fail, FAIL_TO_PASS still pass."""

    @property
    def instance_id(self) -> str:
        return f"{OWNER}__{self.name}-1"


def edit(files: dict[str, str], edits: list[Edit]) -> dict[str, str]:
    out = dict(files)
    for path, old, new in edits:
        if out[path].count(old) != 1:
            raise ValueError(f"edit of {path}: {old!r} occurs {out[path].count(old)} times, not once")
        out[path] = out[path].replace(old, new)
    return out


def _tests_in(text: str) -> list[str]:
    return re.findall(r"^def (test_\w+)", text, flags=re.M)


def snapshots(spec: Spec) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(base snapshot, snapshot with the test patch, snapshot with test patch + fix)."""
    base = dict(sorted({**COMMON, **spec.files}.items()))
    with_tests = dict(base)
    with_tests[spec.test_file] = base.get(spec.test_file, "") + "\n\n" + spec.new_tests
    return base, with_tests, edit(with_tests, spec.fix)


def record(spec: Spec) -> dict:
    base, with_tests, fixed = snapshots(spec)
    f2p = [f"{spec.test_file}::{t}" for t in _tests_in(spec.new_tests)]
    p2p = [f"{path}::{t}" for path, text in base.items() if path.startswith("tests/") for t in _tests_in(text)]
    return {
        "instance_id": spec.instance_id,
        "repo": f"{OWNER}/{spec.name}",
        "base_commit": snapshot_commit(base),
        "problem_statement": textwrap.dedent(spec.problem).strip() + "\n",
        "patch": unified_diff(with_tests, fixed),
        "test_patch": unified_diff(base, with_tests),
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "bug_kind": spec.kind,
        "files": base,
    }


def breaking_patch(spec: Spec) -> str:
    """Reference fix plus the breaking edit, as one patch against the base snapshot."""
    base, _, fixed = snapshots(spec)
    agent = edit(fixed, spec.breaks)
    agent[spec.test_file] = base[spec.test_file]  # the agent's change; the test patch comes later
    return unified_diff(base, agent)


# --------------------------------------------------------------------------------------------
# The tasks. Each repository is a package plus tests/; issue texts describe symptoms only.
# --------------------------------------------------------------------------------------------

SPECS: list[Spec] = []
# fmt: off

SPECS.append(Spec(
    name="pager",
    kind="off-by-one",
    problem="""
        paginate() skips the first page

        With 25 items and 10 per page, `paginate(items, 1, 10)` gives me items 10-19 instead of
        the first ten. Pages are numbered from 1 in our API (page_count() agrees: 3 pages), so
        page 1 should be items 0-9 and page 3 the last five.
    """,
    files={
        "pager/__init__.py": "from pager.core import page_count, paginate\n",
        "pager/core.py": d('''
            """Split a list into pages numbered from 1."""


            def page_count(n_items: int, per_page: int) -> int:
                return -(-n_items // per_page)


            def paginate(items: list, page: int, per_page: int) -> list:
                start = page * per_page
                return items[start : start + per_page]
        '''),
        "tests/test_core.py": d("""
            from pager import page_count


            def test_page_count_rounds_up():
                assert page_count(25, 10) == 3


            def test_page_count_exact():
                assert page_count(20, 10) == 2
        """),
    },
    test_file="tests/test_core.py",
    new_tests=d("""
        from pager import paginate


        def test_first_page():
            assert paginate(list(range(25)), 1, 10) == list(range(10))


        def test_last_page_is_partial():
            assert paginate(list(range(25)), 3, 10) == list(range(20, 25))
    """),
    fix=[("pager/core.py", "start = page * per_page", "start = (page - 1) * per_page")],
    breaks=[("pager/core.py", "-(-n_items // per_page)", "n_items // per_page")],
))

SPECS.append(Spec(
    name="spans",
    kind="off-by-one",
    problem="""
        inclusive_range(a, b) leaves out b

        The docstring says both ends are included, but `inclusive_range(1, 5)` returns
        [1, 2, 3, 4]. Same for `inclusive_range(3, 3)`, which returns an empty list.
    """,
    files={
        "spans/__init__.py": "",
        "spans/ranges.py": d('''
            def inclusive_range(a: int, b: int) -> list[int]:
                """Integers from a to b, both included."""
                return list(range(a, b))


            def chunks(seq: list, size: int) -> list[list]:
                """Consecutive pieces of at most `size` items."""
                return [seq[i : i + size] for i in range(0, len(seq), size)]
        '''),
        "tests/test_ranges.py": d("""
            from spans.ranges import chunks


            def test_chunks_even():
                assert chunks([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


            def test_chunks_remainder():
                assert chunks([1, 2, 3], 2) == [[1, 2], [3]]
        """),
    },
    test_file="tests/test_ranges.py",
    new_tests=d("""
        from spans.ranges import inclusive_range


        def test_inclusive_range_includes_end():
            assert inclusive_range(1, 5) == [1, 2, 3, 4, 5]


        def test_inclusive_range_single():
            assert inclusive_range(3, 3) == [3]
    """),
    fix=[("spans/ranges.py", "return list(range(a, b))", "return list(range(a, b + 1))")],
    breaks=[("spans/ranges.py", "range(0, len(seq), size)", "range(0, len(seq) - 1, size)")],
))

SPECS.append(Spec(
    name="moneyfmt",
    kind="string formatting",
    problem="""
        format_price shows one decimal for round amounts

        `format_price(550)` (cents) prints "$5.5" and `format_price(1200)` prints "$12.0". Prices
        should always have two decimals: "$5.50", "$12.00".
    """,
    files={
        "moneyfmt/__init__.py": "",
        "moneyfmt/fmt.py": d("""
            def format_price(cents: int) -> str:
                return f"${cents / 100}"


            def format_percent(fraction: float) -> str:
                return f"{fraction * 100:.0f}%"
        """),
        "tests/test_fmt.py": d("""
            from moneyfmt.fmt import format_percent, format_price


            def test_price_with_cents():
                assert format_price(1234) == "$12.34"


            def test_percent():
                assert format_percent(0.25) == "25%"
        """),
    },
    test_file="tests/test_fmt.py",
    new_tests=d("""
        def test_price_always_two_decimals():
            assert format_price(550) == "$5.50"
            assert format_price(1200) == "$12.00"
    """),
    fix=[("moneyfmt/fmt.py", 'f"${cents / 100}"', 'f"${cents / 100:.2f}"')],
    breaks=[("moneyfmt/fmt.py", "{fraction * 100:.0f}%", "{fraction:.0f}%")],
))

SPECS.append(Spec(
    name="stats",
    kind="integer vs float division",
    problem="""
        mean() truncates

        `mean([1, 2])` returns 1 but should be 1.5. It looks right for lists whose sum divides
        evenly, which is probably why nobody noticed.
    """,
    files={
        "stats/__init__.py": "from stats.basic import mean, total\n",
        "stats/basic.py": d("""
            def total(xs: list[float]) -> float:
                return sum(xs)


            def mean(xs: list[float]) -> float:
                if not xs:
                    raise ValueError("mean of an empty list")
                return total(xs) // len(xs)
        """),
        "tests/test_basic.py": d("""
            import pytest

            from stats import mean, total


            def test_total():
                assert total([1, 2, 3]) == 6


            def test_mean_even():
                assert mean([2, 4]) == 3


            def test_mean_empty():
                with pytest.raises(ValueError):
                    mean([])
        """),
    },
    test_file="tests/test_basic.py",
    new_tests=d("""
        def test_mean_fraction():
            assert mean([1, 2]) == 1.5
    """),
    fix=[("stats/basic.py", "total(xs) // len(xs)", "total(xs) / len(xs)")],
    breaks=[("stats/basic.py", "    return sum(xs)\n", "    return sum(xs) + 0.5 * (len(xs) == 3)\n")],
))

SPECS.append(Spec(
    name="tagger",
    kind="mutable default argument",
    problem="""
        Tags leak between items

        I create two items with `make_item("a")` and `make_item("b")`, add a tag to the first, and
        the second one has it too. Items created without explicit tags seem to share one list.
    """,
    files={
        "tagger/__init__.py": "",
        "tagger/items.py": d("""
            def make_item(name: str, tags: list[str] = []) -> dict:
                return {"name": name, "tags": tags}


            def add_tag(item: dict, tag: str) -> dict:
                if tag not in item["tags"]:
                    item["tags"].append(tag)
                return item
        """),
        "tests/test_items.py": d("""
            from tagger.items import add_tag, make_item


            def test_explicit_tags():
                item = make_item("x", ["red"])
                assert add_tag(item, "blue")["tags"] == ["red", "blue"]


            def test_no_duplicate_tags():
                item = make_item("x", ["red"])
                assert add_tag(item, "red")["tags"] == ["red"]
        """),
    },
    test_file="tests/test_items.py",
    new_tests=d("""
        def test_default_tags_not_shared():
            a = make_item("a")
            b = make_item("b")
            add_tag(a, "hot")
            assert b["tags"] == []
    """),
    fix=[
        (
            "tagger/items.py",
            """def make_item(name: str, tags: list[str] = []) -> dict:
    return {"name": name, "tags": tags}""",
            """def make_item(name: str, tags: list[str] | None = None) -> dict:
    return {"name": name, "tags": list(tags) if tags is not None else []}""",
        )
    ],
    breaks=[
        ("tagger/items.py", '    if tag not in item["tags"]:\n        item', "    if True:\n        item")
    ],
))

SPECS.append(Spec(
    name="csvsplit",
    kind="wrong default",
    problem="""
        split_fields splits on semicolons by default

        The README says `split_fields(line)` splits comma-separated values, but
        `split_fields("a,b,c")` returns `["a,b,c"]`. Passing `sep=","` works.
    """,
    files={
        "csvsplit/__init__.py": "",
        "csvsplit/split.py": d('''
            def split_fields(line: str, sep: str = ";") -> list[str]:
                """Split a comma-separated line (or another separator) and strip the fields."""
                return [field.strip() for field in line.split(sep)]
        '''),
        "tests/test_split.py": d("""
            from csvsplit.split import split_fields


            def test_explicit_separator():
                assert split_fields("a| b |c", sep="|") == ["a", "b", "c"]


            def test_strips_fields():
                assert split_fields(" a ; b", sep=";") == ["a", "b"]
        """),
    },
    test_file="tests/test_split.py",
    new_tests=d("""
        def test_default_is_comma():
            assert split_fields("a, b,c") == ["a", "b", "c"]
    """),
    fix=[("csvsplit/split.py", 'sep: str = ";"', 'sep: str = ","')],
    breaks=[("csvsplit/split.py", "[field.strip() for", "[field.lstrip() for")],
))

SPECS.append(Spec(
    name="convert",
    kind="exception handling",
    problem="""
        to_int(None) crashes instead of returning the default

        `to_int("12")` gives 12 and `to_int("x", default=0)` gives 0, but `to_int(None, default=0)`
        raises `TypeError: int() argument must be a string...`. Missing values come from JSON as
        None, so they should fall back to the default like any other unparsable value.
    """,
    files={
        "convert/__init__.py": "",
        "convert/numbers.py": d("""
            def to_int(value, default=None):
                try:
                    return int(value)
                except ValueError:
                    return default


            def to_float(value, default=None):
                try:
                    return float(value)
                except (TypeError, ValueError):
                    return default
        """),
        "tests/test_numbers.py": d("""
            from convert.numbers import to_float, to_int


            def test_to_int():
                assert to_int("12") == 12


            def test_to_int_bad_text():
                assert to_int("x", default=0) == 0


            def test_to_float_none():
                assert to_float(None, default=1.5) == 1.5
        """),
    },
    test_file="tests/test_numbers.py",
    new_tests=d("""
        def test_to_int_none():
            assert to_int(None, default=0) == 0
    """),
    fix=[
        (
            "convert/numbers.py",
            "        return int(value)\n    except ValueError:",
            "        return int(value)\n    except (TypeError, ValueError):",
        )
    ],
    breaks=[("convert/numbers.py", "return float(value)", "return float(value or 0)")],
))

SPECS.append(Spec(
    name="settings",
    kind="exception handling",
    problem="""
        A broken config file is silently ignored

        If settings.json has a syntax error, `load_settings(path)` returns `{}` and the app starts
        with defaults, which hid a typo from us for a week. A missing file should still give `{}`,
        but invalid JSON should raise `SettingsError` with the file name in the message.
    """,
    files={
        "settings/__init__.py": "from settings.load import SettingsError, load_settings\n",
        "settings/load.py": d("""
            import json


            class SettingsError(Exception):
                pass


            def load_settings(path) -> dict:
                try:
                    with open(path, encoding="utf-8") as f:
                        return json.load(f)
                except Exception:
                    return {}
        """),
        "tests/test_load.py": d("""
            from settings import load_settings


            def test_missing_file(tmp_path):
                assert load_settings(tmp_path / "nope.json") == {}


            def test_valid_file(tmp_path):
                path = tmp_path / "s.json"
                path.write_text('{"debug": true}')
                assert load_settings(path) == {"debug": True}
        """),
    },
    test_file="tests/test_load.py",
    new_tests=d("""
        import pytest

        from settings import SettingsError


        def test_invalid_json_raises(tmp_path):
            path = tmp_path / "bad.json"
            path.write_text('{"debug": tru')
            with pytest.raises(SettingsError, match="bad.json"):
                load_settings(path)
    """),
    fix=[
        (
            "settings/load.py",
            """    except Exception:
        return {}""",
            """    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as err:
        raise SettingsError(f"{path}: invalid JSON ({err})") from err""",
        )
    ],
    breaks=[("settings/load.py", "    except FileNotFoundError:\n        return {}\n", "")],
))

SPECS.append(Spec(
    name="filenames",
    kind="wrong API use",
    problem="""
        strip_extension eats letters from the file name

        `strip_extension("notes.txt", ".txt")` works, but `strip_extension("test.txt", ".txt")`
        returns "tes" and `strip_extension("data.csv", ".csv")` returns "data" only by luck.
        Only the exact suffix should be removed.
    """,
    files={
        "filenames/__init__.py": "",
        "filenames/names.py": d("""
            def strip_extension(name: str, ext: str) -> str:
                return name.rstrip(ext)


            def add_extension(name: str, ext: str) -> str:
                return name if name.endswith(ext) else name + ext
        """),
        "tests/test_names.py": d("""
            from filenames.names import add_extension, strip_extension


            def test_strip_simple():
                assert strip_extension("notes.txt", ".txt") == "notes"


            def test_add_extension():
                assert add_extension("notes", ".txt") == "notes.txt"
                assert add_extension("notes.txt", ".txt") == "notes.txt"
        """),
    },
    test_file="tests/test_names.py",
    new_tests=d("""
        def test_strip_keeps_matching_letters():
            assert strip_extension("test.txt", ".txt") == "test"
            assert strip_extension("archive.tar.gz", ".gz") == "archive.tar"
    """),
    fix=[("filenames/names.py", "return name.rstrip(ext)", "return name.removesuffix(ext)")],
    breaks=[
        ("filenames/names.py", "return name if name.endswith(ext) else name + ext", "return name + ext")
    ],
))

SPECS.append(Spec(
    name="leaderboard",
    kind="wrong API use",
    problem="""
        ranking() returns None

        `ranking([3, 1, 2])` should give the scores from best to worst, `[3, 2, 1]`, but it returns
        None. It also seems to reorder the list I passed in, which it should not touch.
    """,
    files={
        "leaderboard/__init__.py": "",
        "leaderboard/scores.py": d("""
            def best(scores: list[int]) -> int:
                return max(scores)


            def ranking(scores: list[int]) -> list[int]:
                return scores.sort(reverse=True)
        """),
        "tests/test_scores.py": d("""
            from leaderboard.scores import best


            def test_best():
                assert best([3, 9, 2]) == 9
        """),
    },
    test_file="tests/test_scores.py",
    new_tests=d("""
        from leaderboard.scores import ranking


        def test_ranking_order():
            assert ranking([3, 1, 2]) == [3, 2, 1]


        def test_ranking_leaves_input_alone():
            scores = [3, 1, 2]
            ranking(scores)
            assert scores == [3, 1, 2]
    """),
    fix=[
        (
            "leaderboard/scores.py",
            "return scores.sort(reverse=True)",
            "return sorted(scores, reverse=True)",
        )
    ],
    breaks=[("leaderboard/scores.py", "return max(scores)", "return scores[0]")],
))

SPECS.append(Spec(
    name="textscan",
    kind="wrong API use",
    problem="""
        has_digit misses digits that are not at the start

        `has_digit("7up")` is True but `has_digit("room 101")` is False.
    """,
    files={
        "textscan/__init__.py": "",
        "textscan/scan.py": d("""
            import re


            def has_digit(text: str) -> bool:
                return re.match(r"\\d", text) is not None


            def words(text: str) -> list[str]:
                return re.findall(r"[A-Za-z]+", text)
        """),
        "tests/test_scan.py": d("""
            from textscan.scan import has_digit, words


            def test_leading_digit():
                assert has_digit("7up")


            def test_no_digit():
                assert not has_digit("hello")


            def test_words():
                assert words("Hi, you 2!") == ["Hi", "you"]
        """),
    },
    test_file="tests/test_scan.py",
    new_tests=d("""
        def test_digit_in_the_middle():
            assert has_digit("room 101")
    """),
    fix=[("textscan/scan.py", 're.match(r"\\d", text)', 're.search(r"\\d", text)')],
    breaks=[("textscan/scan.py", 'r"[A-Za-z]+"', 'r"[a-z]+"')],
))

SPECS.append(Spec(
    name="medians",
    kind="missing edge case",
    problem="""
        median of an even number of values is wrong

        `median([1, 2, 3, 4])` returns 3; the median is 2.5 (mean of the two middle values).
        Odd-length lists are fine.
    """,
    files={
        "medians/__init__.py": "",
        "medians/median.py": d("""
            def median(values: list[float]) -> float:
                ordered = sorted(values)
                return ordered[len(ordered) // 2]


            def spread(values: list[float]) -> float:
                return max(values) - min(values)
        """),
        "tests/test_median.py": d("""
            from medians.median import median, spread


            def test_odd():
                assert median([5, 1, 3]) == 3


            def test_spread():
                assert spread([4, 1, 9]) == 8
        """),
    },
    test_file="tests/test_median.py",
    new_tests=d("""
        def test_even():
            assert median([4, 1, 3, 2]) == 2.5
    """),
    fix=[
        (
            "medians/median.py",
            "    return ordered[len(ordered) // 2]\n",
            d("""
        ....mid = len(ordered) // 2
        ....if len(ordered) % 2 == 0:
        ........return (ordered[mid - 1] + ordered[mid]) / 2
        ....return ordered[mid]
    """).replace("....", "    "),
        )
    ],
    breaks=[("medians/median.py", "max(values) - min(values)", "max(values) - values[0]")],
))

SPECS.append(Spec(
    name="initials",
    kind="missing edge case",
    problem="""
        initials() crashes on names with double spaces

        `initials("Ada Lovelace")` gives "AL", but `initials("Ada  Lovelace")` (two spaces, as
        typed in our sign-up form) raises IndexError, and so does a trailing space.
    """,
    files={
        "initials/__init__.py": "",
        "initials/names.py": d("""
            def initials(name: str) -> str:
                return "".join(word[0].upper() for word in name.split(" "))


            def surname(name: str) -> str:
                return name.split()[-1]
        """),
        "tests/test_names.py": d("""
            from initials.names import initials, surname


            def test_initials():
                assert initials("ada lovelace") == "AL"


            def test_surname():
                assert surname("Ada King Lovelace") == "Lovelace"
        """),
    },
    test_file="tests/test_names.py",
    new_tests=d("""
        def test_initials_extra_spaces():
            assert initials("Ada  Lovelace ") == "AL"
    """),
    fix=[("initials/names.py", 'name.split(" "))', "name.split())")],
    breaks=[("initials/names.py", "return name.split()[-1]", "return name.split()[1]")],
))

SPECS.append(Spec(
    name="slugs",
    kind="missing edge case",
    problem="""
        slugify leaves repeated and trailing dashes

        `slugify("Hello, World!")` gives "hello--world-" instead of "hello-world". Runs of
        punctuation/spaces should become a single dash and no dash should be left at either end.
    """,
    files={
        "slugs/__init__.py": "",
        "slugs/slug.py": d("""
            import re


            def slugify(title: str) -> str:
                return re.sub(r"[^a-z0-9]", "-", title.lower())
        """),
        "tests/test_slug.py": d("""
            from slugs.slug import slugify


            def test_simple():
                assert slugify("Hello World") == "hello-world"


            def test_digits_kept():
                assert slugify("Top 10") == "top-10"
        """),
    },
    test_file="tests/test_slug.py",
    new_tests=d("""
        def test_punctuation_collapses():
            assert slugify("Hello, World!") == "hello-world"
    """),
    fix=[
        (
            "slugs/slug.py",
            'return re.sub(r"[^a-z0-9]", "-", title.lower())',
            'return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")',
        )
    ],
    breaks=[("slugs/slug.py", "title.lower()", 'title.lower().replace("0", "o")')],
))

SPECS.append(Spec(
    name="counters",
    kind="aliasing (input mutated)",
    problem="""
        merge_counts modifies its first argument

        After `merged = merge_counts(a, b)`, my dict `a` also contains b's counts, so totals are
        double counted the next time I use it. The inputs should be left unchanged.
    """,
    files={
        "counters/__init__.py": "",
        "counters/merge.py": d("""
            def merge_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
                result = a
                for key, n in b.items():
                    result[key] = result.get(key, 0) + n
                return result
        """),
        "tests/test_merge.py": d("""
            from counters.merge import merge_counts


            def test_merge_values():
                assert merge_counts({"x": 1}, {"x": 2, "y": 3}) == {"x": 3, "y": 3}


            def test_merge_empty():
                assert merge_counts({}, {"y": 1}) == {"y": 1}
        """),
    },
    test_file="tests/test_merge.py",
    new_tests=d("""
        def test_inputs_unchanged():
            a, b = {"x": 1}, {"x": 2}
            merge_counts(a, b)
            assert a == {"x": 1} and b == {"x": 2}
    """),
    fix=[("counters/merge.py", "result = a\n", "result = dict(a)\n")],
    breaks=[("counters/merge.py", "result.get(key, 0) + n", "max(result.get(key, 0), n)")],
))

SPECS.append(Spec(
    name="clock",
    kind="string formatting",
    problem="""
        format_duration drops the leading zero of seconds

        `format_duration(65)` shows "1:5"; it should be "1:05" (m:ss), like a stopwatch.
    """,
    files={
        "clock/__init__.py": "",
        "clock/duration.py": d("""
            def format_duration(seconds: int) -> str:
                minutes, secs = divmod(seconds, 60)
                return f"{minutes}:{secs}"


            def parse_duration(text: str) -> int:
                minutes, secs = text.split(":")
                return int(minutes) * 60 + int(secs)
        """),
        "tests/test_duration.py": d("""
            from clock.duration import format_duration, parse_duration


            def test_format_two_digit_seconds():
                assert format_duration(130) == "2:10"


            def test_parse():
                assert parse_duration("2:05") == 125
        """),
    },
    test_file="tests/test_duration.py",
    new_tests=d("""
        def test_format_pads_seconds():
            assert format_duration(65) == "1:05"
            assert format_duration(600) == "10:00"
    """),
    fix=[("clock/duration.py", 'f"{minutes}:{secs}"', 'f"{minutes}:{secs:02d}"')],
    breaks=[("clock/duration.py", "int(minutes) * 60 + int(secs)", "int(minutes) * 60")],
))

SPECS.append(Spec(
    name="calendar_utils",
    kind="missing edge case",
    problem="""
        is_leap_year(2000) is False

        Years divisible by 400 are leap years, so 2000 and 2400 should be True.
        1900 (divisible by 100, not by 400) is correctly False.
    """,
    files={
        "calendar_utils/__init__.py": "",
        "calendar_utils/years.py": d("""
            def is_leap_year(year: int) -> bool:
                return year % 4 == 0 and year % 100 != 0


            def days_in_year(year: int) -> int:
                return 366 if is_leap_year(year) else 365
        """),
        "tests/test_years.py": d("""
            from calendar_utils.years import days_in_year, is_leap_year


            def test_common_leap_year():
                assert is_leap_year(2024)


            def test_century_not_leap():
                assert not is_leap_year(1900)


            def test_days_in_year():
                assert days_in_year(2023) == 365
        """),
    },
    test_file="tests/test_years.py",
    new_tests=d("""
        def test_divisible_by_400():
            assert is_leap_year(2000)
            assert days_in_year(2400) == 366
    """),
    fix=[
        (
            "calendar_utils/years.py",
            "return year % 4 == 0 and year % 100 != 0",
            "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
        )
    ],
    breaks=[
        (
            "calendar_utils/years.py",
            "366 if is_leap_year(year) else 365",
            "366 if is_leap_year(year) else 366",
        )
    ],
))

SPECS.append(Spec(
    name="bounds",
    kind="swapped arguments",
    problem="""
        clamp() returns the upper bound for values inside the range

        `clamp(5, 0, 10)` returns 10. Values inside [lo, hi] should come back unchanged, values
        below lo should give lo and above hi give hi.
    """,
    files={
        "bounds/__init__.py": "",
        "bounds/clamp.py": d("""
            def clamp(x: float, lo: float, hi: float) -> float:
                if lo > hi:
                    raise ValueError("lo must not exceed hi")
                return max(hi, min(lo, x))


            def in_range(x: float, lo: float, hi: float) -> bool:
                return lo <= x <= hi
        """),
        "tests/test_clamp.py": d("""
            import pytest

            from bounds.clamp import clamp, in_range


            def test_bad_bounds():
                with pytest.raises(ValueError):
                    clamp(1, 5, 0)


            def test_in_range():
                assert in_range(5, 0, 10) and not in_range(11, 0, 10)
        """),
    },
    test_file="tests/test_clamp.py",
    new_tests=d("""
        def test_clamp_inside_and_outside():
            assert clamp(5, 0, 10) == 5
            assert clamp(-3, 0, 10) == 0
            assert clamp(42, 0, 10) == 10
    """),
    fix=[("bounds/clamp.py", "max(hi, min(lo, x))", "max(lo, min(hi, x))")],
    breaks=[("bounds/clamp.py", "lo <= x <= hi", "lo <= x <= hi + 1")],
))

SPECS.append(Spec(
    name="approx",
    kind="float equality",
    problem="""
        close_enough(0.1 + 0.2, 0.3) is False

        The function is meant to compare measured values, which are never bit-exact. It should
        treat values within a relative tolerance of 1e-9 as equal.
    """,
    files={
        "approx/__init__.py": "",
        "approx/compare.py": d("""
            def close_enough(a: float, b: float) -> bool:
                return a == b


            def sign(x: float) -> int:
                return (x > 0) - (x < 0)
        """),
        "tests/test_compare.py": d("""
            from approx.compare import close_enough, sign


            def test_equal_values():
                assert close_enough(1.5, 1.5)


            def test_different_values():
                assert not close_enough(1.0, 1.1)


            def test_sign():
                assert [sign(-2), sign(0), sign(3)] == [-1, 0, 1]
        """),
    },
    test_file="tests/test_compare.py",
    new_tests=d("""
        def test_rounding_noise():
            assert close_enough(0.1 + 0.2, 0.3)
    """),
    fix=[
        ("approx/compare.py", "def close_enough", "import math\n\n\ndef close_enough"),
        ("approx/compare.py", "return a == b", "return math.isclose(a, b, rel_tol=1e-9)"),
    ],
    breaks=[("approx/compare.py", "(x > 0) - (x < 0)", "int(x > 0)")],
))

SPECS.append(Spec(
    name="cleaner",
    kind="mutating a list while iterating",
    problem="""
        drop_negatives keeps some negative numbers

        `drop_negatives([1, -2, -3, 4])` returns [1, -3, 4]. Consecutive negative values are not
        all removed. It also changes the list I pass in; I would rather get a new list.
    """,
    files={
        "cleaner/__init__.py": "",
        "cleaner/lists.py": d("""
            def drop_negatives(values: list[int]) -> list[int]:
                for v in values:
                    if v < 0:
                        values.remove(v)
                return values


            def dedupe(values: list[int]) -> list[int]:
                return list(dict.fromkeys(values))
        """),
        "tests/test_lists.py": d("""
            from cleaner.lists import dedupe, drop_negatives


            def test_single_negative():
                assert drop_negatives([1, -2, 3]) == [1, 3]


            def test_dedupe_keeps_order():
                assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]
        """),
    },
    test_file="tests/test_lists.py",
    new_tests=d("""
        def test_consecutive_negatives():
            assert drop_negatives([1, -2, -3, 4]) == [1, 4]


        def test_input_untouched():
            values = [-1, 2]
            drop_negatives(values)
            assert values == [-1, 2]
    """),
    fix=[
        (
            "cleaner/lists.py",
            """    for v in values:
        if v < 0:
            values.remove(v)
    return values""",
            "    return [v for v in values if v >= 0]",
        )
    ],
    breaks=[("cleaner/lists.py", "list(dict.fromkeys(values))", "sorted(set(values))")],
))

SPECS.append(Spec(
    name="multipliers",
    kind="late-binding closure",
    problem="""
        All functions from make_multipliers multiply by the same number

        `fs = make_multipliers(3)` should give functions multiplying by 0, 1 and 2, but
        `[f(10) for f in fs]` is [20, 20, 20].
    """,
    files={
        "multipliers/__init__.py": "",
        "multipliers/factory.py": d("""
            def make_multipliers(n: int):
                return [lambda x: x * i for i in range(n)]


            def make_adder(k: int):
                return lambda x: x + k
        """),
        "tests/test_factory.py": d("""
            from multipliers.factory import make_adder, make_multipliers


            def test_count():
                assert len(make_multipliers(4)) == 4


            def test_adder():
                assert make_adder(3)(4) == 7
        """),
    },
    test_file="tests/test_factory.py",
    new_tests=d("""
        def test_each_multiplier_keeps_its_factor():
            assert [f(10) for f in make_multipliers(3)] == [0, 10, 20]
    """),
    fix=[
        (
            "multipliers/factory.py",
            "[lambda x: x * i for i in range(n)]",
            "[lambda x, i=i: x * i for i in range(n)]",
        )
    ],
    breaks=[("multipliers/factory.py", "lambda x: x + k", "lambda x: x - k")],
))

SPECS.append(Spec(
    name="grids",
    kind="shallow copy",
    problem="""
        Changing a copied grid changes the original

        `g2 = g.copy(); g2.set(0, 0, "X")` also puts "X" into `g`. The copy should be independent.
    """,
    files={
        "grids/__init__.py": "from grids.grid import Grid\n",
        "grids/grid.py": d("""
            class Grid:
                def __init__(self, width: int, height: int, fill: str = ".") -> None:
                    self.rows = [[fill] * width for _ in range(height)]

                def set(self, x: int, y: int, value: str) -> None:
                    self.rows[y][x] = value

                def get(self, x: int, y: int) -> str:
                    return self.rows[y][x]

                def copy(self) -> "Grid":
                    other = Grid(0, 0)
                    other.rows = list(self.rows)
                    return other
        """),
        "tests/test_grid.py": d("""
            from grids import Grid


            def test_set_get():
                g = Grid(3, 2)
                g.set(2, 1, "#")
                assert g.get(2, 1) == "#" and g.get(0, 0) == "."


            def test_copy_has_same_cells():
                g = Grid(2, 2)
                g.set(1, 1, "#")
                assert g.copy().get(1, 1) == "#"
        """),
    },
    test_file="tests/test_grid.py",
    new_tests=d("""
        def test_copy_is_independent():
            g = Grid(2, 2)
            g2 = g.copy()
            g2.set(0, 0, "X")
            assert g.get(0, 0) == "."
    """),
    fix=[
        ("grids/grid.py", "other.rows = list(self.rows)", "other.rows = [list(row) for row in self.rows]")
    ],
    breaks=[("grids/grid.py", "self.rows[y][x] = value", "self.rows[x % len(self.rows)][y] = value")],
))

SPECS.append(Spec(
    name="progress",
    kind="integer vs float division",
    problem="""
        percent_done rounds down to whole percents

        With 1 of 3 steps done, `percent_done(1, 3)` returns 33 instead of about 33.33, so the
        progress bar never shows fractions. Also, `percent_done(0, 0)` should be 100.0 (nothing
        to do) rather than raising ZeroDivisionError.
    """,
    files={
        "progress/__init__.py": "",
        "progress/bar.py": d("""
            def percent_done(done: int, total: int) -> float:
                return done * 100 // total


            def bar(fraction: float, width: int = 10) -> str:
                filled = round(fraction * width)
                return "#" * filled + "-" * (width - filled)
        """),
        "tests/test_bar.py": d("""
            from progress.bar import bar, percent_done


            def test_half():
                assert percent_done(5, 10) == 50


            def test_bar():
                assert bar(0.5, 4) == "##--"
        """),
    },
    test_file="tests/test_bar.py",
    new_tests=d("""
        import pytest


        def test_fractional_percent():
            assert percent_done(1, 3) == pytest.approx(33.3333, rel=1e-4)


        def test_nothing_to_do():
            assert percent_done(0, 0) == 100.0
    """),
    fix=[
        (
            "progress/bar.py",
            "    return done * 100 // total\n",
            "    if total == 0:\n        return 100.0\n    return done * 100 / total\n",
        )
    ],
    breaks=[
        ("progress/bar.py", "filled = round(fraction * width)", "filled = int(fraction * width) + 1")
    ],
))

SPECS.append(Spec(
    name="tables",
    kind="string formatting",
    problem="""
        render_table misaligns columns when a value is wider than its header

        Rendering [["name", "n"], ["apple", "10"]] gives

            name | n
            apple | 10

        Each column should be as wide as its widest cell (header or value):

            name  | n
            apple | 10
    """,
    files={
        "tables/__init__.py": "",
        "tables/render.py": d("""
            def render_table(rows: list[list[str]]) -> str:
                widths = [len(cell) for cell in rows[0]]
                lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
                return "\\n".join(line.rstrip() for line in lines)
        """),
        "tests/test_render.py": d("""
            from tables.render import render_table


            def test_header_widest():
                assert render_table([["name", "qty"], ["a", "1"]]) == "name | qty\\na    | 1"


            def test_single_row():
                assert render_table([["x", "y"]]) == "x | y"
        """),
    },
    test_file="tests/test_render.py",
    new_tests=d("""
        def test_value_wider_than_header():
            assert render_table([["name", "n"], ["apple", "10"]]) == "name  | n\\napple | 10"
    """),
    fix=[
        (
            "tables/render.py",
            "widths = [len(cell) for cell in rows[0]]",
            "widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]",
        )
    ],
    breaks=[
        (
            "tables/render.py",
            "    widths = [max(",
            '    if len(rows) == 1:\n        return ",".join(rows[0])\n    widths = [max(',
        )
    ],
))

SPECS.append(Spec(
    name="lookup",
    kind="exception handling",
    problem="""
        get_path raises KeyError for missing keys instead of returning the default

        `get_path({"a": {"b": 1}}, "a.c", default=0)` raises KeyError: 'c'. Any missing key on the
        way should give the default. (A missing top-level key already works.)
    """,
    files={
        "lookup/__init__.py": "",
        "lookup/paths.py": d('''
            def get_path(data: dict, path: str, default=None):
                """data["a"]["b"] for path "a.b"; default when a key is missing."""
                first, *rest = path.split(".")
                if first not in data:
                    return default
                value = data[first]
                for key in rest:
                    value = value[key]
                return value
        '''),
        "tests/test_paths.py": d("""
            from lookup.paths import get_path


            def test_nested():
                assert get_path({"a": {"b": 1}}, "a.b") == 1


            def test_missing_top_level():
                assert get_path({}, "a.b", default=7) == 7
        """),
    },
    test_file="tests/test_paths.py",
    new_tests=d("""
        def test_missing_nested_key():
            assert get_path({"a": {"b": 1}}, "a.c", default=0) == 0


        def test_non_dict_on_the_way():
            assert get_path({"a": 5}, "a.b", default=0) == 0
    """),
    fix=[
        (
            "lookup/paths.py",
            """    for key in rest:
        value = value[key]""",
            """    for key in rest:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]""",
        )
    ],
    breaks=[
        (
            "lookup/paths.py",
            "    if first not in data:\n        return default",
            "    if first not in data:\n        return None",
        )
    ],
))

SPECS.append(Spec(
    name="retrying",
    kind="wrong default",
    problem="""
        retry() never retries unless attempts is given

        The docstring says it tries 3 times by default, but `retry(flaky)` gives up after the first
        failure. `retry(flaky, attempts=3)` behaves as documented.
    """,
    files={
        "retrying/__init__.py": "",
        "retrying/retry.py": d('''
            def retry(fn, attempts: int = 1, exceptions=(Exception,)):
                """Call fn() up to `attempts` times (3 by default); re-raise the last error."""
                if attempts < 1:
                    raise ValueError("attempts must be >= 1")
                for i in range(attempts):
                    try:
                        return fn()
                    except exceptions:
                        if i == attempts - 1:
                            raise
        '''),
        "tests/test_retry.py": d("""
            import pytest

            from retrying.retry import retry


            def flaky(failures):
                calls = []

                def fn():
                    calls.append(1)
                    if len(calls) <= failures:
                        raise OSError("boom")
                    return len(calls)

                return fn


            def test_explicit_attempts():
                assert retry(flaky(2), attempts=3) == 3


            def test_gives_up():
                with pytest.raises(OSError):
                    retry(flaky(5), attempts=2)


            def test_bad_attempts():
                with pytest.raises(ValueError):
                    retry(flaky(0), attempts=0)
        """),
    },
    test_file="tests/test_retry.py",
    new_tests=d("""
        def test_default_three_attempts():
            assert retry(flaky(2)) == 3
    """),
    fix=[("retrying/retry.py", "attempts: int = 1,", "attempts: int = 3,")],
    breaks=[("retrying/retry.py", "if attempts < 1:", "if attempts < 0:")],
))

# ---- multi-file tasks ----------------------------------------------------------------------

SPECS.append(Spec(
    name="shop",
    kind="multi-file: float rounding in two modules",
    problem="""
        Cart total is off by a cent

        A cart with two items at 0.29 shows a total of 0.56 (56 cents); it should be 0.58.
        `to_cents(0.29)` also returns 28. Prices in the catalogue have at most two decimals.
    """,
    files={
        "shop/__init__.py": "",
        "shop/money.py": d("""
            def to_cents(amount: float) -> int:
                return int(amount * 100)


            def from_cents(cents: int) -> float:
                return cents / 100
        """),
        "shop/cart.py": d("""
            from shop.money import from_cents


            class Cart:
                def __init__(self) -> None:
                    self.prices: list[float] = []

                def add(self, price: float) -> None:
                    self.prices.append(price)

                def total_cents(self) -> int:
                    return sum(int(p * 100) for p in self.prices)

                def total(self) -> float:
                    return from_cents(self.total_cents())
        """),
        "tests/test_cart.py": d("""
            from shop.cart import Cart
            from shop.money import from_cents, to_cents


            def test_round_prices():
                cart = Cart()
                cart.add(1.5)
                cart.add(2.0)
                assert cart.total_cents() == 350


            def test_from_cents():
                assert from_cents(250) == 2.5


            def test_to_cents_exact():
                assert to_cents(2.5) == 250
        """),
    },
    test_file="tests/test_cart.py",
    new_tests=d("""
        def test_to_cents_rounds():
            assert to_cents(0.29) == 29


        def test_total_of_inexact_prices():
            cart = Cart()
            cart.add(0.29)
            cart.add(0.29)
            assert cart.total_cents() == 58
    """),
    fix=[
        ("shop/money.py", "return int(amount * 100)", "return round(amount * 100)"),
        (
            "shop/cart.py",
            "from shop.money import from_cents",
            "from shop.money import from_cents, to_cents",
        ),
        (
            "shop/cart.py",
            "sum(int(p * 100) for p in self.prices)",
            "sum(to_cents(p) for p in self.prices)",
        ),
    ],
    breaks=[("shop/money.py", "return cents / 100", "return cents // 100")],
))

SPECS.append(Spec(
    name="exporters",
    kind="multi-file: missing registry entry and error type",
    problem="""
        export(rows, "tsv") fails although TSV is documented

        `export([["a", "b"]], "tsv")` raises `KeyError: 'tsv'`; the docs list csv and tsv. While
        at it: an unknown format should raise ValueError naming the supported formats, not a bare
        KeyError.
    """,
    files={
        "exporters/__init__.py": "from exporters.export import export\n",
        "exporters/formats.py": d("""
            def to_csv(rows: list[list[str]]) -> str:
                return "".join(",".join(row) + "\\n" for row in rows)


            FORMATS = {"csv": to_csv}
        """),
        "exporters/export.py": d('''
            from exporters.formats import FORMATS


            def export(rows: list[list[str]], fmt: str = "csv") -> str:
                """Render rows as csv or tsv."""
                return FORMATS[fmt](rows)
        '''),
        "tests/test_export.py": d("""
            from exporters import export


            def test_csv():
                assert export([["a", "b"], ["c", "d"]]) == "a,b\\nc,d\\n"
        """),
    },
    test_file="tests/test_export.py",
    new_tests=d("""
        import pytest


        def test_tsv():
            assert export([["a", "b"]], "tsv") == "a\\tb\\n"


        def test_unknown_format():
            with pytest.raises(ValueError, match="csv, tsv"):
                export([["a"]], "xml")
    """),
    fix=[
        (
            "exporters/formats.py",
            'FORMATS = {"csv": to_csv}',
            d("""
            def to_tsv(rows: list[list[str]]) -> str:
                return "".join("\\t".join(row) + "\\n" for row in rows)


            FORMATS = {"csv": to_csv, "tsv": to_tsv}""").rstrip("\n"),
        ),
        (
            "exporters/export.py",
            "    return FORMATS[fmt](rows)",
            d("""
            ....if fmt not in FORMATS:
            ........raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(sorted(FORMATS))}")
            ....return FORMATS[fmt](rows)""").replace("....", "    "),
        ),
    ],
    breaks=[("exporters/formats.py", '",".join(row) + "\\n"', '",".join(row)')],
))

SPECS.append(Spec(
    name="inventory",
    kind="multi-file: normalisation missing in model and lookup",
    problem="""
        SKU lookup is case-sensitive

        Items added with SKU "ab-12" cannot be found with `store.find("AB-12")`, and vice versa.
        SKUs are case-insensitive in our warehouse system; `Item.sku` should always be stored
        upper-case and `find` should accept any case.
    """,
    files={
        "inventory/__init__.py": "",
        "inventory/models.py": d("""
            from dataclasses import dataclass


            @dataclass
            class Item:
                sku: str
                quantity: int = 0
        """),
        "inventory/store.py": d("""
            from inventory.models import Item


            class Store:
                def __init__(self) -> None:
                    self.items: dict[str, Item] = {}

                def add(self, item: Item) -> None:
                    self.items[item.sku] = item

                def find(self, sku: str) -> Item | None:
                    return self.items.get(sku)

                def total_quantity(self) -> int:
                    return sum(item.quantity for item in self.items.values())
        """),
        "tests/test_store.py": d("""
            from inventory.models import Item
            from inventory.store import Store


            def test_find_exact():
                store = Store()
                store.add(Item("AB-12", 3))
                assert store.find("AB-12").quantity == 3


            def test_total_quantity():
                store = Store()
                store.add(Item("A", 2))
                store.add(Item("B", 5))
                assert store.total_quantity() == 7
        """),
    },
    test_file="tests/test_store.py",
    new_tests=d("""
        def test_sku_stored_upper_case():
            assert Item("ab-12").sku == "AB-12"


        def test_find_any_case():
            store = Store()
            store.add(Item("ab-12", 1))
            assert store.find("Ab-12").quantity == 1
    """),
    fix=[
        (
            "inventory/models.py",
            "    quantity: int = 0\n",
            "    quantity: int = 0\n\n    def __post_init__(self) -> None:\n        self.sku = self.sku.upper()\n",
        ),
        ("inventory/store.py", "return self.items.get(sku)", "return self.items.get(sku.upper())"),
    ],
    breaks=[
        (
            "inventory/store.py",
            "sum(item.quantity for item in self.items.values())",
            "max(item.quantity for item in self.items.values())",
        )
    ],
))

SPECS.append(Spec(
    name="logfilter",
    kind="multi-file: comparing level names as strings",
    problem="""
        filter_records drops errors

        With threshold "info", records at level "error" are filtered out while "warn" ones are kept.
        It looks like the levels are compared alphabetically. Also the level "warning" (as Python's
        logging names it) raises KeyError; it should mean the same as "warn".
    """,
    files={
        "logfilter/__init__.py": "",
        "logfilter/levels.py": d("""
            LEVELS = {"debug": 10, "info": 20, "warn": 30, "error": 40}


            def level_number(name: str) -> int:
                return LEVELS[name.lower()]
        """),
        "logfilter/filter.py": d('''
            def filter_records(records: list[dict], threshold: str) -> list[dict]:
                """Records whose level is at least `threshold`."""
                return [r for r in records if r["level"] >= threshold]
        '''),
        "tests/test_filter.py": d("""
            from logfilter.filter import filter_records
            from logfilter.levels import level_number


            def test_level_number():
                assert level_number("INFO") == 20


            def test_keeps_warn_over_info():
                records = [{"level": "debug"}, {"level": "warn"}]
                assert filter_records(records, "info") == [{"level": "warn"}]
        """),
    },
    test_file="tests/test_filter.py",
    new_tests=d("""
        def test_keeps_errors_over_info():
            records = [{"level": "info"}, {"level": "error"}, {"level": "debug"}]
            assert filter_records(records, "info") == [{"level": "info"}, {"level": "error"}]


        def test_warning_alias():
            assert level_number("warning") == level_number("warn")
            assert filter_records([{"level": "warning"}], "warn") == [{"level": "warning"}]
    """),
    fix=[
        ("logfilter/levels.py", '"warn": 30,', '"warn": 30, "warning": 30,'),
        (
            "logfilter/filter.py",
            "def filter_records",
            "from logfilter.levels import level_number\n\n\ndef filter_records",
        ),
        (
            "logfilter/filter.py",
            'r["level"] >= threshold]',
            'level_number(r["level"]) >= level_number(threshold)]',
        ),
    ],
    breaks=[("logfilter/levels.py", "return LEVELS[name.lower()]", "return LEVELS[name]")],
))

SPECS.append(Spec(
    name="csvtool",
    kind="multi-file: quoting in reader and writer",
    problem="""
        Fields containing commas do not survive a write/read round trip

        `read_line(write_line(["a,b", "c"]))` gives ["a", "b", "c"] instead of ["a,b", "c"]. The
        writer should quote such fields (and quotes inside them) the way CSV does, and the reader
        should understand the quoting.
    """,
    files={
        "csvtool/__init__.py": "",
        "csvtool/reader.py": d("""
            def read_line(line: str) -> list[str]:
                return line.rstrip("\\n").split(",")
        """),
        "csvtool/writer.py": d("""
            def write_line(fields: list[str]) -> str:
                return ",".join(fields) + "\\n"
        """),
        "tests/test_roundtrip.py": d("""
            from csvtool.reader import read_line
            from csvtool.writer import write_line


            def test_plain_round_trip():
                assert read_line(write_line(["a", "b"])) == ["a", "b"]


            def test_write_plain():
                assert write_line(["x", "y"]) == "x,y\\n"
        """),
    },
    test_file="tests/test_roundtrip.py",
    new_tests=d("""
        def test_comma_round_trip():
            fields = ["a,b", 'say "hi"', "c"]
            assert read_line(write_line(fields)) == fields


        def test_writer_quotes_commas():
            assert write_line(["a,b", "c"]) == '"a,b",c\\n'
    """),
    fix=[
        (
            "csvtool/reader.py",
            """def read_line(line: str) -> list[str]:
    return line.rstrip("\\n").split(",")""",
            """import csv


def read_line(line: str) -> list[str]:
    return next(csv.reader([line.rstrip("\\n")]))""",
        ),
        (
            "csvtool/writer.py",
            '''def write_line(fields: list[str]) -> str:
    return ",".join(fields) + "\\n"''',
            """import csv
import io


def write_line(fields: list[str]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\\n").writerow(fields)
    return out.getvalue()""",
        ),
    ],
    breaks=[
        (
            "csvtool/writer.py",
            "    out = io.StringIO()\n",
            (
                '    if not any("," in f or \'"\' in f for f in fields):\n'
                '        return ";".join(fields) + "\\n"\n'
                "    out = io.StringIO()\n"
            ),
        )
    ],
))

SPECS.append(Spec(
    name="thermo",
    kind="multi-file: integer division and report precision",
    problem="""
        Body temperature report shows 37 °C for 98.6 °F, and 98.0 °F gives 36

        `report(98.6)` prints "98.6 °F = 37 °C"; I expected "98.6 °F = 37.0 °C", and
        `fahrenheit_to_celsius(98.0)` should be 36.67, not 36. The conversion should be exact and
        the report should show one decimal.
    """,
    files={
        "thermo/__init__.py": "",
        "thermo/convert.py": d("""
            def fahrenheit_to_celsius(f: float) -> float:
                return (f - 32) * 5 // 9


            def celsius_to_fahrenheit(c: float) -> float:
                return c * 9 / 5 + 32
        """),
        "thermo/report.py": d("""
            from thermo.convert import fahrenheit_to_celsius


            def report(f: float) -> str:
                return f"{f} °F = {fahrenheit_to_celsius(f):.0f} °C"
        """),
        "tests/test_thermo.py": d("""
            from thermo.convert import celsius_to_fahrenheit, fahrenheit_to_celsius


            def test_freezing():
                assert fahrenheit_to_celsius(32) == 0


            def test_back_to_fahrenheit():
                assert celsius_to_fahrenheit(100) == 212
        """),
    },
    test_file="tests/test_thermo.py",
    new_tests=d("""
        import pytest

        from thermo.report import report


        def test_exact_conversion():
            assert fahrenheit_to_celsius(98.0) == pytest.approx(36.6667, rel=1e-4)


        def test_report_one_decimal():
            assert report(98.6) == "98.6 °F = 37.0 °C"
    """),
    fix=[
        ("thermo/convert.py", "(f - 32) * 5 // 9", "(f - 32) * 5 / 9"),
        ("thermo/report.py", ":.0f} °C", ":.1f} °C"),
    ],
    breaks=[("thermo/convert.py", "c * 9 / 5 + 32", "c * 9 / 5")],
))

SPECS.append(Spec(
    name="events",
    kind="multi-file: class attribute shared between instances",
    problem="""
        Handlers registered on one EventBus fire on every bus

        I create two buses, subscribe a handler on the first, and emitting on the second calls it.
        Also `Recorder` (in recorder.py) collects events from all recorders into one list.
    """,
    files={
        "events/__init__.py": "",
        "events/bus.py": d("""
            class EventBus:
                handlers: list = []

                def subscribe(self, handler) -> None:
                    self.handlers.append(handler)

                def emit(self, event: str) -> int:
                    for handler in self.handlers:
                        handler(event)
                    return len(self.handlers)
        """),
        "events/recorder.py": d("""
            class Recorder:
                seen: list = []

                def __call__(self, event: str) -> None:
                    self.seen.append(event)
        """),
        "tests/test_bus.py": d("""
            from events.bus import EventBus
            from events.recorder import Recorder


            def test_emit_reaches_handler():
                bus = EventBus()
                rec = Recorder()
                bus.subscribe(rec)
                bus.emit("x")
                assert "x" in rec.seen


            def test_emit_counts_handlers():
                assert EventBus().emit("y") >= 0
        """),
    },
    test_file="tests/test_bus.py",
    new_tests=d("""
        def test_buses_are_independent():
            a, b = EventBus(), EventBus()
            a.subscribe(Recorder())
            assert b.emit("z") == 0


        def test_recorders_are_independent():
            r1, r2 = Recorder(), Recorder()
            r1("only-r1")
            assert r2.seen == []
    """),
    fix=[
        (
            "events/bus.py",
            "    handlers: list = []\n",
            "    def __init__(self) -> None:\n        self.handlers: list = []\n",
        ),
        (
            "events/recorder.py",
            "    seen: list = []\n",
            "    def __init__(self) -> None:\n        self.seen: list = []\n",
        ),
    ],
    breaks=[("events/recorder.py", "self.seen.append(event)", "self.seen.append(event.upper())")],
))

# fmt: on


def build(specs: list[Spec] = SPECS) -> str:
    """The JSONL text of the task set (one record per line, in SPECS order)."""
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError("task names repeat")
    lines = []
    for spec in specs:
        if spec.test_file not in spec.files or any(path.startswith("tests/") for path, _, _ in spec.fix):
            raise ValueError(f"{spec.name}: the test file must exist and the fix must not touch tests/")
        rec = record(spec)
        parse_task(rec, spec.name)  # the loader's checks, at generation time
        lines.append(json.dumps(rec, ensure_ascii=False, sort_keys=False) + "\n")
    return "".join(lines)


def verify_task(task: SWETask, spec: Spec, timeout_s: float = 60.0) -> list[str]:
    """Problems with one task (empty when it is sound): see the module docstring."""
    problems = []
    stages = [("base", ""), ("fixed", task.patch), ("broken", breaking_patch(spec))]
    for stage, patch in stages:
        with tempfile.TemporaryDirectory() as tmp:
            root = materialise(task, Path(tmp) / "repo")
            for p in (patch, task.test_patch):
                if p and git(["apply", "-"], root, input=p).returncode != 0:
                    problems.append(f"{stage}: a patch does not apply")
            run = local_runner(pytest_command(task.tests), root, timeout_s)
            out = parse_outcomes(run.output, task.tests)
        f2p = [out[t] == "passed" for t in task.fail_to_pass]
        p2p = [out[t] == "passed" for t in task.pass_to_pass]
        if stage == "base" and (any(f2p) or not all(p2p)):
            problems.append(f"base: FAIL_TO_PASS must fail and PASS_TO_PASS pass, got {out}")
        if stage == "fixed" and not (all(f2p) and all(p2p)):
            problems.append(f"fixed: every test must pass, got {out}")
        if stage == "broken" and not (all(f2p) and not all(p2p)):
            problems.append(f"broken: FAIL_TO_PASS must pass and a PASS_TO_PASS test fail, got {out}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_PATH.parent, help="directory for tasks.jsonl")
    parser.add_argument("--check", action="store_true", help="exit 1 if the shipped file differs")
    parser.add_argument("--verify", action="store_true", help="run every task's tests (see the docstring)")
    parser.add_argument("--parquet", action="store_true", help="also write tasks.parquet (needs pyarrow)")
    args = parser.parse_args()
    text = build()
    target = args.out / "tasks.jsonl"
    if args.check:
        same = target.is_file() and target.read_text(encoding="utf-8") == text
        print(f"{target}: {'up to date' if same else 'differs from the generator; rerun tools/make_swe_tasks.py'}")
        if not same:
            return 1
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        print(f"wrote {len(SPECS)} tasks to {target}")
        if args.parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            rows = [json.loads(line) for line in text.splitlines()]
            for row in rows:  # Parquet wants one schema: the snapshot as a JSON string is not it
                row["files"] = [{"path": k, "content": v} for k, v in row["files"].items()]
            pq.write_table(pa.Table.from_pylist(rows), args.out / "tasks.parquet")
    if args.verify:
        failed = 0
        for spec, line in zip(SPECS, text.splitlines(), strict=True):
            task = parse_task(json.loads(line), spec.name)
            problems = verify_task(task, spec)
            failed += bool(problems)
            print(f"{task.instance_id:40s} {'ok' if not problems else 'FAIL: ' + '; '.join(problems)}")
        print(f"verified {len(SPECS) - failed}/{len(SPECS)} tasks")
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
