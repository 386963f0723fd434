"""Reading a profiler trace: where each engine step's time went, from the trace file alone.

A trace (`torch.profiler`'s `export_chrome_trace`, the file Perfetto and chrome://tracing open) is a list of
events, each with a category, a name, a thread, a start `ts` and a duration `dur` in microseconds:

    user_annotation   our ranges: "engine step", the phases (phases.py), "attention"
    cpu_op            a PyTorch operator the host ran (aten::mm, aten::item, ...)
    cuda_runtime,     calls into CUDA on the host: kernel and graph launches, copies, synchronizations
    cuda_driver
    kernel            a kernel as the GPU ran it; args.correlation names the launch that queued it

`read_steps` turns that into one `StepProfile` per engine step: each phase's own host time, the GPU time of
the kernels each phase launched, launches, kernels, synchronizations, and how the GPU spent the step's
window (`breakdown`). Host and GPU timestamps share one clock, so a GPU gap can be laid against what the
host was doing at the time.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from common.profiling.kernels import ATTENTION, MATMUL, category_of
from common.profiling.phases import ATTENTION_RANGE, PHASES, STEP_RANGE

# Host calls that wait for the GPU to finish its queue: PyTorch makes one after every copy it is not told may
# run on (`.item()`, `.tolist()`, `torch.tensor(a_list, device="cuda")`), an event's `synchronize()`, and
# the synchronous `cudaMemcpy`. (`cudaMemcpyAsync` alone is not one.) On a CPU nothing waits, but an
# `.item()` still shows as an operator: it is a call a GPU would wait on, so a CPU profile counts those.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
CPU_SYNC_OPS = ("aten::item",)
MATMUL_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul")  # a layer's weights, on a CPU

# Where a decode step's time goes, in the order the lesson stacks its bars (bottom first).
BREAKDOWN = ("weight read", "matmul above the weight read", "attention", "element-wise and other kernels",
             "gaps between kernels", "waiting for launches", "host work not hidden")


@dataclass
class Event:
    cat: str
    name: str
    tid: int
    start: float  # microseconds, on the clock host and GPU share
    dur: float
    correlation: int | None = None

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclass
class StepProfile:
    """One engine step. Times in milliseconds."""
    ms: float
    host_ms: dict[str, float]  # each phase's own time (less the phases inside it), and "not in a phase"
    gpu_ms: dict[str, float]  # the kernels each phase launched
    kernels_by_phase: dict[str, int]
    launches: int  # kernel and graph launches the host made
    kernels: int  # kernels the GPU ran for this step's launches
    syncs: int
    gpu_busy_ms: float  # within the step's window, whoever launched the work
    breakdown: dict[str, float] = field(default_factory=dict)  # BREAKDOWN's categories; they add up to `ms`


def load_events(path: str | Path) -> list[Event]:
    """The complete events ("ph": "X") of a Chrome trace file."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)["traceEvents"]
    return [Event(e.get("cat", ""), e["name"], e.get("tid", 0), float(e["ts"]), float(e.get("dur", 0.0)),
                  (e.get("args") or {}).get("correlation"))
            for e in raw if e.get("ph") == "X" and "ts" in e]


def nesting(ranges: list[Event]) -> list[tuple[Event, float, int]]:
    """Each range, sorted by start, with its own time (its duration less that of the ranges directly inside
    it) and its depth (0: inside none of the others)."""
    ranges = sorted(ranges, key=lambda e: (e.start, -e.dur))
    own = {id(r): r.dur for r in ranges}
    depth = {}
    stack: list[Event] = []
    for r in ranges:
        while stack and stack[-1].end <= r.start:
            stack.pop()
        if stack:
            own[id(stack[-1])] -= r.dur
        depth[id(r)] = len(stack)
        stack.append(r)
    return [(r, own[id(r)], depth[id(r)]) for r in ranges]


