"""The one list of steps (common/steps.py) is the list everything else shows: the README's step table, and a
folder, a notebook and tests for each step. A step added to one place and not the others fails here."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.cli import Parser
from common.engine import Engine
from common.steps import LESSON_PATH, STEP_NAMES, STEPS, Step, engine_class, find_step

REPO = Path(__file__).resolve().parent.parent
SERVER = "step08_serve"  # not an engine: it serves any of them
WRAPPER = "step04_multi_gpu"  # not in the chain: it splits or replicates the engines of steps 06 and later
TOOL = "step05_profiling"  # not in the chain: a tool every step has (--profile)


def step_number(name: str) -> str:
    return name[len("step"):len("step") + 2]


def test_the_readme_table_lists_the_steps_in_the_paths_order() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| \[\d\d [^\]]+\]\((step\d\d_\w+)/README\.md\)", readme, flags=re.MULTILINE)
    assert listed == list(LESSON_PATH), f"the README's step table, {listed}, against common/steps.py's LESSON_PATH"
    assert sorted(LESSON_PATH) == sorted([*STEP_NAMES, SERVER, WRAPPER, TOOL])


@pytest.mark.parametrize("name", [*STEP_NAMES, SERVER, WRAPPER, TOOL])
def test_each_step_has_its_folder_lesson_run_notebook_and_tests(name: str) -> None:
    folder = REPO / name
    assert (folder / "README.md").is_file() and (folder / "run.py").is_file()
    number = step_number(name)
    assert list((REPO / "notebooks").glob(f"{number}_*.ipynb")), f"no notebooks/{number}_*.ipynb"
    assert list((REPO / "tests").glob(f"test_step{number}*.py")) + list(
        (REPO / "tests").glob(f"test_step*_step{number}_*.py")), f"no tests/test_step{number}*.py"


# Where an engine does not build on the step just before it, and what it builds on instead.
BUILDS_ON = {
    "step02_paged_kv": "the engine interface (a new cache, not step 01's)",
    "step06_paged_attention": "step02_paged_kv (attention replaces step 03's gather; it does not extend it)",
}


def test_each_engine_subclasses_the_one_before() -> None:
    for earlier, later in zip(STEPS, STEPS[1:]):
        if later.name in BUILDS_ON:
            continue
        assert issubclass(later.engine_class(), earlier.engine_class()), f"{later.name} does not extend {earlier.name}"
    assert issubclass(engine_class("step06_paged_attention"), engine_class("step02_paged_kv"))
    assert all(issubclass(step.engine_class(), Engine) for step in STEPS)


@pytest.mark.parametrize("step", STEPS, ids=[s.name for s in STEPS])
def test_each_step_carries_its_run_pys_flags(step: Step) -> None:
    """The registry adds the flags of the step's run.py (none for step 01), and the tools take them from there."""
    ours, theirs = Parser(), Parser()  # the project's parser: a later step replaces an earlier one's flag
    step.add_arguments(ours)
    add_arguments = getattr(importlib.import_module(f"{step.name}.run"), "add_arguments", None)
    if add_arguments is not None:
        add_arguments(theirs)
    assert ours.format_help() == theirs.format_help()
    assert (add_arguments is None) == (step.name == "step01_serial")


def test_the_step_list_for_scripts() -> None:
    """scripts/gpu_suite.sh reads the steps from `python -m common.steps`, one a line, without torch."""
    listed = subprocess.run([sys.executable, "-c", "import runpy, sys; runpy.run_module('common.steps', "
                             "run_name='__main__'); print(sorted({'torch'} & set(sys.modules)))"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    assert listed == [*STEP_NAMES, "[]"]


def test_unknown_step_names_the_choices() -> None:
    with pytest.raises(ValueError, match="step01_serial"):
        find_step("step99_nothing")
    assert engine_class("step07_preemption").__name__ == "PreemptionEngine"
