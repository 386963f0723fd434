"""The lessons read front to back: each names only steps that come before it on the path, except in a look-ahead.

The path is `common.steps.LESSON_PATH`. A lesson names a step as "step 12", "steps 09, 10 and 11", "steps 12-14",
`step12_cuda_graph` or a link to its folder. A look-ahead is a paragraph that opens with `**Looking ahead:**`: it
says why it names later steps; a table right below it (after its source line) belongs to it. The last line, which
says what the next lesson fixes, may name the next one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.steps import LESSON_PATH

REPO = Path(__file__).resolve().parent.parent
LOOK_AHEAD = "**Looking ahead:**"
NUMBER_OF = {name[4:6]: name for name in LESSON_PATH}
# "step 12", "Steps 09, 10 and 11", "steps 12-14", "steps 01/06": a word and the numbers it governs.
STEP_WORDS = re.compile(r"\b[Ss]teps?\s+(\d{2}(?:(?:\s*(?:,|-|–|/|\band\b|\bor\b|\bto\b)\s*)\d{2})*)")
STEP_FOLDER = re.compile(r"\bstep(\d{2})_[a-z_]+")


def steps_named(line: str) -> set[str]:
    """The path's steps a line names, a range ("steps 12-14") read along the path."""
    numbers: set[str] = set(STEP_FOLDER.findall(line))
    for group in STEP_WORDS.findall(line):
        numbers |= set(re.findall(r"\d{2}", group))
        for low, high in re.findall(r"(\d{2})\s*(?:-|–|\bto\b)\s*(\d{2})", group):
            if low in NUMBER_OF and high in NUMBER_OF:
                start, end = LESSON_PATH.index(NUMBER_OF[low]), LESSON_PATH.index(NUMBER_OF[high])
                numbers |= {name[4:6] for name in LESSON_PATH[start:end + 1]}
    return {NUMBER_OF[n] for n in numbers if n in NUMBER_OF}


def outside_look_aheads(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside a look-ahead, without HTML comments and the last line."""
    lines = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S).splitlines()
    kept, in_look_ahead, after_blank = [], False, False
    for number, line in enumerate(lines[:-1], 1):
        stripped = line.strip().lstrip("> ").strip()
        if stripped.startswith(LOOK_AHEAD):
            in_look_ahead, after_blank = True, False
        elif in_look_ahead and not stripped:
            after_blank = True  # the paragraph ended; a table may still follow
        elif in_look_ahead and after_blank and not stripped.startswith("|"):
            in_look_ahead = False
        if not in_look_ahead:
            kept.append((number, line))
    return kept


def later_steps_named(lesson: str, text: str) -> list[str]:
    """Each line of the lesson that names a step after it on the path, outside a look-ahead."""
    later = set(LESSON_PATH[LESSON_PATH.index(lesson) + 1:])
    return [f"line {n}: names {', '.join(sorted(steps_named(line) & later))}: {line.strip()[:90]}"
            for n, line in outside_look_aheads(text) if steps_named(line) & later]


@pytest.mark.parametrize("lesson", LESSON_PATH)
def test_a_lesson_names_later_steps_only_in_a_look_ahead(lesson: str) -> None:
    found = later_steps_named(lesson, (REPO / lesson / "README.md").read_text(encoding="utf-8"))
    assert found == [], (f"{lesson} names later steps of the path (common/steps.py LESSON_PATH) outside a "
                         f"paragraph that opens with {LOOK_AHEAD}: " + "\n".join(found))


def test_the_path_holds_every_lesson_once() -> None:
    folders = sorted(p.parent.name for p in REPO.glob("step*/README.md"))
    assert sorted(LESSON_PATH) == folders, f"LESSON_PATH {LESSON_PATH} against the lessons {folders}"


@pytest.mark.parametrize("lesson", LESSON_PATH[:-1])
def test_the_last_line_leads_to_the_next_lesson(lesson: str) -> None:
    next_lesson = LESSON_PATH[LESSON_PATH.index(lesson) + 1]
    last_line = (REPO / lesson / "README.md").read_text(encoding="utf-8").rstrip().splitlines()[-1]
    assert f"../{next_lesson}/README.md" in last_line, f"{lesson}'s last line should lead to {next_lesson}: {last_line}"


def test_the_check_can_fail() -> None:
    assert steps_named("Steps 09, 10 and 12-14 use `step15_batch_invariant`.") == {
        NUMBER_OF[n] for n in ("09", "10", "12", "13", "14", "15")}
    text = ("Step 06 reads the pool; step 12 replays it.\n\n**Looking ahead:** step 13 fuses it.\n\n"
            "<!-- results/x.json: commit c0 -->\n| step12_cuda_graph | 1 |\n\nStep 14 too.\nNext: step 09.\n")
    assert [line[:7] for line in later_steps_named("step06_paged_attention", text)] == ["line 1:", "line 8:"]
