"""step02_paged_kv and step03_vectorized_gather: parity with step01 and HF, block budget, allocator invariants."""

from __future__ import annotations

import random

import pytest
import torch

from common.checks import compare_engines, staggered_generate
from common.engine import Engine
from common.loading import LoadedModel
from common.prompts import DEMO_PROMPTS, PARITY_PROMPTS
from common.reference import compare_greedy
from common.sampling import SamplingParams
from step01_serial.engine import SerialEngine
from common.engine import EngineConfig
from step02_paged_kv.block_allocator import BlockAllocator
from step02_paged_kv.engine import PagedEngine, PagedEngineConfig
from step02_paged_kv.kv_cache import PagedDecodeForward, PagedKVCache, PagedPrefillForward
from step03_vectorized_gather.engine import VectorizedGatherEngine
from step03_vectorized_gather.kv_cache import VectorizedDecodeForward, VectorizedPrefillForward
from tests.helpers import PARITY_MAX_TOKENS

PAGED_ENGINES = [PagedEngine, VectorizedGatherEngine]


def assert_consistent(engine: PagedEngine) -> None:
    """No block is owned twice, and the allocator's view equals the union of the block tables."""
    owned = [b for request in engine.requests.values() for b in request.block_table]
    assert len(owned) == len(set(owned)), "a block is in two block tables"
    assert set(owned) == engine.allocator.owned
    assert engine.allocator.num_free + engine.allocator.num_used == engine.cache.num_blocks


def assert_all_free(engine: PagedEngine) -> None:
    assert not engine.requests and not engine.running and not engine.waiting
    assert engine.allocator.num_used == 0 and engine.allocator.num_free == engine.cache.num_blocks


