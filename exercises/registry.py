"""The one list of exercises: for each, the stub the learner writes, the project's code it replaces, and the
step's real tests and dry run that check it.

Adding an exercise is a stub module `exNN_<name>.py` here and one `Exercise(...)` line below.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Exercise:
    id: str  # what the learner types: `make exercise EX=02-slot-mapping`
    stub_module: str  # exercises.<stub_module> holds the learner's function, named like the target's attribute
    # "module:Class.attribute", or "module:function" for a module-level function (a Triton kernel's launcher):
    # the project's code (and solution) that the learner's function replaces
    target: str
    tests: tuple[str, ...]  # pytest arguments that select the step's real tests of this code (fast ones)
    step: str  # the step whose dry run runs with the learner's code in place
    lesson: str  # the lesson that teaches it, for the hints
    # A plausible wrong answer that skips the step's idea, in one line: the selected tests must fail on it
    # (tests/exercise_wrong_answers.py holds it, and tests/test_exercises.py checks that they do)
    skips_idea: str

    @property
    def target_owner(self) -> type | ModuleType:
        """The class that holds the target, or its module for "module:function"."""
        module, _, path = self.target.partition(":")
        owner_name, _, _ = path.rpartition(".")
        owner = importlib.import_module(module)
        return getattr(owner, owner_name) if owner_name else owner

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2].rpartition(".")[2]

    @property
    def stub_path(self) -> Path:
        return Path(__file__).parent / f"{self.stub_module}.py"

    def learner_function(self) -> Callable[..., Any]:
        """The learner's function, imported afresh so that an edit since the last import counts."""
        module = importlib.reload(importlib.import_module(f"exercises.{self.stub_module}"))
        return getattr(module, self.attribute)

    def solution(self) -> Callable[..., Any]:
        """The project's own code: the exercise's solution."""
        return vars(self.target_owner)[self.attribute]

    def is_untouched(self) -> bool:
        """Whether the learner's function is still the stub: a docstring, then `raise NotImplementedError`."""
        tree = ast.parse(inspect.getsource(self.learner_function()))
        body = tree.body[0].body  # type: ignore[attr-defined]
        return (len(body) == 2 and isinstance(body[0], ast.Expr) and isinstance(body[1], ast.Raise)
                and "NotImplementedError" in ast.unparse(body[1]))


