"""step12_cuda_graph: the padded static-buffer decode gives the same tokens, with requests joining and
leaving, batches that are not buckets, and preemption between steps.

On CPU the static-buffer forward runs eagerly (nothing to capture); on a CUDA machine the same tests run
and `test_captured_graphs_match_step06_on_cuda` replays real graphs.
"""

from __future__ import annotations

import pytest
import torch

from common.checks import compare_engines, staggered_generate
from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.reference import compare_greedy
from common.sampling import SamplingParams
from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import TorchBackend
from step12_cuda_graph.decode_graphs import SHORT_CONTEXT, DecodeBatch, DecodeGraphs, StaticDecodeInputs, graph_buckets
from step12_cuda_graph.engine import CudaGraphEngine, CudaGraphEngineConfig
from tests.helpers import (PARITY_MAX_TOKENS, check_graphs_match_step06_on_cuda, first_difference, run_checked,
                           seeded_sampling_case, step01_tokens, tight_pool_case)


def test_buckets_cover_every_batch_size() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_padded_rows_point_at_the_dummy_block() -> None:
    inputs = StaticDecodeInputs(max_batch=8, width=5, block_size=4, dummy_block=30, device=torch.device("cpu"))
    inputs.fill(DecodeBatch([7, 9, 11], [6, 1, 9], [[3, 4], [8], [12, 2, 5]], [SamplingParams()] * 3, [1, 1, 1]),
                bucket=4)
    # position 5 is slot 1 of logical block 1 (physical 4); position 8 is slot 0 of physical block 5
    expected = {"input_ids": [7, 9, 11, 0], "positions": [5, 0, 8, 0], "seq_lens": [6, 1, 9, 1],
                "slot_mapping": [4 * 4 + 1, 8 * 4, 5 * 4, 30 * 4],
                "block_table": [[3, 4, 30], [8, 30, 30], [12, 2, 5], [30, 30, 30]]}
    got = {name: (getattr(inputs, name)[:4, :3] if name == "block_table" else getattr(inputs, name)[:4]).tolist()
           for name in expected}
    wrong = {name: f"expected {want}, got {got[name]}" for name, want in expected.items() if got[name] != want}
    assert not wrong, f"3 requests in a bucket of 4, dummy block 30 (its first slot 120): {wrong}"


def test_an_empty_batch_is_all_padding() -> None:
    """What the capture fills before recording a bucket: no request, every row on the dummy block."""
    inputs = StaticDecodeInputs(max_batch=4, width=3, block_size=4, dummy_block=9, device=torch.device("cpu"))
    inputs.fill(DecodeBatch([], [], [], [], []), bucket=4)
    expected = {"input_ids": [0] * 4, "positions": [0] * 4, "seq_lens": [1] * 4, "slot_mapping": [9 * 4] * 4,
                "block_table": [9] * 4}
    got = {name: (getattr(inputs, name)[:, 0] if name == "block_table" else getattr(inputs, name)).tolist()
           for name in expected}
    wrong = {name: f"expected {want}, got {got[name]}" for name, want in expected.items() if got[name] != want}
    assert not wrong, f"an empty batch in a bucket of 4, dummy block 9 (its first slot 36): {wrong}"


