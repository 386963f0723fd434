"""Run one exercise: the learner's function replaces the project's for the run, then the step's own tests and
its dry run check it, and the result is told in a learner's words.

The replacement is a plain attribute swap on the project's class (or module, for a module-level function),
inside this process and undone afterwards: nothing in the project is edited. Tests run through `pytest.main`
in this same process so that they see it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from exercises.registry import EXERCISES, Exercise

# The tests run in this process, which imports the project before pytest reads tests/conftest.py: so choose
# Triton's interpreter where conftest.py does (no GPU), before anything imports triton, or a kernel defined
# in the meantime would ask for a GPU.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
# Which exercises passed, with the hash of the learner's file when they did: an edit since makes it "not yet".
SOLVED_FILE = REPO / ".exercises-solved.json"
# Steps whose dry run fixes its own workload and takes no --max-tokens (step 05 profiles a few steps of its own).
FIXED_DRY_RUNS = ("step05_profiling",)
# Steps whose exercise lives behind a switch that is off by default: their dry run turns it on.
DRY_RUN_SWITCHES = {"step15_batch_invariant": ["--batch-invariant"]}


@contextmanager
def patched(exercise: Exercise, function: Callable[..., Any]) -> Iterator[None]:
    """The project's class (or module) uses `function` in place of its own attribute until the block ends."""
    owner, name = exercise.target_owner, exercise.attribute
    original = vars(owner)[name]
    setattr(owner, name, function)
    try:
        yield
    finally:
        setattr(owner, name, original)


@dataclass
class FailedCase:
    test: str  # the test's node id
    message: str  # pytest's account of what went wrong: the assertion with expected and actual, or the error


class CollectFailures:
    """A pytest plugin that keeps each failed test and the message of its failure."""

    def __init__(self) -> None:
        self.failed: list[FailedCase] = []
        self.passed = 0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)
            self.failed.append(FailedCase(report.nodeid, message))
        elif report.passed and report.when == "call":
            self.passed += 1


def run_tests(exercise: Exercise, function: Callable[..., Any]) -> CollectFailures:
    """The exercise's selected tests, with `function` in place of the project's code."""
    args = [str(REPO / a) if (REPO / a).exists() else a for a in exercise.tests]
    collector = CollectFailures()
    with patched(exercise, function):
        # Quiet and plain: the summary below says what failed in a learner's words (and a notebook shows no colours).
        code = pytest.main([*args, "-q", "--tb=no", "--no-header", "-rN", "--color=no", "-p", "no:cacheprovider",
                            "-p", "no:warnings"], plugins=[collector])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        collector.failed.append(FailedCase(" ".join(exercise.tests), f"pytest could not run them (exit {code})"))
    elif collector.passed == 0 and not collector.failed:
        collector.failed.append(FailedCase(" ".join(exercise.tests), "no test was selected"))
    return collector


def run_dry_run(exercise: Exercise, function: Callable[..., Any]) -> bool:
    """The step's `run.py --dry-run` (tiny models of each architecture against HF), with `function` in place."""
    from common.cli import main
    from common.steps import STEP_NAMES, find_step

    print(f"\n--- {exercise.step}/run.py --dry-run, with your code ---")
    flags = ["--dry-run", "--max-tokens", "6", *DRY_RUN_SWITCHES.get(exercise.step, [])]
    with patched(exercise, function):
        try:
            if exercise.step not in STEP_NAMES:  # a step outside the chain (04, 05) has a run.py of its own
                own_flags = ["--dry-run"] if exercise.step in FIXED_DRY_RUNS else flags
                return importlib.import_module(f"{exercise.step}.run").main(own_flags) == 0
            # The step's own switches too: its exercise may sit behind one (DRY_RUN_SWITCHES).
            return main(exercise.step, None, flags, add_arguments=find_step(exercise.step).add_arguments) == 0
        except Exception as err:  # the learner's code may raise anything; say what, and that it failed
            print(f"your code raised {type(err).__name__}: {err}")
            return False


def explain(case: FailedCase) -> str:
    """One failed case in a learner's words."""
    first_line = case.message.strip().splitlines()[0] if case.message.strip() else ""
    if first_line.startswith("NotImplementedError"):
        return f"  {case.test}\n    not written yet: your function still raises NotImplementedError"
    detail = "\n".join(f"    {line}" for line in case.message.strip().splitlines()[:4])
    return f"  {case.test}\n    failed; expected and actual, as the test's assertion shows them:\n{detail}"


def run(exercise: Exercise, project: bool = False, tests_only: bool = False) -> bool:
    """Run `exercise` on the learner's function (or the project's own, with `project`); print and return the result."""
    function = exercise.solution() if project else exercise.learner_function()
    whose = "the project's code" if project else f"your code in exercises/{exercise.stub_path.name}"
    print(f"=== exercise {exercise.id}: {exercise.target} replaced by {whose} ===")
    tests = run_tests(exercise, function)
    ok = not tests.failed
    if ok and not tests_only:
        ok = run_dry_run(exercise, function)
    print(f"\n=== exercise {exercise.id}: ", end="")
    against = "its checks" if exercise.step in FIXED_DRY_RUNS else "HF"  # step 05's dry run checks traces
    if ok:
        print(f"solved: {tests.passed} tests passed" + ("" if tests_only else f", and the dry run matches {against}"))
    elif tests.failed:
        print(f"not yet: {len(tests.failed)} of {len(tests.failed) + tests.passed} test cases failed")
        print("\n".join(explain(case) for case in tests.failed))
    else:
        print(f"not yet: the tests pass, but the dry run does not match {against} (see its lines above)")
    if not ok:
        print(f"Hints: the docstring in exercises/{exercise.stub_path.name}, and the lesson {exercise.lesson}.")
    if not project and not tests_only:
        record(exercise, ok)
    return ok


def stub_hash(exercise: Exercise) -> str:
    return hashlib.sha256(exercise.stub_path.read_bytes()).hexdigest()


def record(exercise: Exercise, solved: bool) -> None:
    solved_hashes = json.loads(SOLVED_FILE.read_text()) if SOLVED_FILE.exists() else {}
    if solved:
        solved_hashes[exercise.id] = stub_hash(exercise)
    else:
        solved_hashes.pop(exercise.id, None)
    SOLVED_FILE.write_text(json.dumps(solved_hashes, indent=1) + "\n")


def status(exercise: Exercise) -> str:
    """"solved" if the learner's file, as it is now, passed its last run; "not started" if still the stub."""
    if exercise.is_untouched():
        return "not started"
    solved_hashes = json.loads(SOLVED_FILE.read_text()) if SOLVED_FILE.exists() else {}
    return "solved" if solved_hashes.get(exercise.id) == stub_hash(exercise) else "not yet"


def list_exercises() -> None:
    for exercise in EXERCISES:
        print(f"{exercise.id:24s} {status(exercise):12s} {exercise.target}")
    print("\nRun one: make exercise EX=<id>   (or: python -m exercises run <id>)")