EXERCISES = [
    Exercise(
        id="04-shard-layer",
        stub_module="ex04_shard_layer",
        target="step04_multi_gpu.sharding:shard_layer",
        tests=("tests/test_step04_tensor_parallel.py", "-k", "sums_to_the_whole"),
        step="step04_multi_gpu",
        lesson="step04_multi_gpu/README.md",
        skips_idea="o_proj and down_proj cut by rows but left plain nn.Linear: no all-reduce adds the partial sums",
    ),
    Exercise(
        id="01-contiguous-attend",
        stub_module="ex01_contiguous_attend",
        target="step01_serial.kv_cache:ContiguousForward.attend",
        tests=("tests/test_step01_serial.py", "-k", "staggered_arrivals and llama or contiguous_reservation"),
        step="step01_serial",
        lesson="step01_serial/README.md",
        skips_idea='the new K/V stored, but attention over the new tokens only, not the cached prefix',
    ),
    Exercise(
        id="02-slot-mapping",
        stub_module="ex02_slot_mapping",
        target="step02_paged_kv.kv_cache:PagedKVCache.slot",
        tests=("tests/test_step02_step03_paged_kv.py", "-k", "translation_is_printed"),
        step="step02_paged_kv",
        lesson="step02_paged_kv/README.md",
        skips_idea='the block table ignored: the position used as the slot',
    ),
    Exercise(
        id="03-vectorized-gather",
        stub_module="ex03_vectorized_gather",
        target="step03_vectorized_gather.kv_cache:VectorizedDecodeForward.gather_kv",
        tests=("tests/test_step02_step03_paged_kv.py", "-k",
               "equal_the_loops or staggered_arrivals and Vectorized and llama-4"),
        step="step03_vectorized_gather",
        lesson="step03_vectorized_gather/README.md",
        skips_idea="one indexing operation, but each request's blocks taken as consecutive from its first",
    ),
    Exercise(
        id="05-own-time",
        stub_module="ex05_own_time",
        target="common.profiling.trace:nesting",
        tests=("tests/test_step05_profiling.py", "-k",
               "nesting_gives_own_times or kernels_go_to_the_phase or overlapping_kernels"),
        step="step05_profiling",
        lesson="step05_profiling/README.md",
        skips_idea='every range inside a range taken off its time, not only those directly inside',
    ),
    Exercise(
        id="05-count-syncs",
        stub_module="ex05_count_syncs",
        target="common.profiling.trace:count_syncs",
        tests=("tests/test_step05_profiling.py", "-k", "sync_per_layer or kernels_go_to_the_phase"),
        step="step05_profiling",
        lesson="step05_profiling/README.md",
        skips_idea='no sync counted on a CPU ("no device to wait for"): the reads that stall a GPU go unseen',
    ),
    Exercise(
        id="06-merge-splits",
        stub_module="ex06_merge_splits",
        target="step06_paged_attention.backends:TorchBackend.merge_splits",
        tests=("tests/test_step06_paged_attention.py", "-k",
               "worked_example or unsplit_reference or in_splits and llama"),
        step="step06_paged_attention",
        lesson="step06_paged_attention/README.md",
        skips_idea="the parts' sums added without rescaling each to the row's largest max",
    ),
    Exercise(
        id="07-choose-victim",
        stub_module="ex07_choose_victim",
        target="step07_preemption.engine:PreemptionEngine.pick_victim",
        tests=("tests/test_step07_preemption.py", "-k",
               "newest_admission or never_prefilled or runs_at_once and recompute"),
        step="step07_preemption",
        lesson="step07_preemption/README.md",
        skips_idea='the oldest admission picked among equals, not the newest',
    ),
    Exercise(
        id="07-preempt",
        stub_module="ex07_preempt",
        target="step07_preemption.engine:PreemptionEngine.preempt",
        tests=("tests/test_step07_preemption.py", "-k", "keeps_what_was_computed or never_prefilled"),
        step="step07_preemption",
        lesson="step07_preemption/README.md",
        skips_idea='a request never prefilled preempted (and swapped) like the others, not put back',
    ),
    Exercise(
        id="09-token-budget",
        stub_module="ex09_token_budget",
        target="step09_chunked_prefill.engine:ChunkedPrefillEngine.fill_budget",
        tests=("tests/test_step09_chunked_prefill.py", "-k",
               "first_token_only_after_the_last_chunk or priority_goes_first or arrival_goes_before or sits_out or "
               "any_budget_gives_hfs_tokens and "
               "(tiny-llama-4-1] or tiny-llama-4-3]) or preemption_under_a_tiny_kv_budget and tiny-llama-3-recompute"),
        step="step09_chunked_prefill",
        lesson="step09_chunked_prefill/README.md",
        skips_idea="prompt chunks given the whole budget, the decoders' tokens on top",
    ),
    Exercise(
        id="10-block-keys",
        stub_module="ex10_block_keys",
        target="step10_prefix_caching.engine:PrefixCachingEngine.key_full_blocks",
        tests=("tests/test_step10_prefix_caching.py", "-k",
               "every_block_a_forward_fills or last_token_is_always_computed or aborting_one_of_two_sharers or "
               "hit_counters or caching_on_and_off and tiny-qwen2-True-recompute"),
        step="step10_prefix_caching",
        lesson="step10_prefix_caching/README.md",
        skips_idea="each block hashed by its own tokens, without the previous block's key",
    ),
    Exercise(
        id="10-lru-evict",
        stub_module="ex10_lru_evict",
        target="step10_prefix_caching.block_pool:PrefixCachingAllocator.allocate",
        tests=("tests/test_step10_prefix_caching.py", "-k",
               "least_recently_used_first or caching_on_and_off and tiny-llama-True"),
        step="step10_prefix_caching",
        lesson="step10_prefix_caching/README.md",
        skips_idea='the most recently used cached block evicted first',
    ),
    Exercise(
        id="11-accept-greedy",
        stub_module="ex11_accept_greedy",
        target="step11_speculative_decoding.verify:accept_greedy",
        tests=("tests/test_step11_speculative.py", "-k",
               "greedy_acceptance or partly_wrong and 4 or proposals_kept and tiny-qwen2-4"),
        step="step11_speculative_decoding",
        lesson="step11_speculative_decoding/README.md",
        skips_idea='every proposal accepted',
    ),
    Exercise(
        id="11-proposal-counts",
        stub_module="ex11_proposal_counts",
        target="step11_speculative_decoding.engine:SpeculativeEngine.proposal_counts",
        tests=("tests/test_step11_speculative.py", "-k",
               "proposals_that_pay or must_pay or stops_at_the_budget or stops_speculating"),
        step="step11_speculative_decoding",
        lesson="step11_speculative_decoding/README.md",
        skips_idea='as many proposals as the limit allows, whether they pay or not',
    ),
    Exercise(
        id="12-graph-bucket",
        stub_module="ex12_graph_bucket",
        target="step12_cuda_graph.decode_graphs:StaticDecodeInputs.write_rows",
        tests=("tests/test_step12_cuda_graph.py", "-k",
               "padded_rows or empty_batch or joining_and_leaving and tiny-qwen3-4"),
        step="step12_cuda_graph",
        lesson="step12_cuda_graph/README.md",
        skips_idea='padded rows on block 0 (zeros), not on the dummy block',
    ),
    Exercise(
        id="13-add-rmsnorm",
        stub_module="ex13_add_rmsnorm",
        target="step13_fused_decode.fused_kernels:add_rms_norm",
        tests=("tests/test_step13_fused_kernels.py", "-k", "test_add_rms_norm or on_cublas"),
        step="step13_fused_decode",
        lesson="step13_fused_decode/README.md",
        skips_idea="the norm of the sublayer's output alone, without the residual added",
    ),
    Exercise(
        id="14-launch-decode",
        stub_module="ex14_launch_decode",
        target="step14_overlap_scheduling.engine:OverlapSchedulingEngine.launch_decode",
        tests=("tests/test_step14_overlap_scheduling.py", "-k",
               "joining_and_leaving and tiny-qwen3-4-True or stops_where and llama or abort and llama "
               "or output_position or without_waiting"),
        step="step14_overlap_scheduling",
        lesson="step14_overlap_scheduling/README.md",
        skips_idea='the step before waited for and its tokens read on the host before the launch (a sync)',
    ),
    Exercise(
        id="15-row-tiles",
        stub_module="ex15_row_tiles",
        target="step15_batch_invariant.invariant_ops:row_tiled_linear",
        tests=("tests/test_step15_batch_invariant.py", "-k",
               "row_tiled or alone_and_batched_under_any_budget and llama or reference_tokens and qwen3"),
        step="step15_batch_invariant",
        lesson="step15_batch_invariant/README.md",
        skips_idea='the linear called on the whole batch at once',
    ),
    Exercise(
        id="15-split-attention",
        stub_module="ex15_split_attention",
        target="step15_batch_invariant.attention:split_attention",
        tests=("tests/test_step15_batch_invariant.py", "-k",
               "split_attention or alone_and_batched_under_any_budget and qwen2 or prefix_cache_hit and llama"),
        step="step15_batch_invariant",
        lesson="step15_batch_invariant/README.md",
        skips_idea='the whole softmax at once through a batched matmul, not in fixed pieces',
    ),
    Exercise(
        id="16-bitmask",
        stub_module="ex16_bitmask",
        target="step16_structured_output.bitmask:allowed_tokens",
        tests=("tests/test_step16_structured_output.py", "-k",
               "mask_unpacks or greedy_equals and qwen2-eager or speculation_under"),
        step="step16_structured_output",
        lesson="step16_structured_output/README.md",
        skips_idea="each word's bits read from the most significant end: token 32 w + 31 - j for bit j",
    ),
    Exercise(
        id="17-quantize",
        stub_module="ex17_quantize",
        target="step17_fp8_weights.fp8:quantize",
        tests=("tests/test_step17_fp8.py", "-k",
               "by_hand or sixteenth or scale_per_row or every_path and eager and qwen2"),
        step="step17_fp8_weights",
        lesson="step17_fp8_weights/README.md",
        skips_idea="the scale set as for int8, the row's largest magnitude over 127, not over e4m3's 448",
    ),
]


def find_exercise(exercise_id: str) -> Exercise:
    for exercise in EXERCISES:
        if exercise.id == exercise_id:
            return exercise
    raise KeyError(f"no exercise {exercise_id!r}; the exercises are: {', '.join(e.id for e in EXERCISES)}")
