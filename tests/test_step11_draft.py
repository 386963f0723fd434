"""Step 11's draft-model proposer in the engine: whatever a draft proposes, the greedy tokens are step 01's; the
target drafting for itself has every proposal kept; the draft's own KV cache follows each request through
verifications, preemption and abort (checked against a fresh draft before every reuse), and every draft block
goes back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.engine import EngineConfig
from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams
from step01_serial.engine import SerialEngine
from step11_speculative_decoding.draft import DraftProposer
from step11_speculative_decoding.engine import SpeculativeEngine, SpeculativeEngineConfig, SpeculativeRequest
from step11_speculative_decoding.proposers import Proposal
from tests.helpers import (PARITY_MAX_TOKENS, CheckedRun, assert_matches_reference, assert_nothing_left, run_checked,
                           step01_tokens, tight_pool_case, tiny_with_small_vocab)


def drafting(loaded: LoadedModel, k: int, draft: str | None, **config) -> SpeculativeEngine:
    """Every proposal checked (a token costs nothing), proposed by the model `draft`; 4-token blocks, and a pool
    of 512 of them (the CPU default, 1 GiB, would be zeroed twice: once for the target, once for the draft)."""
    config = {"speculative_token_cost": 0.0, "block_size": 4, "num_blocks": 512} | config
    return SpeculativeEngine(loaded, SpeculativeEngineConfig(device="cpu", attn="torch", speculative_tokens=k,
                                                             speculative_method="draft", draft_model=draft, **config))


def chat(loaded: LoadedModel, n: int) -> list[list[int]]:
    return [loaded.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:n]]


def draft_of(engine: SpeculativeEngine) -> DraftProposer:
    assert isinstance(engine.proposer, DraftProposer)
    return engine.proposer


def assert_draft_pool_empty(engine: SpeculativeEngine) -> None:
    assert draft_of(engine).allocator.num_used == 0, "a draft block was not given back"


def kv_of(proposer: DraftProposer, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V, every layer, of positions 0 .. n - 1 of a draft table."""
    slots = torch.tensor([proposer.cache.slot(table, p) for p in range(n)])
    return proposer.cache.k.flatten(1, 2)[:, slots], proposer.cache.v.flatten(1, 2)[:, slots]


def check_every_catch_up(engine: SpeculativeEngine) -> list[int]:
    """From now on, before each catch-up forward (the moment the draft reuses what it kept), compare the K/V it
    keeps for each request, its first `draft_computed` tokens, with what a fresh draft computes from those tokens
    alone; and after each rollback, that it holds no block past them. Returns the list of how many positions each
    comparison covered (it grows as the engine runs)."""
    proposer = draft_of(engine)
    fresh = DraftProposer.create(engine, engine.config)
    compared: list[int] = []
    catch_up, rollback = proposer.catch_up, proposer.rollback

    def checking_catch_up(requests: list[SpeculativeRequest]) -> torch.Tensor:
        for request in requests:
            n = request.draft_computed
            if n:
                probe = dataclasses.replace(request, prompt_token_ids=request.all_token_ids[:n], output_token_ids=[],
                                            draft_table=[], draft_computed=0)
                fresh.reserve_blocks(probe, 1)
                fresh.catch_up([probe])
                kept, computed = kv_of(proposer, request.draft_table, n), kv_of(fresh, probe.draft_table, n)
                torch.testing.assert_close(kept, computed, atol=1e-4, rtol=1e-4,
                                           msg="the draft reuses K/V of tokens the request does not have")
                fresh.release(probe)
                compared.append(n)
        return catch_up(requests)

    def checking_rollback(request: SpeculativeRequest) -> None:
        rollback(request)
        assert len(request.draft_table) == proposer.cache.blocks_for(request.draft_computed), "a draft block kept"

    proposer.catch_up, proposer.rollback = checking_catch_up, checking_rollback
    return compared


def record_proposals(engine: SpeculativeEngine) -> list[Proposal]:
    """From now on, every proposal the draft makes, in a list."""
    proposer, made = draft_of(engine), []
    propose = proposer.propose

    def recording(requests: list[SpeculativeRequest], counts: list[int]) -> list[Proposal]:
        made.extend(proposals := propose(requests, counts))
        return proposals

    proposer.propose = recording
    return made


# ----- greedy: the draft changes how many tokens a step yields, never which -----------------------------------


