"""step07_preemption: outputs unchanged under budgets far too small, priorities, and nothing left behind."""

from __future__ import annotations

import pytest
import torch

from common.engine import EngineConfig
from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.request import RequestStatus
from common.sampling import SamplingParams
from step01_serial.engine import SerialEngine
from step07_preemption.engine import PreemptionEngine, PreemptionEngineConfig
from tests.helpers import (PARITY_MAX_TOKENS, assert_matches_reference, assert_nothing_left, first_difference,
                           run_checked, step01_tokens)


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
    counts = (engine.unadmissions, engine.preemptions)
    assert counts == (1, 0), f"B, never prefilled, is put back, not preempted: (unadmissions, preemptions) {counts}"
    b_request = engine.requests[second]
    assert b_request.status is RequestStatus.WAITING and not b_request.output_token_ids, (
        f"B should wait again with no output; it is {b_request.status.name} with {b_request.output_token_ids}")
    requests = [engine.requests[first], engine.requests[second]]
    while engine.has_unfinished():
        engine.step()
    got = [r.output_token_ids for r in requests]
    assert got == expected, f"not step 01's tokens: {first_difference(expected, got)}"
    assert_nothing_left(engine, requests)


def test_the_victim_is_the_least_important_and_among_equals_the_newest_admission() -> None:
    """The lesson's question: a, b, c of priorities 0, 2, 2, admitted in that order. The victim is c; a waiting
    request takes only from strictly less important ones; among equals the newest admission goes first, even if
    it arrived first (b admitted again after a preemption), whatever the order of the running list."""
    engine = PreemptionEngine(load_model("tiny-llama"), PreemptionEngineConfig(device="cpu", block_size=4,
                                                                               num_blocks=32, attn="torch"))
    a, b, c = (engine.requests[engine.add_request([10 + i] * 4, SamplingParams(max_tokens=4), priority=p)]
               for i, p in enumerate([0, 2, 2]))
    for request in (a, b, c):
        engine.waiting.remove(request)
        engine.mark_running(request)
    names = {a.request_id: "a", b.request_id: "b", c.request_id: "c"}

    def victim(less_important_than=None) -> str | None:  # noqa: ANN001  (the chosen request's name)
        chosen = engine.pick_victim(less_important_than=less_important_than)
        return None if chosen is None else names.get(chosen.request_id, chosen.request_id)

    def state() -> str:
        return ", ".join(f"{names[r.request_id]} (priority {r.priority}, admitted_at {r.admitted_at})"
                         for r in engine.running)

    assert victim() == "c", f"running {state()}: the victim is c (least important, newest), got {victim()}"
    newcomer = engine.requests[engine.add_request([5] * 4, SamplingParams(max_tokens=4), priority=2)]
    got = victim(less_important_than=newcomer)
    assert got is None, f"running {state()}: a newcomer of priority 2 may take from none (equal priority), got {got}"
    newcomer.priority = 1
    got = victim(less_important_than=newcomer)
    assert got == "c", f"running {state()}: a newcomer of priority 1 takes from c, got {got}"
    engine.running.remove(b)
    engine.mark_running(b)  # admitted again: now the newest admission, though it arrived before c
    engine.running.reverse()  # the list's order says nothing; `admitted_at` does
    got = (victim(), victim(less_important_than=newcomer))
    assert got == ("b", "b"), f"running {state()}: b, admitted again, is the newest: expected (b, b), got {got}"
    newcomer.priority, a.priority = -1, 3  # now a is the least important, b and c more
    got = (victim(), victim(less_important_than=newcomer))
    assert got == ("a", "a"), f"running {state()}: a is now the least important: expected (a, a), got {got}"
    order = [names[r.request_id] for r in engine.running]
    assert order == ["b", "c", "a"], f"choosing a victim changed the running list to {order}"


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preempt_frees_the_blocks_and_keeps_what_was_computed(preempt: str) -> None:
    """`preempt` called by hand. A request admitted but never prefilled is put back (nothing computed, nothing
    kept); a decoding one gives back all its blocks and keeps its tokens, and with swap its K/V of every layer
    in host memory. All three then finish with step 01's tokens (in a bounded number of steps)."""
    tiny = load_model("tiny-llama")
    prompts = [[20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44]]
    params = SamplingParams(max_tokens=8)
    engine = PreemptionEngine(tiny, PreemptionEngineConfig(device="cpu", block_size=4, num_blocks=16, attn="torch",
                                                            preempt=preempt))
    a, b = (engine.requests[engine.add_request(p, params)] for p in prompts[:2])
    engine.step()
    engine.step()  # both prefilled and one token decoded: 8 tokens, 2 blocks each
    c = engine.requests[engine.add_request(prompts[2], params)]
    names = {a.request_id: "a", b.request_id: "b", c.request_id: "c"}

    def queues() -> dict[str, list[str]]:
        return {"running": [names[r.request_id] for r in engine.running],
                "waiting": [names[r.request_id] for r in engine.waiting],
                "swapped": [names[r.request_id] for r in engine.swapped]}

    engine._not_prefilled = set()  # as `schedule` does, around the admissions
    admitted = engine.admit_waiting(None)
    assert admitted == [c] and len(c.block_table) == 2, (
        f"c should be admitted with 2 blocks: admitted {admitted}, c's table {c.block_table}")
    free = engine.allocator.num_free
    engine.preempt(c)  # admitted, never prefilled: un-admitted
    assert queues() == {"running": ["a", "b"], "waiting": ["c"], "swapped": []}, (
        f"c, never prefilled, goes back to waiting: queues are {queues()}")
    assert c.status is RequestStatus.WAITING, f"c is {c.status.name}, expected WAITING"
    assert c.block_table == [] and c.host_kv is None, f"c keeps blocks {c.block_table} or a host copy"
    assert engine.allocator.num_free == free + 2, f"{engine.allocator.num_free - free} of c's 2 blocks freed"
    counts = (engine.unadmissions, engine.preemptions)
    assert counts == (1, 0), f"c was put back, not preempted: (unadmissions, preemptions) {counts}, expected (1, 0)"
    engine._not_prefilled = set()

    table, tokens = list(b.block_table), list(b.output_token_ids)
    k_blocks, v_blocks = engine.cache.k[:, table].clone(), engine.cache.v[:, table].clone()
    engine.preempt(b)
    assert b.block_table == [], f"b keeps blocks {b.block_table} after its preemption"
    freed = engine.allocator.num_free - free - 2
    assert freed == len(table) and not set(table) & engine.allocator.owned, (
        f"b's {len(table)} blocks {table} should all be free again; {freed} were freed")
    counts = (engine.unadmissions, engine.preemptions)
    assert counts == (1, 1), f"(unadmissions, preemptions) {counts}, expected (1, 1)"
    assert b.output_token_ids == tokens, f"b's tokens changed: {first_difference(tokens, b.output_token_ids)}"
    if preempt == "swap":
        assert queues() == {"running": ["a"], "waiting": ["c"], "swapped": ["b"]}, f"queues: {queues()}"
        assert b.status is RequestStatus.SWAPPED, f"b is {b.status.name}, expected SWAPPED"
        assert b.host_kv is not None and b.host_kv.k.device.type == "cpu", "b's K/V was not copied to the host"
        assert torch.equal(b.host_kv.k, k_blocks) and torch.equal(b.host_kv.v, v_blocks), (  # [layers, blocks, ...]
            "b's host copy is not its blocks' K/V, every layer, in its table's order")
    else:
        assert queues() == {"running": ["a"], "waiting": ["c", "b"], "swapped": []}, f"queues: {queues()}"
        assert b.status is RequestStatus.WAITING, f"b is {b.status.name}, expected WAITING"
        assert b.host_kv is None, "recompute keeps no host copy"
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    expected, got = step01_tokens(tiny, prompts, params), [r.output_token_ids for r in (a, b, c)]
    assert got == expected, f"not step 01's tokens: {first_difference(expected, got)}"
    assert_nothing_left(engine, [a, b, c])


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
    assert engine.allocator.num_free < per_request and not any(r.finished for r in low_requests), (
        f"the pool should be too full for the important request: {engine.allocator.num_free} blocks free")
    vip_id = engine.add_request(vip, vip_params, priority=0)
    vip_request = engine.requests[vip_id]
    engine.step()
    assert vip_request.status is RequestStatus.RUNNING and len(vip_request.output_token_ids) == 1, (
        f"the important request should run at once: it is {vip_request.status.name} with "
        f"{len(vip_request.output_token_ids)} tokens after one step")
    finished_order = []
    while engine.has_unfinished():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order[0] == vip_id, f"the important request finished at place {finished_order.index(vip_id)}"
    assert vip_request.output_token_ids == expected_vip, (
        f"the important request: {first_difference(expected_vip, vip_request.output_token_ids)}")
    got_low = [r.output_token_ids for r in low_requests]
    assert got_low == expected_low, f"the preempted requests: {first_difference(expected_low, got_low)}"
    assert engine.preemptions >= 1, "nothing was preempted: the test checked no preemption"
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
