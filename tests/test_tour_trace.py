"""`python tour.py --trace`: the final engine's calls in one mixed step and one decode step, each line naming the step
whose class defines the method. What a line claims is checked against the classes themselves, so a step that moves
a method changes what is expected, not the test."""

from __future__ import annotations

import importlib
import re
import sys
import time

import pytest

import tour
from common.steps import STEPS

LINE = re.compile(r"^(step\d\d|common)  ((?:  )*)(\w+)\.(\w+)( x\d+)?$")  # "step09    ChunkedPrefillEngine.fill_budget x2"
SECTION = "=== "


class TracedCall:
    def __init__(self, line: str) -> None:
        match = LINE.match(line)
        assert match, f"not a call line: {line!r}"
        self.step, indent, self.owner, self.method = match.group(1), match.group(2), match.group(3), match.group(4)
        self.depth = len(indent) // 2  # past the step column ("step09" and two spaces), two spaces a level


@pytest.fixture(scope="module")
def trace() -> tuple[list[str], float]:
    start = time.perf_counter()
    lines = tour.trace_lines()
    return lines, time.perf_counter() - start


def sections(lines: list[str]) -> dict[str, list[TracedCall]]:
    """The traced steps by their title's first words ("a mixed step", "a decode step"), each a list of its calls."""
    found: dict[str, list[TracedCall]] = {}
    current = None
    for line in lines:
        if line.startswith(SECTION):
            current = found.setdefault(line[len(SECTION):].split(",")[0].split(":")[0], [])
        elif not line:
            current = None
        elif current is not None:
            current.append(TracedCall(line))
    return found


def defining_class(call: TracedCall) -> type:
    """The one class named `call.owner` defined in a module of the step's folder (or in common/engine.py)."""
    if call.step == "common":
        prefixes = ("common.engine",)
    else:
        prefixes = tuple(name for name in sys.modules if name.partition(".")[0].partition("_")[0] == call.step)
    found = {cls for name in prefixes if name in sys.modules
             for cls in vars(sys.modules[name]).values()
             if isinstance(cls, type) and cls.__name__ == call.owner and cls.__module__ == name}
    assert len(found) == 1, f"{call.step} defines {len(found)} classes named {call.owner}"
    return found.pop()


def test_the_trace_runs_in_seconds_and_shows_a_mixed_step_and_a_decode_step(trace: tuple[list[str], float]) -> None:
    lines, seconds = trace
    assert seconds < 60, f"the trace took {seconds:.0f} s"
    assert list(sections(lines)) == ["a mixed step", "a decode step"]
    assert lines[0].startswith(f"The trace of {STEPS[-1].engine_class().__name__} ({STEPS[-1].name})")
    mixed = next(line for line in lines if line.startswith(SECTION + "a mixed step"))
    numbers = [int(n) for n in re.findall(r"\d+", mixed.partition(": ")[2])]
    decoded, first, last, prompt = numbers[-4:]
    assert decoded == 1 and first == 0 and 0 < last < prompt, f"the mixed step did not cut the prompt: {mixed}"
    assert all(len(line) < 120 for line in lines)


def test_the_path_enters_the_steps_of_the_idea(trace: tuple[list[str], float]) -> None:
    entered = {call.step for calls in sections(trace[0]).values() for call in calls}
    assert {"step09", "step10", "step11", "step12", "step14"} <= entered, sorted(entered)


def test_every_line_names_a_class_of_its_step_that_defines_the_method(trace: tuple[list[str], float]) -> None:
    for calls in sections(trace[0]).values():
        for call in calls:
            cls = defining_class(call)
            assert call.method in vars(cls), f"{call.step} {call.owner} does not define {call.method}"
            assert not isinstance(vars(cls)[call.method], property)  # properties are said to be left out


def test_a_call_is_printed_before_the_calls_it_makes(trace: tuple[list[str], float]) -> None:
    """The tree reads top-down: every step starts at the engine's step(); a line is at most one deeper than the one
    before it; each override calls the version it overrides (super()) under it, in the chain's order."""
    final = STEPS[-1].engine_class()
    for title, calls in sections(trace[0]).items():
        runs_step = next(cls for cls in final.__mro__ if "step" in vars(cls))
        assert (calls[0].owner, calls[0].method, calls[0].depth) == (runs_step.__name__, "step", 0), title
        assert all(after.depth <= before.depth + 1 for before, after in zip(calls, calls[1:])), title
        assert all(call.depth >= 1 for call in calls[1:]), f"{title}: more than one engine step traced"
        names = [f"{call.owner}.{call.method}" for call in calls]
        assert names.index("ChunkedPrefillEngine.schedule") < names.index("ChunkedPrefillEngine.fill_budget")
        for call, inner in zip(calls, calls[1:]):
            if inner.method == call.method and inner.depth == call.depth + 1:  # an override calls super()
                assert issubclass(defining_class(call), defining_class(inner)), f"{call.owner} {inner.owner}"
    mixed, decode = sections(trace[0]).values()
    assert any(c.method == "forward_mixed" for c in mixed) and not any(c.method == "forward_mixed" for c in decode)
    assert any(c.method == "decode" for c in decode) and not any(c.method == "decode" for c in mixed)


def test_the_checks_can_fail(trace: tuple[list[str], float]) -> None:
    """The checks above read every line of the traced steps: a line that is not a call, or that names the wrong
    step for a class, fails them (the trace's modules are loaded by then)."""
    with pytest.raises(AssertionError):
        TracedCall("        ChunkedPrefillEngine.fill_budget")
    call = TracedCall("step09      ChunkedPrefillEngine.fill_budget x3")
    assert (call.step, call.depth, call.owner, call.method) == ("step09", 2, "ChunkedPrefillEngine", "fill_budget")
    assert defining_class(call) is importlib.import_module("step09_chunked_prefill.engine").ChunkedPrefillEngine
    with pytest.raises(AssertionError):
        defining_class(TracedCall("step10  ChunkedPrefillEngine.fill_budget"))  # step 09's class, imported there


def test_trace_is_a_flag_of_its_own() -> None:
    assert tour.parse_args(["--trace"]).trace
    assert not tour.parse_args([]).trace
    with pytest.raises(SystemExit):
        tour.parse_args(["--trace", "--map"])
