"""step08_serve through the official openai SDK and raw HTTP: responses validated strictly, bad input,
concurrency, and a cancellation storm that must leave nothing behind."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import APIStatusError, BadRequestError, NotFoundError, OpenAI
from openai.types import Completion as CompletionResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.loading import LoadedModel, load_model
from common.sampling import SamplingParams
from step02_paged_kv.engine import PagedEngineConfig
from step03_vectorized_gather.engine import VectorizedGatherEngine
from step07_preemption.engine import PreemptionEngine, PreemptionEngineConfig
from step08_serve.api_server import create_app
from step08_serve.async_engine import AsyncEngine
from step08_serve.launcher import running_server

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
MODEL = "tiny-qwen2"


class Served:
    """A live server on loopback, its engine, and a count of requests that reached the engine."""

    def __init__(self, loaded: LoadedModel, served_name: str, num_blocks: int, max_model_len: int | None = None) -> None:
        config = PagedEngineConfig(device="cpu", block_size=16, num_blocks=num_blocks, max_model_len=max_model_len)
        self.engine = VectorizedGatherEngine(loaded, config)
        self.adds = 0
        add = self.engine.add_request

        def counting_add(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.adds += 1
            return add(*args, **kwargs)

        self.engine.add_request = counting_add  # type: ignore[method-assign]
        self.async_engine = AsyncEngine(self.engine)
        self.app = create_app(self.async_engine, served_name, served_name)
        self.name = served_name

    def assert_idle(self, timeout: float = 15.0) -> None:
        """Zero running or waiting requests, every KV block free, no per-request state anywhere."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self.engine
            if (not e.requests and not e.running and not e.waiting and e.allocator.num_used == 0
                    and self.async_engine.num_open_streams() == 0):  # a request's timing is on its record
                return
            time.sleep(0.05)
        e = self.engine
        raise AssertionError(
            f"not idle: {len(e.requests)} requests, {len(e.running)} running, {len(e.waiting)} waiting, "
            f"{e.allocator.num_used} blocks used, {self.async_engine.num_open_streams()} open streams"
        )


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Served, str]]:
    s = Served(load_model(MODEL), MODEL, num_blocks=600)
    with running_server(s.app) as url:
        yield s, url


@pytest.fixture()
def client(served: tuple[Served, str]) -> OpenAI:
    return OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0, _strict_response_validation=True)


def chat(client: OpenAI, content: str = "Tell me about the sea.", **kwargs) -> ChatCompletion:  # noqa: ANN003
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def stream_chunks(client: OpenAI, content: str = "Tell me about the sea.", **kwargs) -> list[ChatCompletionChunk]:  # noqa: ANN003
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                            stream=True, **kwargs)
    return [ChatCompletionChunk.model_validate(chunk.model_dump()) for chunk in stream]


def joined(chunks: list[ChatCompletionChunk], index: int = 0) -> str:
    return "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == index)


# ----- the response format ------------------------------------------------------------------------------


def test_streamed_text_equals_non_streamed_and_chunks_are_well_formed(client: OpenAI) -> None:
    full = chat(client, max_tokens=20)
    chunks = stream_chunks(client, max_tokens=20)
    assert joined(chunks) == full.choices[0].message.content and full.choices[0].message.content
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.model == MODEL
    assert full.usage is not None and full.usage.completion_tokens == 20
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and {c.created for c in chunks} == {chunks[0].created} and {c.model for c in chunks} == {MODEL}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    roles = [ch.delta.role for c in chunks for ch in c.choices]
    assert roles[0] == "assistant" and all(r is None for r in roles[1:])
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["length"] and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage without include_usage


def test_usage_chunk_only_with_include_usage(client: OpenAI) -> None:
    chunks = stream_chunks(client, max_tokens=7, stream_options={"include_usage": True})
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])
    prompt_tokens = chat(client, max_tokens=7).usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


