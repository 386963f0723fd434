"""Named ranges around an engine's phases, put on from outside: no step's code changes to be profiled.

A step's time goes to six phases, each made of methods the steps already have:

    schedule         choose this step's requests and give them blocks      admit, schedule, launch_ahead
    prepare inputs   the tensors the forward reads (positions, slots)       build_metadata, launch, inputs.fill
    forward          the model, eagerly or as a replayed CUDA graph       model.forward, CUDAGraph.replay
    sample           logits to token ids, copied to the host                sample, verify, PendingTokens.wait
    process outputs  append tokens, check stops, retire finished requests   process_tokens, emit
    detokenize       token ids to text                                      IncrementalDetokenizer.add

`instrument(engine)` wraps each of those methods that the engine has in a `torch.profiler.record_function`
range of the phase's name (and an NVTX range on a GPU, for Nsight Systems), for as long as the `with` lasts.
Phases nest (a step's `launch` fills the inputs and replays the graph): a phase's own time is its range less
the phases inside it. Time in no phase shows as such, so a method missing from the lists cannot hide.
Inside the forward, each layer's attention gets a range too (`attention`), so the profile can tell it from
the projections even on a CPU, where no kernel names say which is which.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch.profiler import record_function

from common.engine import Engine

PHASES = ("schedule", "prepare inputs", "forward", "sample", "process outputs", "detokenize")
STEP_RANGE = "engine step"  # around each `engine.step()`: the window a step's phases add up to
ATTENTION_RANGE = "attention"  # inside the forward, around each layer's `ctx.attend`

# The engine's own methods, by phase. A step that lacks one simply does not have that seam.
ENGINE_METHODS = {
    "schedule": ("admit", "schedule", "launch_ahead"),
    "prepare inputs": ("grow_block_tables", "make_decode_context", "build_metadata", "mixed_chunk", "launch",
                       "launch_decode"),
    "sample": ("sample", "verify", "tokens_from_argmax"),
    "process outputs": ("process_tokens", "emit"),
}
MODEL_METHODS = {"forward": ("forward", "compute_logits")}
# Methods of classes that live below the engine (graph buffers, the detokenizer), as "module:Class.method".
# Each is wrapped only if its module is loaded already: a step that never imported it cannot be calling it.
CLASS_METHODS = {
    "prepare inputs": ("step01_serial.kv_cache:ContiguousForward.__init__",
                       "step12_cuda_graph.decode_graphs:StaticDecodeInputs.fill",
                       "step12_cuda_graph.mixed_graphs:StaticMixedInputs.fill"),
    "forward": ("torch.cuda.graphs:CUDAGraph.replay", "step12_cuda_graph.decode_graphs:DecodeGraphs.forward",
                "step12_cuda_graph.mixed_graphs:MixedStepGraphs.forward"),
    "sample": ("step12_cuda_graph.decode_graphs:PendingTokens.wait",),
    "detokenize": ("common.tokenizer:IncrementalDetokenizer.add",),
}


def ranged(name: str, fn: Callable, nvtx: bool) -> Callable:
    """`fn`, run inside a profiler range called `name` (and an NVTX range of the same name if `nvtx`)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with record_function(name):
            if not nvtx:
                return fn(*args, **kwargs)
            torch.cuda.nvtx.range_push(name)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.nvtx.range_pop()
    return wrapper


@contextmanager
def patched(owner: object, attribute: str, replacement: Callable) -> Iterator[None]:
    """`owner.attribute` is `replacement` inside the `with`, and what it was after (even after an error)."""
    had_own = attribute in vars(owner)  # an instance's own attribute, or a class's own method
    original = vars(owner)[attribute] if had_own else None
    setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, attribute, original)
        else:
            delattr(owner, attribute)  # the class's method shows through again


def loaded_class(path: str) -> tuple[type, str] | None:
    """("module:Class.method") -> (Class, "method"), or None when the module is not loaded."""
    module_name, _, rest = path.partition(":")
    if module_name not in sys.modules:
        return None
    class_name, _, method = rest.partition(".")
    return getattr(importlib.import_module(module_name), class_name), method


def with_attention_ranges(forward: Callable, wrap: Callable[[str, Callable], Callable]) -> Callable:
    """The model's forward, with each `ctx.attend` of this call wrapped as an attention range."""
    @functools.wraps(forward)
    def wrapper(input_ids: torch.Tensor, ctx, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if "attend" not in vars(ctx):  # a context reused by a later call keeps its first wrapper
            ctx.attend = wrap(ATTENTION_RANGE, ctx.attend)
        return forward(input_ids, ctx, *args, **kwargs)
    return wrapper


class PhaseTimer:
    """The other way to wrap the same seams: each phase's own time (less the phases inside it) by the host's clock,
    with no profiler, whose own cost would swamp phases of a tenth of a millisecond (step 14's bench_host.py).

        timer = PhaseTimer()
        with instrument(engine, wrap=timer.wrap):
            engine.step()
        timer.own_seconds  # {"schedule": ..., "forward": ..., "engine step": ...}
    """

    def __init__(self) -> None:
        self.own_seconds: dict[str, float] = {}
        self.inner: list[float] = []  # per open phase, the time of the phases inside it so far

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                own = elapsed - self.inner.pop()
                self.own_seconds[name] = self.own_seconds.get(name, 0.0) + own
                if self.inner:
                    self.inner[-1] += elapsed
        return timed


@contextmanager
def instrument(engine: Engine, wrap: Callable[[str, Callable], Callable] | None = None) -> Iterator[None]:
    """Inside the `with`, every phase of `engine` runs in a range of its name and every `engine.step()` in a
    range of its own; everything is as it was afterwards. `wrap(name, fn)` replaces the profiler's ranges
    (`PhaseTimer.wrap`, say)."""
    nvtx = engine.device.type == "cuda"
    if wrap is None:
        def wrap(name: str, fn: Callable) -> Callable:
            return ranged(name, fn, nvtx)
    with ExitStack() as stack:
        for phase, names in ENGINE_METHODS.items():
            for name in names:
                if hasattr(engine, name):
                    stack.enter_context(patched(engine, name, wrap(phase, getattr(engine, name))))
        for phase, names in MODEL_METHODS.items():
            for name in names:
                method = getattr(engine.model, name)
                if name == "forward":
                    method = with_attention_ranges(method, wrap)
                stack.enter_context(patched(engine.model, name, wrap(phase, method)))
        for phase, paths in CLASS_METHODS.items():
            for path in paths:
                found = loaded_class(path)
                if found is not None:
                    owner, name = found
                    stack.enter_context(patched(owner, name, wrap(phase, getattr(owner, name))))
        stack.enter_context(patched(engine, "step", wrap(STEP_RANGE, engine.step)))
        yield
