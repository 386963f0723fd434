"""step06_paged_attention: every backend gives step01's tokens; batched prefill; metadata; backend choice."""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch

from common.checks import compare_engines, staggered_generate
from common.engine import EngineConfig
from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams
from step01_serial.engine import SerialEngine
from step06_paged_attention.backends import AttentionMetadata, TorchBackend, TritonBackend, create_backend
from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig
from tests.helpers import PARITY_MAX_TOKENS, assert_matches_reference, needs_triton, step01_tokens


def assert_same_as_step01(loaded: LoadedModel, prompts: list[list[int]], ours, theirs) -> None:
    """Identical tokens, or a divergence the reference itself shows to be a tie."""
    for report in compare_engines(loaded, prompts, ours, theirs):
        assert report.ok, report.describe()


def check_against_step01(loaded: LoadedModel, attn: str, block_size: int, arrive_every: int,
                         device: str = "cpu") -> None:
    """All prompts at once (one batched prefill of six) or one per step (joining mid-decode)."""
    prompts = [loaded.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(max_tokens=8)
    reference = SerialEngine(loaded, EngineConfig(device=device)).generate(prompts, params)
    engine = PagedAttentionEngine(loaded, PagedAttentionEngineConfig(device=device, block_size=block_size,
                                                                      num_blocks=256, attn=attn))
    ours = staggered_generate(engine, prompts, params, arrive_every=arrive_every)
    assert_same_as_step01(loaded, prompts, ours, reference)
    assert engine.allocator.num_used == 0 and not engine.requests


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("arrive_every", [0, 1])
def test_torch_backend_matches_step01(tiny: LoadedModel, block_size: int, arrive_every: int) -> None:
    check_against_step01(tiny, "torch", block_size, arrive_every)


def test_merging_splits_gives_the_lessons_worked_example() -> None:
    """The lesson's split-K by hand: scores [1, 0, 3, 2], values [10, 40, 20, 30], two splits of two keys; the
    merge gives the full softmax's 22.14. A third split with no keys at all (m = -inf, l = 0) changes nothing."""
    e = math.exp(-1)
    acc = torch.tensor([[[[10 + e * 40], [20 + e * 30], [0.0]]]], dtype=torch.float64)  # [1, 1, 3 splits, 1]
    m = torch.tensor([[[1.0, 3.0, float("-inf")]]], dtype=torch.float64)
    l = torch.tensor([[[1 + e, 1 + e, 0.0]]], dtype=torch.float64)
    full = torch.softmax(torch.tensor([1.0, 0, 3, 2], dtype=torch.float64), 0) @ torch.tensor([10.0, 40, 20, 30],
                                                                                             dtype=torch.float64)
    for splits in (2, 3):
        out = TorchBackend().merge_splits(acc[:, :, :splits], m[:, :, :splits], l[:, :, :splits])
        assert out.shape == (1, 1, 1), f"merged output of shape {tuple(out.shape)}, expected (1, 1, 1)"
        assert torch.isclose(out, full).all(), f"{splits} parts merged to {out.item():.4f}, expected {full.item():.4f}"
        assert round(out.item(), 2) == 22.14, f"{splits} parts merged to {out.item():.4f}, the lesson's 22.14"


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_decode_matches_the_unsplit_reference(splits: int) -> None:
    """Split-K decode in torch, merged by `merge_splits`, against SDPA: shuffled block tables, uneven lengths (so a
    short request's later parts hold none of its keys), three query heads per KV head."""
    torch.manual_seed(0)
    seq_lens, block_size, kv_heads, group, head_dim = [1, 5, 37, 16], 4, 2, 3, 16
    k_cache, v_cache = torch.randn(2, 40, block_size, kv_heads, head_dim).unbind(0)
    blocks = list(range(40))
    random.Random(0).shuffle(blocks)
    need = [-(-n // block_size) for n in seq_lens]
    starts = [sum(need[:i]) for i in range(len(need))]
    table = torch.tensor([blocks[s : s + n] + [0] * (max(need) - n) for s, n in zip(starts, need)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=lens.long() - 1, block_table=table, seq_lens=lens,
                             cu_q_lens=torch.arange(len(seq_lens) + 1, dtype=torch.int32), q_lens=[1] * len(seq_lens),
                             seq_lens_host=seq_lens, max_q_len=1, max_seq_len=max(seq_lens), block_size=block_size)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim)
    expected = TorchBackend().decode(q, k_cache, v_cache, meta)
    torch.testing.assert_close(TorchBackend(splits=splits).decode(q, k_cache, v_cache, meta), expected,
                               atol=1e-5, rtol=1e-5)


def test_torch_backend_in_splits_matches_step01(tiny: LoadedModel) -> None:
    """The engine decoding split-K in torch, every step merged by `merge_splits`: step 01's tokens."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=8)
    reference = SerialEngine(tiny, EngineConfig(device="cpu")).generate(prompts, params)
    engine = PagedAttentionEngine(tiny, PagedAttentionEngineConfig(device="cpu", block_size=4, num_blocks=256,
                                                                    attn="torch"))
    engine.backend = TorchBackend(splits=3)
    assert_same_as_step01(tiny, prompts, staggered_generate(engine, prompts, params, arrive_every=1), reference)


@needs_triton
@pytest.mark.parametrize(("model", "block_size", "arrive_every"), [("tiny-qwen3", 4, 1), ("tiny-llama", 16, 0)])
def test_triton_backend_matches_step01(model: str, block_size: int, arrive_every: int) -> None:
    """The engine on our kernels, on the GPU where there is one (in Triton's interpreter otherwise: slow,
    so two cases here; the kernels' own tests cover the shapes)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_against_step01(load_model(model, device=device), "triton", block_size, arrive_every, device)


@pytest.mark.parametrize(("sync", "batched_prefill"), [(False, True), (True, True), (False, False)])
def test_tight_budget_per_layer_sync_and_prefill_one_by_one_change_nothing(sync: bool, batched_prefill: bool) -> None:
    tiny = load_model("tiny-qwen3")
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:8]]
    params = SamplingParams(max_tokens=10)
    expected = step01_tokens(tiny, prompts, params)
    longest = max(len(p) for p in prompts) + 10
    engine = PagedAttentionEngine(tiny, PagedAttentionEngineConfig(
        device="cpu", block_size=4, num_blocks=2 * -(-longest // 4), attn="torch", sync_per_layer=sync,
        batched_prefill=batched_prefill))
    for p in prompts:
        engine.add_request(p, params)
    requests = list(engine.requests.values())
    waited = False
    while engine.has_unfinished():
        engine.step()
        waited |= bool(engine.waiting) and bool(engine.running)
    assert waited
    assert [r.output_token_ids for r in requests] == expected


def test_metadata_maps_every_new_token_to_its_slot() -> None:
    engine = PagedAttentionEngine.from_config(PagedAttentionEngineConfig(
        model="tiny-llama", device="cpu", block_size=4, num_blocks=32, attn="torch"))
    a = engine.add_request([5] * 6, SamplingParams(max_tokens=4))
    b = engine.add_request([6] * 3, SamplingParams(max_tokens=4))
    requests = [engine.requests[a], engine.requests[b]]
    requests[0].block_table, requests[1].block_table = [9, 2], [7]
    meta, positions = engine.build_metadata(requests, [2, 3], [6, 3], is_prefill=True)
    assert positions.tolist() == [4, 5, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 7 * 4 + 0, 7 * 4 + 1, 7 * 4 + 2]
    assert meta.cu_q_lens.tolist() == [0, 2, 5] and meta.block_table.tolist() == [[9, 2], [7, 0]]
    assert meta.max_seq_len == 6 and meta.max_q_len == 3


def test_split_counts_fill_one_wave_and_keep_splits_worth_merging() -> None:
    """The H200's shape (132 multiprocessors) and Qwen2.5-7B's 4 KV heads: the split count the kernel sweep
    found fastest at each of its points (kernel_bench.py, 7a98687)."""
    splits = TritonBackend(num_sms=132).num_splits
    assert [splits(1, 4, n) for n in (128, 512, 2048, 8192)] == [2, 8, 32, 32]  # capped at 32
    assert [splits(8, 4, n) for n in (128, 512, 2048)] == [2, 8, 16]  # few rows: one-tile splits pay
    assert [splits(16, 4, n) for n in (128, 512, 2048)] == [1, 4, 8]  # 64 rows: two tiles a split at least
    assert [splits(32, 4, n) for n in (128, 512, 8192)] == [1, 4, 4]  # one wave: 128 rows x 4 splits
    assert [splits(64, 4, n) for n in (128, 512, 8192)] == [1, 2, 2]
    assert splits(256, 4, 8192) == 1  # past one wave already: never split


def test_backend_choice_and_clear_refusals() -> None:
    cpu = torch.device("cpu")
    assert create_backend("auto", cpu, 16).name == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device and the flash-attn package"):
        create_backend("flash_attn", cpu, 256)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("xformers", cpu, 16)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
                    reason="flash-attn runs only on CUDA with the flash-attn package installed")
def test_flash_attn_backend_matches_step01() -> None:
    tiny = load_model("tiny-qwen2", device="cuda", dtype=torch.float16)
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=8)
    torch_engine = PagedAttentionEngine(tiny, PagedAttentionEngineConfig(device="cuda", block_size=256,
                                                                          num_blocks=16, attn="torch"))
    flash_engine = PagedAttentionEngine(tiny, PagedAttentionEngineConfig(device="cuda", block_size=256,
                                                                          num_blocks=16, attn="flash_attn"))
    assert_same_as_step01(tiny, prompts, flash_engine.generate(prompts, params), torch_engine.generate(prompts, params))


@pytest.mark.embedded
def test_embedded_model_parity_torch_backend(embedded: LoadedModel, embedded_hf, embedded_reference) -> None:
    prompts = [ids for ids, _ in embedded_reference]
    engine = PagedAttentionEngine(embedded, PagedAttentionEngineConfig(device="cpu", block_size=16,
                                                                        num_blocks=512, attn="torch"))
    ours = staggered_generate(engine, prompts, SamplingParams(max_tokens=PARITY_MAX_TOKENS), arrive_every=0)
    assert_matches_reference(embedded_hf, embedded_reference, [c.token_ids for c in ours])


@needs_triton
def test_triton_on_a_cpu_asks_for_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        create_backend("triton", torch.device("cpu"), 16)
