"""Every exercise checks both ways: its tests pass with the project's own code (the solution) and fail with the
untouched stub, so no selected test can pass on a stub. Each run is `python -m exercises run <id> --tests-only`
in a subprocess, as the learner runs it (the dry run is left out here: the step's own tests run it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exercises import EXERCISES, Exercise

REPO = Path(__file__).resolve().parent.parent


def run_exercise(exercise: Exercise, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exercises", "run", exercise.id, "--tests-only", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_project_code_solves_it(exercise: Exercise) -> None:
    result = run_exercise(exercise, "--project")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"exercise {exercise.id}: solved" in result.stdout


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_untouched_stub_fails_every_selected_test(exercise: Exercise) -> None:
    if not exercise.is_untouched():
        pytest.skip(f"exercises/{exercise.stub_path.name} has been written in this checkout; CI checks the stub")
    result = run_exercise(exercise)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "not written yet" in result.stdout
    assert " passed" not in result.stdout.split(f"=== exercise {exercise.id}: not yet")[0]  # not one passes


def test_exercise_ids_are_unique_and_each_target_exists() -> None:
    assert len({e.id for e in EXERCISES}) == len(EXERCISES)
    for exercise in EXERCISES:
        assert callable(exercise.solution()), exercise.target
        assert exercise.learner_function().__name__ == exercise.attribute
