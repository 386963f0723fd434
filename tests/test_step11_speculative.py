"""Step 11's pieces on their own: the n-gram proposer, greedy acceptance, and the rejection sampler, whose
emitted tokens must follow the target's distribution exactly (a chi-square test that a wrong rule fails)."""

from __future__ import annotations

import pytest
import torch

from common.engine import EngineConfig
from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams, SamplingTensors, sample_rows
from step01_serial.engine import SerialEngine
from step11_speculative_decoding import verify
from step11_speculative_decoding.engine import SpeculativeEngine, SpeculativeEngineConfig
from step11_speculative_decoding.bench.oracle import OracleProposer
from step11_speculative_decoding.proposers import NgramProposer
from step11_speculative_decoding.verify import rejection_sample, target_probabilities
from tests.helpers import (PARITY_MAX_TOKENS, CheckedRun, assert_matches_reference, assert_nothing_left,
                           first_difference, run_checked, step01_tokens, tight_pool_case)


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # the 3-token suffix occurred at the start
    ([5, 6, 1, 2, 7, 1, 2], 3, [7, 1, 2]),  # no earlier [7, 1, 2]; [1, 2] did, latest at 2
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, [8, 1]),  # two earlier [1, 2]: the latest one's continuation
    ([4, 4, 4, 4], 5, [4]),  # [4, 4, 4] occurs at 0, and one token follows it there
    ([1, 2, 3], 4, []),  # nothing repeats
    ([7], 4, []),
])
def test_ngram_proposals(tokens: list[int], k: int, expected: list[int]) -> None:
    assert NgramProposer(k).lookup(tokens) == expected


def test_the_index_answers_as_the_scan_does_as_a_request_grows() -> None:
    """The engine's lookups go through the request's n-gram index, fed a few tokens at a time: every answer must
    be the plain scan's, on sequences small enough to repeat themselves."""
    import random

    from step11_speculative_decoding.engine import SpeculativeRequest

    rng = random.Random(0)
    proposer = NgramProposer(4)
    for _ in range(20):
        request = SpeculativeRequest("r", [rng.randrange(5) for _ in range(3)], SamplingParams(), None, frozenset(), 999)
        while len(request.output_token_ids) < 60:
            request.output_token_ids += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
            assert proposer.indexed_lookup(request) == proposer.lookup(request.all_token_ids)


def test_ngram_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="--speculative-tokens must be at least 1"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(2, max_n=1, min_n=2)


@pytest.mark.parametrize("proposals, target, emitted", [
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all kept, plus the token after them
    ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the second differs: the target's token replaces it, and the rest go
    ([5], [4, 3], [4]),
    ([], [4], [4]),
])
def test_greedy_acceptance(proposals: list[int], target: list[int], emitted: list[int]) -> None:
    got = verify.accept_greedy(proposals, target)
    assert got == emitted, (f"proposals {proposals}, target's tokens {target}: the row emits {emitted} (proposals "
                            f"kept while they equal the target's, then the target's token), got {got}")


def test_no_proposal_draws_exactly_what_plain_sampling_draws() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 1, 50)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=s) for s in range(64)]
    rows = SamplingTensors.build(params, list(range(64)), 50, torch.device("cpu"))
    tokens, emitted = rejection_sample(target_probabilities(logits, rows), None, torch.zeros(64, 0, dtype=torch.long),
                                       torch.zeros(64, dtype=torch.long), rows.seeds, rows.positions)
    assert emitted.tolist() == [1] * 64
    assert tokens[:, 0].tolist() == sample_rows(logits[:, 0], rows).tolist()


# A target and a draft over 6 tokens that disagree: the draft over-proposes tokens the target finds unlikely.
P = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
                  [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]], dtype=torch.float64)
Q = torch.tensor([[0.05, 0.05, 0.10, 0.30, 0.30, 0.20],
                  [0.40, 0.30, 0.10, 0.10, 0.05, 0.05]], dtype=torch.float64)
TRIALS = 30_000


def first_two_tokens(draft: torch.Tensor | None, proposals: torch.Tensor) -> torch.Tensor:
    """Each trial's first two tokens: the verification's, completed where it emitted one (a rejection at the
    first proposal) by what the next step would draw, from the target at the second position."""
    target = P[None].expand(TRIALS, -1, -1).float()
    seeds = torch.arange(TRIALS)
    tokens, emitted = rejection_sample(target, draft, proposals, torch.full((TRIALS,), 2), seeds,
                                       torch.zeros(TRIALS, dtype=torch.long))
    next_step = verify.draw(target[:, 1], seeds + 10**6, torch.ones(TRIALS, dtype=torch.long))
    second = torch.where(emitted >= 2, tokens[:, 1], next_step)
    return torch.stack([tokens[:, 0], second], 1)


