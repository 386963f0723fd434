"""Log-probabilities of generated tokens: the engine's against HF's log_softmax on every engine path that picks
tokens (step 01, step 10, the final engine eagerly, with a small token budget, and with speculation on), and
through the server with the official SDK."""

from __future__ import annotations

import pytest
import torch
from openai import BadRequestError, OpenAI
from transformers import PreTrainedModel

from common.engine import Engine
from common.loading import LoadedModel
from common.prompts import PARITY_PROMPTS
from common.reference import hf_model_for, reference_logits
from common.request import Request
from common.sampling import Sampler, SamplingParams, TokenLogprob, largest
from common.steps import STEPS, engine_class
from tests.test_step08_serve import MODEL, Served, client, served  # noqa: F401 (fixtures)

TOP = 5
ENGINES = [
    ("step01_serial", {}),
    ("step10_prefix_caching", {}),
    (STEPS[-1].name, {}),
    (STEPS[-1].name, {"max_num_batched_tokens": 16}),
    (STEPS[-1].name, {"speculative_tokens": 4}),
    (STEPS[-1].name, {"overlap": True}),
]


def make_engine(loaded: LoadedModel, step: str, **config: object) -> Engine:
    cls = engine_class(step)
    return cls(loaded, cls.config_class(device="cpu", **config))


def run_with_logprobs(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Request]:
    """The finished requests themselves: each one's log-probability records live on it."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    requests = [engine.requests[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
    return requests


def check_records(records: list[TokenLogprob], tokens: list[int], rows: torch.Tensor) -> None:
    """Record i is token i's, with the log-probability of row i (a log_softmax) and the row's top-k, in order."""
    assert [r.token_id for r in records] == tokens
    for record, row in zip(records, rows, strict=True):
        assert abs(record.logprob - row[record.token_id].item()) < 1e-4
        values, ids = row.topk(len(record.top))
        assert [i for i, _ in record.top] == ids.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in record.top]), values, atol=1e-4)


def check_against_hf(hf: PreTrainedModel, prompt: list[int], tokens: list[int], records: list[TokenLogprob]) -> None:
    """Each token's logprob is HF's log_softmax at its position; the alternatives are HF's top-k, in order."""
    assert all(len(r.top) == TOP for r in records)
    check_records(records, tokens, reference_logits(hf, prompt + tokens)[len(prompt) - 1 : -1].log_softmax(dim=-1))


@pytest.mark.parametrize(("step", "config"), ENGINES, ids=[f"{s}-{'-'.join(c) or 'eager'}" for s, c in ENGINES])
def test_greedy_logprobs_match_hf(tiny: LoadedModel, step: str, config: dict) -> None:
    hf = hf_model_for(tiny)
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:3]]
    plain = SamplingParams(max_tokens=10, ignore_eos=True)
    asking = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=TOP)
    alone = make_engine(tiny, step, **config).generate(prompts, plain)
    engine = make_engine(tiny, step, **config)
    # The middle request asks, beside two that do not: their tokens stay those they get alone.
    requests = run_with_logprobs(engine, prompts, [plain, asking, plain])
    if config.get("overlap"):
        assert engine.steps_taken_from_ahead > 0  # the asking request's steps were launched ahead too
    assert [r.output_token_ids for r in requests] == [c.token_ids for c in alone]
    assert requests[0].output_logprobs == [] and requests[2].output_logprobs == []
    check_against_hf(hf, prompts[1], requests[1].output_token_ids, requests[1].output_logprobs)


def test_a_request_asking_for_logprobs_gets_no_proposals(tiny: LoadedModel) -> None:
    """A repetitive prompt, for which the n-gram proposer finds proposals: asking for logprobs leaves the
    request to the sampler, one token a step, and its logprobs are still HF's."""
    prompt = tiny.tokenizer.encode("one two three four " * 8)
    proposing = make_engine(tiny, STEPS[-1].name, speculative_tokens=4)
    proposing.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert proposing.proposed_tokens > 0
    engine = make_engine(tiny, STEPS[-1].name, speculative_tokens=4)
    requests = run_with_logprobs(engine, [prompt], [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=TOP)])
    assert engine.proposed_tokens == 0
    check_against_hf(hf_model_for(tiny), prompt, requests[0].output_token_ids, requests[0].output_logprobs)