@pytest.mark.parametrize("model, k", [("tiny-llama", 1), ("tiny-qwen2", 2), ("tiny-qwen3", 4), ("tiny-llama", 8)])
def test_the_target_drafting_for_itself_has_every_proposal_kept(model: str, k: int) -> None:
    """Same name, same seed: the same weights, so the draft's argmax is the target's at every position, and
    every proposal is kept; the tokens are step 01's, requests arriving while others decode."""
    tiny = load_model(model)
    prompts, params = chat(tiny, 6), SamplingParams(max_tokens=40)
    engine = drafting(tiny, k, model)
    assert CheckedRun(engine).run(prompts, params) == step01_tokens(tiny, prompts, params)
    assert engine.proposed_tokens > 0 and engine.accepted_tokens == engine.proposed_tokens
    assert_draft_pool_empty(engine)


@pytest.mark.parametrize("model, draft, k", [("tiny-llama", "tiny-qwen2", 1), ("tiny-qwen2", "tiny-qwen3", 2),
                                             ("tiny-qwen3", "tiny-llama", 4), ("tiny-llama", "tiny-qwen2", 8)])
def test_another_model_drafting_changes_no_token(model: str, draft: str, k: int) -> None:
    """Another random model guesses mostly wrong: proposals are rejected and the draft rolls back, its kept K/V
    still the request's at every reuse, and the tokens are step 01's."""
    tiny = load_model(model)
    prompts, params = chat(tiny, 6), SamplingParams(max_tokens=40)
    engine = drafting(tiny, k, draft)
    compared = check_every_catch_up(engine)
    assert CheckedRun(engine).run(prompts, params) == step01_tokens(tiny, prompts, params)
    assert engine.accepted_tokens < engine.proposed_tokens, "nothing rejected: no rollback was tested"
    assert sum(compared) > 0
    assert_draft_pool_empty(engine)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("draft", ["tiny-llama", "tiny-qwen2"])
def test_a_tiny_pool_preempts_and_the_tokens_stay_step01s(preempt: str, draft: str) -> None:
    """Preemption releases the draft's blocks and the draft catches up again later; where the target's pool
    cannot hold a proposal at all the engine drops it unchecked, and the draft forgets its K/V as well."""
    tiny = load_model("tiny-llama")
    prompts, params, expected, num_blocks = tight_pool_case(tiny)
    engine = drafting(tiny, 4, draft, num_blocks=num_blocks, preempt=preempt)
    compared = check_every_catch_up(engine)
    assert run_checked(engine, prompts, params)[0] == expected
    assert engine.preemptions > 0 and engine.proposed_tokens > 0 and sum(compared) > 0
    if draft == "tiny-llama":  # the target itself
        assert engine.accepted_tokens == engine.proposed_tokens
    assert_draft_pool_empty(engine)


def test_a_small_budget_and_cached_prefixes() -> None:
    """A budget of 8 leaves little to speculate with; the second wave of the same prompts finds them cached in
    the target's pool, and the draft (which caches no prefix) catches up on them 8 tokens a step at most."""
    tiny = load_model("tiny-qwen3")
    prompts, params = chat(tiny, 4), SamplingParams(max_tokens=30)
    engine = drafting(tiny, 4, "tiny-qwen3", max_num_batched_tokens=8)
    expected = step01_tokens(tiny, prompts, params)
    forward, widest = engine.proposer.forward, []

    def recording_forward(requests, token_ids, q_lens, seq_lens):  # noqa: ANN001, ANN202
        widest.append(sum(q_lens))
        return forward(requests, token_ids, q_lens, seq_lens)

    engine.proposer.forward = recording_forward
    assert CheckedRun(engine).run(prompts, params) == expected
    assert CheckedRun(engine).run(prompts, params) == expected
    assert max(widest) <= 8 < min(len(p) for p in prompts), "a catch-up computed more than the token budget"
    assert engine.hit_tokens > 0 and engine.proposed_tokens > 0 and engine.accepted_tokens == engine.proposed_tokens
    assert_draft_pool_empty(engine)


def test_max_tokens_and_a_stop_string_inside_a_kept_run() -> None:
    """The request ends where plain decoding ends it, even when the step kept proposals past that point."""
    tiny = load_model("tiny-llama")
    prompt = chat(tiny, 1)[0]
    plain = step01_tokens(tiny, [prompt], SamplingParams(max_tokens=40))[0]
    for max_tokens in range(5, 12):
        engine = drafting(tiny, 8, "tiny-llama")
        assert engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].token_ids == plain[:max_tokens]
        assert engine.accepted_tokens > 0
        assert_draft_pool_empty(engine)
    text = tiny.tokenizer.decode(plain)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = SerialEngine(tiny, EngineConfig(device="cpu")).generate([prompt], SamplingParams(max_tokens=40,
                                                                                                stop=[stop]))[0]
    engine = drafting(tiny, 8, "tiny-llama")
    got = engine.generate([prompt], SamplingParams(max_tokens=40, stop=[stop]))[0]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, expected.finish_reason)
    assert engine.accepted_tokens > 0
    assert_draft_pool_empty(engine)


