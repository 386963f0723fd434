"""step14_overlap_scheduling: each decode step launched before the host has processed the previous one gives
the same tokens, with requests joining, leaving, stopping, being aborted or preempted meanwhile.

On a CPU the launch-ahead path runs eagerly when asked for (`overlap=True`): the same bookkeeping, the same
static buffers, the previous step's tokens read on the device; only nothing is captured.
"""

from __future__ import annotations

import pytest
import torch

from common.checks import staggered_generate
from common.loading import LoadedModel
from common.prompts import PARITY_PROMPTS
from common.sampling import LogitControls, SamplingParams
from step07_preemption.engine import PreemptionEngine, PreemptionEngineConfig
from step12_cuda_graph.decode_graphs import DecodeBatch, PendingTokens
from step14_overlap_scheduling.engine import (LaunchAheadBatch, LaunchAheadInputs, OverlapSchedulingEngine,
                                              OverlapSchedulingEngineConfig, count_pending)
from tests.helpers import (check_graphs_match_step06_on_cuda, first_difference, in_vocab, run_checked,
                           seeded_sampling_case, step01_tokens, tight_pool_case, tiny_with_small_vocab)


def engine_for(tiny: LoadedModel, **config: object) -> OverlapSchedulingEngine:
    return OverlapSchedulingEngine(tiny, OverlapSchedulingEngineConfig(device="cpu", attn="torch", **config))


def test_previous_rows_are_laid_out_and_read_on_the_device() -> None:
    """A launched-ahead row names the row of the step before whose token is its input; a plain row, and every
    padded row, reads its own token."""
    inputs = LaunchAheadInputs(max_batch=8, width=4, block_size=4, dummy_block=30, device=torch.device("cpu"))
    batch = LaunchAheadBatch([0, 9, 0], [6, 2, 9], [[3, 4], [8], [12, 2, 5]], [SamplingParams()] * 3, [1, 1, 1],
                             previous_rows=[2, -1, 0])
    inputs.fill(batch, bucket=4)
    assert inputs.previous_rows[:4].tolist() == [2, -1, 0, -1]
    last_tokens = torch.tensor([101, 102, 103, 104, 0, 0, 0, 0])
    assert inputs.token_inputs(4, last_tokens).tolist() == [103, 9, 101, 0]
    inputs.fill(DecodeBatch([5], [3], [[1]], [SamplingParams()], [1]), bucket=2)  # a plain batch: no previous row
    assert inputs.token_inputs(2, last_tokens).tolist() == [5, 0]


def test_overlap_is_off_on_a_cpu_unless_asked_for(tiny: LoadedModel) -> None:
    assert not engine_for(tiny, num_blocks=16).overlap
    assert engine_for(tiny, num_blocks=16, overlap=True).overlap


def test_overlap_needs_the_static_buffers(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="--no-cuda-graph"):
        engine_for(tiny, num_blocks=16, overlap=True, cuda_graph=False)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_step01_with_requests_joining_and_leaving(tiny: LoadedModel, block_size: int, overlap: bool) -> None:
    """Seven prompts, one arriving per step, with uneven lengths: the batch passes through 3, 5, 6 and 7
    rows, none of them a bucket, and shrinks again as requests finish."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:7]]
    params = [SamplingParams(max_tokens=6 + 3 * i) for i in range(7)]
    expected = step01_tokens(tiny, prompts, params)
    engine = engine_for(tiny, block_size=block_size, num_blocks=128, max_graph_batch=8, overlap=overlap)
    got = [c.token_ids for c in staggered_generate(engine, prompts, params, arrive_every=1)]
    assert got == expected, f"not step 01's tokens: {first_difference(expected, got)}"
    assert engine.allocator.num_used == 0 and not engine.requests, (
        f"{len(engine.requests)} requests and {engine.allocator.num_used} blocks still held at the end")
    ahead, taken = engine.steps_launched_ahead, engine.steps_taken_from_ahead
    if overlap:  # arrivals join the step launched ahead (they were prefilled before it was launched), and
        # nothing here (no swap, no preemption) changes a batch in a way the guess cannot cover: all are used
        assert ahead >= 20 and taken == ahead, f"{ahead} steps launched ahead (20 at least), {taken} of them used: all"
    else:
        assert ahead == 0, f"overlap off, yet {ahead} steps were launched ahead"


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_between_steps_changes_no_output(tiny: LoadedModel, preempt: str) -> None:
    prompts, params, expected, num_blocks = tight_pool_case(tiny)
    engine = engine_for(tiny, block_size=4, num_blocks=num_blocks, preempt=preempt, overlap=True)
    outputs, _ = run_checked(engine, prompts, params)
    assert outputs == expected
    assert engine.preemptions >= 2 and engine.steps_launched_ahead > 0


def test_an_arrival_takes_the_decoders_tokens_from_the_step_launched_ahead(tiny: LoadedModel) -> None:
    """Two requests decode, each step launched ahead; a third arrives. The next step mixes its first chunk
    with the decoders, whose tokens the step launched ahead has already computed: they are taken from it
    (not computed twice), and every request still gets step 01's tokens."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:3]]
    params = SamplingParams(max_tokens=12)
    expected = step01_tokens(tiny, prompts, params)
    engine = engine_for(tiny, block_size=4, num_blocks=128, overlap=True, max_num_batched_tokens=8)
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    tokens: dict[str, list[int]] = {i: [] for i in ids}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids

    while engine.prefill_pending() or engine.ahead is None:
        step()
    taken = engine.steps_taken_from_ahead
    ids.append(engine.add_request(prompts[2], params))
    tokens[ids[2]] = []
    step()  # the new prompt's first chunk of 8 tokens, beside the two decoders
    assert engine.steps_taken_from_ahead == taken + 1 and len(tokens[ids[2]]) == 0
    while engine.has_unfinished():
        step()
    assert [tokens[i] for i in ids] == expected
    assert engine.allocator.num_used == 0