def test_n_choices_stream_interleaved_and_seeded(client: OpenAI) -> None:
    chunks = stream_chunks(client, n=2, temperature=1.0, seed=5, max_tokens=10)
    for index in (0, 1):
        mine = [ch for c in chunks for ch in c.choices if ch.index == index]
        assert mine[0].delta.role == "assistant" and all(ch.delta.role is None for ch in mine[1:])
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["length"]
    full = chat(client, n=2, temperature=1.0, seed=5, max_tokens=10)
    assert [c.index for c in full.choices] == [0, 1]
    assert [c.message.content for c in full.choices] == [joined(chunks, 0), joined(chunks, 1)]
    assert full.choices[0].message.content != full.choices[1].message.content  # each choice its own seed
    assert full.usage.completion_tokens == 20


def test_seed_reproduces_and_differs(client: OpenAI) -> None:
    a = chat(client, temperature=1.0, seed=11, max_tokens=16).choices[0].message.content
    b = chat(client, temperature=1.0, seed=11, max_tokens=16).choices[0].message.content
    c = chat(client, temperature=1.0, seed=12, max_tokens=16).choices[0].message.content
    assert a == b and a != c


def test_stop_string_and_finish_reasons(client: OpenAI) -> None:
    reference = chat(client, max_tokens=24).choices[0].message.content
    stop = reference[8:12]
    assert len(stop) == 4 and stop.strip()
    full = chat(client, max_tokens=24, stop=[stop])
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].message.content == reference[: reference.index(stop)]
    streamed = stream_chunks(client, max_tokens=24, stop=stop)
    assert joined(streamed) == full.choices[0].message.content
    assert chat(client, max_tokens=3).choices[0].finish_reason == "length"


def test_completions_endpoint(client: OpenAI) -> None:
    one = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert isinstance(one, CompletionResponse) and one.object == "text_completion" and one.id.startswith("cmpl-")
    assert one.usage.completion_tokens == 8 and one.choices[0].finish_reason == "length"
    many = client.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"], max_tokens=8, temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == one.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[100, 200, 300], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3
    # The SDK types a completion choice's finish_reason as never null, yet streamed chunks carry null until the
    # last one (as OpenAI's own do), so the stream is read without strict validation and checked here.
    lenient = client.with_options()
    lenient._strict_response_validation = False
    stream = lenient.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert all(c.object == "text_completion" and c.id == chunks[0].id and c.model == MODEL for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == one.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    default = client.completions.create(model=MODEL, prompt="Hi", temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # the completions default budget


def test_models_and_health(served: tuple[Served, str], client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(f"{served[1]}/v1/models").json()["data"][0]
    assert raw["root"] == MODEL and raw["max_model_len"] == served[0].engine.max_model_len
    assert httpx.get(f"{served[1]}/health").status_code == 200
    metrics = httpx.get(f"{served[1]}/metrics").text
    assert "llm_kv_blocks_used 0" in metrics and "llm_time_to_first_token_seconds_count" in metrics


def test_extra_body_fields_are_honoured_and_unknown_ones_ignored(client: OpenAI) -> None:
    eos_free = chat(client, max_tokens=12, extra_body={"top_k": 1, "ignore_eos": True, "priority": 1,
                                                        "some_future_field": {"x": 1}})
    assert eos_free.usage.completion_tokens == 12
    assert eos_free.choices[0].message.content == chat(client, max_tokens=12).choices[0].message.content


def test_sampling_controls_through_the_sdk(served: tuple[Served, str], client: OpenAI) -> None:
    """Penalties, min_p and logit_bias are served: a bias of -100 on the greedy answer's first token changes it;
    a strong repetition penalty changes a greedy answer that repeats itself."""
    s, _ = served
    # The reference: a second engine on the same weights (the served one belongs to the server's thread).
    local = VectorizedGatherEngine(s.engine.loaded, PagedEngineConfig(device="cpu", block_size=16, num_blocks=64))
    plain = client.completions.create(model=MODEL, prompt="a b a b a b", max_tokens=8, temperature=0)
    first = s.engine.tokenizer.encode(plain.choices[0].text)[0]
    biased = client.completions.create(model=MODEL, prompt="a b a b a b", max_tokens=8, temperature=0,
                                       logit_bias={str(first): -100})
    assert s.engine.tokenizer.encode(biased.choices[0].text)[0] != first
    penalized = client.completions.create(model=MODEL, prompt="a b a b a b", max_tokens=8, temperature=0,
                                          extra_body={"repetition_penalty": 1.3})
    reference = local.generate(["a b a b a b"], SamplingParams(max_tokens=8, repetition_penalty=1.3))[0]
    assert penalized.choices[0].text == reference.text != plain.choices[0].text
    both = chat(client, presence_penalty=1.5, frequency_penalty=-0.5, extra_body={"min_p": 0.2})
    reference = local.generate([local.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the sea."}])], SamplingParams(
        max_tokens=12, presence_penalty=1.5, frequency_penalty=-0.5, min_p=0.2))[0]
    assert both.choices[0].message.content == reference.text
    s.assert_idle()


# ----- bad input ---------------------------------------------------------------------------------------


BAD_BODIES = [
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"42": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 5}}, 400,
     "logit_bias"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     400, "response_format"),
    ({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_BODIES, ids=[p for _, _, p in BAD_BODIES])
def test_bad_input_gets_the_error_envelope_and_never_reaches_the_engine(
    served: tuple[Served, str], body: dict, status: int, param: str
) -> None:
    s, url = served
    before = s.adds
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and param in (error["param"] or "") + error["message"]
    assert "Traceback" not in response.text
    assert s.adds == before
    assert httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2}).status_code == 200


