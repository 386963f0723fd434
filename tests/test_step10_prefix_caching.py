"""step10_prefix_caching: the pool's keys, counts and eviction; HF's tokens with caching on and off on prompts
that share prefixes, under a pool small enough to evict and preempt; nothing held once idle."""

from __future__ import annotations

import pytest

from common.loading import LoadedModel, load_model
from common.reference import hf_model_for, reference_greedy
from common.request import RequestStatus
from common.sampling import SamplingParams
from step02_paged_kv.block_allocator import OutOfBlocksError
from step10_prefix_caching.block_pool import PrefixCachingAllocator, chain_keys
from step10_prefix_caching.engine import PrefixCachingEngine, PrefixCachingEngineConfig
from tests.helpers import assert_blocks_held_once_per_holder, first_difference


def test_keys_chain_over_the_prefix() -> None:
    a = list(chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2))
    b = list(chain_keys([9, 9, 9, 9, 5, 6, 7, 8], 4, 2))
    assert a[0] != b[0] and a[1] != b[1]  # same second block, other prefix: another key
    assert list(chain_keys([1, 2, 3, 4, 0, 0], 4, 1)) == a[:1]
    assert len(set(a + b)) == 4 and all(len(key) == 32 for key in a)  # SHA-256 digests


def test_a_lookup_hashes_no_block_past_the_first_miss() -> None:
    pool = PrefixCachingAllocator(4)
    (x,) = pool.allocate(1)
    pool.register(x, b"x")
    read: list[bytes] = []

    def keys():  # noqa: ANN202
        for key in (b"x", b"miss", b"never"):
            read.append(key)
            yield key

    assert pool.claim(keys()) == [x] and read == [b"x", b"miss"]


def test_blocks_are_counted_cached_then_evicted_least_recently_used_first() -> None:
    pool = PrefixCachingAllocator(4)
    x, y = pool.allocate(2)
    pool.register(x, b"x")
    pool.register(y, b"y")
    claimed = pool.claim([b"x", b"y", b"z"])
    assert claimed == [x, y] and pool.ref_counts[x] == 2, (
        f"claiming keys x, y, z gives blocks {claimed} (expected [{x}, {y}]), x held by {pool.ref_counts[x]}")

    def counts() -> dict[str, int]:
        return {"cached": pool.num_cached, "free": pool.num_free, "used": pool.num_used}

    pool.free([x, y])
    pool.free([y])  # y: nobody holds it now, so it is cached
    assert counts() == {"cached": 1, "free": 3, "used": 1}, f"y cached, x still held: {counts()}"
    pool.free([x])  # x: cached after y, so y is the least recently used
    assert counts() == {"cached": 2, "free": 4, "used": 0}, f"x and y cached, none held: {counts()}"
    fresh = pool.allocate(3)  # two free blocks, then y evicted
    assert y in fresh and x not in fresh, (
        f"allocate(3) with 2 free blocks, then cached y (freed first) and x: expected y ({y}) evicted and x ({x}) "
        f"kept, got blocks {fresh}")
    claims = (pool.claim([b"y"]), pool.claim([b"x"]))
    assert claims == ([], [x]), f"after y's eviction, key y finds nothing and x finds block {x}: got {claims}"
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([fresh[0], fresh[0]])


def assert_idle(engine: PrefixCachingEngine) -> None:
    """Once every request is done, each block is free or cached, with no reference left."""
    pool = engine.allocator
    held = {"requests": len(engine.requests), "running": len(engine.running), "waiting": len(engine.waiting),
            "swapped": len(engine.swapped)}
    assert set(held.values()) == {0}, f"the engine still holds requests: {held}"
    assert pool.num_used == 0 and not pool.ref_counts, f"blocks still held: {pool.ref_counts}"
    assert pool.num_free == pool.num_blocks, f"{pool.num_free} of {pool.num_blocks} blocks free or cached"
    assert set(pool.cached) == set(pool.key_of_block), "a cached block has no key, or a keyed block is not cached"


