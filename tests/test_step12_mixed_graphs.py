"""step12_cuda_graph's mixed-step graphs: the static layout of a mixed step, the prefill kernel launched over
a tile list, and HF's tokens with prompts in chunks beside decoders (eager on a CPU, replayed on a GPU)."""

from __future__ import annotations

import pytest
import torch

from common.config import tiny_config
from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionMetadata, TorchBackend
from step12_cuda_graph.engine import CudaGraphEngine, CudaGraphEngineConfig
from step12_cuda_graph.mixed_graphs import (TILE_ROWS, MixedChunk, MixedGraphForward, StaticMixedInputs, max_tiles,
                                            mixed_row_buckets, mixed_token_buckets)
from tests.helpers import LONG_PROMPT, CheckedRun, hf_tokens, in_vocab, needs_triton, tiny_with_small_vocab

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_buckets() -> None:
    assert mixed_token_buckets(2048) == [32, 64, 128, 256, 512, 1024, 2048]
    assert mixed_token_buckets(300) == [32, 64, 128, 256, 300]
    assert mixed_token_buckets(20) == [20]
    assert mixed_row_buckets(256) == [16, 64, 256] and mixed_row_buckets(33) == [16, 33]
    assert max_tiles(256, 16) == 256 // TILE_ROWS + 16


def test_fill_lays_out_chunks_and_pads_on_the_dummy_block() -> None:
    inputs = StaticMixedInputs(max_tokens=16, max_rows=4, width=6, block_size=4, dummy_block=9,
                               device=torch.device("cpu"))
    decoder = MixedChunk([7], 5, [3, 4], True, SamplingParams(), 3)  # position 5: block 4, slot 1
    chunk = MixedChunk([11, 12, 13], 2, [8, 2], False, SamplingParams(), 0)  # positions 2..4: 4 is in block 2
    inputs.fill([decoder, chunk], tokens=8, rows=3)
    assert inputs.input_ids[:8].tolist() == [7, 11, 12, 13, 0, 0, 0, 0]
    assert inputs.positions[:8].tolist() == [5, 2, 3, 4, 0, 0, 0, 0]
    assert inputs.slot_mapping[:8].tolist() == [4 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 2 * 4, *[9 * 4] * 4]
    assert inputs.cu_q_lens[:4].tolist() == [0, 1, 4, 4]  # the padded row has no tokens
    assert inputs.seq_lens[:3].tolist() == [6, 5, 0]
    assert inputs.sample_index[:3].tolist() == [0, 3, 0]
    tiles = max_tiles(8, 3)
    assert inputs.tile_request[:tiles].tolist() == [0, 1] + [-1] * (tiles - 2)
    assert inputs.block_table[:2, :2].tolist() == [[3, 4], [8, 2]]  # the padded row reads no block