def chi_square_p_value(pairs: torch.Tensor) -> float:
    """How likely counts this far from P[0] x P[1] would be if the pairs were drawn from it."""
    counts = torch.bincount(pairs[:, 0] * 6 + pairs[:, 1], minlength=36).double()
    expected = (P[0][:, None] * P[1][None, :]).flatten() * TRIALS
    statistic = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor(35 / 2, dtype=torch.float64), statistic / 2).item()


def draft_proposals() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.stack([torch.multinomial(Q[i], TRIALS, replacement=True, generator=generator) for i in range(2)], 1)


def test_rejection_sampling_keeps_the_targets_distribution() -> None:
    draft = Q[None].expand(TRIALS, -1, -1).float()
    assert chi_square_p_value(first_two_tokens(draft, draft_proposals())) > 1e-3


def test_named_proposals_keep_the_targets_distribution() -> None:
    """A proposer that names its tokens (n-gram lookup: one-hot q), here always the same two."""
    proposals = torch.tensor([[3, 0]]).expand(TRIALS, -1)
    assert chi_square_p_value(first_two_tokens(None, proposals)) > 1e-3


def test_a_wrong_rule_fails_the_same_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing from p itself after a rejection (instead of max(0, p - q)) over-weights what the draft proposes:
    the check must see it, or it proves nothing."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    draft = Q[None].expand(TRIALS, -1, -1).float()
    assert chi_square_p_value(first_two_tokens(draft, draft_proposals())) < 1e-6


# ----- the engine: speculation changes how many tokens a step yields, never which -----------------------------


def speculative(loaded: LoadedModel, k: int, **config) -> SpeculativeEngine:
    """Every proposal checked (a token costs nothing): the tokens must not depend on how many are."""
    config = {"speculative_token_cost": 0.0} | config
    return SpeculativeEngine(loaded, SpeculativeEngineConfig(device="cpu", attn="torch", speculative_tokens=k,
                                                             **config))


@pytest.mark.parametrize("tiny", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"], indirect=True)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_is_step01s_with_proposals_kept(tiny: LoadedModel, k: int) -> None:
    """Random tiny models fall into loops, which n-gram lookup predicts: proposals are kept, and the tokens are
    still exactly step 01's, requests arriving while others decode."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(max_tokens=40)
    engine = speculative(tiny, k, block_size=4)
    assert CheckedRun(engine).run(prompts, params) == step01_tokens(tiny, prompts, params)
    assert engine.accepted_tokens > 0, "no proposal was kept: the check proves nothing about keeping them"


def oracle(k: int, prompts: list[list[int]], continuations: list[list[int]], acceptance: float,
           tiny: LoadedModel) -> OracleProposer:
    """Each request's true greedy continuation (known from step 01), each token wrong with chance 1 - acceptance."""
    return OracleProposer(k, {tuple(p): c for p, c in zip(prompts, continuations, strict=True)}, acceptance,
                          tiny.model.config.vocab_size)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_partly_wrong_proposals_are_rolled_back(k: int) -> None:
    """Proposals right or wrong at random: every verification keeps some and rolls back the rest."""
    tiny = load_model("tiny-qwen2")
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(max_tokens=40)
    expected = step01_tokens(tiny, prompts, params)
    engine = speculative(tiny, k, block_size=4)
    engine.proposer = oracle(k, prompts, expected, 0.6, tiny)
    got = CheckedRun(engine).run(prompts, params)
    assert got == expected, f"not step 01's tokens: {first_difference(expected, got)}"
    assert 0 < engine.accepted_tokens < engine.proposed_tokens, (  # some kept, some rolled back
        f"{engine.accepted_tokens} of {engine.proposed_tokens} proposals accepted: some right, some wrong, expected")


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_a_tiny_pool_preempts_and_the_tokens_stay_step01s(preempt: str) -> None:
    tiny = load_model("tiny-llama")
    prompts, params, expected, num_blocks = tight_pool_case(tiny)
    engine = speculative(tiny, 4, block_size=4, num_blocks=num_blocks, preempt=preempt)
    assert run_checked(engine, prompts, params)[0] == expected
    assert engine.preemptions > 0 and engine.accepted_tokens > 0


def test_a_small_budget_and_cached_prefixes() -> None:
    """A budget of 8 leaves little to speculate with; the second wave of the same prompts finds them cached."""
    tiny = load_model("tiny-qwen3")
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=30)
    engine = speculative(tiny, 4, block_size=4, max_num_batched_tokens=8)
    expected = step01_tokens(tiny, prompts, params)
    assert CheckedRun(engine).run(prompts, params) == expected
    assert CheckedRun(engine).run(prompts, params) == expected
    assert engine.hit_tokens > 0 and engine.accepted_tokens > 0


