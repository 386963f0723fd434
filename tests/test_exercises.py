"""Every exercise checks both ways: its tests pass with the project's own code (the solution) and fail with the
untouched stub, so no selected test can pass on a stub.

The checks call the runner in this process (`exercises.runner.run_tests`, what `python -m exercises run <id>`
calls), so each costs the selected tests alone, not a new Python that imports torch and transformers again; one
test runs the command itself, both ways, as the learner runs it (the dry run is left out here: the step's own
tests run it).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exercises import EXERCISES, Exercise, find_exercise
from exercises.engine import run_engine
from exercises.runner import explain, run_tests
from tests.exercise_wrong_answers import WRONG_ANSWERS
from tests.helpers import first_difference

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_project_code_solves_it(exercise: Exercise) -> None:
    result = run_tests(exercise, exercise.solution())
    assert not result.failed, "\n".join(explain(case) for case in result.failed)
    assert result.passed >= 1


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_untouched_stub_fails_every_selected_test(exercise: Exercise) -> None:
    if not exercise.is_untouched():
        pytest.skip(f"exercises/{exercise.stub_path.name} has been written in this checkout; CI checks the stub")
    result = run_tests(exercise, exercise.learner_function())
    assert result.passed == 0, f"{result.passed} selected tests pass on the stub: they do not check it"
    assert result.failed and any("not written yet" in explain(case) for case in result.failed)


# What "fast" means for an exercise's selected tests, on a wrong answer: seconds, on 2 cores beside other tests.
FAST_SECONDS = 60


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_fast_tests_fail_a_wrong_answer_that_skips_the_idea(exercise: Exercise) -> None:
    """The wrong answer of tests/exercise_wrong_answers.py (the registry's `skips_idea`) swapped in as a learner's
    function is: at least one selected test fails on an assertion (not on an error of the wrong answer's own),
    within seconds."""
    start = time.monotonic()
    result = run_tests(exercise, WRONG_ANSWERS[exercise.id])
    seconds = time.monotonic() - start
    assert result.failed, (f"{exercise.id}: all {result.passed} selected tests pass with a wrong answer that "
                           f"skips the idea ({exercise.skips_idea})")
    assertions = [case for case in result.failed if case.message.lstrip().startswith(("AssertionError", "assert"))]
    assert assertions, (f"{exercise.id}: the wrong answer fails only with errors, no assertion catches it:\n"
                        + "\n".join(explain(case) for case in result.failed))
    assert seconds < FAST_SECONDS, f"{exercise.id}: its selected tests took {seconds:.0f} s on the wrong answer"


def test_every_exercise_has_one_wrong_answer() -> None:
    assert sorted(WRONG_ANSWERS) == sorted(e.id for e in EXERCISES), "tests/exercise_wrong_answers.py and the registry differ"
    for exercise in EXERCISES:
        wanted = inspect.signature(exercise.learner_function()).parameters
        got = inspect.signature(WRONG_ANSWERS[exercise.id]).parameters
        assert list(got) == list(wanted), f"{exercise.id}: the wrong answer takes {list(got)}, the stub {list(wanted)}"


def test_the_command_checks_an_exercise_as_the_learner_runs_it() -> None:
    """`python -m exercises run <id>` in a process of its own: "solved" with the project's code (exit 0), "not
    yet" with the stub (exit 1), each test named and told in a learner's words."""
    exercise = find_exercise("02-slot-mapping")

    def command(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "exercises", "run", exercise.id, "--tests-only", *flags],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    solved = command("--project")
    assert solved.returncode == 0, solved.stdout[-3000:] + solved.stderr[-3000:]
    assert f"exercise {exercise.id}: solved" in solved.stdout
    if not exercise.is_untouched():
        pytest.skip(f"exercises/{exercise.stub_path.name} has been written in this checkout; CI checks the stub")
    stub = command()
    assert stub.returncode == 1, stub.stdout[-3000:] + stub.stderr[-3000:]
    assert f"exercise {exercise.id}: not yet" in stub.stdout and "not written yet" in stub.stdout


@pytest.mark.embedded
def test_the_final_engine_with_every_solution_swapped_in_gives_hfs_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m exercises engine --project` (in this process, on 2 prompts of 8 tokens): the final engine's dry
    run and the embedded model match HF with all 19 solutions in place at once, and the report says of each
    whether it ran. The scheduler's functions run on every device; step 01's, 03's and 05's are never on the
    final engine's path, so they must be reported as not run."""
    ok = run_engine(project=True, prompts=2, max_tokens=8)
    out = capsys.readouterr().out
    assert ok, f"the final engine with the project's solutions failed:\n{out[-4000:]}"
    assert "embedded model: 2/2 prompts give HF's tokens exactly" in out, out[-4000:]
    report = {line.split()[0]: line for line in out.partition("=== which functions")[2].splitlines()[1:]
              if line.startswith("  ")}
    assert sorted(report) == sorted(e.id for e in EXERCISES), f"the report names {sorted(report)}"
    for exercise_id in ("09-token-budget", "10-block-keys", "10-lru-evict"):
        assert re.search(r"ran, [1-9]\d* calls$", report[exercise_id]), f"not reported as run: {report[exercise_id]}"
    for exercise_id in ("01-contiguous-attend", "03-vectorized-gather", "05-own-time", "05-count-syncs"):
        assert report[exercise_id].endswith("swapped in, not run by the final engine on this device"), (
            f"reported as run, though the final engine never calls it: {report[exercise_id]}")


def test_exercise_ids_are_unique_and_each_target_exists() -> None:
    assert len({e.id for e in EXERCISES}) == len(EXERCISES)
    for exercise in EXERCISES:
        assert callable(exercise.solution()), exercise.target
        assert exercise.learner_function().__name__ == exercise.attribute


def test_each_lesson_links_its_exercises_to_the_lines_that_solve_them() -> None:
    """The lesson's Exercises section names the exercise and links the solution's lines, as they are now: the
    link starts at or above the solution's first line (a kernel the learner also writes may come first) and ends
    at its last, so a moved function fails here instead of pointing a learner at the wrong lines."""
    for exercise in EXERCISES:
        lesson = REPO / exercise.lesson
        solution = inspect.unwrap(exercise.solution())
        lines, first = inspect.getsourcelines(solution)
        last = first + len(lines) - 1
        target = os.path.relpath(inspect.getsourcefile(solution), lesson.parent)
        section = lesson.read_text(encoding="utf-8").partition("## Exercises")[2]
        assert f"`{exercise.id}`" in section, f"{exercise.lesson} has no Exercises entry for {exercise.id}"
        links = re.findall(rf"\]\({re.escape(target)}#L(\d+)-L(\d+)\)", section)
        assert any(int(a) <= first and int(b) == last for a, b in links), (
            f"{exercise.lesson}: link the solution as {target}#L{first}-L{last} (found {links})")


def test_first_difference_names_the_position_and_a_few_tokens_around_it() -> None:
    """The message the exercises' token checks give: where two token lists part, not the whole lists."""
    expected, got = list(range(40)), list(range(40))
    got[20] = 999
    message = first_difference(expected, got)
    assert message == ("first difference at position 20 (of 40 expected, 40 got): expected [..., 17, 18, 19, 20, 21, "
                       "22, 23], got [..., 17, 18, 19, 999, 21, 22, 23]"), message
    nested = first_difference([[1, 2], [3, 4, 5]], [[1, 2], [3, 4]])
    assert nested == "request 1: first difference at position 2 (of 3 expected, 2 got): expected [3, 4, 5], got [3, 4]", (
        nested)
