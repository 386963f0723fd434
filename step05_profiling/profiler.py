"""Profile an engine's steps: a trace for Perfetto, and a table of where each step's time went.

    report = profile_steps(engine, num_steps=8, trace_path=Path("runs/profile/step06.json"))
    print(format_report(report))

The requests must already be in the engine (and past their first steps, if the steady state is what you
want). `torch.profiler` records the host's operators, and on a GPU every CUDA call and kernel, while
`phases.instrument` names the engine's phases; the trace is written, then read back (`trace.read_steps`),
so the table says exactly what the file shows. `--profile` on every step's run.py and the server's
`POST /profile` use it.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from common.config import weight_params_per_decode_step
from common.engine import Engine
from common.request import Completion
from common.sampling import SamplingParams
from step05_profiling.phases import PHASES, instrument
from step05_profiling.trace import BREAKDOWN, StepProfile, load_events, read_steps


@dataclass
class ProfileReport:
    trace: str  # the trace file
    device: str
    steps: list[StepProfile]  # one per profiled engine step
    weight_read_ms: float  # every weight read once at the copy bandwidth: the decode step's floor
    copy_bandwidth_gbs: float

    def mean(self, pick) -> float:  # noqa: ANN001 - a function of a StepProfile
        return sum(pick(s) for s in self.steps) / len(self.steps)

    def summary(self) -> dict:
        """Means over the profiled steps, as the evidence files and the lesson's tables hold them."""
        rows = [*PHASES, "not in a phase"]
        return {
            "steps_profiled": len(self.steps), "step_ms": self.mean(lambda s: s.ms),
            "host_ms": {p: self.mean(lambda s: s.host_ms[p]) for p in rows},  # noqa: B023 - called at once
            "gpu_ms": {p: self.mean(lambda s: s.gpu_ms.get(p, 0.0)) for p in rows},  # noqa: B023
            "kernels_by_phase": {p: self.mean(lambda s: s.kernels_by_phase.get(p, 0)) for p in rows},  # noqa: B023
            "launches": self.mean(lambda s: s.launches), "kernels": self.mean(lambda s: s.kernels),
            "syncs": self.mean(lambda s: s.syncs), "gpu_busy_ms": self.mean(lambda s: s.gpu_busy_ms),
            "breakdown_ms": {c: self.mean(lambda s: s.breakdown[c]) for c in BREAKDOWN},  # noqa: B023
            "weight_read_ms": self.weight_read_ms, "copy_bandwidth_gbs": self.copy_bandwidth_gbs,
            "trace": self.trace,
        }


_bandwidth: dict[str, float] = {}  # measured once per device and process


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Bytes read plus written per second by a large copy on `device`: how fast its memory can feed a step."""
    key = str(device)
    if key not in _bandwidth:
        if device.type == "cuda":
            from step06_paged_attention.bench.kernel_bench import copy_bandwidth_gbs as cuda_copy_bandwidth

            _bandwidth[key] = cuda_copy_bandwidth(device)
        else:  # 256 MiB: far beyond the caches; the fastest of a few copies
            src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - start)
            _bandwidth[key] = 2 * src.numel() / best / 1e9
    return _bandwidth[key]


def weight_read_ms(engine: Engine) -> tuple[float, float]:
    """(ms to read every weight a decode step uses once, the copy bandwidth in GB/s it assumes)."""
    gbs = copy_bandwidth_gbs(engine.device)
    weight_bytes = weight_params_per_decode_step(engine.model.config) * engine.model.dtype.itemsize
    return weight_bytes / (gbs * 1e9) * 1e3, gbs


class StepProfiler:
    """The profiler and the phase ranges over whatever steps `engine` takes between `start()` and `stop()`,
    for a caller that runs the steps itself (the server's step loop); `profile_steps` is the usual way in."""

    def __init__(self, engine: Engine, trace_path: Path) -> None:
        self.engine, self.trace_path = engine, trace_path
        self.on_gpu = engine.device.type == "cuda"
        self.floor_ms, self.gbs = weight_read_ms(engine)  # measured before: the copy is not part of the trace
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
        self.prof = profile(activities=activities)
        self.ranges = ExitStack()

    def start(self) -> None:
        # The first ranges a process opens pay a one-off setup (a millisecond or two) that would land in the first
        # profiled step, outside any phase: pay it here, before the profiler starts.
        with record_function("warm-up"), record_function("warm-up"):
            pass
        self.ranges.enter_context(self.prof)
        self.ranges.enter_context(instrument(self.engine))

    def stop(self) -> ProfileReport:
        """Stop, write the trace, and read it back; raises ValueError if no step ran meanwhile."""
        if self.on_gpu:
            torch.cuda.synchronize()  # the last step's kernels into the trace
        self.ranges.close()
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.trace_path))
        steps = read_steps(load_events(self.trace_path), self.floor_ms, self.on_gpu)
        if not steps:
            raise ValueError("no engine step ran while profiling: give the engine requests first")
        return ProfileReport(str(self.trace_path), str(self.engine.device), steps, self.floor_ms, self.gbs)


