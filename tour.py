"""The tutorial tour: every step's engine runs on the embedded model, is checked against HF generate(),
and its throughput is printed; then step 08 serves a tiny model and is called through the openai SDK.
Run it with `make tour` (or `.venv/bin/python tour.py`).

`python tour.py --map [STEP]` loads no model: it prints the final engine (or STEP's) as one engine, each method
under the step whose code runs it, with the earlier steps whose version it overrides.

`python tour.py --trace` runs the final engine on a tiny random model for a few seconds and prints, call by call, the
methods that one mixed step (a decoder beside a prompt's prefill chunk) and one decode step run, each with the step
whose class defines it: the map's methods in the order the engine calls them."""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import NamedTuple

from transformers.utils import logging as transformers_logging

from common.checks import check_against_reference
from common.engine import Engine
from common.prompts import DEMO_PROMPTS
from common.sampling import SamplingParams
from common.steps import STEP_NAMES, STEPS, Step, find_step
from step08_serve.run import parse_args as server_args
from step08_serve.run import dry_run as server_dry_run

MAX_TOKENS = 32


def tour_step(name: str, idea: str, engine_class: type[Engine]) -> tuple[float, bool]:
    print(f"\n=== {name}: {idea}")
    engine = engine_class.from_config(engine_class.config_class(device="cpu"))
    prompts = [engine.tokenizer.apply_chat_template(p) for p in DEMO_PROMPTS]
    start = time.perf_counter()
    completions = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    elapsed = time.perf_counter() - start
    for prompt, completion in zip(DEMO_PROMPTS, completions):
        print(f"  {prompt!r} -> {completion.text[:70]!r}")
    tokens = sum(len(c.token_ids) for c in completions)
    reports = check_against_reference(engine, prompts, completions, MAX_TOKENS)
    ok = all(r.ok for r in reports)
    print(f"  {tokens} tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tok/s; "
          f"parity with HF generate(): {'OK' if ok else 'FAILED'} "
          f"({sum(r.equal for r in reports)}/{len(reports)} identical)")
    return tokens / elapsed, ok


# ----- the map: the chain of engine classes read as one engine (`python tour.py --map [STEP]`) -----------------

LINE_WIDTH = 119  # every line of the map fits in 120 columns
BASE_FILE = "common/engine.py"  # the base class is no step: the map names its file


def is_method(value: object) -> bool:
    """What the map lists: functions, static and class methods, properties (not class attributes)."""
    return inspect.isfunction(value) or isinstance(
        value, (staticmethod, classmethod, property, functools.cached_property))


def method_kind(value: object) -> str:
    """" [property]", " [classmethod]", ...: a tag after the name; nothing for a plain method."""
    return "" if inspect.isfunction(value) else f" [{type(value).__name__}]"


def chain_of(engine_class: type[Engine]) -> list[type]:
    """The engine's classes from the base up: its __mro__ reversed, without `object` and `ABC`."""
    return [cls for cls in reversed(engine_class.__mro__) if cls.__module__ not in ("builtins", "abc")]


def step_of(cls: type) -> Step | None:
    """The registry's step whose engine this class is (matched by "module:Class", so nothing is imported)."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    return next((step for step in STEPS if step.engine_path == path), None)


def short_label(cls: type) -> str:
    """How an "overrides" list names a class: step02, common/engine.py, or module.Class for anything else."""
    step = step_of(cls)
    if step is not None:
        return step.name.split("_")[0]
    return BASE_FILE if cls is Engine else f"{cls.__module__}.{cls.__qualname__}"


def header(cls: type) -> str:
    """A class's line in the map: `step07_preemption (PreemptionEngine): optimistic admission, ...`."""
    step = step_of(cls)
    if step is not None:
        return f"{step.name} ({cls.__name__}): {step.idea}"
    doc = inspect.getdoc(sys.modules[cls.__module__] if cls is Engine else cls) or ""
    return f"{short_label(cls)} ({cls.__name__}): {doc.splitlines()[0] if doc else ''}"


