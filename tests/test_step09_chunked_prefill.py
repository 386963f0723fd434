"""step09_chunked_prefill: HF's tokens under any token budget, decoders never stalled, and every way a
half-prefilled request can leave (preempted in either mode, aborted) frees what it held."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.request import RequestStatus
from common.sampling import SamplingParams
from step09_chunked_prefill.engine import ChunkedPrefillEngine, ChunkedPrefillEngineConfig
from tests.helpers import (LONG_PROMPT, PARITY_MAX_TOKENS, CheckedRun, assert_matches_reference, assert_nothing_left,
                           first_difference, hf_tokens, in_vocab, needs_triton, tiny_with_small_vocab)

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_case(tiny: LoadedModel) -> tuple[LoadedModel, list[list[int]], list[list[int]]]:
    """A tiny model, five prompts (one of them longer than every budget), and HF's greedy tokens for them."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in [LONG_PROMPT, *PARITY_PROMPTS[:4]]]
    return tiny, prompts, hf_tokens(tiny, prompts, MAX_TOKENS)


@pytest.mark.parametrize("budget", [1, 3, 16, 64])
@pytest.mark.parametrize("block_size", [4, 16])
def test_any_budget_gives_hfs_tokens(tiny_case, budget: int, block_size: int) -> None:
    """Chunks of 3 tokens in blocks of 4 end inside a block and cross block boundaries: positions and slots
    must carry over from one chunk to the next."""
    tiny, prompts, expected = tiny_case
    assert len(prompts[0]) > budget, f"the first prompt ({len(prompts[0])} tokens) must need more than one chunk"
    engine = ChunkedPrefillEngine(tiny, ChunkedPrefillEngineConfig(
        device="cpu", attn="torch", block_size=block_size, max_num_batched_tokens=budget))
    got = CheckedRun(engine).run(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert got == expected, f"budget {budget}: not HF's tokens: {first_difference(expected, got)}"
    assert engine.prefill_chunks > 0, "no prompt was prefilled in chunks"
    if budget > 1:
        assert engine.mixed_steps > 0, "no step mixed decoders with prefill chunks"


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("budget", [1, 3, 16, 64])
def test_preemption_under_a_tiny_kv_budget(tiny: LoadedModel, preempt: str, budget: int) -> None:
    """Short prompts in several scripts (no chat template) that each grow to about 15 blocks, in a pool of
    17: two of them cannot decode together to the end."""
    prompts = [tiny.tokenizer.encode(p) for p in PARITY_PROMPTS[1:5]]
    expected = hf_tokens(tiny, prompts, 40)
    longest_blocks = -(-(max(len(p) for p in prompts) + 40) // 4)
    engine = ChunkedPrefillEngine(tiny, ChunkedPrefillEngineConfig(
        device="cpu", attn="torch", block_size=4, num_blocks=longest_blocks + 2, preempt=preempt,
        max_num_batched_tokens=budget))
    got = CheckedRun(engine).run(prompts, SamplingParams(max_tokens=40), arrive_every=1)
    assert got == expected, f"budget {budget}, {preempt}: not HF's tokens: {first_difference(expected, got)}"
    if budget > 1:
        assert engine.preemptions >= 1, "the pool is too small for two requests, yet none was preempted"
    else:
        # One decoder fills a budget of one token: no prompt is prefilled beside it, requests run one at a
        # time, and none ever needs another's blocks.
        assert engine.preemptions == 0, f"{engine.preemptions} preemptions where requests run one at a time"


def long_prompt_behind_a_decoder(preempt: str, num_blocks: int, budget: int = 8):
    """Request A decodes; B, a 40-token prompt, arrives and is prefilled in chunks of `budget - 1` beside it."""
    tiny = load_model("tiny-qwen2")
    a, b = list(range(100, 110)), list(range(200, 240))
    engine = ChunkedPrefillEngine(tiny, ChunkedPrefillEngineConfig(
        device="cpu", attn="torch", block_size=4, num_blocks=num_blocks, preempt=preempt,
        max_num_batched_tokens=budget))
    a_id = engine.add_request(a, SamplingParams(max_tokens=30))
    engine.step()  # A's first 8 prompt tokens
    engine.step()  # its last 2: it samples its first token
    assert engine.is_decoding(engine.requests[a_id])
    b_id = engine.add_request(b, SamplingParams(max_tokens=6))
    return tiny, engine, engine.requests[a_id], engine.requests[b_id], a, b


def test_first_token_only_after_the_last_chunk_and_the_decoder_never_waits() -> None:
    tiny, engine, a, b, _, b_prompt = long_prompt_behind_a_decoder("recompute", num_blocks=64)
    computed = []
    while not b.output_token_ids:
        a_tokens = len(a.output_token_ids)
        engine.step()
        computed.append(b.num_computed)
        assert len(a.output_token_ids) == a_tokens + 1, "the decoder waited for the prefill"
    assert computed == [7, 14, 21, 28, 35, 40], (  # chunks of budget 8 - 1 decoder, the last one short
        f"B's prompt computed after each step: {computed}; a budget of 8 with one decoder leaves chunks of 7: "
        "[7, 14, 21, 28, 35, 40]")
    # No token while the prompt was incomplete: the loop above stopped at B's first token.
    assert all(n < len(b_prompt) for n in computed[:-1]), f"B sampled before its last chunk: {computed}"
    while engine.has_unfinished():
        engine.step()
    expected = hf_tokens(tiny, [b_prompt], 6)[0]
    assert b.output_token_ids == expected, f"B: not HF's tokens: {first_difference(expected, b.output_token_ids)}"
    assert_nothing_left(engine, [a, b])


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_a_half_prefilled_request_is_preempted_and_still_gives_hfs_tokens(preempt: str) -> None:
    """A pool of 13 blocks: A holds 3 and grows; B, mid-prefill, holds the rest. When A needs a block, B,
    admitted later, is the victim: its computed chunks are swapped out or dropped, and it resumes later."""
    tiny, engine, a, b, a_prompt, b_prompt = long_prompt_behind_a_decoder(preempt, num_blocks=13)
    for _ in range(40):
        if engine.preemptions:
            break
        engine.step()
    assert engine.preemptions == 1 and not b.output_token_ids
    if preempt == "swap":
        assert b.status is RequestStatus.SWAPPED and 0 < b.num_computed < len(b_prompt) and b.host_kv is not None
    else:
        assert b.status is RequestStatus.WAITING and b.num_computed == 0 and not b.block_table
    while engine.has_unfinished():
        engine.step()
    assert [a.output_token_ids, b.output_token_ids] == [hf_tokens(tiny, [a_prompt], 30)[0],
                                                         hf_tokens(tiny, [b_prompt], 6)[0]]
    assert_nothing_left(engine, [a, b])


def test_abort_mid_prefill_frees_everything() -> None:
    tiny, engine, a, b, a_prompt, _ = long_prompt_behind_a_decoder("recompute", num_blocks=64)
    engine.step()
    engine.step()
    assert 0 < b.num_computed < len(b.prompt_token_ids)
    used = engine.allocator.num_used
    engine.abort(b.request_id)
    assert engine.allocator.num_used < used and not b.block_table
    assert engine.stats()["requests_prefilling"] == 0
    while engine.has_unfinished():
        engine.step()
    assert a.output_token_ids == hf_tokens(tiny, [a_prompt], 30)[0]
    assert_nothing_left(engine, [a, b])


def test_priority_goes_first_within_the_budget() -> None:
    """Two long prompts arrive together; the more important one gets the whole budget until it is done."""
    tiny = load_model("tiny-llama")
    engine = ChunkedPrefillEngine(tiny, ChunkedPrefillEngineConfig(device="cpu", attn="torch",
                                                                   max_num_batched_tokens=16))
    low = engine.add_request(list(range(300, 340)), SamplingParams(max_tokens=4), priority=5)
    high = engine.add_request(list(range(400, 440)), SamplingParams(max_tokens=4), priority=0)
    engine.step()
    def computed() -> tuple[int, int]:
        return engine.requests[high].num_computed, engine.requests[low].num_computed

    assert computed() == (16, 0), f"(high, low) computed after one step of 16: {computed()}, expected (16, 0)"
    engine.step()
    engine.step()  # 32 + 8 of the high one, then 8 of the low one
    assert computed() == (40, 8), f"(high, low) computed after three steps: {computed()}, expected (40, 8)"
    sampled = len(engine.requests[high].output_token_ids)
    assert sampled == 1, f"the high one, its 40 tokens computed, sampled {sampled} tokens, expected 1"


def test_a_more_important_arrival_goes_before_a_prompt_mid_prefill() -> None:
    """One list of candidates, sorted by importance: a waiting request more important than one mid-prefill gets
    the budget first (running requests are not served before waiting ones as such)."""
    engine = ChunkedPrefillEngine(load_model("tiny-llama"), ChunkedPrefillEngineConfig(device="cpu", attn="torch",
                                                                                        max_num_batched_tokens=8))
    low = engine.requests[engine.add_request(list(range(300, 340)), SamplingParams(max_tokens=4), priority=5)]
    engine.step()
    assert low.num_computed == 8, f"alone, the low one computes a whole budget of 8: {low.num_computed}"
    high = engine.requests[engine.add_request(list(range(400, 440)), SamplingParams(max_tokens=4), priority=0)]
    engine.step()
    assert (high.num_computed, low.num_computed) == (8, 8), "the more important arrival takes this step's budget"


def test_a_request_that_sits_out_does_not_stop_the_ones_after_it() -> None:
    """A candidate that gets no chunk (here: more important, but no place among the running requests) is skipped;
    the less important request mid-prefill after it still gets its chunk."""
    engine = ChunkedPrefillEngine(load_model("tiny-llama"), ChunkedPrefillEngineConfig(
        device="cpu", attn="torch", max_num_batched_tokens=8, max_num_seqs=1))
    low = engine.requests[engine.add_request(list(range(300, 340)), SamplingParams(max_tokens=4), priority=5)]
    engine.step()
    high = engine.requests[engine.add_request(list(range(400, 440)), SamplingParams(max_tokens=4), priority=0)]
    engine.step()
    assert (high.num_computed, low.num_computed) == (0, 16), "the request mid-prefill must go on"


@pytest.mark.parametrize("budget", [0, -5])
def test_a_budget_below_one_is_refused(budget: int) -> None:
    with pytest.raises(ValueError, match="--max-num-batched-tokens must be at least 1"):
        ChunkedPrefillEngine(load_model("tiny-llama"), ChunkedPrefillEngineConfig(device="cpu",
                                                                                 max_num_batched_tokens=budget))


def test_cpu_says_its_budget_and_measures_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    engine = ChunkedPrefillEngine(load_model("tiny-llama"), ChunkedPrefillEngineConfig(device="cpu"))
    assert engine.token_budget == 512 and engine.step_memory_bytes is None
    assert "token budget: 512 tokens per step" in capsys.readouterr().out


@needs_triton
def test_triton_kernels_run_the_mixed_batch() -> None:
    """Decoders and chunks through step 06's Triton prefill kernel (on the GPU, or the interpreter on a CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = tiny_with_small_vocab("tiny-qwen3", device)
    prompts = [in_vocab(tiny.tokenizer.apply_chat_template(p)) for p in PARITY_PROMPTS[:3]]
    expected = hf_tokens(tiny, prompts, 6)
    engine = ChunkedPrefillEngine(tiny, ChunkedPrefillEngineConfig(device=device, attn="triton", block_size=16,
                                                                   max_num_batched_tokens=24))
    assert CheckedRun(engine).run(prompts, SamplingParams(max_tokens=6), arrive_every=3) == expected
    assert engine.mixed_steps > 0


@pytest.mark.embedded
def test_embedded_model_in_chunks(embedded: LoadedModel, embedded_hf: PreTrainedModel, embedded_reference) -> None:
    """The real model, prompts in several scripts, in chunks of at most 16 tokens among decoders."""
    reference = embedded_reference[:6]
    prompts = [ids for ids, _ in reference]
    engine = ChunkedPrefillEngine(embedded, ChunkedPrefillEngineConfig(device="cpu", attn="torch",
                                                                       max_num_batched_tokens=16))
    outputs = CheckedRun(engine).run(prompts, SamplingParams(max_tokens=PARITY_MAX_TOKENS))
    assert_matches_reference(embedded_hf, reference, outputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the worst step's memory is measured on a CUDA device only")
def test_worst_step_is_measured_before_the_pool_is_sized() -> None:
    loaded = load_model("random:qwen3-0.6b", device="cuda")
    engine = ChunkedPrefillEngine(loaded, ChunkedPrefillEngineConfig(device="cuda", max_num_batched_tokens=4096))
    assert engine.step_memory_bytes is not None
    # At least the MLP's gate and up activations of 4096 tokens, in bf16.
    assert engine.step_memory_bytes >= 4096 * 2 * loaded.model.config.intermediate_size * 2


def test_abort_of_a_half_prefilled_request_in_host_memory_frees_it() -> None:
    """B is swapped out mid-prefill (as in the preemption test above), then aborted: its host copy and its
    count of computed tokens go with it."""
    tiny, engine, a, b, a_prompt, _ = long_prompt_behind_a_decoder("swap", num_blocks=13)
    for _ in range(40):
        if b.status is RequestStatus.SWAPPED:
            break
        engine.step()
    assert b.status is RequestStatus.SWAPPED and b.host_kv is not None
    engine.abort(b.request_id)
    assert b.host_kv is None and not engine.swapped
    while engine.has_unfinished():
        engine.step()
    assert a.output_token_ids == hf_tokens(tiny, [a_prompt], 30)[0]
    assert_nothing_left(engine, [a, b])