def test_max_tokens_and_a_stop_string_inside_a_kept_run() -> None:
    """The request ends where plain decoding ends it, even when the step kept proposals past that point."""
    tiny = load_model("tiny-llama")
    prompt = tiny.tokenizer.apply_chat_template(PARITY_PROMPTS[0])
    plain = step01_tokens(tiny, [prompt], SamplingParams(max_tokens=40))[0]
    for max_tokens in range(5, 12):
        engine = speculative(tiny, 8, block_size=4)
        assert engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].token_ids == plain[:max_tokens]
    text = tiny.tokenizer.decode(plain)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = SerialEngine(tiny, EngineConfig(device="cpu")).generate([prompt], SamplingParams(max_tokens=40,
                                                                                                stop=[stop]))[0]
    got = speculative(tiny, 8, block_size=4).generate([prompt], SamplingParams(max_tokens=40, stop=[stop]))[0]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, expected.finish_reason)


def test_abort_after_a_verification_frees_everything() -> None:
    tiny = load_model("tiny-llama")
    engine = speculative(tiny, 4, block_size=4)
    rid = engine.add_request(tiny.tokenizer.apply_chat_template(PARITY_PROMPTS[0]), SamplingParams(max_tokens=40))
    request = engine.requests[rid]
    while engine.verify_rows == 0:
        engine.step()
    engine.abort(rid)
    assert_nothing_left(engine, [request])


def test_seeded_sampling_with_speculation_is_reproducible_and_finishes_cleanly() -> None:
    """Rejection sampling in the engine (its distribution is the chi-square tests' matter): a seeded request
    draws the same tokens run after run, alone or checked step by step. A random model samples nearly uniformly
    over 49,152 tokens, so only a low temperature makes it repeat itself enough for n-gram proposals."""
    tiny = load_model("tiny-qwen3")
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=30, temperature=0.1, seed=3)
    first = [c.token_ids for c in speculative(tiny, 4, block_size=4).generate(prompts, params)]
    engine = speculative(tiny, 4, block_size=4)
    assert run_checked(engine, prompts, params)[0] == first
    assert 0 < engine.accepted_tokens < engine.proposed_tokens


@pytest.mark.embedded
@pytest.mark.parametrize("k", [2, 8])
def test_embedded_model_speculates_and_gives_hfs_tokens(embedded: LoadedModel, embedded_hf, embedded_reference,
                                                         k: int) -> None:
    """The real model, prompts in several scripts (multi-byte text), against HF's greedy tokens."""
    reference = embedded_reference[:6]
    engine = speculative(embedded, k)
    outputs = CheckedRun(engine).run([ids for ids, _ in reference], SamplingParams(max_tokens=PARITY_MAX_TOKENS))
    assert_matches_reference(embedded_hf, reference, outputs)
    assert engine.accepted_tokens > 0


def test_the_benchmark_runs_and_finds_the_same_tokens(tmp_path) -> None:  # noqa: ANN001
    import json

    from step11_speculative_decoding.bench import bench_speculative

    out = tmp_path / "speculative.json"
    assert bench_speculative.main(["--model", "tiny-llama", "--ks", "4", "--max-tokens", "16", "--workloads", "chat",
                                   "--output", str(out)]) == 0
    runs = json.loads(out.read_text(encoding="utf-8"))["runs"]
    # Off, k = 4 under the rule, k = 4 with every proposal checked.
    assert [(r["speculative_tokens"], r["token_cost"] == 0) for r in runs] == [(0, False), (4, False), (4, True)]
    assert all(r["identical_to_off"] for r in runs) and runs[2]["accepted"] > 0


# ----- the rule: how many proposals a step checks -------------------------------------------------------------


def rule_engine(cost: float, budget: int = 512, step_cost: float = 0.0) -> SpeculativeEngine:
    return speculative(load_model("tiny-llama"), 8, speculative_token_cost=cost, speculative_step_cost=step_cost,
                       max_num_batched_tokens=budget)