def test_malformed_json_and_wrong_content_type(served: tuple[Served, str]) -> None:
    s, url = served
    before = s.adds
    bad_json = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    as_text = httpx.post(f"{url}/v1/completions", content=b"hello", headers={"content-type": "text/plain"})
    assert as_text.status_code == 400 and "Content-Type" in as_text.json()["error"]["message"]
    assert s.adds == before


def test_sdk_raises_typed_errors(client: OpenAI) -> None:
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5)


def test_a_json_response_format_is_refused_and_text_is_served(client: OpenAI) -> None:
    """A client asking for JSON must not get free text under a 200: an engine that cannot constrain the output (this
    one is step 03's) refuses it, as it refuses a format without its schema."""
    with pytest.raises(BadRequestError, match="step16_structured_output"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "json_object"})
    with pytest.raises(BadRequestError, match="json_schema"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    text = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason == "length", text


def test_api_key_is_required_when_set() -> None:
    s = Served(load_model(MODEL), MODEL, num_blocks=64)
    s.app = create_app(s.async_engine, MODEL, MODEL, api_key="sesame")
    with running_server(s.app) as url:
        denied = OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(APIStatusError) as info:
            denied.models.list()
        assert info.value.status_code == 401
        allowed = OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert allowed.models.list().data[0].id == MODEL
        assert httpx.get(f"{url}/health").status_code == 200  # health needs no key


def test_preemptions_show_in_metrics_and_change_no_text() -> None:
    """Step 07 behind the server with a pool far too small for six concurrent clients: requests get
    swapped out and back, every client still gets the text it gets alone, and /metrics counts it."""
    loaded = load_model(MODEL)
    engine = PreemptionEngine(loaded, PreemptionEngineConfig(device="cpu", block_size=4, num_blocks=24,
                                                             attn="torch", preempt="swap"))
    async_engine = AsyncEngine(engine)
    prompts = [f"Story number {i} about the sea." for i in range(6)]
    with running_server(create_app(async_engine, MODEL, MODEL)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        alone = [chat(client, p, max_tokens=40, extra_body={"ignore_eos": True}).choices[0].message.content
                 for p in prompts]
        assert engine.preemptions == 0
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: chat(client, p, max_tokens=40, extra_body={"ignore_eos": True})
                                     .choices[0].message.content, prompts))
        metrics = httpx.get(f"{url}/metrics").text
    assert together == alone
    assert engine.preemptions >= 1 and engine.swapper.stats.swapped_out_blocks > 0
    assert f"llm_preemptions_total {engine.preemptions}" in metrics
    assert f"llm_swapped_out_blocks_total {engine.swapper.stats.swapped_out_blocks}" in metrics
    assert "llm_requests_swapped 0" in metrics


