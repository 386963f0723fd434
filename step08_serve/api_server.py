"""The OpenAI-compatible HTTP API over one shared `AsyncEngine`.

`OpenAIServer` holds what every route needs (the engine, the served model's name, the API key) and has
one method per route and per stage of a request: parse and check the body, build the prompt, admit one
engine request per choice, then answer, either as server-sent events or collected into one JSON body.
Below the class are the pieces that need no server state: the JSON shape of each endpoint's responses,
merging and collecting the outputs of several engine requests, watching for a client that leaves, SSE
framing, and the error envelope.

Every request, however it ends (finished, client gone, error), leaves nothing behind: leaving
`AsyncEngine.generate` early aborts the engine request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from common.request import FinishReason, RequestOutput
from common.sampling import TokenLogprob
from common.tokenizer import Tokenizer
from step08_serve.async_engine import AsyncEngine, RequestFailedError, SlowReaderError, UnavailableError
from step08_serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    GenerationFields,
    error_body,
)

# One engine request's outputs, tagged with the index of the choice it produces.
Streams = list[tuple[int, AsyncIterator[RequestOutput]]]
Body = TypeVar("Body", bound=GenerationFields)


def create_app(async_engine: AsyncEngine, served_model: str, model_root: str, api_key: str | None = None) -> FastAPI:
    return OpenAIServer(async_engine, served_model, model_root, api_key).app


class OpenAIServer:
    def __init__(self, async_engine: AsyncEngine, served_model: str, model_root: str,
                 api_key: str | None = None) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.served_model = served_model  # the id clients send as `model`
        self.model_root = model_root  # the weights it names
        self.api_key = api_key
        self.created_at = int(time.time())
        self.app = self.build_app()

    def build_app(self) -> FastAPI:
        app = FastAPI(title="llm-serving-steps", lifespan=self.lifespan)
        app.state.async_engine = self.async_engine  # for the launcher's graceful shutdown
        # The API key is checked by a dependency of each /v1 route, not by an HTTP middleware: Starlette's
        # middleware wrapper hides client disconnects from the handler, and disconnects are how abandoned
        # requests get aborted.
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self.authorize)])
        v1.add_api_route("/chat/completions", self.chat_completions, methods=["POST"])
        v1.add_api_route("/completions", self.completions, methods=["POST"])
        v1.add_api_route("/models", self.models, methods=["GET"])
        app.include_router(v1)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/profile", self.profile, methods=["POST"], dependencies=[Depends(self.authorize)])
        for refusal in (RequestError, ValueError, UnavailableError, RequestFailedError):
            app.add_exception_handler(refusal, error_response)
        return app

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """The step loop runs while the app does."""
        self.async_engine.start(asyncio.get_running_loop())
        yield
        self.async_engine.stop()

    # ----- the routes -----------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = await self.parse(request, ChatCompletionRequest)
        shape = ChatShape(self.served_model, self.engine.tokenizer)
        return await self.respond(request, body, [self.chat_prompt(body)], shape)

    async def completions(self, request: Request) -> Response:
        body = await self.parse(request, CompletionRequest)
        prompts = [self.checked_prompt(self.engine.tokenizer.encode(p) if isinstance(p, str) else p, "prompt")
                   for p in body.prompts()]
        echoed = [(p if isinstance(p, str) else self.engine.tokenizer.decode(p), ids)
                  for p, ids in zip(body.prompts(), prompts, strict=True)] if body.echo else None
        shape = CompletionShape(self.served_model, self.engine.tokenizer, body.n, echoed, body.max_tokens != 0)
        return await self.respond(request, body, prompts, shape)

    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.served_model, "object": "model", "created": self.created_at, "owned_by": "llm-serving-steps",
            "root": self.model_root, "max_model_len": self.engine.max_model_len,
        }]})

    async def health(self) -> Response:
        """200 while requests are taken; 503, saying why, once the engine failed or the server is shutting down."""
        refusal = self.async_engine.unavailable()
        if refusal is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(str(refusal), "service_unavailable"), status_code=503)

    async def metrics(self) -> Response:
        return Response(self.async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def profile(self, request: Request) -> Response:
        """Step 05's profiler over the next `steps` engine steps (default 8, at most 1000), answered once they
        have run: `{"trace": path, "table": text, "summary": {...}}`. It waits for traffic to profile."""
        try:
            payload = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"the request body is not valid JSON: {err}") from None
        steps = payload.get("steps", 8) if isinstance(payload, dict) else None
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 1000:
            raise RequestError("steps must be a whole number from 1 to 1000", "steps")
        return JSONResponse(await self.async_engine.profile(steps))

    # ----- a request's stages, in order -----------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise RequestError("invalid or missing API key", status=401, error_type="authentication_error",
                               code="invalid_api_key")

    async def parse(self, request: Request, model_class: type[Body]) -> Body:
        """Body -> validated request model; every failure is a RequestError that names what is wrong."""
        if "application/json" not in request.headers.get("content-type", ""):
            raise RequestError("the request body must be JSON (Content-Type: application/json)")
        try:
            payload = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"the request body is not valid JSON: {err}") from None
        if not isinstance(payload, dict):
            raise RequestError("the request body must be a JSON object")
        try:
            body = model_class.model_validate(payload)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or None
            raise RequestError(f"{field}: {first['msg']}" if field else first["msg"], field) from None
        if body.model != self.served_model:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves {self.served_model!r}",
                               "model", status=404, code="model_not_found")
        body.check_supported(self.engine.model.config.vocab_size)
        if body.structured_output() is not None and not getattr(self.engine, "serves_structured_output", False):
            raise RequestError(f"this server's engine ({type(self.engine).__name__}) does not constrain output to a "
                               "format: start it with --step step16_structured_output", "response_format")
        return body

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = self.engine.tokenizer.apply_chat_template(messages)
        except Exception as err:  # the template itself may refuse a conversation (e.g. role order)
            raise RequestError(f"messages: the chat template rejected them ({err})", "messages") from None
        return self.checked_prompt(prompt_ids, "messages")

    def checked_prompt(self, prompt_ids: list[int], field: str) -> list[int]:
        try:
            self.engine.check_prompt(prompt_ids)
        except ValueError as err:
            raise RequestError(f"{field}: {err}", field) from None
        return prompt_ids

    def admit(self, body: GenerationFields, prompts: list[list[int]], base_id: str) -> Streams:
        """One engine request per prompt and choice (`n` of each). Nothing reaches the engine until a stream
        is first read; then `AsyncEngine.generate` registers its queue and only then adds the request."""
        streams = []
        for p, prompt_ids in enumerate(prompts):
            room = self.engine.max_model_len - len(prompt_ids)
            max_tokens = min(body.token_budget() or room, room)
            for c in range(body.n):
                index = p * body.n + c
                try:
                    params = body.sampling_params(max_tokens, c, self.engine.model.config.vocab_size)
                except ValueError as err:
                    raise RequestError(str(err)) from None
                streams.append((index, self.async_engine.generate(prompt_ids, params, f"{base_id}-{index}",
                                                                  body.priority)))
        return streams

    async def respond(self, request: Request, body: GenerationFields, prompts: list[list[int]],
                      shape: ResponseShape) -> Response:
        """The end both endpoints share: an SSE stream, or every choice collected into one JSON body."""
        streams = self.admit(body, prompts, shape.id)
        if body.stream:
            return await self.stream_response(request, body, prompts, streams, shape)
        choices = await unless_disconnected(request, collect(streams))
        if choices is None:  # the client left; its engine requests are already aborted
            return Response(status_code=499)
        generated = sum(len(c.token_ids) for c in choices) if shape.generates else 0
        return JSONResponse(shape.response(choices, usage(prompts, generated)))

    async def stream_response(self, request: Request, body: GenerationFields, prompts: list[list[int]],
                              streams: Streams, shape: ResponseShape) -> Response:
        """Wait for the first output before answering, so that a request the engine refuses still gets a
        plain HTTP error (and a client that leaves while queued is noticed); then every output is an event."""
        outputs = merged(streams)
        try:
            first = await unless_disconnected(request, anext(outputs))
        except BaseException:
            await outputs.aclose()
            raise
        if first is None:
            await outputs.aclose()
            return Response(status_code=499)
        events = stream_events(shape, prompts, first, outputs, body.include_usage_chunk)
        return StreamingResponse(events, media_type="text/event-stream")


# ----- the shape of responses ---------------------------------------------------------------------------


@dataclass
class ChoiceResult:
    """One choice of a non-streamed response, collected."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None = None  # where the request asked (echo with logprobs)