def profile_steps(engine: Engine, num_steps: int, trace_path: Path) -> ProfileReport:
    """Run up to `num_steps` steps of `engine` (fewer if its requests finish) under the profiler, write the
    trace to `trace_path`, and read it back."""
    profiler = StepProfiler(engine, trace_path)
    profiler.start()
    try:
        for _ in range(num_steps):
            if not engine.has_unfinished():
                break
            engine.step()
    finally:
        report = profiler.stop()
    return report


def format_report(report: ProfileReport) -> str:
    """The per-phase table and the step's totals, as a terminal shows them."""
    s = report.summary()
    on_gpu = report.device.startswith("cuda")
    lines = [f"{s['steps_profiled']} steps profiled, trace in {report.trace} (open it in https://ui.perfetto.dev)",
             f"{'phase':<18}{'host ms':>10}" + (f"{'GPU ms':>10}{'kernels':>9}" if on_gpu else "")]
    for phase in [*PHASES, "not in a phase"]:
        gpu = f"{s['gpu_ms'][phase]:>10.3f}{s['kernels_by_phase'][phase]:>9.0f}" if on_gpu else ""
        lines.append(f"{phase:<18}{s['host_ms'][phase]:>10.3f}{gpu}")
    lines.append(f"{'step':<18}{s['step_ms']:>10.3f}")
    syncs = "synchronizations" if on_gpu else "reads of a value to the host (.item(): a GPU would wait on each)"
    lines.append(f"per step: {s['launches']:.0f} launches, {s['kernels']:.0f} kernels, {s['syncs']:.1f} {syncs}")
    if on_gpu:
        idle = s["step_ms"] - s["gpu_busy_ms"]
        lines.append(f"GPU idle {idle:.3f} ms of the step's {s['step_ms']:.3f} ms ({idle / s['step_ms']:.0%})")
    lines.append(f"weight read at {s['copy_bandwidth_gbs']:.0f} GB/s: {s['weight_read_ms']:.3f} ms, "
                 f"{s['weight_read_ms'] / s['step_ms']:.0%} of the step")
    lines.append("where the step went: " + ", ".join(f"{c} {ms:.3f} ms" for c, ms in s["breakdown_ms"].items()))
    return "\n".join(lines)


def report_dict(report: ProfileReport) -> dict:
    """The report with every profiled step, for JSON evidence."""
    return report.summary() | {"per_step": [asdict(step) for step in report.steps]}


WARMUP_STEPS = 2  # the first steps prefill and allocate: not what a steady decode step costs


def profile_generate(engine: Engine, prompts: list[list[int]], params: SamplingParams, num_steps: int,
                     trace_path: Path) -> tuple[list[Completion], ProfileReport]:
    """`engine.generate(prompts, params)`, with `num_steps` of its steps profiled after `WARMUP_STEPS`."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    requests = [engine.requests[i] for i in ids]
    for _ in range(WARMUP_STEPS):
        if engine.has_unfinished():
            engine.step()
    report = profile_steps(engine, num_steps, trace_path)
    while engine.has_unfinished():
        engine.step()
    return [r.to_completion() for r in requests], report