def run(engine: PrefixCachingEngine, waves: list[list[list[int]]], max_tokens: int) -> list[list[int]]:
    """Each wave of prompts is added once the previous wave has finished (so its blocks are cached); at
    every step no block is held by more tables than its count says."""
    outputs = []
    for wave in waves:
        requests = [engine.requests[engine.add_request(p, SamplingParams(max_tokens=max_tokens))] for p in wave]
        while engine.has_unfinished():
            engine.step()
            assert_blocks_held_once_per_holder(engine)
        outputs += [r.output_token_ids for r in requests]
    return outputs


def shared_prefix_waves(tokenizer) -> list[list[list[int]]]:  # noqa: ANN001
    system = tokenizer.encode("You are a careful assistant. Answer in one short sentence, in English only. " * 2)
    base = system + tokenizer.encode("Where is 北京?")
    return [
        [base],
        [base,  # an exact repeat
         base + tokenizer.encode(" And 東京 🗼?"),  # extends a cached prompt
         system[:13] + tokenizer.encode(" Hi"),  # a shared prefix that ends inside a block
         system[:16]],  # itself a cached prefix: a whole number of blocks, its last token computed again
    ]


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("tight", [False, True])
def test_caching_on_and_off_give_hfs_tokens(tiny: LoadedModel, preempt: str, tight: bool) -> None:
    """Tight: a pool one block larger than the longest request's worst case, so that the second wave cannot
    run at once nor keep every cached block."""
    waves = shared_prefix_waves(tiny.tokenizer)
    prompts = [p for wave in waves for p in wave]
    num_blocks = -(-(max(len(p) for p in prompts) + 12) // 4) + 1 if tight else None
    hf = hf_model_for(tiny)
    expected = [reference_greedy(hf, p, 12, tiny.tokenizer.eos_token_ids) for p in prompts]
    results = {}
    for caching in (True, False):
        engine = PrefixCachingEngine(tiny, PrefixCachingEngineConfig(
            device="cpu", attn="torch", block_size=4, num_blocks=num_blocks, preempt=preempt,
            max_num_batched_tokens=16, enable_prefix_caching=caching))
        results[caching] = run(engine, waves, 12)
        assert_idle(engine)
        if caching:
            assert engine.hit_tokens > 0, "no prompt token was found in the cache"
            if tight:
                assert engine.preemptions > 0 and engine.allocator.evictions > 0, (
                    f"{engine.preemptions} preemptions, {engine.allocator.evictions} evictions: the tight pool "
                    "should force both")
        else:
            assert engine.hit_tokens == 0 and engine.allocator.num_cached == 0, "caching off, yet blocks were cached"
    for caching in (True, False):
        assert results[caching] == expected, (
            f"caching {'on' if caching else 'off'}: not HF's tokens: {first_difference(expected, results[caching])}")


def test_the_last_token_is_always_computed() -> None:
    """A prompt of exactly two blocks, cached whole: one block is claimed, the second computed again."""
    tiny = load_model("tiny-qwen2")
    engine = PrefixCachingEngine(tiny, PrefixCachingEngineConfig(device="cpu", attn="torch", block_size=4))
    prompt = list(range(300, 308))
    first = run(engine, [[prompt]], 5)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=5))
    engine.step()
    hits = (engine.hit_tokens, engine.queried_tokens)
    assert hits == (4, 16), f"(hit, queried) tokens {hits}: of the 8-token prompt cached whole, only the first " \
        "block may be claimed (the last token must be computed), expected (4, 16)"
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used == 0, f"{engine.allocator.num_used} blocks still held at the end"
    expected = [reference_greedy(hf_model_for(tiny), prompt, 5, tiny.tokenizer.eos_token_ids)]
    assert first == expected, f"not HF's tokens: {first_difference(expected, first)}"
    del rid


def short(keys: list[bytes]) -> list[str]:
    """Block keys as a message shows them: the first hex digits of each."""
    return [key.hex()[:8] for key in keys]