def test_abort_with_a_step_launched_ahead(tiny: LoadedModel) -> None:
    """A request aborted while the step launched ahead computes its next token: everything it held is
    freed, and the others get exactly the tokens they get alone."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=16)
    expected = step01_tokens(tiny, prompts, params)
    engine = engine_for(tiny, block_size=4, num_blocks=128, overlap=True)
    ids = [engine.add_request(p, params) for p in prompts]
    aborted = engine.requests[ids[1]]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(5):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine.ahead is not None and aborted in engine.ahead.row_of, "no step launched ahead holds the request"
    engine.abort(ids[1])
    assert not aborted.block_table, f"the aborted request still holds blocks {aborted.block_table}"
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine.allocator.num_used == 0, f"{engine.allocator.num_used} blocks still held at the end"
    got, want = [tokens[i] for i in (ids[0], ids[2], ids[3])], [expected[0], expected[2], expected[3]]
    assert got == want, f"the others: not step 01's tokens: {first_difference(want, got)}"
    taken = engine.steps_taken_from_ahead
    assert taken >= 10, f"the shrunken batch took the step launched ahead only {taken} times (10 at least)"


def test_a_decode_step_is_launched_without_waiting_for_the_one_before(tiny: LoadedModel,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of launching ahead: `launch_decode` never waits for the step launched before it (on a GPU,
    reading its tokens stalls the host until the device is done, and nothing overlaps). Waiting gives the same
    tokens, so only a watch on `PendingTokens.wait` during the launch shows it."""
    launch, wait = OverlapSchedulingEngine.launch_decode, PendingTokens.wait  # looked up now: an exercise swaps it
    launching, waits_while_launching = [False], []

    def watched_launch(self: OverlapSchedulingEngine, *args: object, **kwargs: object) -> object:
        launching[0] = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            launching[0] = False

    def watched_wait(self: PendingTokens) -> list[int]:
        if launching[0]:
            waits_while_launching.append(1)
        return wait(self)

    monkeypatch.setattr(OverlapSchedulingEngine, "launch_decode", watched_launch)
    monkeypatch.setattr(PendingTokens, "wait", watched_wait)
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:3]]
    engine = engine_for(tiny, block_size=4, num_blocks=128, overlap=True)
    engine.generate(prompts, SamplingParams(max_tokens=8))
    assert engine.steps_launched_ahead > 0, "no step was launched ahead: nothing was checked"
    assert not waits_while_launching, (
        f"launch_decode waited for a step's tokens {len(waits_while_launching)} times in "
        f"{engine.steps_launched_ahead} steps launched ahead: a launched-ahead row must read its input token "
        "on the device (previous_rows), not on the host")