class ResponseShape(ABC):
    """One response's id, time and model, and the JSON of its chunks and choices. The two endpoints differ
    only in this: `CompletionShape` and `ChatShape` below."""

    id_prefix: str
    object: str  # of a whole response
    chunk_object: str  # of each streamed chunk
    generates = True  # False: the client asked for no new token (echo, max_tokens 0), and the engine's one is dropped

    def __init__(self, served_model: str, tokenizer: Tokenizer) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = served_model
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def head(self, object_type: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_type, "created": self.created, "model": self.model}

    def chunk(self, index: int, out: RequestOutput, first: bool) -> dict[str, Any]:
        """The streamed chunk of one output of choice `index` (`first`: the choice's first)."""
        reason = out.finish_reason.value if out.finished and out.finish_reason else None
        choice = self.chunk_choice(index, out.new_text, first, reason) | {"logprobs": self.logprobs(index, out.logprobs)}
        return self.head(self.chunk_object) | {"choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return self.head(self.chunk_object) | {"choices": [], "usage": usage}

    def response(self, choices: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        choices_json = [self.choice(c) | {"logprobs": self.logprobs(c.index, c.logprobs)} for c in choices]
        return self.head(self.object) | {"choices": choices_json, "usage": usage}

    @abstractmethod
    def chunk_choice(self, index: int, text: str, first: bool, finish_reason: str | None) -> dict[str, Any]:
        """One choice's part of a streamed chunk (`first`: the choice's first chunk)."""

    @abstractmethod
    def choice(self, c: ChoiceResult) -> dict[str, Any]:
        """One choice of a non-streamed response (`response` adds its log-probabilities)."""

    @abstractmethod
    def logprobs(self, index: int, tokens: list[TokenLogprob]) -> dict[str, Any] | None:
        """The `logprobs` of choice `index` for these tokens (the next ones, when streamed); None if it has none."""


class CompletionShape(ResponseShape):
    """Completions, and their `echo`: each choice's text and log-probabilities begin with its prompt's."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, served_model: str, tokenizer: Tokenizer, n: int = 1,
                 echoed: list[tuple[str, list[int]]] | None = None, generates: bool = True) -> None:
        super().__init__(served_model, tokenizer)
        self.n = n  # choices per prompt: choice i answers prompt i // n
        self.echoed = echoed  # each prompt's text and token ids, for `echo`; None: no echo
        self.generates = generates
        # Each choice's text length so far, for the next token's offset: an echoed prompt comes first.
        self.text_offsets = {i: len(echoed[i // n][0]) for i in range(len(echoed) * n)} if echoed else {}

    def chunk(self, index: int, out: RequestOutput, first: bool) -> dict[str, Any]:
        if not self.generates:  # the one token the engine drew is not the client's
            out = replace(out, new_token_ids=[], new_text="", logprobs=[],
                          finish_reason=FinishReason.LENGTH if out.finished else None)
        chunk = super().chunk(index, out, first)
        if first and self.echoed is not None:
            choice = chunk["choices"][0]
            choice["text"] = self.echoed[index // self.n][0] + choice["text"]
            choice["logprobs"] = self.with_prompt(index, out.prompt_logprobs, choice["logprobs"])
        return chunk

    def response(self, choices: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        if not self.generates:
            choices = [replace(c, text="", token_ids=[], logprobs=[], finish_reason=FinishReason.LENGTH.value)
                       for c in choices]
        body = super().response(choices, usage)
        if self.echoed is not None:
            for choice, c in zip(body["choices"], choices, strict=True):
                choice["text"] = self.echoed[c.index // self.n][0] + choice["text"]
                choice["logprobs"] = self.with_prompt(c.index, c.prompt_logprobs, choice["logprobs"])
        return body

    def with_prompt(self, index: int, prompt: list[TokenLogprob | None] | None,
                    generated: dict[str, Any] | None) -> dict[str, Any] | None:
        """The legacy `logprobs` of the echoed prompt (its first token has none: null), then the generated ones'."""
        if prompt is None:  # echo without logprobs
            return generated
        _, prompt_ids = self.echoed[index // self.n]
        texts = [self.token_text(t) for t in prompt_ids]
        entries = [t for t in prompt if t is not None]
        echoed = {"tokens": texts, "token_logprobs": [None] + [t.logprob for t in entries],
                  "top_logprobs": [None] + [{self.token_text(i): lp for i, lp in t.top} | {text: t.logprob}
                                            for t, text in zip(entries, texts[1:], strict=True)],
                  "text_offset": list(itertools.accumulate(map(len, texts[:-1]), initial=0))}
        return echoed if generated is None else {key: echoed[key] + generated[key] for key in echoed}

    def chunk_choice(self, index: int, text: str, first: bool, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "finish_reason": finish_reason}

    def choice(self, c: ChoiceResult) -> dict[str, Any]:
        return {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}

    def logprobs(self, index: int, tokens: list[TokenLogprob]) -> dict[str, Any] | None:
        if not tokens:
            return None
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = list(itertools.accumulate(map(len, texts), initial=self.text_offsets.get(index, 0)))
        self.text_offsets[index] = offsets.pop()
        # The legacy form: each position's alternatives as text -> logprob, the chosen token always among them.
        top = [{self.token_text(i): lp for i, lp in t.top} | {text: t.logprob} for t, text in zip(tokens, texts)]
        return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens], "top_logprobs": top,
                "text_offset": offsets}


class ChatShape(ResponseShape):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def chunk_choice(self, index: int, text: str, first: bool, finish_reason: str | None) -> dict[str, Any]:
        # Only a choice's first chunk carries the role, and it is sent once the first token exists.
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
        return {"index": index, "delta": delta, "finish_reason": finish_reason}

    def choice(self, c: ChoiceResult) -> dict[str, Any]:
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason}

    def logprobs(self, index: int, tokens: list[TokenLogprob]) -> dict[str, Any] | None:
        if not tokens:
            return None
        return {"content": [self.entry(t.token_id, t.logprob)
                            | {"top_logprobs": [self.entry(i, lp) for i, lp in t.top]} for t in tokens]}

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        # `token` is the text (U+FFFD for part of a multi-byte character); `bytes` the token's own raw bytes, which
        # a client joins to rebuild such a character.
        return {"token": self.token_text(token_id), "logprob": logprob,
                "bytes": list(self.tokenizer.token_bytes(token_id))}