@pytest.mark.embedded
def test_greedy_logprobs_match_hf_on_the_embedded_model(embedded: LoadedModel, embedded_hf: PreTrainedModel) -> None:
    prompt = embedded.tokenizer.apply_chat_template(PARITY_PROMPTS[0])
    requests = run_with_logprobs(make_engine(embedded, STEPS[-1].name), [prompt],
                                 [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=TOP)])
    check_against_hf(embedded_hf, prompt, requests[0].output_token_ids, requests[0].output_logprobs)


@pytest.mark.parametrize("width", [49152, 1000, 384])  # cut into 128-wide chunks; not evenly; too few chunks for k
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_largest_is_topk(width: int, k: int) -> None:
    values = torch.randn(6, width, generator=torch.Generator().manual_seed(width + k))
    values[0, :256] = 50 + torch.arange(256.0)  # the whole top in two neighbouring chunks
    top_values, top_ids = largest(values, k)
    expected_values, expected_ids = values.topk(k, dim=-1)
    assert torch.equal(top_values, expected_values) and torch.equal(top_ids, expected_ids)


def test_sampled_logprobs_are_of_the_tempered_distribution() -> None:
    """With temperature t, the logprob is log_softmax(logits / t) at the chosen token; the chosen token is
    the one `__call__` gives."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7, seed=1, logprobs=3), SamplingParams(), SamplingParams(logprobs=0)]
    ids, records = Sampler().sample(logits, params, [0, 0, 0])
    assert ids.tolist() == Sampler()(logits, params, [0, 0, 0]).tolist()
    assert records[1] is None and records[2].top == []
    expected = (logits[0] / 0.7).log_softmax(-1)
    assert records[0].logprob == pytest.approx(expected[ids[0]].item(), abs=1e-6)
    assert [i for i, _ in records[0].top] == expected.topk(3).indices.tolist()
    assert records[2].logprob == pytest.approx(logits[2].log_softmax(-1)[ids[2]].item(), abs=1e-6)


@pytest.mark.parametrize("bad", [-1, 21, 1.5])
def test_logprobs_are_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)  # type: ignore[arg-type]


# ----- through the server, with the official SDK ----------------------------------------------------------------


def engine_records(served: tuple[Served, str], prompt: list[int], count: int) -> list[TokenLogprob]:
    """The records a separate engine on the served weights gives the same greedy request."""
    engine = make_engine(served[0].engine.loaded, "step01_serial")
    return run_with_logprobs(engine, [prompt], [SamplingParams(max_tokens=8, logprobs=count)])[0].output_logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_through_the_sdk(served: tuple[Served, str], client: OpenAI, stream: bool) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3, stream=stream)
    if stream:
        content = [t for chunk in reply for c in chunk.choices if c.logprobs for t in c.logprobs.content or []]
    else:
        content = reply.choices[0].logprobs.content
    expected = engine_records(served, served[0].engine.tokenizer.apply_chat_template(messages), 3)
    decode = served[0].engine.tokenizer.decode
    assert [t.token for t in content] == [decode([r.token_id]) for r in expected]
    token_bytes = served[0].engine.tokenizer.token_bytes
    for got, want in zip(content, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.bytes == list(token_bytes(want.token_id)), f"token {want.token_id}: bytes {got.bytes}"
        assert [t.token for t in got.top_logprobs] == [decode([i]) for i, _ in want.top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_through_the_sdk(served: tuple[Served, str], client: OpenAI, stream: bool) -> None:
    prompt = "The sea is"
    # Streamed completion chunks carry finish_reason null, which the SDK types as never null: read leniently
    # (see test_step08_serve's test of the endpoint).
    lenient = client.with_options()
    lenient._strict_response_validation = not stream
    reply = lenient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                      stream=stream)
    if stream:
        parts = [c.logprobs for chunk in reply for c in chunk.choices if c.logprobs]
    else:
        parts = [reply.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    token_logprobs = [lp for p in parts for lp in p.token_logprobs]
    top = [d for p in parts for d in p.top_logprobs]
    offsets = [o for p in parts for o in p.text_offset]
    expected = engine_records(served, served[0].engine.tokenizer.encode(prompt), 2)
    decode = served[0].engine.tokenizer.decode
    assert tokens == [decode([r.token_id]) for r in expected]
    assert token_logprobs == pytest.approx([r.logprob for r in expected], abs=1e-4)
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    for alternatives, token, record in zip(top, tokens, expected, strict=True):
        assert token in alternatives and len(alternatives) <= 3
        assert list(alternatives)[:2] == [decode([i]) for i, _ in record.top]
