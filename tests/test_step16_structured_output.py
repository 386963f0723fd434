"""Step 16: output held to a grammar. Every constrained output parses and validates; greedy tokens equal HF's logits
masked by the same matcher, step by step; a format that cannot be enforced, or an engine that cannot enforce it,
is refused with a message that says so."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import jsonschema
import pytest
import torch
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field
from transformers import PreTrainedModel

from common.config import tiny_config
from common.loading import LoadedModel, embedded_tokenizer, random_model
from common.prompts import PARITY_PROMPTS
from common.reference import hf_model_for, reference_logits
from common.sampling import SamplingParams, StructuredOutput
from common.tokenizer import Tokenizer
from step16_structured_output.bitmask import BLOCK, allowed_tokens, apply_token_bitmask, masked_logits
from step16_structured_output.engine import StructuredOutputEngine, StructuredOutputEngineConfig
from step16_structured_output.grammar import GrammarCompiler, GrammarError
from step16_structured_output.schemas import SCHEMAS
from step08_serve.api_server import create_app
from step08_serve.async_engine import AsyncEngine
from step08_serve.launcher import running_server
from tests.test_sampling_controls import ALWAYS_PROPOSE, make_engine

MODEL = "smollm2-135m-instruct"

def json_schema(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def engine(embedded: LoadedModel) -> StructuredOutputEngine:
    return StructuredOutputEngine(embedded, StructuredOutputEngineConfig(device="cpu", num_blocks=512))


@pytest.mark.embedded
@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_parses_and_validates(engine: StructuredOutputEngine, name: str) -> None:
    schema, tokenizer = SCHEMAS[name], engine.tokenizer
    prompts = [tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    greedy = SamplingParams(max_tokens=96, structured=json_schema(schema))
    sampled = SamplingParams(max_tokens=96, temperature=0.9, seed=11, structured=json_schema(schema))
    for completion in engine.generate(prompts + prompts, [greedy] * len(prompts) + [sampled] * len(prompts)):
        assert completion.finish_reason.value == "stop", completion.text  # the object closed: the grammar ended
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.embedded
def test_choices_and_a_regular_expression(engine: StructuredOutputEngine) -> None:
    prompt = engine.tokenizer.apply_chat_template(PARITY_PROMPTS[0])
    choice = SamplingParams(max_tokens=16, structured=StructuredOutput("choice", json.dumps(["yes", "no", "maybe"])))
    code = SamplingParams(max_tokens=16, structured=StructuredOutput("regex", "[A-Z]{3}-[0-9]{2}"))
    chosen, matched = engine.generate([prompt, prompt], [choice, code])
    assert chosen.text in ("yes", "no", "maybe") and chosen.finish_reason.value == "stop"
    assert len(matched.text) == 6 and matched.text[3] == "-" and matched.finish_reason.value == "stop"


def reference_constrained(hf: PreTrainedModel, compiler: GrammarCompiler, prompt: list[int],
                          structured: StructuredOutput, max_tokens: int) -> list[int]:
    """HF's logits at each position, masked by a fresh matcher of the same grammar, then the argmax."""
    matcher, output = compiler.matcher(structured), []
    for _ in range(max_tokens):
        logits = reference_logits(hf, prompt + output)[-1:]
        masked = apply_token_bitmask(logits, compiler.bitmask([matcher]), torch.tensor([0]))
        output.append(int(masked.argmax()))
        matcher.advance(output[-1])
        if matcher.complete:
            break
    return output


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 16}, {"speculative_tokens": 4, **ALWAYS_PROPOSE}],
                         ids=["eager", "budget", "speculative"])
def test_greedy_equals_hf_masked_by_the_same_matcher(tiny: LoadedModel, config: dict) -> None:
    engine = make_engine(tiny, "step16_structured_output", **config)
    hf = hf_model_for(tiny)
    structured = json_schema(SCHEMAS["required"])
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:3]]
    constrained = SamplingParams(max_tokens=40, structured=structured)
    plain = SamplingParams(max_tokens=40, ignore_eos=True)
    got = engine.generate(prompts + prompts, [constrained] * 3 + [plain] * 3)  # free text beside, the same prompts
    for prompt, completion in zip(prompts, got[:3], strict=True):
        assert completion.token_ids == reference_constrained(hf, engine.grammars, prompt, structured, 40)


def test_speculation_under_a_grammar_checks_only_allowed_proposals(tiny: LoadedModel) -> None:
    """Constrained requests alone, proposing at every step: proposals the grammar forbids are cut, the rest are
    checked against masked logits, and the tokens are those of one-a-step decoding under the grammar."""
    engine = make_engine(tiny, "step16_structured_output", speculative_tokens=4, **ALWAYS_PROPOSE)
    hf = hf_model_for(tiny)
    structured = StructuredOutput("regex", "(ab|cd|ef){1,12}!")  # repeating text: the n-gram proposer finds some
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:3]]
    got = engine.generate(prompts, SamplingParams(max_tokens=30, structured=structured))
    assert engine.accepted_tokens > 0  # proposals were checked for constrained requests, and some kept
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion.token_ids == reference_constrained(hf, engine.grammars, prompt, structured, 30)


