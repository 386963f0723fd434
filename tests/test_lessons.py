"""Every lesson has the lesson's shape and reads as a lesson, not as a lab log.

The shape (DESIGN.md §2): a "where we are" box, questions with their answers, at most ~250 lines, and a last
line that says what the next step fixes. A lab log shows itself by phrases about calls, runs and sessions, and by
commit hashes in the prose; history belongs in a step's NOTES.md or in git.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LESSONS = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("step*/README.md"))
MAX_LINES = 250

# Phrases that narrate how the evidence was made rather than what it shows.
LOG_PHRASES = (
    "in one call", "earlier call", "last call", "this call", "this session", "before they went",
    "in an earlier run", "earlier run", "in this run", "previous version of this table", "provisional",
    "in the same call", "run twice more", "runs twice more",
)
# Seven to twelve hex digits with at least one letter and one digit: how a commit hash looks in prose.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")
# A generated table's source line names a committed file, and maybe the records it shows:
# `<!-- results/...json [a; b]: commit ..., device, ... -->`.
TABLE_MARKER = re.compile(r"<!--\s*(\S+?)(?:\s+\[[^\]]*\])?:\s*commit\b")


def prose_of(text: str) -> str:
    """The text a reader reads as sentences: without HTML comments, code blocks and inline code (paths, flags)."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def log_phrasing(text: str) -> list[str]:
    """Each line of prose that narrates the lab: a log phrase or a commit hash."""
    found = []
    for number, line in enumerate(prose_of(text).splitlines(), 1):
        lowered = line.lower()
        phrases = [p for p in LOG_PHRASES if p in lowered] + COMMIT_HASH.findall(line)
        if phrases:
            found.append(f"{phrases}: {line.strip()[:100]}")
    return found


def markers_without_a_file(text: str) -> list[str]:
    """Each `<!-- ... commit ... -->` table marker that does not start with a committed file's path."""
    bad = []
    for line in text.splitlines():
        if line.startswith("<!--") and "commit" in line:
            marker = TABLE_MARKER.match(line)
            if marker is None or not (REPO / marker.group(1)).is_file():
                bad.append(line[:100])
    return bad


@pytest.mark.parametrize("lesson", [*LESSONS, "README.md"])
def test_no_log_phrasing(lesson: str) -> None:
    assert log_phrasing((REPO / lesson).read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("lesson", [*LESSONS, "README.md"])
def test_every_table_marker_names_a_committed_file(lesson: str) -> None:
    assert markers_without_a_file((REPO / lesson).read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("lesson", [*LESSONS, "README.md"])
def test_lesson_length(lesson: str) -> None:
    lines = (REPO / lesson).read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{lesson} has {lines} lines: move history to NOTES.md, keep the lesson"


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_shape(lesson: str) -> None:
    text = (REPO / lesson).read_text(encoding="utf-8")
    assert "**Where we are:**" in text, "the three-line box: where we are, what is left, this step's fix"
    assert text.count("<details>") >= 3, "three to five questions, each answer in <details>"
    last_line = text.rstrip().splitlines()[-1]
    assert "next" in last_line.lower(), f"the last line says what the next lesson fixes, not: {last_line[:80]}"


IMAGE = re.compile(r"!\[[^\]]+\]\(([^)\s]+)\)")
# A drawing in text: a ```text block with its caption right below it, `*Figure: ...*`.
TEXT_FIGURE = re.compile(r"^```text\n.*?^```\n\*Figure[^*\n]*\*", flags=re.S | re.M)


def figures_in(lesson: str, text: str) -> list[str]:
    """The lesson's pictures: images of committed files, and captioned drawings in text."""
    folder = (REPO / lesson).parent
    images = [path for path in IMAGE.findall(text) if (folder / path).resolve().is_file()]
    return images + TEXT_FIGURE.findall(text)


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_has_a_picture(lesson: str) -> None:
    text = (REPO / lesson).read_text(encoding="utf-8")
    assert figures_in(lesson, text), (f"{lesson} has no picture: a plot of its evidence (`![what it shows](file.png)`, "
                                      "a committed file) or a drawing in a ```text block captioned `*Figure: ...*`")


def test_the_checks_can_fail() -> None:
    lesson = "step01_serial/README.md"
    assert figures_in(lesson, "![plot](../results/gpu/nothing.png)\n```text\na -> b\n```\nno caption\n") == []
    assert len(figures_in(lesson, "![plot](../results/gpu/decode-batch1-8.png)\n```text\na\n```\n*Figure: a.*\n")) == 2
    log = "The figures are provisional.\nA gain of 1.2x at c064396, as `results/a-c064396.json` says.\n"
    assert len(log_phrasing(log)) == 2
    assert log_phrasing("Run `git show c064396:results/x.json`.\n<!-- results/x.json: commit c064396 -->\n") == []
    assert markers_without_a_file("<!-- commit c064396, H200 -->\n<!-- results/nothing.json: commit c0 -->") != []
    assert markers_without_a_file("<!-- results/gpu/decode-batch1-8.json [step01_serial; hf-generate]: commit c0 -->") == []
