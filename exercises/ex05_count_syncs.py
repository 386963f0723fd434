"""Exercise 05-count-syncs: how many times a step's host stopped to wait for the device.

Write the body of `count_syncs`; `python -m exercises run 05-count-syncs` plugs it into the profiler's trace
reader in place of `common.profiling.trace.count_syncs` and runs step 05's tests and dry run on it.
"""

from __future__ import annotations

from common.profiling.trace import CPU_SYNC_OPS, SYNC_CALLS, Event


def count_syncs(events: list[Event], on_gpu: bool) -> int:
    """How many of `events` (the host's events within one engine step) are the host waiting for the device.

    - On a GPU (`on_gpu` True): the events whose category (`.cat`) is "cuda_runtime" or "cuda_driver" and
      whose name is one of `SYNC_CALLS` (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize,
      cudaMemcpy), by the whole name: "cudaMemcpyAsync" does not count, since an asynchronous copy by itself
      does not wait (when PyTorch must wait for one, as in `.item()`, it calls cudaStreamSynchronize after
      it, and that counts). An event of any other category never counts, whatever its name.
    - On a CPU (`on_gpu` False): the events of category "cpu_op" whose name is one of `CPU_SYNC_OPS`
      (`aten::item`), by the whole name. A CPU has no device to wait for: the host runs the kernels itself.
      But `aten::item` is what `.item()` (and `int(tensor)`, `bool(tensor)`) calls to read a value back into
      Python, and on a GPU that read must wait until every kernel queued before it has run. Counting it on
      a CPU finds, without a GPU, each place where a GPU would stall.

    Example: [cpu_op "aten::item", cpu_op "aten::mm", cuda_runtime "cudaMemcpyAsync", cuda_runtime
    "cudaStreamSynchronize", cuda_driver "cuLaunchKernel"] gives 1 on a GPU (the stream synchronize: the copy
    is asynchronous, and `aten::item` is a cpu_op, not a CUDA call) and 1 on a CPU (the `aten::item`: on a
    CPU the CUDA calls do not count).

    Then use it: `.venv/bin/python step05_profiling/run.py --model tiny-llama` profiles every step (well under
    a minute; the embedded model takes minutes on a CPU), and each row's table has a "per step:" line with its
    synchronizations per step, counted by your function. Find the row with the most. It is step 06 with
    `--sync-per-layer`, the seed's bug kept as an ablation: it reads one value back in every layer of the
    forward, one synchronization per layer (on a CPU, 2 a step on tiny-llama and 30 on the embedded model,
    where plain step 06 has none; on a GPU, one per layer on top of the few that every step has anyway, such
    as reading the sampled tokens back).

    Hints (step05_profiling/README.md, "The seed's bug, found as a learner would"): `e.name in SYNC_CALLS`
    compares the whole name with each in the tuple; `sum(1 for e in events if ...)` counts.
    """
    raise NotImplementedError("write common.profiling.trace.count_syncs: see the hints in its docstring")