def fit(line: str) -> str:
    """Cut a line that would pass LINE_WIDTH, and say so with "..."."""
    return line if len(line) <= LINE_WIDTH else line[:LINE_WIDTH - 3] + "..."


def runs_from(engine_class: type[Engine], name: str) -> type:
    """The class whose `name` the engine runs: the first one on its __mro__ that defines it."""
    return next(cls for cls in engine_class.__mro__ if name in vars(cls))


class MapEntry(NamedTuple):
    name: str  # with a tag for what it is, if not a plain method: "importance [staticmethod]"
    overrides: list[type]  # the earlier classes of the chain that define it too, base first


def entries_of(engine_class: type[Engine], cls: type, chain: list[type]) -> list[MapEntry]:
    """The methods of `cls` that run in the engine: every public one, and any other that a class overrides."""
    entries = []
    for name, value in vars(cls).items():
        if not is_method(value) or runs_from(engine_class, name) is not cls:
            continue  # not a method, or a later class's version runs instead
        earlier = [other for other in chain if other is not cls and is_method(vars(other).get(name))]
        if name.startswith("_") and not earlier:
            continue  # private and never overridden: a detail of its own class
        entries.append(MapEntry(name + method_kind(value), earlier))
    return entries


def entry_lines(entry: MapEntry) -> list[str]:
    """`  decode                              overrides step02, step12`: a long list goes on under its column."""
    name = f"  {entry.name:<36}"
    if not entry.overrides:
        return [name.rstrip()]
    overrides = "overrides " + ", ".join(short_label(cls) for cls in entry.overrides)
    return textwrap.wrap(overrides, LINE_WIDTH, initial_indent=name, subsequent_indent=" " * len(name))


def not_in_chain(engine_class: type[Engine], chain: list[type]) -> list[Step]:
    """The registry's steps before this engine's that it does not build on (a side branch of the tutorial)."""
    paths = {f"{cls.__module__}:{cls.__qualname__}" for cls in chain}
    last = step_of(engine_class)
    before = STEPS if last is None else STEPS[:STEPS.index(last)]
    return [step for step in before if step.engine_path not in paths]


def engine_map(engine_class: type[Engine]) -> list[str]:
    """The map of one engine, as lines: a header per class of its chain (base first) and the methods it runs."""
    chain = chain_of(engine_class)
    step = step_of(engine_class)
    lines = [fit(f"The map of {engine_class.__name__}{f' ({step.name})' if step else ''}, its chain of classes "
                 "read as one engine:"),
             'each method under the class whose version runs; "overrides" names the earlier classes '
             'that define it too.']
    skipped = not_in_chain(engine_class, chain)
    if skipped:
        names = ", ".join(f"{s.name} ({s.engine_path.partition(':')[2]})" for s in skipped)
        lines.append(fit(f"Not in this chain: {names}"))
    entries = []
    for cls in chain:
        own = entries_of(engine_class, cls, chain)
        entries += own
        lines += ["", fit(header(cls))]
        own_lines = [line for entry in own for line in entry_lines(entry)]
        lines += own_lines or ["  (nothing of its own runs here: later classes override it all)"]
    overriding = sum(bool(e.overrides) for e in entries)
    lines += ["", fit(f"{engine_class.__name__} runs {len(entries)} methods from {len(chain)} classes; "
                      f"{overriding} of them override an earlier class's version.")]
    return lines


# ----- the trace: the final engine's calls in one mixed step and one decode step (`python tour.py --trace`) -----

TRACE_MODEL = "tiny-llama"  # random weights of a tiny shape: the engine starts in seconds and downloads nothing
TRACE_BUDGET = 16  # tokens per step: fewer than the second prompt has, so it is prefilled in chunks
TRACE_PROMPTS = ("The capital of France is",  # admitted first: it decodes while the next one is prefilled
                 "Once upon a time, in a land far away, there lived a king who had three daughters, a dragon "
                 "and a very old library full of maps")