def test_overlap_stops_where_step07_stops(tiny: LoadedModel) -> None:
    """Requests that end by a stop string, by a stop token, and at the context limit, while steps are launched
    ahead: the same tokens, text and finish reasons as step 07, and nothing launched past the context."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    config = dict(device="cpu", block_size=4, num_blocks=128, attn="torch", max_model_len=max(map(len, prompts)) + 12)
    free_run = PreemptionEngine(tiny, PreemptionEngineConfig(**config)).generate(prompts, SamplingParams(max_tokens=40))
    params = [
        SamplingParams(max_tokens=40, stop=[free_run[0].text[5:8]]),  # a stop string a few tokens in
        SamplingParams(max_tokens=40, stop_token_ids=[free_run[1].token_ids[3]]),  # a stop token
        SamplingParams(max_tokens=40),  # runs into the context limit
        SamplingParams(max_tokens=7),  # ends by length
    ]
    expected = PreemptionEngine(tiny, PreemptionEngineConfig(**config)).generate(prompts, params)
    engine = OverlapSchedulingEngine(tiny, OverlapSchedulingEngineConfig(**config, overlap=True))
    ours = engine.generate(prompts, params)
    got, want = [c.token_ids for c in ours], [c.token_ids for c in expected]
    assert got == want, f"not step 07's tokens: {first_difference(want, got)}"
    reasons = [(c.text, c.finish_reason.value) for c in ours]
    assert reasons == [(c.text, c.finish_reason.value) for c in expected], (
        f"(text, finish reason) {reasons}, step 07's {[(c.text, c.finish_reason.value) for c in expected]}")
    assert [c.finish_reason.value for c in expected] == ["stop", "stop", "length", "length"], (
        f"the case does not end as planned: {[c.finish_reason.value for c in expected]}")
    assert engine.steps_taken_from_ahead > 0, "no step launched ahead was used"
    assert engine.allocator.num_used == 0, f"{engine.allocator.num_used} blocks still held at the end"


def test_seeded_sampling_is_step07s() -> None:
    """The sampling variant draws exactly the tokens step 07's sampler draws (same seeds, same positions),
    launched ahead or not."""
    tiny, prompts, params, config, expected = seeded_sampling_case()
    for overlap in (False, True):
        ours = OverlapSchedulingEngine(tiny, OverlapSchedulingEngineConfig(**config, overlap=overlap)).generate(
            prompts, params)
        assert [c.token_ids for c in ours] == expected


def test_rows_launched_ahead_draw_at_their_output_position() -> None:
    """Seeded sampling draws by each token's position in its output: a row launched ahead draws one position
    past what the host has appended (the pending token counts). Step 07's tokens, on a 1000-token vocabulary
    (fast: the sampler's sort is over the vocabulary)."""
    tiny = tiny_with_small_vocab("tiny-qwen3")
    prompts = [in_vocab(tiny.tokenizer.apply_chat_template(p)) for p in PARITY_PROMPTS[:5]]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, top_k=k, seed=i) for i, k in
              enumerate([0, 5, 0, 50, 0])]
    config = dict(device="cpu", block_size=4, num_blocks=96, attn="torch")
    expected = PreemptionEngine(tiny, PreemptionEngineConfig(**config)).generate(prompts, params)
    engine = OverlapSchedulingEngine(tiny, OverlapSchedulingEngineConfig(**config, overlap=True))
    got, want = [c.token_ids for c in engine.generate(prompts, params)], [c.token_ids for c in expected]
    assert got == want, f"not step 07's seeded tokens: {first_difference(want, got)}"
    assert engine.steps_taken_from_ahead > 0, "no step launched ahead was used"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none here)")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_captured_graphs_launched_ahead_match_step06_on_cuda(model: str) -> None:
    """Step 12's test on the final engine: step 13's fused graphs, each step launched ahead."""
    def make_engine(loaded: LoadedModel, num_blocks: int) -> OverlapSchedulingEngine:
        engine = OverlapSchedulingEngine(loaded, OverlapSchedulingEngineConfig(
            device="cuda", block_size=16, num_blocks=num_blocks, attn="triton", max_graph_batch=8))
        assert engine.overlap
        return engine

    check_graphs_match_step06_on_cuda(model, make_engine)


def test_count_pending_equals_the_controls_with_the_pending_token_appended() -> None:
    """Row 0's pending token was drawn before, row 1's never, row 2 has none pending: the logits are those of the
    controls built with each pending token appended to its row's output, bit for bit."""
    vocab = 12
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                             logit_bias={3: 2.0}),
              SamplingParams(frequency_penalty=0.9, repetition_penalty=0.8), SamplingParams(presence_penalty=1.1)]
    prompts, outputs = [[1, 2], [4], [5]], [[3, 3, 7], [8], [9]]
    last_tokens = torch.tensor([6, 3, 5, 10])  # what the step before drew, by its rows
    previous_rows = [1, 3, -1]  # row 0's input is the 3 of row 1, row 1's the 10 of row 3
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    controls = LogitControls.build(params, prompts, outputs, vocab, torch.device("cpu"))
    got = count_pending(controls, logits, last_tokens, previous_rows)
    appended = [[3, 3, 7, 3], [8, 10], [9]]
    expected = LogitControls.build(params, prompts, appended, vocab, torch.device("cpu")).apply(logits)
    assert torch.equal(got, expected)
    assert not torch.equal(got, controls.apply(logits))  # the pending tokens changed something
