"""The one list of the tutorial's engines and their own flags, read by the tour, the cross-step comparison,
step 04, the server, the exercises and the GPU evidence script.

Adding a step is its folder plus one line here. Each engine is named as "module:Class" and imported only
when asked for, so listing the steps loads none of them, nor torch (a command line checks its values and
answers --help before anything heavy loads; and a step whose optional kernels are missing does not stop the
others from being listed). A step's flags come from its run.py's `add_arguments`, which imports no torch.

    python -m common.steps    # the step names, one a line (scripts/gpu_suite.sh reads them)
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only: importing the engine at run time would load torch
    from common.engine import Engine


@dataclass(frozen=True)
class Step:
    name: str  # the step's folder, and its name on every command line (`--step`, `--steps`)
    idea: str  # what the step teaches, in one line
    engine_path: str  # "module:Class" of its engine

    def engine_class(self) -> type[Engine]:
        module, _, cls = self.engine_path.partition(":")
        return getattr(importlib.import_module(module), cls)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the step's own flags (its run.py's `add_arguments`; step 01 has none) to `parser`."""
        add = getattr(importlib.import_module(f"{self.name}.run"), "add_arguments", None)
        if add is not None:
            add(parser)


# In step order. Each engine subclasses an earlier one: 02 starts afresh from common's Engine (01 is the serial
# baseline), 06 builds on 02 (03 only swaps 02's gather), and from 06 on each builds on the one above it.
STEPS: tuple[Step, ...] = (
    Step("step01_serial", "serial decode, one forward per request, contiguous KV",
         "step01_serial.engine:SerialEngine"),
    Step("step02_paged_kv", "paged KV blocks, one batched decode forward, continuous batching",
         "step02_paged_kv.engine:PagedEngine"),
    Step("step03_vectorized_gather", "step 02 with one vectorized gather instead of loops",
         "step03_vectorized_gather.engine:VectorizedGatherEngine"),
    Step("step06_paged_attention", "attention reads KV from the block table, one batched prefill",
         "step06_paged_attention.engine:PagedAttentionEngine"),
    Step("step07_preemption", "optimistic admission, preemption by recompute or swap, priorities",
         "step07_preemption.engine:PreemptionEngine"),
    Step("step09_chunked_prefill", "a token budget per step: long prompts in chunks, one forward with the decoders",
         "step09_chunked_prefill.engine:ChunkedPrefillEngine"),
    Step("step10_prefix_caching", "full KV blocks keyed by their tokens, shared by prompts that start alike",
         "step10_prefix_caching.engine:PrefixCachingEngine"),
    Step("step11_speculative_decoding", "several proposed tokens checked in one forward: n-gram or draft-model guesses",
         "step11_speculative_decoding.engine:SpeculativeEngine"),
    Step("step12_cuda_graph", "decode replayed as CUDA graphs per batch bucket (eager on a CPU)",
         "step12_cuda_graph.engine:CudaGraphEngine"),
    Step("step13_fused_decode", "fewer, larger kernels: packed projections, fused element-wise chains, own matmul, PDL",
         "step13_fused_decode.engine:FusedDecodeEngine"),
    Step("step14_overlap_scheduling", "the host's work for the next decode step hidden behind the GPU's current one",
         "step14_overlap_scheduling.engine:OverlapSchedulingEngine"),
    Step("step15_batch_invariant", "a request's tokens and logits bit for bit the same, whatever else is in its batch",
         "step15_batch_invariant.engine:BatchInvariantEngine"),
    Step("step16_structured_output", "output held to a JSON schema, a regular expression or choices, token by token",
         "step16_structured_output.engine:StructuredOutputEngine"),
    Step("step17_fp8_weights", "the projections in FP8 with a scale per row: half the bytes a decode step reads",
         "step17_fp8_weights.engine:Fp8WeightsEngine"),
)
STEP_NAMES: tuple[str, ...] = tuple(step.name for step in STEPS)

# The order a learner reads the lessons in: the chain, with step 05 after step 06 (whose eager decode step it
# dissects) and step 08 after step 07 (it serves any engine of the chain), and step 04 last (it splits the final
# engine over processes). A lesson names a step after it on this path only in a marked look-ahead.
LESSON_PATH: tuple[str, ...] = (
    "step01_serial", "step02_paged_kv", "step03_vectorized_gather", "step06_paged_attention", "step05_profiling",
    "step07_preemption", "step08_serve", "step09_chunked_prefill", "step10_prefix_caching",
    "step11_speculative_decoding", "step12_cuda_graph", "step13_fused_decode", "step14_overlap_scheduling",
    "step15_batch_invariant", "step16_structured_output", "step17_fp8_weights", "step04_multi_gpu",
)


def find_step(name: str) -> Step:
    for step in STEPS:
        if step.name == name:
            return step
    raise ValueError(f"no step named {name!r}: choose from {', '.join(STEP_NAMES)}")


def engine_class(name: str) -> type[Engine]:
    return find_step(name).engine_class()


if __name__ == "__main__":
    print("\n".join(STEP_NAMES))
