"""Helpers that several test modules share: constants, reference runs, checks and markers.

Plain functions only (the fixtures are in conftest.py); a test module imports them from here, never from
another test module:

    from tests.helpers import PARITY_MAX_TOKENS, step01_tokens

The steps' engines are imported inside the helpers that use them, so that importing this module (conftest.py
does, for every test) loads no step beyond step 01.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import PreTrainedModel

from common.config import tiny_config
from common.engine import EngineConfig
from common.loading import LoadedModel, embedded_tokenizer, load_model, random_model
from common.prompts import PARITY_PROMPTS
from common.request import Request
from common.reference import hf_model_for, reference_greedy
from common.sampling import SamplingParams
from step01_serial.engine import SerialEngine

if TYPE_CHECKING:
    from step07_preemption.engine import PreemptionEngine
    from step09_chunked_prefill.engine import ChunkedPrefillEngine
    from step12_cuda_graph.engine import CudaGraphEngine

# ----- messages ---------------------------------------------------------------------------------------------


def first_difference(expected: Sequence[Any], got: Sequence[Any], around: int = 3) -> str:
    """Where `got` first differs from `expected`, in one line: two token lists, or two lists of them (one per
    request). Shows the position and a few tokens either side, not the whole lists."""
    if expected and isinstance(expected[0], (list, tuple)):
        for i, (want, have) in enumerate(zip(expected, got)):
            if list(want) != list(have):
                return f"request {i}: {first_difference(want, have, around)}"
        return f"expected {len(expected)} requests' tokens, got {len(got)}"
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    start = max(0, at - around)
    dots = "..., " if start else ""
    return (f"first difference at position {at} (of {len(expected)} expected, {len(got)} got): expected "
            f"[{dots}{', '.join(map(str, expected[start:at + around + 1]))}], got "
            f"[{dots}{', '.join(map(str, got[start:at + around + 1]))}]")


# ----- reference outputs ------------------------------------------------------------------------------------

PARITY_MAX_TOKENS = 24


def step01_tokens(loaded: LoadedModel, prompts: list[list[int]],
                  params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Step 01's tokens for these prompts on the CPU, each request run alone: what every later step must give."""
    return [c.token_ids for c in SerialEngine(loaded, EngineConfig(device="cpu")).generate(prompts, params)]