def decoders_with(engine: SpeculativeEngine, acceptances: list[float], unchecked: int = 0) -> list:  # noqa: ANN001
    requests = [engine.requests[engine.add_request([1, 2, 3], SamplingParams())] for _ in acceptances]
    for request, acceptance in zip(requests, acceptances, strict=True):
        request.acceptance, request.steps_unchecked = acceptance, unchecked
    return requests


@pytest.mark.parametrize("acceptances, cost, expected", [
    ([0.5], 0.0, [8]),  # a token costs nothing: every proposal is checked
    ([0.5], 0.1, [2]),  # 0.5 and 0.25 pay at 0.1 a token; 0.125 does not (worked out in the lesson)
    ([0.9], 0.1, [8]),
    ([0.0], 0.005, [0]),  # never kept: never checked
    ([0.2], 0.1, [1]),
    ([0.9, 0.2], 0.1, [8, 0]),  # the likely one first; then the step is larger, and 0.2 no longer pays
    ([0.5] * 64, 0.1, [0] * 64),  # a batch of 64: a token costs more than half a row's worth
])
def test_the_rule_checks_proposals_that_pay(acceptances: list[float], cost: float, expected: list[int]) -> None:
    engine = rule_engine(cost)
    got = engine.proposal_counts(decoders_with(engine, acceptances), [8] * len(acceptances), len(acceptances))
    assert got == expected, (f"acceptances {acceptances[:4]}{'...' if len(acceptances) > 4 else ''}, {cost} a "
                             f"token: expected {expected[:4]} proposals (those that pay), got {got[:4]}")


@pytest.mark.parametrize("acceptance, expected", [(0.9, [4]), (0.5, [0])])
def test_a_step_that_verifies_must_pay_for_leaving_the_decode_path(acceptance: float, expected: list[int]) -> None:
    """A step that verifies costs twice a decode step (step cost 1, token cost 0.01, k = 4). 0.9: 1 + 0.9 + 0.81 +
    0.73 + 0.66 = 4.1 tokens for 2.05; 0.5: 1.94 tokens for 2.05, less than the plain step's 1 for 1.01."""
    engine = rule_engine(0.01, step_cost=1.0)
    got = engine.proposal_counts(decoders_with(engine, [acceptance]), [4], 1)
    assert got == expected, f"acceptance {acceptance}, a verifying step costing 2: expected {expected}, got {got}"


def test_the_rule_stops_at_the_budget_and_probes_the_left_out() -> None:
    engine = rule_engine(0.0, budget=5)
    # Three tokens left: 0.9, 0.9, then 0.81, the most likely proposals first, whoever's they are.
    got = engine.proposal_counts(decoders_with(engine, [0.9, 0.9]), [8, 8], 2)
    assert got == [2, 1], f"a budget of 5 with 2 decoders leaves 3 proposals: expected [2, 1], got {got}"
    probing = rule_engine(0.005)
    left_out = decoders_with(probing, [0.0, 0.0], unchecked=probing.probe_interval(2, 2))
    got = probing.proposal_counts(left_out, [8, 0], 2)
    assert got == [1, 0], f"decoders left out long enough probe one proposal where they may: expected [1, 0], got {got}"


def test_a_request_whose_proposals_fail_stops_speculating_but_still_probes() -> None:
    """An oracle that is always wrong: the acceptance estimate falls, checks become probes, output unchanged."""
    tiny = load_model("tiny-qwen2")
    prompts = [tiny.tokenizer.apply_chat_template(PARITY_PROMPTS[0])]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = step01_tokens(tiny, prompts, params)
    engine = speculative(tiny, 4, block_size=4, speculative_token_cost=0.1)
    engine.proposer = oracle(4, prompts, expected, 0.0, tiny)
    got = CheckedRun(engine).run(prompts, params)
    assert got == expected, f"not step 01's tokens: {first_difference(expected, got)}"
    assert engine.accepted_tokens == 0, f"an always-wrong oracle had {engine.accepted_tokens} proposals accepted"
    # At 0.1 a token, a proposal pays while a > 0.09: 0.5 x 0.8^n falls below after 8 rejections; then a probe
    # every probe_interval + 1 steps (10 + 1 here: a step with one probe costs 1.2 against 1.1, 9% more, and
    # probes take at most 1% of the time).
    interval = engine.probe_interval(1, 1)
    assert interval == 10, f"probe interval {interval}, expected 10"
    assert 8 <= engine.verify_rows <= 8 + 60 // interval, (
        f"{engine.verify_rows} verification rows in 60 steps: expected 8 before it stops, then a probe every "
        f"{interval + 1} steps at most")