class SplittingBackend(TorchBackend):
    """The reference backend, with a split count that depends on the batch and the longest length."""

    def num_splits(self, batch: int, kv_heads: int, max_seq_len: int) -> int:
        return max(1, min(32 // batch, max_seq_len // 64))


@pytest.mark.parametrize("backend", [TorchBackend(), SplittingBackend()])
def test_short_contexts_get_graphs_of_their_own_where_they_split_differently(backend: TorchBackend) -> None:
    tiny = load_model("tiny-llama")
    cache = PagedKVCache(tiny.model.config, 9, 16, torch.device("cpu"), torch.float32)
    graphs = DecodeGraphs(tiny.model, cache, backend, max_model_len=1024, dummy_block=8, max_batch=16,
                          capture=False)
    if isinstance(backend, SplittingBackend):  # 4 splits when short; 32, 16, 8 when long at batch 1, 2, 4
        assert graphs.frozen_lens == {1: [SHORT_CONTEXT, 1024], 2: [SHORT_CONTEXT, 1024], 4: [SHORT_CONTEXT, 1024],
                                      8: [1024], 16: [1024]}
        assert graphs.frozen_len_for(1, SHORT_CONTEXT) == SHORT_CONTEXT
    else:  # no split count: one graph per bucket and sampling mode, as before
        assert all(lens == [1024] for lens in graphs.frozen_lens.values())
    assert graphs.frozen_len_for(1, SHORT_CONTEXT + 1) == 1024 and graphs.frozen_len_for(8, 10) == 1024


def test_cpu_says_it_runs_eagerly() -> None:
    engine = CudaGraphEngine(load_model("tiny-llama"), CudaGraphEngineConfig(device="cpu", num_blocks=16))
    assert "eager" in engine.graph_status() and "CUDA device" in engine.graph_status()
    assert engine.dummy_block == 16 and engine.cache.num_blocks == 17 and engine.allocator.num_blocks == 16


@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_step01_with_requests_joining_and_leaving(tiny: LoadedModel, block_size: int) -> None:
    """Seven prompts, one arriving per step, with uneven lengths: the batch passes through 3, 5, 6 and 7
    rows, none of them a bucket, and shrinks again as requests finish."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:7]]
    params = [SamplingParams(max_tokens=6 + 3 * i) for i in range(7)]
    expected = step01_tokens(tiny, prompts, params)
    engine = CudaGraphEngine(tiny, CudaGraphEngineConfig(device="cpu", block_size=block_size, num_blocks=128,
                                                         attn="torch", max_graph_batch=8))
    got = [c.token_ids for c in staggered_generate(engine, prompts, params, arrive_every=1)]
    assert got == expected, f"not step 01's tokens: {first_difference(expected, got)}"
    assert engine.allocator.num_used == 0 and not engine.requests, (
        f"{len(engine.requests)} requests and {engine.allocator.num_used} blocks still held at the end")


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_between_steps_changes_no_output(tiny: LoadedModel, preempt: str) -> None:
    prompts, params, expected, num_blocks = tight_pool_case(tiny)
    engine = CudaGraphEngine(tiny, CudaGraphEngineConfig(device="cpu", block_size=4, attn="torch",
                                                         num_blocks=num_blocks, preempt=preempt))
    outputs, _ = run_checked(engine, prompts, params)
    assert outputs == expected
    assert engine.preemptions >= 2


def test_seeded_sampling_is_step07s() -> None:
    """The sampling variant draws exactly the tokens step 07's sampler draws (same seeds, same positions)."""
    tiny, prompts, params, config, expected = seeded_sampling_case()
    ours = CudaGraphEngine(tiny, CudaGraphEngineConfig(**config)).generate(prompts, params)
    assert [c.token_ids for c in ours] == expected


@pytest.mark.embedded
def test_embedded_model_matches_hf(embedded: LoadedModel, embedded_hf, embedded_reference) -> None:
    reference = embedded_reference[:6]
    prompts = [ids for ids, _ in reference]
    engine = CudaGraphEngine(embedded, CudaGraphEngineConfig(device="cpu", block_size=16, num_blocks=64,
                                                             attn="torch", max_graph_batch=4))
    outputs = staggered_generate(engine, prompts, SamplingParams(max_tokens=PARITY_MAX_TOKENS), arrive_every=1)
    for (prompt, theirs), ours in zip(reference, outputs):
        report = compare_greedy(embedded_hf, prompt, ours.token_ids, theirs)
        assert report.ok, report.describe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none here)")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_captured_graphs_match_step06_on_cuda(model: str) -> None:
    check_graphs_match_step06_on_cuda(model, lambda loaded, num_blocks: CudaGraphEngine(loaded, CudaGraphEngineConfig(
        device="cuda", block_size=16, num_blocks=num_blocks, attn="triton", max_graph_batch=8)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none here)")
def test_graphs_for_short_and_long_contexts_match_step06_on_cuda() -> None:
    """One request past SHORT_CONTEXT among short ones: the batches holding it replay the graphs captured for
    the longest context, the others those for short contexts (fewer splits); step 06's tokens either way."""
    loaded = load_model("tiny-llama", device="cuda", dtype=torch.float32)
    prompts = [loaded.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    prompts[1] = prompts[1] * (SHORT_CONTEXT // len(prompts[1]) + 1)  # longer than SHORT_CONTEXT tokens
    assert len(prompts[1]) > SHORT_CONTEXT and max(len(p) for p in prompts[2:]) < SHORT_CONTEXT - 40
    params = [SamplingParams(max_tokens=12) for _ in prompts]
    step06 = PagedAttentionEngine(loaded, PagedAttentionEngineConfig(device="cuda", block_size=16, num_blocks=128,
                                                                      attn="triton"))
    expected = staggered_generate(step06, prompts, params, arrive_every=1)
    engine = CudaGraphEngine(loaded, CudaGraphEngineConfig(device="cuda", block_size=16, num_blocks=128,
                                                           attn="triton", max_graph_batch=8))
    assert engine.graphs is not None and any(len(lens) > 1 for lens in engine.graphs.frozen_lens.values())
    outputs = staggered_generate(engine, prompts, params, arrive_every=1)
    reports = compare_engines(loaded, prompts, outputs, expected)
    assert all(r.ok for r in reports), [r.describe() for r in reports if not r.ok]
    assert sum(r.equal for r in reports) >= len(prompts) - 1