TRACE_MAX_TOKENS = 32  # more than the steps taken: both requests still run in the decode step


@dataclass
class Call:
    """One call of a method the trace shows, and the shown calls made while it ran."""

    step: str  # where the method's class is defined: "step09", or "common" for common/engine.py
    name: str  # "ChunkedPrefillEngine.fill_budget"
    calls: list[Call] = field(default_factory=list)


def step_label(module: str) -> str | None:
    """"step09" for a module of a step's folder, "common" for common/engine.py, None for any other module."""
    package = module.partition(".")[0]
    if package.startswith("step"):
        return package.partition("_")[0]
    return "common" if module == "common.engine" else None


def shown_methods() -> dict[CodeType, tuple[str, str]]:
    """(step, "Class.method") by code object, for every method the trace shows: the functions, static and class
    methods of the classes defined in a step's folder or in common/engine.py, dunders (`__init__`, ...) aside;
    properties are not functions of the class, so they are not shown either. Keyed by code object because that is
    what a running frame holds (and Python 3.10's code objects do not name their class)."""
    shown: dict[CodeType, tuple[str, str]] = {}
    for module_name, module in list(sys.modules.items()):
        step = step_label(module_name)
        if step is None:
            continue
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module_name):
                continue  # not a class, or one imported from elsewhere: its own module names it
            for name, value in vars(cls).items():
                function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                if inspect.isfunction(function) and not name.startswith("__"):
                    # a decorated method: its own code, not the wrapper's, which other methods share
                    shown[inspect.unwrap(function).__code__] = (step, f"{cls.__qualname__}.{name}")
    return shown


class CallRecorder:
    """The shown calls that a function makes, as a tree, through `sys.setprofile`: Python calls the profile function
    as every Python function starts and returns, so the calls open at each moment are known."""

    def __init__(self) -> None:
        self.root = Call("", "")
        self.open: list[Call | None] = []  # one entry per Python call running now: its Call, None if not shown
        self.shown: dict[CodeType, tuple[str, str]] = {}

    def record(self, function: Callable[[], object]) -> list[Call]:
        self.root.calls = []
        self.shown = shown_methods()  # once the engine is built: every step's module is loaded by then
        sys.setprofile(self.profile)
        try:
            function()
        finally:
            sys.setprofile(None)
        return self.root.calls

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            method = self.shown.get(frame.f_code)
            call = None if method is None else Call(*method)
            if call is not None:
                next((c for c in reversed(self.open) if c is not None), self.root).calls.append(call)
            self.open.append(call)
        elif event == "return":
            self.open.pop()


def call_lines(calls: list[Call], depth: int = 0) -> list[str]:
    """`step09      ChunkedPrefillEngine.fill_budget`: the step in the first column, the method indented by its
    depth. The same call made several times in a row, with the same calls under it, is one line ending in xN."""
    lines: list[str] = []
    for (step, name, inner), group in itertools.groupby(
            ((call.step, call.name, tuple(call_lines(call.calls, depth + 1))) for call in calls)):
        count = sum(1 for _ in group)
        lines += [f"{step:<8}{'  ' * depth}{name}{f' x{count}' if count > 1 else ''}", *inner]
    return lines