# ----- concurrency and cancellation -------------------------------------------------------------------


def test_32_concurrent_streams_get_the_same_text_as_alone(served: tuple[Served, str], client: OpenAI) -> None:
    prompts = [f"Story number {i}: once upon a time" for i in range(32)]
    alone = {p: chat(client, p, max_tokens=10).choices[0].message.content for p in prompts[:8]}
    results: dict[str, str] = {}

    def worker(prompt: str) -> None:
        results[prompt] = joined(stream_chunks(client, prompt, max_tokens=10))

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 32
    for p in prompts[:8]:
        assert results[p] == alone[p]
    for p in prompts[8:]:  # the rest are checked alone afterwards
        assert results[p] == chat(client, p, max_tokens=10).choices[0].message.content
    served[0].assert_idle()


def test_cancellation_storm_leaves_nothing_behind(served: tuple[Served, str], client: OpenAI) -> None:
    s, url = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 1500,
            "ignore_eos": True}

    async def storm() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as http:
            async def drop_after_first_chunk() -> None:
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return  # leave with the stream open: the server sees a disconnect

            async def give_up_waiting(stream: bool) -> None:
                # The client hangs up after half a second, whatever it has received by then.
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(http.post(f"{url}/v1/chat/completions", json=body | {"stream": stream}), 0.5)

            await asyncio.gather(*[drop_after_first_chunk() for _ in range(20)],
                                 *[give_up_waiting(stream=False) for _ in range(20)],
                                 *[give_up_waiting(stream=True) for _ in range(10)])

    sample = s.async_engine.metrics.registry.get_sample_value  # the server is shared: count from here on
    added_before, aborted_before = sample("llm_requests_added_total"), sample("llm_requests_aborted_total")
    asyncio.run(storm())
    s.assert_idle(timeout=30)
    # Every request that reached the engine was aborted (none can finish 1500 tokens in time); on a loaded machine a
    # client may hang up before its request got that far, so the count is at least the 20 that saw a first chunk.
    added = sample("llm_requests_added_total") - added_before
    assert sample("llm_requests_aborted_total") - aborted_before == added >= 20
    fresh = chat(client, max_tokens=5)
    assert fresh.usage.completion_tokens == 5 and fresh.choices[0].finish_reason == "length"
    s.assert_idle()


# ----- the real model ------------------------------------------------------------------------------------


@pytest.mark.embedded
def test_multibyte_streaming_on_the_embedded_model(embedded: LoadedModel) -> None:
    s = Served(embedded, "smollm2-135m-instruct", num_blocks=256)
    with running_server(s.app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True)
        args = dict(model="smollm2-135m-instruct", prompt="中文：你好，世界！今天天气很好，我们", max_tokens=24, temperature=0)
        full = client.completions.create(**args).choices[0].text
        lenient = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)  # see test_completions_endpoint
        deltas = [c.choices[0].text for c in lenient.completions.create(stream=True, **args)]
    assert "".join(deltas) == full
    assert any("\u4e00" <= ch <= "\u9fff" for ch in full), full  # the model really wrote CJK characters
    assert all("\ufffd" not in d for d in deltas)
    s.assert_idle()


def test_the_default_step_has_a_token_budget_and_takes_its_flag() -> None:
    """Without --step the server runs the final engine; a step's own flags reach its engine."""
    from step08_serve.run import build_engine, chosen_step, parse_args
    from step09_chunked_prefill.engine import ChunkedPrefillEngine

    assert chosen_step(["--device", "cpu"]) == chosen_step([]) == "step16_structured_output"
    assert chosen_step(["--device", "cpu", "--step", "step07_preemption"]) == "step07_preemption"
    engine = build_engine(parse_args(["--device", "cpu", "--model", "tiny-llama", "--max-num-batched-tokens", "64"]))
    assert isinstance(engine, ChunkedPrefillEngine) and engine.token_budget == 64