def usage(prompts: list[list[int]], completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ----- the outputs of several engine requests ------------------------------------------------------------


async def merged(streams: Streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come, tagged with their choice index. The queue is short: a
    reader that falls behind leaves the outputs waiting in the engine's queues, where `AsyncEngine` bounds them."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue(maxsize=2 * len(streams))
    tasks = [asyncio.create_task(pump(index, stream, queue)) for index, stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:  # client gone or error: stop every pump, which aborts its engine request
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def pump(index: int, stream: AsyncIterator[RequestOutput],
               queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None]) -> None:
    """Move one engine request's outputs into the shared queue; None when it ends, or the error it raised."""
    try:
        async for out in stream:
            await queue.put((index, out))
        await queue.put(None)
    except Exception as err:  # hand the error to the reader
        await queue.put(err)


async def collect(streams: Streams) -> list[ChoiceResult]:
    """Every choice run to its end, for a non-streamed response."""
    texts: dict[int, list[str]] = {i: [] for i, _ in streams}
    ids: dict[int, list[int]] = {i: [] for i, _ in streams}
    logprobs: dict[int, list[TokenLogprob]] = {i: [] for i, _ in streams}
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
    reasons: dict[int, str] = {}
    async for index, out in merged(streams):
        texts[index].append(out.new_text)
        ids[index] += out.new_token_ids
        logprobs[index] += out.logprobs
        if out.prompt_logprobs is not None:
            prompt_logprobs[index] = out.prompt_logprobs
        if out.finished and out.finish_reason is not None:
            reasons[index] = out.finish_reason.value
    return [ChoiceResult(i, "".join(texts[i]), ids[i], reasons[i], logprobs[i], prompt_logprobs.get(i))
            for i, _ in streams]


async def unless_disconnected(request: Request, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable` while watching the connection; if the client leaves first, cancel the work
    (which aborts its engine requests) and return None."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(wait_for_disconnect(request))
    await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    return work.result()


async def wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


# ----- server-sent events ---------------------------------------------------------------------------------


async def stream_events(shape: ResponseShape, prompts: list[list[int]], first: tuple[int, RequestOutput],
                        outputs: AsyncIterator[tuple[int, RequestOutput]], include_usage: bool) -> AsyncIterator[str]:
    """Each output as a chunk event (the first output already read), the usage chunk if asked, then [DONE]."""
    completion_tokens = 0
    started: set[int] = set()
    try:
        async for index, out in prepended(first, outputs):
            completion_tokens += len(out.new_token_ids) if shape.generates else 0
            first_of_choice = index not in started
            started.add(index)
            if first_of_choice or out.new_text or out.finished or out.logprobs:
                yield sse(shape.chunk(index, out, first_of_choice))
        if include_usage:
            yield sse(shape.usage_chunk(usage(prompts, completion_tokens)))
    except (UnavailableError, RequestFailedError, SlowReaderError, ValueError) as err:  # begun: an error event
        kind = "invalid_request_error" if isinstance(err, ValueError) else "server_error"
        yield sse(error_body(str(err), kind))
    finally:
        await outputs.aclose()  # a client that left mid-stream lands here: abort what is still running
    yield sse("[DONE]")


async def prepended(first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]
                    ) -> AsyncIterator[tuple[int, RequestOutput]]:
    yield first
    async for item in rest:
        yield item


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# ----- errors -----------------------------------------------------------------------------------------------


async def error_response(_: Request, err: Exception) -> JSONResponse:
    """A refused request as the OpenAI error envelope: the app's handler for RequestError (400, or the status it
    names), any other ValueError (the engine refused the request, e.g. it could never fit in the KV cache:
    400), UnavailableError (503: the engine failed, or the server is shutting down) and RequestFailedError (500:
    the engine failed on this request alone)."""
    if isinstance(err, UnavailableError):
        err = RequestError(str(err), status=503, error_type="service_unavailable")
    elif isinstance(err, RequestFailedError):  # this request alone: the server is fine
        err = RequestError(str(err), status=500, error_type="server_error")
    elif not isinstance(err, RequestError):
        err = RequestError(str(err))
    headers = {"x-should-retry": "false"} if err.status >= 500 else None
    return JSONResponse(error_body(str(err), err.error_type, err.param, err.code), status_code=err.status,
                        headers=headers)