def innermost(ranges: list[Event], at: float) -> str | None:
    """The name of the innermost of `ranges` (sorted by start, nested) that holds the instant `at`."""
    name = None
    for r in ranges[: bisect_right([r.start for r in ranges], at)]:
        if r.start <= at < r.end:
            name = r.name  # later starts lie inside earlier ones: the last holding `at` is innermost
    return name


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two lists of disjoint, sorted intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def count_syncs(events: list[Event], on_gpu: bool) -> int:
    """How many times the host waited for the device among `events` (one step's host events): on a GPU the CUDA
    calls that block until the device is done (SYNC_CALLS); on a CPU the operators a GPU would wait on
    (CPU_SYNC_OPS)."""
    if on_gpu:
        return sum(1 for e in events if e.cat in ("cuda_runtime", "cuda_driver") and e.name in SYNC_CALLS)
    return sum(1 for e in events if e.cat == "cpu_op" and e.name in CPU_SYNC_OPS)


def read_steps(events: list[Event], weight_read_ms: float, on_gpu: bool) -> list[StepProfile]:
    """One StepProfile per "engine step" range, in order. `weight_read_ms`: reading every weight once at the
    device's copy bandwidth, the part of the matrix multiplies no kernel can avoid."""
    steps = sorted((e for e in events if e.cat == "user_annotation" and e.name == STEP_RANGE), key=lambda e: e.start)
    if not steps:
        return []
    host = steps[0].tid
    phases = sorted((e for e in events if e.cat == "user_annotation" and e.name in PHASES and e.tid == host),
                    key=lambda e: (e.start, -e.dur))
    attention = [e for e in events if e.cat == "user_annotation" and e.name == ATTENTION_RANGE and e.tid == host]
    ops = [e for e in events if e.cat == "cpu_op" and e.tid == host]
    calls = [e for e in events if e.cat in ("cuda_runtime", "cuda_driver")]
    launches = {e.correlation: e for e in calls if "Launch" in e.name and e.correlation is not None}
    launch_at = {correlation: call.start for correlation, call in launches.items()}
    kernels = sorted((e for e in events if e.cat == "kernel" and e.correlation in launch_at), key=lambda e: e.start)
    out = []
    for step in steps:
        def inside(e: Event) -> bool:
            return step.start <= e.start < step.end  # noqa: B023 - used within this iteration

        mine = [p for p in phases if inside(p)]
        host_ms = dict.fromkeys(PHASES, 0.0)
        outermost = 0.0
        for phase, own, depth in nesting(mine):
            host_ms[phase.name] += own / 1e3
            outermost += phase.dur if depth == 0 else 0.0
        host_ms["not in a phase"] = (step.dur - outermost) / 1e3
        launched = [k for k in kernels if step.start <= launch_at[k.correlation] < step.end]
        gpu_ms = dict.fromkeys(PHASES, 0.0)
        by_phase = dict.fromkeys(PHASES, 0)
        for k in launched:
            phase = innermost(mine, launch_at[k.correlation]) or "not in a phase"
            gpu_ms[phase] = gpu_ms.get(phase, 0.0) + k.dur / 1e3
            by_phase[phase] = by_phase.get(phase, 0) + 1
        window = [(step.start, step.end)]
        busy = merged([(max(k.start, step.start), min(k.end, step.end)) for k in kernels
                       if k.end > step.start and k.start < step.end])
        syncs = count_syncs([e for e in (calls if on_gpu else ops) if inside(e)], on_gpu)
        profile = StepProfile(step.dur / 1e3, host_ms, gpu_ms, by_phase,
                              sum(1 for c in calls if inside(c) and "Launch" in c.name), len(launched), syncs,
                              overlap(busy, window) / 1e3)
        forward = merged([(p.start, p.end) for p in mine if p.name == "forward"])
        if on_gpu:
            queued_at = {correlation: call.end for correlation, call in launches.items()}
            profile.breakdown = gpu_breakdown(step, kernels, queued_at, busy, forward, weight_read_ms)
        else:
            profile.breakdown = cpu_breakdown(step, [o for o in ops if inside(o)],
                                              [a for a in attention if inside(a)], forward, weight_read_ms)
        out.append(profile)
    return out


def split_matmul(parts: dict[str, float], matmul_ms: float, weight_read_ms: float) -> None:
    """The matrix multiplies' time as the weight read (at most what they took) and what lies above it."""
    parts["weight read"] = min(matmul_ms, weight_read_ms)
    parts["matmul above the weight read"] = matmul_ms - parts["weight read"]