def test_abort_after_a_verification_gives_back_every_block_of_both_pools() -> None:
    tiny = load_model("tiny-llama")
    engine = drafting(tiny, 4, "tiny-qwen3")
    prompts = chat(tiny, 2)
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=40))
    request = engine.requests[rid]
    while engine.verify_rows == 0:
        engine.step()
    assert request.draft_table and request.draft_computed > 0 and request.output_token_ids
    engine.abort(rid)
    assert_nothing_left(engine, [request])
    assert (request.draft_table, request.draft_computed) == ([], 0)
    assert_draft_pool_empty(engine)
    # The engine goes on, and a request run to its end gives its blocks back too.
    params = SamplingParams(max_tokens=20)
    assert engine.generate([prompts[1]], params)[0].token_ids == step01_tokens(tiny, [prompts[1]], params)[0]
    assert_nothing_left(engine)
    assert_draft_pool_empty(engine)


# ----- sampling: the draft's own distribution, drawn with its own noise ----------------------------------------


@pytest.mark.parametrize("draft", ["tiny-qwen3", "tiny-llama"])
def test_seeded_sampling_with_a_draft_is_reproducible_and_finishes_cleanly(draft: str) -> None:
    """A seeded request draws the same tokens run after run: the draft's draws, too, are a pure function of the
    seed and the position. Each proposal carries the distribution it was drawn from, for rejection sampling."""
    tiny = load_model("tiny-qwen3")
    prompts = chat(tiny, 4)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3)
    first = [c.token_ids for c in drafting(tiny, 4, draft).generate(prompts, params)]
    engine = drafting(tiny, 4, draft)
    proposals = record_proposals(engine)
    assert run_checked(engine, prompts, params)[0] == first
    assert all(len(tokens) == 30 for tokens in first)
    assert proposals and engine.proposed_tokens > 0
    vocab = tiny.model.config.vocab_size
    for proposal in proposals:
        probs = proposal.probs
        assert probs is not None and probs.shape == (len(proposal.tokens), vocab)
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(proposal.tokens)))
        assert (probs[range(len(proposal.tokens)), proposal.tokens] > 0).all(), "a token its distribution excludes"
    if draft == "tiny-qwen3":  # the target itself: q = p, and a proposal drawn from p is kept
        assert engine.accepted_tokens >= 0.9 * engine.proposed_tokens
    assert_draft_pool_empty(engine)


# ----- the real model, and what is refused ---------------------------------------------------------------------


@pytest.mark.embedded
def test_the_embedded_model_drafting_for_itself_gives_hfs_tokens(embedded: LoadedModel, embedded_hf,
                                                                  embedded_reference) -> None:
    """The real model, prompts in several scripts (multi-byte text), against HF's greedy tokens."""
    reference = embedded_reference[:6]
    engine = drafting(embedded, 4, "smollm2-135m-instruct", block_size=16, num_blocks=256)
    outputs = CheckedRun(engine).run([ids for ids, _ in reference], SamplingParams(max_tokens=PARITY_MAX_TOKENS))
    assert_matches_reference(embedded_hf, reference, outputs)
    assert engine.proposed_tokens > 0 and engine.accepted_tokens >= 0.9 * engine.proposed_tokens
    assert_draft_pool_empty(engine)


def test_a_draft_must_be_named_and_share_the_targets_vocabulary() -> None:
    tiny = load_model("tiny-llama")
    with pytest.raises(ValueError, match="--speculative-method draft needs --draft-model") as missing:
        drafting(tiny, 4, None)
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens and the target 1000") as mismatched:
        drafting(tiny_with_small_vocab("tiny-llama"), 4, "tiny-llama")
    assert all("\n" not in str(refused.value) for refused in (missing, mismatched))  # one line each
    # Named, with the target's vocabulary, a draft runs.
    prompt, params = chat(tiny, 1), SamplingParams(max_tokens=12)
    engine = drafting(tiny, 4, "tiny-qwen3")
    assert [c.token_ids for c in engine.generate(prompt, params)] == step01_tokens(tiny, prompt, params)
    assert engine.proposed_tokens > 0