@needs_triton
def test_tile_kernel_matches_step06_prefill() -> None:
    """Three requests (a decoder, a chunk over a cached prefix, a fresh prompt of two tiles), launched over a
    tile list with spare entries, give step 06's kernel's output; three padded tokens after them get zeros."""
    from step06_paged_attention.triton_kernels import paged_prefill
    from step12_cuda_graph.prefill_tiles import paged_prefill_tiles

    torch.manual_seed(0)
    block_size, kv_heads, heads, head_dim = 4, 2, 6, 16
    new, cached = [1, 5, 70], [9, 6, 0]
    lens = [n + c for n, c in zip(new, cached)]
    blocks = [-(-n // block_size) for n in lens]
    table = torch.zeros(3, max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(at, at + n)
        at += n
    k_cache = torch.randn(at, block_size, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(new) + 3, heads, head_dim, device=DEVICE)  # 3 padded tokens: no request's
    cu = torch.tensor([0, 1, 6, 76], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    table = table.to(DEVICE)
    expected = paged_prefill(q[: sum(new)], k_cache, v_cache, table, cu, ctx, max(new), block_m=TILE_ROWS, tile=16)
    tile_request = torch.tensor([0, 1, 2, 2, -1, -1], dtype=torch.int32, device=DEVICE)
    tile_index = torch.tensor([0, 0, 0, 1, 0, 0], dtype=torch.int32, device=DEVICE)
    out = paged_prefill_tiles(q, k_cache, v_cache, table, cu, ctx, tile_request, tile_index, TILE_ROWS, tile=16)
    torch.testing.assert_close(out[: sum(new)], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[sum(new) :], torch.zeros_like(out[sum(new) :]))


class UninitializedPaddingBackend(TorchBackend):
    """The torch backend, with the output of tokens past every request's set to NaN: what uninitialized
    memory may hold there, since no request's attention writes it."""

    def prefill(self, q, k_cache, v_cache, meta):  # noqa: ANN001, ANN201
        out = super().prefill(q, k_cache, v_cache, meta)
        out[sum(meta.q_lens) :] = float("nan")
        return out


def test_padded_tokens_attend_to_nothing_on_other_backends() -> None:
    """A mixed step's padded tokens belong to no request: whatever a backend leaves in their output, the mixed
    forward hands on zeros (NaN would be written to the dummy block as K/V, and summed by a later masked read)."""
    torch.manual_seed(0)
    config = tiny_config("llama")
    cache = PagedKVCache(config, num_blocks=4, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    shape = (5 + 3, config.num_heads, config.head_dim)  # one request's 5 new tokens, then 3 padded ones
    q, k = torch.randn(shape), torch.randn(8, config.num_kv_heads, config.head_dim)
    v = torch.randn_like(k)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.tensor([0, 1, 2, 3, 4, 12, 12, 12]),
                             block_table=torch.tensor([[0, 1]]), seq_lens=torch.tensor([5]),
                             cu_q_lens=torch.tensor([0, 5]), q_lens=[5], seq_lens_host=[5], max_q_len=8,
                             max_seq_len=5, block_size=4)
    forward = MixedGraphForward(cache, UninitializedPaddingBackend(), meta, torch.arange(8), torch.zeros(0),
                                torch.zeros(0))
    out = forward.attend(0, q, k, v)
    assert torch.isfinite(out[:5]).all() and torch.equal(out[5:], torch.zeros_like(out[5:]))


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("budget", [3, 16, 64])
def test_mixed_steps_on_static_buffers_give_hfs_tokens(tiny: LoadedModel, budget: int, preempt: str) -> None:
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in [LONG_PROMPT, *PARITY_PROMPTS[:3]]]
    expected = hf_tokens(tiny, prompts, 10)
    longest_blocks = -(-(max(len(p) for p in prompts) + 10) // 4)
    engine = CudaGraphEngine(tiny, CudaGraphEngineConfig(
        device="cpu", attn="torch", block_size=4, max_num_batched_tokens=budget, mixed_graphs=True,
        num_blocks=longest_blocks + 8, preempt=preempt, max_num_seqs=8))
    assert engine.mixed is not None
    assert CheckedRun(engine).run(prompts, SamplingParams(max_tokens=10), arrive_every=1) == expected
    assert engine.mixed_steps > 0


@needs_triton
def test_mixed_steps_through_the_tile_kernel() -> None:
    """The same on the Triton backend (the interpreter on a CPU, graphs replayed on a GPU)."""
    tiny = tiny_with_small_vocab("tiny-qwen3", DEVICE)
    prompts = [in_vocab(tiny.tokenizer.apply_chat_template(p)) for p in PARITY_PROMPTS[:3]]
    expected = hf_tokens(tiny, prompts, 6)
    engine = CudaGraphEngine(tiny, CudaGraphEngineConfig(device=DEVICE, attn="triton", block_size=16,
                                                         max_num_batched_tokens=24, mixed_graphs=True,
                                                         max_num_seqs=4, max_model_len=512))
    assert CheckedRun(engine).run(prompts, SamplingParams(max_tokens=6), arrive_every=3) == expected
    assert engine.mixed_steps > 0
    if DEVICE == "cuda":
        assert engine.mixed.graphs, "mixed steps were not captured on the GPU"