def busy_by_kind(step: Event, kernels: list[Event]) -> dict[str, float]:
    """The GPU's busy time in the step's window (ms) by kind of kernel. Kernels may overlap: step 13's
    programmatic dependent launch starts a kernel while the one before it still runs, and the new one waits
    (inside its own time) for the old one to finish. An instant shared by several kernels goes to the one that
    started first, the one doing the work, so the kinds add up to the busy time, not to more."""
    by_kind = {MATMUL: 0.0, ATTENTION: 0.0, "other": 0.0}
    edges = []
    for k in kernels:
        start, end = max(k.start, step.start), min(k.end, step.end)
        if end > start:
            kind = category_of(k.name)
            edges += [(start, 1, k.start, kind), (end, -1, k.start, kind)]
    edges.sort(key=lambda e: (e[0], e[1]))
    active: list[tuple[float, str]] = []  # (when it started, kind) of the kernels running now
    last = 0.0
    for at, change, started, kind in edges:
        if active and at > last:
            first = min(active)[1]
            by_kind[first if first in by_kind else "other"] += (at - last) / 1e3
        if change > 0:
            active.append((started, kind))
        else:
            active.remove((started, kind))
        last = at
    return by_kind


def gpu_breakdown(step: Event, kernels: list[Event], queued_at: dict, busy: list[tuple[float, float]],
                  forward: list[tuple[float, float]], weight_read_ms: float) -> dict[str, float]:
    """The step's window on the GPU: kernel time by kind, and idle time by its cause. Before each idle gap ends,
    the next kernel was queued either already (its launch call had returned: a gap between kernels, the cost of
    starting one) or during the gap: then the GPU waited for the host, "waiting for launches" while the host was
    launching the forward (a graph's launch call included), "host work not hidden" while it did anything else.
    `queued_at`: when each launch call (by correlation) returned."""
    by_kind = busy_by_kind(step, kernels)
    idle, cursor = [], step.start
    for start, end in busy:
        if start > cursor:
            idle.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < step.end:
        idle.append((cursor, step.end))
    starts = [k.start for k in kernels]  # kernels sorted by start
    between = launching = host_wait = 0.0
    for a, b in idle:
        following = bisect_right(starts, a)  # the first kernel to start after the gap began
        queued = queued_at[kernels[following].correlation] if following < len(kernels) else float("inf")
        waited = (a, min(b, max(a, queued)))  # the GPU had nothing queued: it waited for the host
        in_forward = overlap([waited], forward)
        between += b - waited[1]
        launching += in_forward
        host_wait += (waited[1] - waited[0]) - in_forward
    parts: dict[str, float] = {}
    split_matmul(parts, by_kind[MATMUL], weight_read_ms)
    parts["attention"] = by_kind[ATTENTION]
    parts["element-wise and other kernels"] = by_kind["other"]
    parts["gaps between kernels"] = between / 1e3
    parts["waiting for launches"] = launching / 1e3
    parts["host work not hidden"] = host_wait / 1e3
    return parts


def cpu_breakdown(step: Event, ops: list[Event], attention: list[Event], forward: list[tuple[float, float]],
                  weight_read_ms: float) -> dict[str, float]:
    """The same categories on a CPU, where the host runs the kernels: the forward's operators by kind, the
    interpreter's time between them (the CPU waiting for its next launch), and the rest of the step."""
    attention_ms = sum(a.dur for a in attention) / 1e3
    inside_forward = [o for o in ops if any(s <= o.start < e for s, e in forward)
                      and not any(a.start <= o.start < a.end for a in attention)]
    top = [o for o, _, depth in nesting(inside_forward) if depth == 0]  # an operator, not one it called
    matmul_ms = sum(o.dur for o in top if o.name in MATMUL_OPS) / 1e3
    other_ms = sum(o.dur for o in top if o.name not in MATMUL_OPS) / 1e3
    forward_ms = sum(e - s for s, e in forward) / 1e3
    parts: dict[str, float] = {}
    split_matmul(parts, matmul_ms, weight_read_ms)
    parts["attention"] = attention_ms
    parts["element-wise and other kernels"] = other_ms
    parts["gaps between kernels"] = 0.0  # an operator starts as soon as the interpreter reaches it
    parts["waiting for launches"] = max(0.0, forward_ms - attention_ms - matmul_ms - other_ms)
    parts["host work not hidden"] = step.dur / 1e3 - forward_ms
    return parts
