"""`python tour.py --map [STEP]`: the chain of engine classes printed as one engine, each method under the class
whose version runs, with the earlier classes it overrides. The expectations are read from the classes themselves,
so a step that adds or moves an override changes what is expected, not the test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import tour
from common.engine import Engine
from common.steps import STEPS, find_step

REPO = Path(__file__).resolve().parent.parent
HEADER = re.compile(r"^(\S+) \((\w+)\): ")  # "step07_preemption (PreemptionEngine): optimistic admission, ..."


def sections(lines: list[str]) -> dict[str, list[str]]:
    """The map's method lines by class label ("step02_paged_kv", "common/engine.py"), in the printed order; a
    long "overrides" list that goes on under its column is joined back onto its method's line."""
    found: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if match := HEADER.match(line):
            current = found.setdefault(match.group(1), [])
        elif current is not None and line.startswith("    ") and current:
            current[-1] += " " + line.strip()
        elif current is not None and line.startswith("  "):
            current.append(line)
        elif not line:
            current = None
    return found


def method_name(line: str) -> str:
    return line.split()[0]


def overrides_of(line: str) -> list[str]:
    """`  decode     overrides step02, step06` -> ["step02", "step06"]."""
    _, _, listed = line.partition("overrides ")
    return listed.split(", ") if listed else []


def label(cls: type) -> str:
    """The class's section in the map, read off the registry independently of tour.py."""
    if cls is Engine:
        return "common/engine.py"
    return next(step.name for step in STEPS if step.engine_path == f"{cls.__module__}:{cls.__qualname__}")


def chain(engine_class: type) -> list[type]:
    """The engine classes of the chain, base first."""
    return [cls for cls in reversed(engine_class.__mro__) if issubclass(cls, Engine)]


@pytest.fixture(scope="module")
def final_map() -> list[str]:
    return tour.engine_map(STEPS[-1].engine_class())


def test_the_final_map_names_every_class_of_the_chain_in_order(final_map: list[str]) -> None:
    expected = [label(cls) for cls in chain(STEPS[-1].engine_class())]
    assert expected[0] == "common/engine.py" and expected[-1] == STEPS[-1].name
    assert list(sections(final_map)) == expected
    for cls in chain(STEPS[-1].engine_class()):
        assert any(line.startswith(f"{label(cls)} ({cls.__name__}): ") for line in final_map)
    assert final_map[-1].startswith(f"{STEPS[-1].engine_class().__name__} runs ")
    assert f"from {len(expected)} classes" in final_map[-1]
    assert all(len(line) < 120 for line in final_map)


def test_a_registry_step_outside_the_chain_is_named_as_such(final_map: list[str]) -> None:
    in_chain = {label(cls) for cls in chain(STEPS[-1].engine_class())}
    outside = [step.name for step in STEPS if step.name not in in_chain]
    note = [line for line in final_map if line.startswith("Not in this chain: ")]
    if outside:
        assert len(note) == 1 and all(name in note[0] for name in outside)
    else:
        assert not note


def test_the_most_overridden_method_is_under_its_most_derived_class(final_map: list[str]) -> None:
    engine_class = STEPS[-1].engine_class()
    classes = chain(engine_class)
    defined_by = {name: [cls for cls in classes if tour.is_method(vars(cls).get(name))]
                  for cls in classes for name in vars(cls) if not name.startswith("_")}
    name = max(sorted(defined_by), key=lambda n: len(defined_by[n]))  # e.g. step, free_request, memory_report
    definers = defined_by[name]
    assert len(definers) >= 3, f"no public method is defined by three classes of the chain ({name}: {definers})"
    runs = next(cls for cls in engine_class.__mro__ if name in vars(cls))
    assert runs is definers[-1]

    listed = {section: [line for line in lines if method_name(line) == name]
              for section, lines in sections(final_map).items()}
    assert [section for section, lines in listed.items() if lines] == [label(runs)]
    (line,) = listed[label(runs)]
    assert overrides_of(line) == [label(cls).split("_")[0] for cls in definers[:-1]]  # step02, or common/engine.py


def test_an_overridden_private_method_is_listed_with_every_class_it_overrides(final_map: list[str]) -> None:
    """`__init__` is private but overridden down the chain: it is listed once, with the whole list, even where that
    list goes on to a second line."""
    engine_class = STEPS[-1].engine_class()
    definers = [cls for cls in chain(engine_class) if "__init__" in vars(cls)]
    runs = next(cls for cls in engine_class.__mro__ if "__init__" in vars(cls))
    (line,) = [line for line in sections(final_map)[label(runs)] if method_name(line) == "__init__"]
    assert overrides_of(line) == [label(cls).split("_")[0] for cls in definers if cls is not runs]


def test_map_of_step02_lists_decode_under_step02() -> None:
    proc = subprocess.run([sys.executable, "tour.py", "--map", "step02_paged_kv"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True)
    lines = proc.stdout.splitlines()
    found = sections(lines)
    assert list(found) == [label(cls) for cls in chain(find_step("step02_paged_kv").engine_class())]
    assert "decode" in [method_name(line) for line in found["step02_paged_kv"]]
    assert "add_request" in [method_name(line) for line in found["common/engine.py"]]
    (step_line,) = [line for line in found["step02_paged_kv"] if method_name(line) == "step"]
    assert overrides_of(step_line) == ["common/engine.py"]
    assert lines[0].startswith("The map of PagedEngine (step02_paged_kv)")


def test_map_takes_the_last_step_by_default_and_refuses_an_unknown_one() -> None:
    assert tour.parse_args(["--map"]).map == STEPS[-1].name
    assert tour.parse_args([]).map is None  # the plain tour
    with pytest.raises(SystemExit) as exit_info:
        tour.parse_args(["--map", "step99_nothing"])
    assert exit_info.value.code == 2
