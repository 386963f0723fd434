"""The notebooks' saved outputs against the code they run now. A notebook is saved with its outputs, so that it
renders where the repository is browsed; once a step is added or an engine renamed, its code runs another engine
than its outputs name until it is executed again (`make notebooks`). Read from the files, nothing is executed:

- every engine named in an output (a registry engine's class, alone or in a wrapper's name: `[BatchInvariantEngine]`,
  `[TensorParallelBatchInvariantEngine]`) must be one the notebook's code runs now: a class it names, or one it
  reaches through the registry (`STEP_NAMES[-1]`, `STEPS[i]`, a step's name in a string);
- every step folder named in an output must be named in the code or reached through the registry, or come from
  an evidence file the code reads (`results/.../*.json`). A pytest test id (an exercise's test run) is not a claim
  about what ran, and a module or file path in a step's folder (`step06_paged_attention/engine.py`) is not one either.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from common.steps import STEPS

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
STEP_OF_ENGINE = {step.engine_path.partition(":")[2]: step.name for step in STEPS}  # "SerialEngine": "step01_serial"
STEP_FOLDERS = {path.name for path in REPO.glob("step[0-9]*") if path.is_dir()}
ENGINE_WORD = re.compile(r"\b\w*Engine\b")
STEP_WORD = re.compile(r"\bstep\d\d_\w*[a-z0-9]\b(?![./])")  # a folder's name, not a path or module inside it
REGISTRY_INDEX = re.compile(r"\bSTEP(?:S|_NAMES)\[(-?\d+)\]")


def code_of(notebook: dict[str, Any]) -> str:
    return "\n".join("".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code")


def output_lines(notebook: dict[str, Any]) -> list[str]:
    """The text of every saved output: printed streams, results' plain text, errors' tracebacks."""
    texts = []
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            texts.append("".join(output.get("text", "")))
            texts.append("".join(output.get("data", {}).get("text/plain", "")))
            texts.append("\n".join(output.get("traceback", [])))
    return "\n".join(texts).splitlines()


def engine_named(word: str) -> str | None:
    """The registry's engine class a word names, itself or at the end of a wrapper's name (step 04's
    `TensorParallelBatchInvariantEngine`); the longest such name, or None."""
    return max((name for name in STEP_OF_ENGINE if word.endswith(name)), key=len, default=None)


def steps_run(code: str) -> set[str]:
    """The registry's steps whose engines the code runs now: the ones whose engine class it names, the ones it
    indexes in the registry, and the ones it names in a string (`find_step("step07_preemption")`)."""
    run = {STEP_OF_ENGINE[name] for name in STEP_OF_ENGINE if re.search(rf"\b{name}\b", code)}
    run |= {STEPS[int(index)].name for index in REGISTRY_INDEX.findall(code)}
    run |= {step.name for step in STEPS if re.search(rf"[\"']{step.name}[\"']", code)}
    return run


def evidence_read(code: str) -> str:
    """The text of every file under results/ whose name the code writes out (`"stall-step09.json"`)."""
    names = set(re.findall(r"[\w.-]+\.json\b", code))
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted((REPO / "results").rglob("*.json"))
                     if path.name in names)


def stale_names(notebook: dict[str, Any]) -> list[str]:
    """Each engine or step folder an output names that the notebook's code does not run now, with its line."""
    code = code_of(notebook)
    run = steps_run(code)
    allowed_steps = run | set(STEP_WORD.findall(code)) | set(STEP_WORD.findall(evidence_read(code)))
    problems = []
    for line in output_lines(notebook):
        for word in ENGINE_WORD.findall(line):
            engine = engine_named(word)
            if engine is not None and STEP_OF_ENGINE[engine] not in run:
                problems.append(f"{word} ({STEP_OF_ENGINE[engine]}) in {line.strip()!r}")
        if "::" in line:
            continue  # a pytest test id, e.g. an exercise's test parametrized over steps
        problems += [f"{step} in {line.strip()!r}" for step in STEP_WORD.findall(line)
                     if step in STEP_FOLDERS and step not in allowed_steps]
    return problems


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_saved_outputs_name_the_engines_the_code_runs_now(path: Path) -> None:
    problems = stale_names(read(path))
    assert not problems, (f"{path.name} was saved by other code than it runs now: execute it again "
                          f"(make notebooks). Its outputs name " + "; ".join(problems))


def test_the_check_reads_engines_in_the_outputs() -> None:
    """Not a check that passes by finding nothing: the final engine's name is printed by at least one notebook
    that runs it (its start-up lines), and every notebook's outputs are read."""
    final = STEPS[-1].engine_path.partition(":")[2]
    printing = [path.name for path in NOTEBOOKS
                if any(engine_named(word) == final for line in output_lines(read(path))
                       for word in ENGINE_WORD.findall(line))]
    assert printing, f"no notebook's outputs name {final}"
    assert all(output_lines(read(path)) for path in NOTEBOOKS)


def fabricated(code: str, printed: str) -> dict[str, Any]:
    """A notebook of one code cell and what it printed, as nbformat saves it."""
    return {"cells": [{"cell_type": "code", "source": code.splitlines(keepends=True),
                       "outputs": [{"output_type": "stream", "name": "stdout",
                                    "text": printed.splitlines(keepends=True)}]}]}


def test_the_check_can_fail_on_a_notebook_saved_before_a_step_was_added() -> None:
    """Notebook 04's case: its code runs the registry's last step, its outputs were saved when the last step was
    another one."""
    code = ("from common.steps import STEP_NAMES, find_step\nFINAL = STEP_NAMES[-1]\n"
            "engine = find_step(FINAL).engine_class()(loaded, config)\n")
    last, before = STEPS[-1], STEPS[-2]
    old_class = before.engine_path.partition(":")[2]
    stale = fabricated(code, f"[{old_class}] token budget: 512 tokens per step\n"
                             f"[TensorParallel{old_class}] token budget: 16 tokens per step\nfinal step: {before.name}\n")
    problems = stale_names(stale)
    assert len(problems) == 3 and all(before.name in problem for problem in problems), problems

    new_class = last.engine_path.partition(":")[2]
    fresh = fabricated(code, f"[{new_class}] token budget: 512 tokens per step\n"
                             f"[TensorParallel{new_class}] token budget: 16 tokens per step\nfinal step: {last.name}\n")
    assert stale_names(fresh) == []


def test_a_step_named_in_a_path_a_test_id_or_evidence_read_is_no_claim() -> None:
    code = 'doc = json.loads((ROOT / "results/gpu/stall-step09.json").read_text())\n'
    printed = ("step06_paged_attention/engine.py:44: if self.sync_per_layer:\n"
               "  tests/test_step05_profiling.py::test_trace[step01_serial]\n")
    assert stale_names(fabricated(code, printed)) == []
    steps_in_evidence = set(STEP_WORD.findall(evidence_read(code)))
    assert steps_in_evidence, "results/gpu/stall-step09.json names no step"
    step = sorted(steps_in_evidence)[0]
    assert stale_names(fabricated(code, f"{step}: 3.1 s\n")) == []
    assert stale_names(fabricated("print(1)\n", f"{step}: 3.1 s\n")) == [f"{step} in '{step}: 3.1 s'"]