def test_every_block_a_forward_fills_is_keyed_on_its_whole_prefix() -> None:
    """Chunks of 3 tokens in blocks of 4 end inside blocks: after every step the request's keys are exactly the
    chained keys of its full, computed blocks (generated tokens included), each registered for its block."""
    tiny = load_model("tiny-qwen2")
    engine = PrefixCachingEngine(tiny, PrefixCachingEngineConfig(device="cpu", attn="torch", block_size=4,
                                                                 max_num_batched_tokens=3))
    request = engine.requests[engine.add_request(list(range(300, 314)), SamplingParams(max_tokens=6))]
    seen = []
    while not request.finished:
        engine.step()
        full = request.num_computed // 4
        seen.append((request.num_computed, len(request.block_keys)))
        chained = list(chain_keys(request.all_token_ids, 4, full))
        assert request.block_keys == chained, (
            f"{request.num_computed} tokens computed, {full} full blocks, each keyed on the key before it (from "
            f"ROOT_KEY): expected keys {short(chained)}, got {short(request.block_keys)}")
        if not request.finished:  # a finished request has given its blocks back
            registered = [engine.allocator.key_of_block.get(b) for b in request.block_table[:full]]
            assert registered == request.block_keys, (
                f"the pool's keys of blocks {request.block_table[:full]} are not the request's keys: a full block "
                "must be registered under its key")
    # 14 prompt tokens in chunks of 3, then one token a step; the last of the 20 tokens is never computed.
    expected = [(3, 0), (6, 1), (9, 2), (12, 3), (14, 3), (15, 3), (16, 4), (17, 4), (18, 4), (19, 4)]
    assert seen == expected, f"(tokens computed, keys) after each step: {seen}, expected {expected}"
    assert engine.allocator.num_cached == 4, f"{engine.allocator.num_cached} blocks cached at the end, expected 4"
    lost = [i for i, k in enumerate(request.block_keys) if k not in engine.allocator.block_of_key]
    assert not lost, f"the keys of blocks {lost} are not in the pool: a later prompt cannot claim them"


def test_aborting_one_of_two_sharers_leaves_the_other_whole() -> None:
    tiny = load_model("tiny-llama")
    engine = PrefixCachingEngine(tiny, PrefixCachingEngineConfig(device="cpu", attn="torch", block_size=4))
    prompt = list(range(500, 523))
    run(engine, [[prompt]], 2)
    a = engine.requests[engine.add_request(prompt + [7], SamplingParams(max_tokens=8))]
    b = engine.requests[engine.add_request(prompt + [9], SamplingParams(max_tokens=8))]
    engine.step()
    shared = set(a.block_table) & set(b.block_table)
    refs = {x: engine.allocator.ref_counts[x] for x in sorted(shared)}
    assert len(shared) == 5 and set(refs.values()) == {2}, (
        f"the 5 full blocks of the shared 23-token prefix should be held by both: blocks and holders {refs}")
    engine.abort(b.request_id)
    refs = {x: engine.allocator.ref_counts[x] for x in sorted(shared)}
    assert set(refs.values()) == {1}, f"after b's abort, a alone should hold the shared blocks: {refs}"
    while engine.has_unfinished():
        engine.step()
    hf = hf_model_for(tiny)
    expected = reference_greedy(hf, prompt + [7], 8, tiny.tokenizer.eos_token_ids)
    assert a.output_token_ids == expected, f"a: not HF's tokens: {first_difference(expected, a.output_token_ids)}"
    assert_idle(engine)
    assert b.status is RequestStatus.FINISHED, f"the aborted b is {b.status.name}, expected FINISHED"


def test_the_hit_counters_reach_the_servers_metrics() -> None:
    from step08_serve.metrics import ServingMetrics

    tiny = load_model("tiny-llama")
    engine = PrefixCachingEngine(tiny, PrefixCachingEngineConfig(device="cpu", attn="torch", block_size=4))
    prompt = list(range(600, 620))
    run(engine, [[prompt], [prompt]], 2)
    text = ServingMetrics(engine, lambda: 0).render().decode()
    lines = [line for line in text.splitlines() if "prefix_cache" in line or "blocks_cached" in line]
    assert "llm_prefix_cache_queries_total 40.0" in text and "llm_prefix_cache_hits_total 16.0" in text, (
        f"two 20-token prompts, the second hitting 4 blocks: expected 40 queried, 16 hit tokens; metrics: {lines}")
    assert "# TYPE llm_prefix_cache_hits_total counter" in text and "llm_kv_blocks_cached" in text, (
        f"the metrics lack the hit counter's type or the cached-blocks gauge: {lines}")