def test_launched_ahead_with_a_grammar_the_tokens_are_the_same(tiny: LoadedModel) -> None:
    """Step 14's launch-ahead with constrained requests in the batch (greedy and seeded sampling), free text beside
    them (with a penalty and log-probabilities), arriving while others decode: each step's forward is launched
    before the host has the tokens of the one before, its tokens drawn once the masks are filled, and every output
    (tokens, log-probabilities) is what the same engine gives one step at a time."""
    structured = json_schema(SCHEMAS["required"])
    params = [SamplingParams(max_tokens=30, structured=structured),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, structured=structured),
              SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=0.7, logprobs=2),
              SamplingParams(max_tokens=30, structured=StructuredOutput("regex", "[a-z]{4,30}"), logprobs=1)]
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    engines = {overlap: make_engine(tiny, "step16_structured_output", overlap=overlap, block_size=4, num_blocks=256)
               for overlap in (False, True)}
    filled_in = []  # the thread each batch of masks was filled in
    fill = engines[True].grammars.bitmask
    engines[True].grammars.bitmask = lambda matchers: filled_in.append(threading.current_thread().name) or fill(matchers)
    runs = {overlap: run_arriving(engine, prompts, params) for overlap, engine in engines.items()}
    assert runs[True].engine.steps_launched_ahead > 0 and runs[True].engine.steps_taken_from_ahead > 0
    # Most masks were filled while the host turned the step before's tokens into text (`fill_ahead`).
    assert sum(name.startswith("grammar-masks") for name in filled_in) > len(filled_in) / 2
    assert runs[True].tokens == runs[False].tokens
    assert runs[True].alternatives == runs[False].alternatives
    # The values to float32's rounding: a batch launched ahead may hold a finished request's row more, and a
    # matrix product over other rows sums in another order.
    assert runs[True].logprobs == pytest.approx(runs[False].logprobs, rel=1e-5)


@dataclass
class ArrivingRun:
    engine: StructuredOutputEngine
    tokens: list[list[int]] = field(default_factory=list)  # per request
    logprobs: list[float] = field(default_factory=list)  # of every token of the requests that ask, in order
    alternatives: list[list[int]] = field(default_factory=list)  # their top token ids