def trace_lines() -> list[str]:
    """Start the final engine on a tiny model and trace two of its steps: a mixed step, where the first request
    decodes while the second one's prompt is prefilled in chunks, and, once that prompt is in, a decode step."""
    step = STEPS[-1]
    engine_class = step.engine_class()
    engine = engine_class.from_config(engine_class.config_class(
        model=TRACE_MODEL, device="cpu", max_num_batched_tokens=TRACE_BUDGET))
    params = SamplingParams(max_tokens=TRACE_MAX_TOKENS)
    decoder = engine.requests[engine.add_request(TRACE_PROMPTS[0], params)]
    engine.step()  # its whole prompt, and its first token: it decodes from now on
    chunked = engine.requests[engine.add_request(TRACE_PROMPTS[1], params)]
    recorder = CallRecorder()
    about = (f"The trace of {engine_class.__name__} ({step.name}), the final engine, on {TRACE_MODEL} (random "
             f"weights) on the CPU, with a budget of {TRACE_BUDGET} tokens a step and its other settings at their "
             "defaults: speculation off (--speculative-tokens 0: step 11's overrides still run, and hand over to step "
             "10's), and no CUDA graphs on a CPU (step 12's static buffers run eagerly). A line: the step whose class "
             "defines the method, then the method, indented under its caller. Not shown: dunder methods, properties, "
             "plain functions, and everything outside the steps' folders and common/engine.py (the model's forward, "
             "the sampler, the request's own methods, PyTorch). The same call repeated, with the same calls under "
             "it: one line, xN.")
    lines = textwrap.wrap(about, LINE_WIDTH)
    before, tokens = chunked.num_computed, len(decoder.output_token_ids)
    calls = recorder.record(engine.step)
    decoded = len(decoder.output_token_ids) - tokens
    lines += ["", f"=== a mixed step, one forward: {decoder.request_id} decodes {decoded} token, and "
                  f"{chunked.request_id}'s prompt tokens {before} to {chunked.num_computed} of "
                  f"{len(chunked.prompt_token_ids)} are prefilled", *call_lines(calls)]
    untraced = 0
    while engine.prefill_pending():
        engine.step()
        untraced += 1
    calls = recorder.record(engine.step)
    lines += ["", f"({untraced} step{'s' * (untraced != 1)} not traced: the rest of {chunked.request_id}'s "
                  f"prompt, beside {decoder.request_id}'s decoding)",
              "", f"=== a decode step: {', '.join(r.request_id for r in engine.running)} decode one token each",
              *call_lines(calls)]
    return lines


# ----- the command line --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run every step's engine on the embedded model, checked "
                                                 "against HF generate() and timed; or map one engine.")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--map", nargs="?", const=STEPS[-1].name, choices=STEP_NAMES, metavar="STEP",
                       help="print the engine of STEP (default: the last step) as one engine, and load no model")
    shown.add_argument("--trace", action="store_true",
                       help="run the final engine on a tiny random model and print the methods that one mixed step "
                            "and one decode step call, in order, each with its step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.map:
        print("\n".join(engine_map(find_step(args.map).engine_class())))
        return 0
    if args.trace:
        print("\n".join(trace_lines()))
        return 0
    return run_tour()


def run_tour() -> int:
    # Each step's parity check loads the HF model again: its "Loading weights" bar would repeat for every step.
    transformers_logging.disable_progress_bar()
    print(f"The tour runs {len(STEPS)} engines on the embedded SmolLM2-135M-Instruct, on the CPU, "
          f"{len(DEMO_PROMPTS)} prompts x {MAX_TOKENS} tokens each, then step 08's server.")
    results = [(step.name, *tour_step(step.name, step.idea, step.engine_class())) for step in STEPS]
    print("\n=== step08_serve: an OpenAI-compatible server over one step loop (tiny model, the openai SDK)")
    served_ok = server_dry_run(server_args([])) == 0
    width = max(len(name) for name, _, _ in results) + 2
    print(f"\n{'step':<{width}}{'tok/s':>6}   parity")
    for name, tok_s, ok in results:
        print(f"{name:<{width}}{tok_s:>6.1f}   {'OK' if ok else 'FAILED'}")
    print(f"{'step08_serve':<{width}}{'-':>6}   {'OK' if served_ok else 'FAILED'} (streamed text equals the non-streamed)")
    return 0 if served_ok and all(ok for _, _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
