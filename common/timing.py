"""Timing a GPU kernel, and how fast a device's memory can be read: the ceilings the benchmarks compare against.

`timed_ms` replays a CUDA graph of `CALLS_PER_GRAPH` calls, so the figure is the GPU's time per call, not the
host's time to launch it (measured per call, a small kernel on a slow host shows only the launch);
`call_timed_ms` times call by call, for a kernel long enough that its launch does not count; `graph_replay_ms`
times a graph already captured (an engine's decode step).
`copy_bandwidth_gbs` is the device's copy bandwidth, measured as a large copy; `memory_bandwidth_gbs` the same,
on a CPU too, measured once per device and process (the profiler's weight-read floor).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CALLS_PER_GRAPH = 20


def timed_ms(fn: Callable[[], object], repeats: int) -> float:
    """GPU milliseconds per call of `fn`: the median over `repeats` replays of a graph of CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and allocate outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS_PER_GRAPH)
    return statistics.median(times)


def call_timed_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    """GPU milliseconds of one call of `fn`, timed call by call with CUDA events: the median of `repeats`."""
    for _ in range(3):  # compile and allocate before timing
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """GPU milliseconds per replay of a captured graph, over `replays` replays after one to warm up."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def copy_bandwidth_gbs(device: torch.device, gigabytes: float = 2.0, repeats: int = 20) -> float:
    """Device-to-device copy by a kernel: bytes read plus bytes written, per second. Timed call by call
    (2 GB takes long enough that the launch does not count); inside a CUDA graph the same copy_ would
    become a copy-engine transfer, which is slower (about 2.7 TB/s on the H200) and not the ceiling.
    The fastest of the repeats: a ceiling is what the memory can do at its best (the median moved between
    4.17 and 4.24 TB/s from one run to the next), so shares of it err low rather than high."""
    src = torch.empty(int(gigabytes * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() / (min(times) * 1e-3) / 1e9


_bandwidth: dict[str, float] = {}  # measured once per device and process


def memory_bandwidth_gbs(device: torch.device) -> float:
    """Bytes read plus written per second by a large copy on `device`, a GPU or a CPU: how fast its memory can
    feed a step."""
    key = str(device)
    if key not in _bandwidth:
        if device.type == "cuda":
            _bandwidth[key] = copy_bandwidth_gbs(device)
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
