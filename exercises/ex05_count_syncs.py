"""Exercise 05-count-syncs: how many times a step's host stopped to wait for the device.

Write the body of `count_syncs`; `python -m exercises run 05-count-syncs` plugs it into the profiler's trace
reader in place of `common.profiling.trace.count_syncs` and runs step 05's tests and dry run on it.
"""

from __future__ import annotations

from common.profiling.trace import CPU_SYNC_OPS, SYNC_CALLS, Event


def count_syncs(events: list[Event], on_gpu: bool) -> int:
    """How many of `events` (the host's events within one engine step) are the host waiting for the device.

    Inputs: `events`, each with a category `.cat` and a `.name`; `on_gpu`, whether the trace was taken on a GPU.
    Returns: the count, an int.
    Rule:
    - On a GPU: the events of category "cuda_runtime" or "cuda_driver" whose whole name is one of `SYNC_CALLS`
      (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, cudaMemcpy). "cudaMemcpyAsync" does
      not count: an asynchronous copy by itself does not wait (when PyTorch must wait for one, as in `.item()`,
      it calls cudaStreamSynchronize after it, and that counts). Any other category never counts.
    - On a CPU: the events of category "cpu_op" whose whole name is one of `CPU_SYNC_OPS` (`aten::item`). A CPU
      has no device to wait for, but `aten::item` is what `.item()`, `int(tensor)` and `bool(tensor)` call to
      read a value back into Python, and on a GPU that read waits for every kernel queued before it: counting
      it on a CPU finds, without a GPU, each place where a GPU would stall.

    Example: [cpu_op "aten::item", cpu_op "aten::mm", cuda_runtime "cudaMemcpyAsync", cuda_runtime
    "cudaStreamSynchronize", cuda_driver "cuLaunchKernel"] gives 1 on a GPU (the stream synchronize) and 1 on a
    CPU (the `aten::item`).

    Then use it: `.venv/bin/python step05_profiling/run.py --model tiny-llama` profiles every step (well under
    a minute), and each row's table has a "per step:" line with its synchronizations per step, counted by your
    function. The row with the most is step 06 with `--sync-per-layer`, the seed's bug kept as an ablation: one
    read back per layer (on a CPU, 2 a step on tiny-llama and 30 on the embedded model, where plain step 06 has
    none).

    Hints (step05_profiling/README.md, "The seed's bug, found as a learner would").
    """
    raise NotImplementedError("write common.profiling.trace.count_syncs: see the hints in its docstring")
