"""The prompt's log-probabilities (`echo` with `logprobs`): HF's forward over the prompt, on every engine path
(step 01, step 10 after its prompt's blocks were cached, the final engine with a small token budget, with
speculation, and batch-invariant alone and batched), and through the server with the official SDK."""

from __future__ import annotations

import pytest
from openai import BadRequestError, OpenAI
from transformers import PreTrainedModel

from common.loading import LoadedModel
from common.prompts import PARITY_PROMPTS
from common.reference import hf_model_for, reference_logits
from common.sampling import SamplingParams, TokenLogprob
from common.steps import STEPS
from tests.test_logprobs import check_records, make_engine, run_with_logprobs
from tests.test_step08_serve import MODEL, Served, client, served  # noqa: F401 (fixtures)

TOP = 3
ENGINES = [
    ("step01_serial", {}),
    ("step10_prefix_caching", {}),
    (STEPS[-1].name, {"max_num_batched_tokens": 16}),
    (STEPS[-1].name, {"speculative_tokens": 4}),
    (STEPS[-1].name, {"overlap": True}),
]


def check_prompt_against_hf(hf: PreTrainedModel, prompt: list[int], records: list[TokenLogprob | None]) -> None:
    """Record i is HF's log_softmax at position i - 1, at prompt token i; its alternatives HF's top-k, in order."""
    assert len(records) == len(prompt) and records[0] is None
    assert all(r is not None and len(r.top) == TOP for r in records[1:])
    check_records(records[1:], prompt[1:], reference_logits(hf, prompt)[:-1].float().log_softmax(dim=-1))


@pytest.mark.parametrize(("step", "config"), ENGINES, ids=[f"{s}-{'-'.join(c) or 'eager'}" for s, c in ENGINES])
def test_prompt_logprobs_match_hf(tiny: LoadedModel, step: str, config: dict) -> None:
    hf = hf_model_for(tiny)
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:3]]
    engine = make_engine(tiny, step, **config)
    # The first prompt once more in front of the batch: step 10 then finds its full blocks in the cache.
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    asking = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    requests = run_with_logprobs(engine, prompts, [asking, plain, asking])
    if step == "step10_prefix_caching":
        assert engine.hit_tokens > 0  # the scored prompt was a cache hit: its logits came from its own forward
    assert requests[1].prompt_logprobs is None
    for request in (requests[0], requests[2]):
        check_prompt_against_hf(hf, request.prompt_token_ids, request.prompt_logprobs)
    alone = make_engine(tiny, step, **config).generate(prompts, plain)
    assert [r.output_token_ids for r in requests] == [c.token_ids for c in alone]  # scoring changes no token


def test_prompt_logprobs_are_the_same_alone_and_batched_under_batch_invariance(tiny: LoadedModel) -> None:
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    asking = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    batched = run_with_logprobs(make_engine(tiny, STEPS[-1].name, batch_invariant=True), prompts, [asking] * 4)
    for prompt, request in zip(prompts, batched, strict=True):
        alone = run_with_logprobs(make_engine(tiny, STEPS[-1].name, batch_invariant=True), [prompt], [asking])[0]
        assert alone.prompt_logprobs == request.prompt_logprobs


@pytest.mark.embedded
def test_prompt_logprobs_of_multibyte_text_on_the_embedded_model(embedded: LoadedModel,
                                                                 embedded_hf: PreTrainedModel) -> None:
    prompt = embedded.tokenizer.encode("Un café à Zürich, 咖啡 und Tee: ☕ bitte.")
    request = run_with_logprobs(make_engine(embedded, STEPS[-1].name), [prompt],
                                [SamplingParams(max_tokens=1, prompt_logprobs=TOP)])[0]
    check_prompt_against_hf(embedded_hf, prompt, request.prompt_logprobs)


def test_prompt_logprobs_are_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


# ----- through the server, with the official SDK ----------------------------------------------------------------


def served_prompt_records(served: tuple[Served, str], prompt: list[int], count: int) -> list[TokenLogprob | None]:
    engine = make_engine(served[0].engine.loaded, "step01_serial")
    return run_with_logprobs(engine, [prompt], [SamplingParams(max_tokens=1, prompt_logprobs=count)])[0].prompt_logprobs


@pytest.mark.parametrize(("max_tokens", "stream"), [(0, False), (1, False), (3, True), (0, True)])
def test_echo_with_logprobs_through_the_sdk(served: tuple[Served, str], client: OpenAI, max_tokens: int,
                                            stream: bool) -> None:
    """As harnesses score text: the prompt comes back first, its first token without a log-probability, then the
    generated tokens (none for max_tokens 0); offsets count from the start of the echoed prompt."""
    prompt = "The sea is calm"
    lenient = client.with_options()
    lenient._strict_response_validation = False  # streamed chunks carry finish_reason null; token_logprobs a null
    reply = lenient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2,
                                      echo=True, stream=stream)
    choices = [c for chunk in reply for c in chunk.choices] if stream else reply.choices
    text = "".join(c.text for c in choices)
    parts = [c.logprobs for c in choices if c.logprobs]
    tokens = [t for p in parts for t in p.tokens]
    token_logprobs = [lp for p in parts for lp in p.token_logprobs]
    offsets = [o for p in parts for o in p.text_offset]
    prompt_ids = served[0].engine.tokenizer.encode(prompt)
    expected = served_prompt_records(served, prompt_ids, 2)
    decode = served[0].engine.tokenizer.decode
    assert text.startswith(prompt) and len(tokens) == len(prompt_ids) + max_tokens
    assert tokens[: len(prompt_ids)] == [decode([t]) for t in prompt_ids]
    assert token_logprobs[0] is None
    assert token_logprobs[1 : len(prompt_ids)] == pytest.approx([r.logprob for r in expected[1:]], abs=1e-4)
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    if max_tokens == 0:
        assert text == prompt and choices[-1].finish_reason == "length"
        if not stream:
            assert reply.usage.completion_tokens == 0
    else:
        assert all(lp is not None for lp in token_logprobs[len(prompt_ids):])


def test_echo_without_logprobs_and_token_prompts(client: OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=3, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "The sea is" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    lenient = client.with_options()
    lenient._strict_response_validation = False  # the SDK types token_logprobs without its leading null
    batch = lenient.completions.create(model=MODEL, prompt=[[504, 3129], [504]], max_tokens=0, echo=True, logprobs=0)
    assert [len(c.logprobs.tokens) for c in batch.choices] == [2, 1]
    assert [c.logprobs.token_logprobs[0] for c in batch.choices] == [None, None]


def test_max_tokens_zero_needs_echo(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"
