"""step07_preemption: outputs unchanged under budgets far too small, priorities, and nothing left behind."""

from __future__ import annotations

import pytest

from common.engine import EngineConfig
from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.request import RequestStatus
from common.sampling import SamplingParams
from step01_serial.engine import SerialEngine
from step07_preemption.engine import PreemptionEngine, PreemptionEngineConfig
from tests.helpers import (PARITY_MAX_TOKENS, assert_matches_reference, assert_nothing_left, run_checked,
                           step01_tokens)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("extra_blocks", [0, 3])
def test_far_too_small_budget_changes_no_output(tiny: LoadedModel, preempt: str, extra_blocks: int) -> None:
    """Eight requests in a pool barely larger than the longest one (which alone needs over half of it)."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:8]]
    params = SamplingParams(max_tokens=24)
    expected = step01_tokens(tiny, prompts, params)
    longest_blocks = -(-(max(len(p) for p in prompts) + 24) // 4)
    engine = PreemptionEngine(tiny, PreemptionEngineConfig(device="cpu", block_size=4, attn="torch",
                                                            num_blocks=longest_blocks + extra_blocks, preempt=preempt))
    assert longest_blocks > engine.cache.num_blocks / 2
    outputs, _ = run_checked(engine, prompts, params)
    assert outputs == expected
    assert engine.preemptions >= 2
    if preempt == "swap":
        stats = engine.swapper.stats
        assert stats.swapped_out_blocks == stats.swapped_in_blocks > 0


def test_admitted_but_never_prefilled_is_put_back() -> None:
    """A is decoding and needs a new block in the very step B is admitted with the last free blocks:
    B, the most recently admitted, is preempted before its prefill ever ran, and simply waits again."""
    tiny = load_model("tiny-llama")
    a, b = [11, 12, 13, 14], [21, 22, 23, 24, 25, 26, 27, 28]
    expected = step01_tokens(tiny, [a, b], [SamplingParams(max_tokens=7), SamplingParams(max_tokens=4)])
    engine = PreemptionEngine(tiny, PreemptionEngineConfig(device="cpu", block_size=4, num_blocks=3, attn="torch"))
    first = engine.add_request(a, SamplingParams(max_tokens=7))
    engine.step()  # A prefilled: 4 tokens cached in its one block, its 5th token needs a second block
    second = engine.add_request(b, SamplingParams(max_tokens=4))
    engine.step()  # B takes the last two blocks, then A needs one: B is un-admitted, A decodes
    assert engine.unadmissions == 1 and engine.preemptions == 0
    assert engine.requests[second].status is RequestStatus.WAITING and not engine.requests[second].output_token_ids
    requests = [engine.requests[first], engine.requests[second]]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected
    assert_nothing_left(engine, requests)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_important_request_runs_at_once_and_finishes_first(preempt: str) -> None:
    """Low-priority requests fill the pool; an important one arrives, runs within one step, finishes
    first; the preempted ones still produce exactly their tokens."""
    tiny = load_model("tiny-qwen3")
    low = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    vip = tiny.tokenizer.apply_chat_template("This one is urgent.")
    params, vip_params = SamplingParams(max_tokens=30), SamplingParams(max_tokens=12)
    serial = SerialEngine(tiny, EngineConfig(device="cpu"))
    expected_low = [c.token_ids for c in serial.generate(low, params)]
    expected_vip = serial.generate([vip], vip_params)[0].token_ids
    per_request = -(-(max(len(p) for p in low + [vip]) + 30) // 4)
    engine = PreemptionEngine(tiny, PreemptionEngineConfig(device="cpu", block_size=4, attn="torch",
                                                            num_blocks=2 * per_request, preempt=preempt))
    low_ids = [engine.add_request(p, params, priority=5) for p in low]
    low_requests = [engine.requests[i] for i in low_ids]
    for _ in range(3):
        engine.step()
    assert engine.allocator.num_free < per_request and not any(r.finished for r in low_requests)
    vip_id = engine.add_request(vip, vip_params, priority=0)
    vip_request = engine.requests[vip_id]
    engine.step()
    assert vip_request.status is RequestStatus.RUNNING and len(vip_request.output_token_ids) == 1
    finished_order = []
    while engine.has_unfinished():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order[0] == vip_id
    assert vip_request.output_token_ids == expected_vip
    assert [r.output_token_ids for r in low_requests] == expected_low
    assert engine.preemptions >= 1
    assert_nothing_left(engine, [*low_requests, vip_request])


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_abort_of_preempted_requests_frees_everything(preempt: str) -> None:
    tiny = load_model("tiny-llama")
    engine = PreemptionEngine(tiny, PreemptionEngineConfig(device="cpu", block_size=4, num_blocks=12,
                                                            attn="torch", preempt=preempt))
    ids = [engine.add_request([30 + i] * 9, SamplingParams(max_tokens=30)) for i in range(5)]
    requests = [engine.requests[rid] for rid in ids]
    for _ in range(12):
        engine.step()
    assert engine.preemptions >= 1
    assert preempt == "recompute" or any(r.host_kv is not None for r in requests)  # some K/V sits in host memory
    for rid in ids:
        engine.abort(rid)
    assert_nothing_left(engine, requests)


@pytest.mark.embedded
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_embedded_model_under_a_tight_budget(preempt: str, embedded: LoadedModel, embedded_hf,
                                             embedded_reference) -> None:
    """Six of the parity prompts in a pool with room for about two of them at their longest."""
    reference = embedded_reference[:6]
    prompts = [ids for ids, _ in reference]
    longest_blocks = -(-(max(len(p) for p in prompts) + PARITY_MAX_TOKENS) // 8)
    engine = PreemptionEngine(embedded, PreemptionEngineConfig(device="cpu", block_size=8, attn="torch",
                                                                num_blocks=2 * longest_blocks, preempt=preempt))
    outputs, _ = run_checked(engine, prompts, SamplingParams(max_tokens=PARITY_MAX_TOKENS))
    assert engine.preemptions >= 2
    assert_matches_reference(embedded_hf, reference, outputs)


@pytest.mark.parametrize("extra_blocks", [0, 3, 6])
def test_a_request_swapped_in_is_not_swapped_out_in_the_same_step(tiny: LoadedModel, extra_blocks: int) -> None:
    """Swap-in leaves room for the blocks decoding requests start this step; otherwise the request just
    swapped in, being the newest admission, is the first victim and its K/V makes a pointless round trip."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:8]]
    params = [SamplingParams(max_tokens=8 + 4 * i) for i in range(8)]
    longest_blocks = -(-(max(len(p) for p in prompts) + 36) // 4)
    engine = PreemptionEngine(tiny, PreemptionEngineConfig(device="cpu", block_size=4, attn="torch",
                                                            num_blocks=longest_blocks + extra_blocks, preempt="swap"))
    swapped_in: set[str] = set()
    round_trips: list[str] = []
    mark_running, preempt = engine.mark_running, engine.preempt

    def watch_mark_running(request) -> None:
        if request.status is RequestStatus.SWAPPED:
            swapped_in.add(request.request_id)
        mark_running(request)

    def watch_preempt(victim) -> None:
        if victim.request_id in swapped_in:
            round_trips.append(victim.request_id)
        preempt(victim)

    engine.mark_running, engine.preempt = watch_mark_running, watch_preempt
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    while engine.has_unfinished():
        swapped_in.clear()
        engine.step()
    assert engine.swapper.stats.swapped_in_blocks > 0, "the budget should force swapping"
    assert not round_trips, f"swapped in and straight back out in the same step: {round_trips}"
    assert_nothing_left(engine)