@pytest.mark.parametrize("engine_class", PAGED_ENGINES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_tiny_models_match_step01_with_staggered_arrivals(tiny: LoadedModel, engine_class: type[Engine], block_size: int) -> None:
    """Uneven prompts split across blocks, requests joining mid-decode: the same tokens as step01."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(max_tokens=12)
    reference = staggered_generate(SerialEngine(tiny, EngineConfig(device="cpu")), prompts, params, arrive_every=1)
    engine = engine_class(tiny, PagedEngineConfig(device="cpu", block_size=block_size, num_blocks=256))
    ours = staggered_generate(engine, prompts, params, arrive_every=1)
    for report in compare_engines(tiny, prompts, ours, reference):  # a divergence only at a shown tie
        assert report.ok, report.describe()
    assert_all_free(engine)


@pytest.mark.parametrize("engine_class", PAGED_ENGINES)
def test_tight_budget_makes_requests_wait_and_changes_nothing(engine_class: type[Engine]) -> None:
    """With room for about two requests at a time, the rest wait for blocks; outputs stay identical."""
    from common.loading import load_model

    tiny = load_model("tiny-qwen2")
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in DEMO_PROMPTS * 2]
    params = SamplingParams(max_tokens=10)
    expected = SerialEngine(tiny, EngineConfig(device="cpu")).generate(prompts, params)
    longest = max(len(p) for p in prompts) + 10
    engine = engine_class(tiny, PagedEngineConfig(device="cpu", block_size=4, num_blocks=2 * -(-longest // 4) + 1))
    for p in prompts:
        engine.add_request(p, params)
    requests = list(engine.requests.values())
    saw_waiting_while_running = False
    while engine.has_unfinished():
        engine.step()
        assert_consistent(engine)
        saw_waiting_while_running |= bool(engine.waiting) and bool(engine.running)
        assert len(engine.running) <= 2
    assert saw_waiting_while_running
    assert [r.output_token_ids for r in requests] == [c.token_ids for c in expected]
    assert_all_free(engine)


def test_request_that_can_never_fit_is_refused_clearly() -> None:
    engine = PagedEngine.from_config(PagedEngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=8))
    with pytest.raises(ValueError, match="raise --num-blocks or lower max_tokens"):
        engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=20))
    assert not engine.requests and not engine.waiting
    engine.add_request(list(range(100, 110)), SamplingParams(max_tokens=20))  # 30 tokens = 8 blocks: fits


@pytest.mark.parametrize("engine_class", PAGED_ENGINES)
def test_abort_returns_every_block(engine_class: type[Engine]) -> None:
    engine = engine_class.from_config(PagedEngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=64))
    ids = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in ["a b c", "d e f g h i", "j", "k l"]]
    for _ in range(6):
        engine.step()
        assert_consistent(engine)
    aborted = engine.requests[ids[0]]
    engine.abort(ids[0])  # running, mid-decode
    engine.abort(ids[3])
    assert not aborted.block_table
    assert_consistent(engine)
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)


def random_cache(num_blocks: int = 12, block_size: int = 4) -> PagedKVCache:
    from common.config import tiny_config

    cache = PagedKVCache(tiny_config("llama"), num_blocks, block_size, torch.device("cpu"), torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def test_vectorized_gather_and_write_equal_the_loops() -> None:
    """On shuffled, non-contiguous block tables, step03's single indexing ops do exactly what step02's loops do."""
    rng = random.Random(0)
    blocks = list(range(12))
    rng.shuffle(blocks)
    tables = [blocks[0:3], blocks[3:4], blocks[4:8]]
    seq_lens = [10, 3, 16]
    loop_cache, vec_cache = random_cache(), random_cache()
    vec_cache.k.copy_(loop_cache.k)
    vec_cache.v.copy_(loop_cache.v)
    kv_shape = (3, loop_cache.k.shape[3], loop_cache.k.shape[4])
    new_k, new_v = torch.randn(kv_shape), torch.randn(kv_shape)
    loop = PagedDecodeForward(loop_cache, tables, seq_lens, torch.device("cpu"))
    vec = VectorizedDecodeForward(vec_cache, tables, seq_lens, torch.device("cpu"))
    for layer in range(loop_cache.k.shape[0]):
        loop.write_kv(layer, new_k, new_v)
        vec.write_kv(layer, new_k, new_v)
        (lk, lv), (vk, vv) = loop.gather_kv(layer), vec.gather_kv(layer)
        assert vk.shape == vv.shape == lk.shape, f"gathered K/V of shape {tuple(vk.shape)}, expected {tuple(lk.shape)}"
        for i, n in enumerate(seq_lens):  # only real positions must agree; padding is masked
            for name, got, want in (("K", vk, lk), ("V", vv, lv)):
                wrong = (got[i, :n] != want[i, :n]).flatten(1).any(-1).nonzero().flatten().tolist()
                assert not wrong, f"layer {layer}, request {i}: gathered {name} differs at positions {wrong}"
            assert torch.equal(lk[i, n - 1], new_k[i]), f"layer {layer}, request {i}: its new key is not last"
    assert torch.equal(loop_cache.k, vec_cache.k) and torch.equal(loop_cache.v, vec_cache.v), (
        "the vectorized write_kv left the pool different from the loops' (decode)")

    prompt_k, prompt_v = torch.randn(10, *kv_shape[1:]), torch.randn(10, *kv_shape[1:])
    PagedPrefillForward(loop_cache, tables[0], 10, torch.device("cpu")).write_kv(1, prompt_k, prompt_v)
    VectorizedPrefillForward(vec_cache, tables[0], 10, torch.device("cpu")).write_kv(1, prompt_k, prompt_v)
    assert torch.equal(loop_cache.k, vec_cache.k) and torch.equal(loop_cache.v, vec_cache.v), (
        "the vectorized write_kv left the pool different from the loops' (prefill)")


def test_block_allocator_invariants() -> None:
    allocator = BlockAllocator(8)
    a = allocator.allocate(3)
    b = allocator.allocate(5)
    assert not set(a) & set(b) and allocator.num_free == 0
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        allocator.allocate(1)
    allocator.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free(a[:1])
    allocator.free(b)
    assert allocator.num_free == 8 and allocator.num_used == 0


def test_block_table_translation_is_printed_for_scattered_blocks() -> None:
    """The lesson's printout: a request whose blocks are not contiguous, position by position."""
    engine = PagedEngine.from_config(PagedEngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=64))
    engine.generate([[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(max_tokens=12))
    assert engine.scattered_example is not None, "no request had scattered blocks to show"
    request_id, table, num_tokens = engine.scattered_example
    assert any(b != a + 1 for a, b in zip(table, table[1:])), f"the example's block table {table} is contiguous"
    text = engine.memory_report()
    assert f"request {request_id}" in text, f"the memory report does not name request {request_id}: {text}"
    for position in range(num_tokens):
        block = table[position // 4]
        got = engine.cache.slot(table, position)
        assert got == block * 4 + position % 4, (
            f"block table {table}, blocks of 4: position {position} is logical block {position // 4} = physical "
            f"block {block}, offset {position % 4}: slot {block * 4 + position % 4}, got slot {got}")
    assert f"block  1 -> {table[1]:4d}" in text, f"the report does not show logical block 1 -> {table[1]}: {text}"


@pytest.mark.embedded
@pytest.mark.parametrize("engine_class", PAGED_ENGINES)
def test_embedded_model_parity(engine_class: type[Engine], embedded: LoadedModel, embedded_hf, embedded_reference) -> None:
    """The real model, 12 prompts arriving over time, block size 16: HF's greedy tokens (or a shown tie)."""
    prompts = [ids for ids, _ in embedded_reference]
    engine = engine_class(embedded, PagedEngineConfig(device="cpu", block_size=16, num_blocks=512))
    ours = staggered_generate(engine, prompts, SamplingParams(max_tokens=PARITY_MAX_TOKENS), arrive_every=2)
    identical = 0
    for (prompt, theirs), completion in zip(embedded_reference, ours):
        report = compare_greedy(embedded_hf, prompt, completion.token_ids, theirs)
        assert report.ok, report.describe()
        identical += report.equal
        assert "\ufffd" not in completion.text
    assert identical >= len(prompts) - 1
    assert_all_free(engine)