def run_arriving(engine: StructuredOutputEngine, prompts: list[list[int]], params: list[SamplingParams]
                 ) -> ArrivingRun:
    """One request arrives every third step; each one's tokens and log-probabilities as the steps hand them out."""
    run, ids = ArrivingRun(engine), []
    steps = 0
    while steps < 3 * len(prompts) or engine.has_unfinished():
        if steps % 3 == 0 and steps // 3 < len(prompts):
            ids.append(engine.add_request(prompts[steps // 3], params[steps // 3]))
            run.tokens.append([])
        for out in engine.step():
            run.tokens[ids.index(out.request_id)] += out.new_token_ids
            run.logprobs += [record.logprob for record in out.logprobs]
            run.alternatives += [[token for token, _ in record.top] for record in out.logprobs]
        steps += 1
    return run


def test_a_random_model_whose_config_names_an_end_its_tokenizer_lacks() -> None:
    """random:qwen2.5-7b borrows the embedded tokenizer (49,152 tokens) while its config ends at 151,645, and a folder
    written of it gives its tokenizer that end too (as `Tokenizer.from_dir` does): the grammar ends at the
    end-of-sequence the tokenizer names, and its masks span the model's wider vocabulary."""
    config = replace(tiny_config("qwen2"), vocab_size=49_280, eos_token_ids=(49_200,))
    tokenizer = Tokenizer(embedded_tokenizer().hf, config.eos_token_ids)
    loaded = LoadedModel("wide", random_model(config, torch.device("cpu"), torch.float32), tokenizer, None)
    engine = StructuredOutputEngine(loaded, StructuredOutputEngineConfig(device="cpu", num_blocks=64))
    prompt = loaded.tokenizer.apply_chat_template(PARITY_PROMPTS[0])
    (completion,) = engine.generate([prompt], SamplingParams(max_tokens=8, structured=StructuredOutput(
        "choice", json.dumps(["yes", "no"]))))
    assert completion.text in ("yes", "no") and completion.finish_reason.value == "stop"
    assert engine.grammars.bitmask([engine.grammars.matcher(StructuredOutput("json_object"))]).shape == (1, 49_280 // 32)


def test_each_request_reads_its_own_copy_of_the_compiled_format() -> None:
    """A format is compiled once, into a matcher that is never handed out; each request gets a copy, so one that has
    read a token leaves the next request's copy, and the kept one, at the start."""
    tokenizer = embedded_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer.hf))
    answer = StructuredOutput("choice", json.dumps(["yes", "no"]))
    first = compiler.matcher(answer)
    at_start = compiler.bitmask([first])
    first.advance(int(allowed_tokens(at_start, compiler.vocab_size)[0].nonzero()[0]))
    assert not torch.equal(compiler.bitmask([first]), at_start)
    second = compiler.matcher(answer)
    assert torch.equal(compiler.bitmask([second]), at_start)
    assert second.matcher is not compiler.unread(answer) and compiler.unread.cache_info().currsize >= 1


def test_the_mask_unpacks_bit_j_of_word_w_to_token_32w_plus_j() -> None:
    bitmask = torch.tensor([[0b1011, -2**31], [0, 1]], dtype=torch.int32)  # -2**31: bit 31 alone
    allowed = allowed_tokens(bitmask, 64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 1, 3, 63]
    assert allowed[1].nonzero().flatten().tolist() == [32]
    assert allowed_tokens(bitmask, 40)[0].nonzero().flatten().tolist() == [0, 1, 3]  # rows past the vocabulary cut
    masked = apply_token_bitmask(torch.zeros(3, 64), bitmask, torch.tensor([0, 2]))
    assert masked[1].eq(0).all()  # a row without a grammar is untouched
    assert masked[0].isfinite().nonzero().flatten().tolist() == [0, 1, 3, 63]
    assert masked[2].isfinite().nonzero().flatten().tolist() == [32]


def test_the_kernel_masks_as_the_pytorch_ops_do() -> None:
    """The GPU's one-pass kernel (here in Triton's interpreter) against the PyTorch ops, on a view of a larger
    buffer (as a graph's logits are), over a vocabulary that ends inside a word and inside a program's block."""
    generator = torch.Generator().manual_seed(0)
    vocab = BLOCK + 1000 + 7
    buffer = torch.randn(6, vocab, generator=generator)
    logits = buffer[:5]
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), generator=generator, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    expected = apply_token_bitmask(logits, bitmask, rows)  # on the CPU: the PyTorch ops
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = masked_logits(logits.to(device), bitmask.to(device), rows.to(device)).cpu()
    assert torch.equal(got, expected)
    assert torch.equal(expected[[1, 3]], logits[[1, 3]])  # rows without a grammar as they were
    assert expected[4].isinf().sum() == (~allowed_tokens(bitmask[:1], vocab)).sum()  # row 4 took the mask's row 0


@pytest.mark.embedded
def test_a_format_that_cannot_be_enforced_is_refused_by_name(engine: StructuredOutputEngine) -> None:
    with pytest.raises(GrammarError, match="Unknown format: nonsense"):
        engine.add_request("hi", SamplingParams(structured=json_schema(
            {"type": "object", "properties": {"a": {"type": "string", "format": "nonsense"}}})))
    with pytest.raises(GrammarError, match="unclosed group"):
        engine.add_request("hi", SamplingParams(structured=StructuredOutput("regex", "a(b")))
    with pytest.raises(ValueError, match="structured output kind"):
        StructuredOutput("xml")
    assert not engine.requests  # nothing was queued


def test_an_engine_before_step16_refuses_a_format(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, "step15_batch_invariant")
    with pytest.raises(ValueError, match="--step step16_structured_output"):
        engine.add_request("hi", SamplingParams(structured=StructuredOutput("json_object")))


# ----- through the server, with the official SDK ------------------------------------------------------------------


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=130)


@pytest.fixture(scope="module")
def client(embedded: LoadedModel) -> Iterator[OpenAI]:
    """A server of its own engine: the server's step thread owns it (the tests above step theirs directly)."""
    served = StructuredOutputEngine(embedded, StructuredOutputEngineConfig(device="cpu", num_blocks=512))
    with running_server(create_app(AsyncEngine(served), MODEL, MODEL)) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def ask(client: OpenAI, **kwargs) -> str:  # noqa: ANN003
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                           max_tokens=96, temperature=0, **kwargs)
    if not kwargs.get("stream"):
        return reply.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)


@pytest.mark.embedded
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_through_the_sdk(client: OpenAI, stream: bool) -> None:
    assert isinstance(json.loads(ask(client, stream=stream, response_format={"type": "json_object"})), dict)
    schema = SCHEMAS["required"]
    text = ask(client, stream=stream, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.embedded
def test_the_sdk_parses_into_a_pydantic_model(client: OpenAI) -> None:
    reply = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                          max_tokens=96, temperature=0, response_format=Person)
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 130


@pytest.mark.embedded
def test_structured_outputs_extension_and_refusals(client: OpenAI) -> None:
    assert ask(client, extra_body={"structured_outputs": {"choice": ["red", "green"]}}) in ("red", "green")
    code = ask(client, extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(code) == 6 and code[:3].isupper() and code[4:].isdigit()
    with pytest.raises(BadRequestError, match="Unknown format: nonsense"):
        ask(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "format": "nonsense"}}}}})
    with pytest.raises(BadRequestError, match="exactly one of"):
        ask(client, extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