def hf_tokens(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    hf = hf_model_for(loaded)
    return [reference_greedy(hf, p, max_tokens, loaded.tokenizer.eos_token_ids) for p in prompts]


def assert_matches_reference(hf: PreTrainedModel, reference: list[tuple[list[int], list[int]]],
                             outputs: list[list[int]]) -> None:
    """Each output is HF's greedy continuation of its prompt, or differs only at a near-tie (measured under HF),
    and at most one of them differs at all."""
    from common.reference import compare_greedy

    identical = 0
    for (prompt, theirs), ours in zip(reference, outputs, strict=True):
        report = compare_greedy(hf, prompt, ours, theirs)
        assert report.ok, report.describe()
        identical += report.equal
    assert identical >= len(reference) - 1


# ----- tiny models with a small vocabulary ------------------------------------------------------------------

# The tiny models keep the tokenizer's whole vocabulary (49152), so their output head is by far their largest
# weight. Triton's interpreter runs a skinny matrix multiply one program per band of 32 output columns, one
# after another: 1536 programs for that head, about 8 s of every decode step. 1000 columns make 32 bands, the
# last one of 8 (uneven, as the whole vocabulary's is not), and leave every other shape of the tiny model as is.
SMALL_VOCAB = 1000


def tiny_with_small_vocab(name: str, device: str | torch.device = "cpu", vocab_size: int = SMALL_VOCAB) -> LoadedModel:
    """`load_model(name)` for a tiny model ("tiny-llama", ...), with only `vocab_size` rows in its embedding
    and output head; seeded random weights, the embedded tokenizer (each id below `vocab_size` is one of its
    tokens). Prompts must be brought into the vocabulary first: `in_vocab`."""
    config = dataclasses.replace(tiny_config(name.removeprefix("tiny-")), vocab_size=vocab_size)
    return LoadedModel(name, random_model(config, torch.device(device), torch.float32), embedded_tokenizer(), None)


def in_vocab(prompt_ids: list[int], vocab_size: int = SMALL_VOCAB) -> list[int]:
    """A prompt's ids folded into a small vocabulary (random weights care for no meaning, only for ids)."""
    return [t % vocab_size for t in prompt_ids]


# ----- markers ----------------------------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (Linux x86-64 only)")


# ----- what an engine holds ---------------------------------------------------------------------------------


def assert_blocks_held_once_per_holder(engine: Any) -> None:
    """Every block in a request's block table is owned by the allocator, and held once per holder: by one
    request before step 10, by as many requests as its reference count from step 10 on (a shared cached prefix)."""
    held = Counter(b for request in engine.requests.values() for b in request.block_table)
    ref_counts = getattr(engine.allocator, "ref_counts", None)
    if ref_counts is None:
        assert all(n == 1 for n in held.values()), "a block is in two block tables"
    else:
        assert held == ref_counts, "a block's reference count is not the number of block tables holding it"
    assert set(held) == engine.allocator.owned


def assert_nothing_left(engine: Any, requests: Iterable[Request] = ()) -> None:
    """The engine holds no request and no block; and each of `requests`, finished or aborted, holds nothing
    either: no block, no host copy of its K/V."""
    held = {"requests": len(engine.requests), "running": len(engine.running), "waiting": len(engine.waiting),
            "swapped": len(getattr(engine, "swapped", []))}
    assert set(held.values()) == {0}, f"the engine still holds requests at the end: {held}"
    assert engine.allocator.num_used == 0, f"{engine.allocator.num_used} blocks still held at the end"
    for request in requests:
        assert not request.block_table, f"{request.request_id} still holds blocks"
        assert getattr(request, "host_kv", None) is None, "host (pinned) memory of a swapped request was not released"


# ----- checked runs -----------------------------------------------------------------------------------------


def run_checked(engine: PreemptionEngine, prompts: list[list[int]], params: SamplingParams,
                priorities: list[int] | None = None) -> tuple[list[list[int]], list[str]]:
    """Run to completion while checking, at every step, that what was emitted never changes and that no
    block is owned twice. Returns each request's tokens and the order in which requests finished."""
    ids = [engine.add_request(p, params, priority=(priorities or [0] * len(prompts))[i]) for i, p in enumerate(prompts)]
    requests = {rid: engine.requests[rid] for rid in ids}
    streamed = {rid: "" for rid in ids}
    tokens_seen = {rid: [] for rid in ids}
    finished: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.new_text
            if out.finished:
                finished.append(out.request_id)
        for rid, request in requests.items():
            assert request.output_token_ids[: len(tokens_seen[rid])] == tokens_seen[rid], "a token changed"
            tokens_seen[rid] = list(request.output_token_ids)
        assert_blocks_held_once_per_holder(engine)
    assert sorted(finished) == sorted(ids), "a request was lost or finished twice"
    for rid, request in requests.items():
        assert streamed[rid] == request.text, (  # the streamed text is exactly the final text
            f"{rid}: streamed {streamed[rid]!r}, final text {request.text!r}")
    assert_nothing_left(engine, requests.values())
    return [requests[rid].output_token_ids for rid in ids], finished


# A prompt longer than the largest budget tested (64), mixing scripts: each chunk boundary falls somewhere new.
LONG_PROMPT = "Summarise this, keeping every name: " + " ".join(
    ["Ada Lovelace wrote the first program; 李白 wrote poems; Émile Zola wrote novels 📚."] * 4)


class CheckedRun:
    """Runs an engine step by step, requests arriving while others decode, and checks at every step what
    chunked prefill promises: no step computes more than the budget (or one token per decoder, if more),
    every decoder gets its token, no request samples before its prompt is fully computed, no block is owned
    twice, and nothing is left behind at the end."""

    def __init__(self, engine: ChunkedPrefillEngine) -> None:
        self.engine = engine
        self.tokens_per_step: list[int] = []
        forward_mixed, decode = engine.forward_mixed, engine.decode

        def counting_forward_mixed(chunks):  # noqa: ANN001, ANN202
            self.tokens_per_step.append(sum(c.num_tokens for c in chunks))
            return forward_mixed(chunks)

        def counting_decode(requests):  # noqa: ANN001, ANN202
            self.tokens_per_step.append(len(requests))
            return decode(requests)

        engine.forward_mixed, engine.decode = counting_forward_mixed, counting_decode

    def run(self, prompts: list[list[int]], params: SamplingParams, arrive_every: int = 2,
            priorities: list[int] | None = None) -> list[list[int]]:
        engine, pending, requests, steps = self.engine, list(enumerate(prompts)), [], 0
        while pending or engine.has_unfinished():
            while pending and pending[0][0] * arrive_every <= steps:
                index, prompt = pending.pop(0)
                rid = engine.add_request(prompt, params, priority=(priorities or [0] * len(prompts))[index])
                requests.append(engine.requests[rid])
            decoders = {r.request_id for r in engine.running if engine.is_decoding(r)}
            before = len(self.tokens_per_step)
            outputs = engine.step()
            steps += 1
            got_token = {o.request_id for o in outputs if o.new_token_ids}
            still_there = {r.request_id for r in engine.running} | {r.request_id for r in requests if r.finished}
            assert decoders & still_there <= got_token, "a running decoder got no token this step"
            if len(self.tokens_per_step) > before:
                limit = max(engine.token_budget, len(decoders))
                assert self.tokens_per_step[-1] <= limit, (
                    f"a step ran {self.tokens_per_step[-1]} tokens; the budget allows {limit} "
                    f"(budget {engine.token_budget}, {len(decoders)} decoders)")
            for rid in got_token:
                request = next(r for r in requests if r.request_id == rid)
                if not request.finished:
                    assert request.num_computed == request.num_tokens - 1, "sampled before the last chunk"
            assert_blocks_held_once_per_holder(engine)
        assert_nothing_left(engine, requests)
        return [r.output_token_ids for r in requests]


def tight_pool_case(tiny: LoadedModel) -> tuple[list[list[int]], SamplingParams, list[list[int]], int]:
    """Eight prompts of 24 new tokens each, step 01's tokens for them, and a pool of 4-token blocks that holds the
    longest request and two blocks more: tight enough that requests are preempted between steps."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:8]]
    params = SamplingParams(max_tokens=24)
    longest_blocks = -(-(max(len(p) for p in prompts) + 24) // 4)
    return prompts, params, step01_tokens(tiny, prompts, params), longest_blocks + 2


def seeded_sampling_case() -> tuple[LoadedModel, list[list[int]], list[SamplingParams], dict[str, Any], list[list[int]]]:
    """Five prompts on tiny-qwen3 with seeded sampling (top-k, top-p, and one greedy row), an engine config, and
    step 07's tokens for them: what a later step's static-buffer sampler must draw exactly."""
    from step07_preemption.engine import PreemptionEngine, PreemptionEngineConfig

    tiny = load_model("tiny-qwen3")
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:5]]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, top_k=k, seed=i) for i, k in
              enumerate([0, 5, 0, 50, 0])]
    params[2] = SamplingParams(max_tokens=12)  # a greedy row inside a sampling batch
    config: dict[str, Any] = dict(device="cpu", block_size=4, num_blocks=96, attn="torch")
    expected = PreemptionEngine(tiny, PreemptionEngineConfig(**config)).generate(prompts, params)
    return tiny, prompts, params, config, [c.token_ids for c in expected]


# ----- CUDA graphs ------------------------------------------------------------------------------------------


def check_graphs_match_step06_on_cuda(model: str, make_engine: Callable[[LoadedModel, int], CudaGraphEngine],
                                      reference: Callable[[LoadedModel], LoadedModel] = lambda loaded: loaded) -> None:
    """fp32, our Triton kernels in both engines: replayed graphs give step 06's eager tokens, with
    arrivals, non-bucket batches and a budget tight enough to preempt (step 13 runs it on its fused path).
    `reference`: the model step 06 and HF run, made from the loaded one (default: that one)."""
    from common.checks import compare_engines, staggered_generate
    from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig

    loaded = load_model(model, device="cuda", dtype=torch.float32)
    prompts = [loaded.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:7]]
    params = [SamplingParams(max_tokens=10 + 2 * i) for i in range(7)]
    step06 = PagedAttentionEngine(reference(loaded), PagedAttentionEngineConfig(
        device="cuda", block_size=16, num_blocks=64, attn="triton"))
    expected = staggered_generate(step06, prompts, params, arrive_every=1)
    for num_blocks in (64, 10):
        engine = make_engine(loaded, num_blocks)
        assert engine.eager_reason is None and engine.graphs is not None and engine.graphs.graphs
        outputs = staggered_generate(engine, prompts, params, arrive_every=1)
        # The graphs fix the decode kernel's split count, so float32 sums may be ordered differently from
        # step 06's: a token may differ only where HF shows the two candidates tied.
        reports = compare_engines(reference(loaded), prompts, outputs, expected)
        assert all(r.ok for r in reports), [r.describe() for r in reports if not r.ok]
        assert sum(r.equal for r in reports) >= len(prompts) - 1
        assert engine.allocator.num_used == 0
        if num_blocks == 10:
            assert engine.preemptions >= 1
