"""Every measured figure a lesson quotes in its prose comes from the evidence the lesson names.

A figure is a number with a unit of measure (`40.2 ms`, `1,997 tok/s`, `9.4x`, `35%`, `1,252 kernels`). It is held
when a generated table of the lesson shows it (tests/test_results_tables.py checks those against their files), or
when an evidence file named in its section of the lesson (a table's source line, a `results/...` path or link)
holds it at the
precision shown: a value, scaled to the unit (seconds to ms, a fraction to %, bytes to MiB), or for `x` and `%` the
ratio of two values under the same name in that file (one system's tok/s over another's) or of two values side by
side in one record. A figure that is arithmetic on a worked example, not a measurement, goes in a code block.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_lessons import prose_of

REPO = Path(__file__).resolve().parent.parent
LESSONS = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("step*/README.md")) + ["README.md"]

# A number (with thousands separators and decimals) and the unit that makes it a measurement.
FIGURE = re.compile(
    r"(?<![\w.,/-])(?P<number>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<decimals>\d+))?"
    r"(?:(?P<ratio>x|%)|\s(?P<unit>tok/s|ms|us|µs|s|GB/s|TB/s|TFLOP/s|MiB|GiB|MB|GB|kernels|launches|syncs))"
    r"(?![\w/])")
# How a value stored under a unit can be shown under another: ms as s, s as ms, bytes as MiB, ...
SCALES: dict[str, tuple[float, ...]] = {
    "tok/s": (1.0,), "ms": (1.0, 1e3, 1e-3), "us": (1.0, 1e3, 1e6), "µs": (1.0, 1e3, 1e6), "s": (1.0, 1e-3),
    "GB/s": (1.0, 1e3), "TB/s": (1.0, 1e-3), "TFLOP/s": (1.0,), "MiB": (1.0, 2.0 ** -20), "GiB": (1.0, 2.0 ** -30, 2.0 ** -10),
    "MB": (1.0, 1e-6), "GB": (1.0, 1e-9, 1e-3), "kernels": (1.0,), "launches": (1.0,), "syncs": (1.0,),
    "x": (1.0,), "%": (100.0,),
}
EVIDENCE_PATH = re.compile(r"results/(?:gpu|cpu)/[\w.+-]+\.(?:json|txt)")


class Figure:
    def __init__(self, match: re.Match[str]) -> None:
        self.text = match.group(0)
        decimals = match.group("decimals") or ""
        self.places = len(decimals)
        self.value = float(match.group("number").replace(",", "") + (f".{decimals}" if decimals else ""))
        self.unit = match.group("ratio") or match.group("unit")

    def shown_as(self, value: float) -> bool:
        """Whether `value` is this figure at its precision, under any scale its unit may be stored in."""
        return any(round(value * scale, self.places) == self.value for scale in SCALES[self.unit])


def numbers(node: object, name: str = "") -> Iterator[tuple[str, float, int]]:
    """Every number in a JSON document: (its key, its value, the id of the record that holds it)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield str(key), float(value), id(node)
            else:
                yield from numbers(value, str(key))
    elif isinstance(node, list):
        for item in node:
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                yield name, float(item), id(node)
            else:
                yield from numbers(item, name)


class Evidence:
    """The numbers of the files a lesson names, and the ratios a figure may be computed as."""

    def __init__(self, paths: set[str]) -> None:
        self.values: list[float] = []
        self.ratios: set[tuple[float, float]] = set()  # (numerator, denominator) pairs worth dividing
        self.text_figures: set[str] = set()
        for path in sorted(paths):
            text = (REPO / path).read_text(encoding="utf-8")
            if path.endswith(".txt"):
                self.text_figures |= {m.group(0) for m in FIGURE.finditer(text)}
                self.values += [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]
                continue
            found = list(numbers(json.loads(text)))
            self.values += [value for _, value, _ in found]
            by_name: dict[str, list[float]] = {}
            by_record: dict[int, list[float]] = {}
            for name, value, record in found:
                by_name.setdefault(name, []).append(value)
                by_record.setdefault(record, []).append(value)
            for group in [*by_name.values(), *by_record.values()]:
                self.ratios |= {(a, b) for a in group for b in group if b and a != b}

    def holds(self, figure: Figure) -> bool:
        if figure.text in self.text_figures or any(figure.shown_as(v) for v in self.values):
            return True
        if figure.unit in ("x", "%"):
            return any(figure.shown_as(a / b) or figure.unit == "%" and figure.shown_as(1 - a / b)
                       for a, b in self.ratios)
        return False


def named_evidence(text: str) -> set[str]:
    """The committed evidence files a lesson names: its tables' source lines, paths and links."""
    return {path for path in EVIDENCE_PATH.findall(text) if (REPO / path).is_file()}


def table_figures(text: str) -> set[str]:
    """The figures the lesson's tables show, as written."""
    rows = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("|"))
    return {m.group(0) for m in FIGURE.finditer(rows)}


def prose_lines(text: str) -> str:
    """The prose a reader reads as sentences (prose_of), without the tables."""
    return "\n".join(line for line in prose_of(text).splitlines() if not line.lstrip().startswith("|"))


def sections(text: str) -> list[str]:
    """The lesson cut at its headings: a figure's evidence is named in its own section (the box is one)."""
    return re.split(r"^(?=#)", text, flags=re.M)


def unsourced_figures(text: str) -> list[str]:
    """Each figure of the prose that neither a table of the lesson shows nor an evidence file its section names
    holds."""
    shown = table_figures(text)
    missing = []
    for section in sections(text):
        evidence = Evidence(named_evidence(section))
        missing += [figure.text for figure in map(Figure, FIGURE.finditer(prose_lines(section)))
                    if figure.text not in shown and not evidence.holds(figure)]
    return missing


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_figure_comes_from_named_evidence(lesson: str) -> None:
    missing = unsourced_figures((REPO / lesson).read_text(encoding="utf-8"))
    assert missing == [], (f"{lesson}: figures no table or named evidence file holds: {missing}. Quote the "
                           "generated table or the file's value (scripts/results_table.py), and name the file")


def test_the_check_can_fail() -> None:
    cited = "The final engine writes 1,997 tok/s (`results/gpu/decode-batch1-8.json`).\n"
    doc = json.loads((REPO / "results/gpu/decode-batch1-8.json").read_text(encoding="utf-8"))
    fastest = max(run["output_tok_per_s"] for run in doc["runs"])
    slowest = min(run["output_tok_per_s"] for run in doc["runs"])
    held = f"It writes {fastest:,.1f} tok/s, {fastest / slowest:.1f}x the slowest (`results/gpu/decode-batch1-8.json`).\n"
    assert unsourced_figures(held) == []
    assert unsourced_figures(held.replace("decode-batch1-8", "nothing-here")) != []  # a file it does not name
    assert unsourced_figures(cited.replace("1,997", "1,234.5")) == ["1,234.5 tok/s"]
    assert unsourced_figures("The pool holds 8 x 16 slots.\n```\n12.5 ms\n```\n") == []  # worked arithmetic
