"""The OpenAI-compatible HTTP API over one shared `AsyncEngine`.

Each handler only checks the request, tokenizes it, and then reads the outputs of its engine request(s)
from a queue: streaming as server-sent events, or collected into one JSON response. Every request, however
it ends (finished, client gone, error), leaves nothing behind: leaving `AsyncEngine.generate` early aborts
the engine request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from common.request import RequestOutput
from step08_serve.async_engine import AsyncEngine, EngineDeadError
from step08_serve.metrics import render_metric
from step08_serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    _GenerationFields,
    error_body,
)


def error_response(err: RequestError) -> JSONResponse:
    headers = {"x-should-retry": "false"} if err.status >= 500 else None
    return JSONResponse(error_body(str(err), err.error_type, err.param, err.code), status_code=err.status,
                        headers=headers)


@dataclass
class ChoiceResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str


def create_app(async_engine: AsyncEngine, served_model: str, model_root: str, api_key: str | None = None) -> FastAPI:
    engine = async_engine.engine
    tokenizer = engine.tokenizer
    created_at = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start(asyncio.get_running_loop())
        yield
        async_engine.stop()

    app = FastAPI(title="llm-serving-steps", lifespan=lifespan)

    def authorize(request: Request) -> None:
        # A plain check in each /v1 handler, not an HTTP middleware: Starlette's middleware wrapper hides
        # client disconnects from the handler, and disconnects are how abandoned requests get aborted.
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise RequestError("invalid or missing API key", status=401, error_type="authentication_error",
                               code="invalid_api_key")

    async def parse(request: Request, model_class: type[_GenerationFields]) -> Any:
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
        if body.model != served_model:
            raise RequestError(f"the model {body.model!r} does not exist; this server serves {served_model!r}",
                               "model", status=404, code="model_not_found")
        body.check_supported()
        return body

    def checked_prompt(prompt_ids: list[int], field: str) -> list[int]:
        try:
            engine.check_prompt(prompt_ids)
        except ValueError as err:
            raise RequestError(f"{field}: {err}", field) from None
        return prompt_ids

    def budget(body: _GenerationFields, prompt_ids: list[int]) -> int:
        room = engine.max_model_len - len(prompt_ids)
        return min(body.token_budget() or room, room)

    async def run_handler(request: Request, handler: Callable[[Request], Awaitable[Response]]) -> Response:
        try:
            authorize(request)
            return await handler(request)
        except RequestError as err:
            return error_response(err)
        except ValueError as err:  # the engine refused the request (e.g. it could never fit in the KV cache)
            return error_response(RequestError(str(err)))
        except EngineDeadError as err:
            return error_response(RequestError(str(err), status=503, error_type="service_unavailable"))

    # ----- generation, shared by both endpoints ----------------------------------------------------------

    def engine_streams(body: _GenerationFields, prompts: list[list[int]], base_id: str
                       ) -> list[tuple[int, AsyncIterator[RequestOutput]]]:
        streams = []
        for p, prompt_ids in enumerate(prompts):
            for c in range(body.n):
                index = p * body.n + c
                try:
                    params = body.sampling_params(budget(body, prompt_ids), c)
                except ValueError as err:
                    raise RequestError(str(err)) from None
                streams.append((index, async_engine.generate(prompt_ids, params, f"{base_id}-{index}", body.priority)))
        return streams

    async def merged(streams: list[tuple[int, AsyncIterator[RequestOutput]]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several engine requests as they come, tagged with their choice index."""
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((index, out))
                queue.put_nowait(None)
            except Exception as err:  # hand the error to the reader
                queue.put_nowait(err)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in streams]
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

    async def collect(streams: list[tuple[int, AsyncIterator[RequestOutput]]]) -> list[ChoiceResult]:
        texts: dict[int, list[str]] = {i: [] for i, _ in streams}
        ids: dict[int, list[int]] = {i: [] for i, _ in streams}
        reasons: dict[int, str] = {}
        async for index, out in merged(streams):
            texts[index].append(out.new_text)
            ids[index] += out.new_token_ids
            if out.finished and out.finish_reason is not None:
                reasons[index] = out.finish_reason.value
        return [ChoiceResult(i, "".join(texts[i]), ids[i], reasons[i]) for i, _ in streams]

    async def unless_disconnected(request: Request, awaitable: Awaitable[Any]) -> Any:
        """Await `awaitable` while watching the connection; if the client leaves first, cancel the work
        (which aborts its engine requests) and return None."""
        work = asyncio.ensure_future(awaitable)

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch())
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return None
        return work.result()

    def usage(prompts: list[list[int]], completion_tokens: int) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(data: dict[str, Any] | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"

    async def start_stream(request: Request, body: _GenerationFields, prompts: list[list[int]], streams, make_chunk
                           ) -> Response:
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
        return StreamingResponse(stream_events(body, prompts, first, outputs, make_chunk),
                                 media_type="text/event-stream")

    async def stream_events(body: _GenerationFields, prompts: list[list[int]], first_output: tuple[int, RequestOutput],
                            outputs: AsyncIterator[tuple[int, RequestOutput]], make_chunk) -> AsyncIterator[str]:
        async def all_outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            yield first_output
            async for item in outputs:
                yield item

        completion_tokens = 0
        started: set[int] = set()
        try:
            async for index, out in all_outputs():
                completion_tokens += len(out.new_token_ids)
                first = index not in started
                started.add(index)
                reason = out.finish_reason.value if out.finished and out.finish_reason else None
                if first or out.new_text or reason:
                    yield sse(make_chunk(index, out.new_text, first, reason))
            if body.include_usage_chunk:
                yield sse(make_chunk(None, "", False, None) | {"choices": [], "usage": usage(prompts, completion_tokens)})
        except (EngineDeadError, ValueError) as err:
            yield sse(error_body(str(err), "server_error" if isinstance(err, EngineDeadError) else "invalid_request_error"))
        finally:
            await outputs.aclose()  # a client that left mid-stream lands here: abort what is still running
        yield sse("[DONE]")

    async def respond(request: Request, body: _GenerationFields, prompts: list[list[int]], streams,
                      make_chunk, make_choice: Callable[[ChoiceResult], dict[str, Any]],
                      head: dict[str, Any]) -> Response:
        """The end both endpoints share: an SSE stream, or every choice collected into one JSON body."""
        if body.stream:
            return await start_stream(request, body, prompts, streams, make_chunk)
        choices = await unless_disconnected(request, collect(streams))
        if choices is None:  # the client left; its engine requests are already aborted
            return Response(status_code=499)
        return JSONResponse(head | {
            "model": served_model,
            "choices": [make_choice(c) for c in choices],
            "usage": usage(prompts, sum(len(c.token_ids) for c in choices)),
        })

    # ----- endpoints ------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def handle(request: Request) -> Response:
            body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                prompt_ids = tokenizer.apply_chat_template(messages)
            except Exception as err:  # the template itself may refuse a conversation (e.g. role order)
                raise RequestError(f"messages: the chat template rejected them ({err})", "messages") from None
            prompts = [checked_prompt(prompt_ids, "messages")]
            response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            streams = engine_streams(body, prompts, response_id)

            def chunk(index: int | None, text: str, first: bool, reason: str | None) -> dict[str, Any]:
                delta: dict[str, str] = {"role": "assistant"} if first else {}
                if text or first:
                    delta["content"] = text
                return {"id": response_id, "object": "chat.completion.chunk", "created": created,
                        "model": served_model,
                        "choices": [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}]}

            def choice(c: ChoiceResult) -> dict[str, Any]:
                return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "finish_reason": c.finish_reason, "logprobs": None}

            return await respond(request, body, prompts, streams, chunk, choice,
                                 {"id": response_id, "object": "chat.completion", "created": created})

        return await run_handler(request, handle)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def handle(request: Request) -> Response:
            body: CompletionRequest = await parse(request, CompletionRequest)
            prompts = [
                checked_prompt(tokenizer.encode(p) if isinstance(p, str) else p, "prompt") for p in body.prompts()
            ]
            response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
            streams = engine_streams(body, prompts, response_id)

            def chunk(index: int | None, text: str, first: bool, reason: str | None) -> dict[str, Any]:
                return {"id": response_id, "object": "text_completion", "created": created, "model": served_model,
                        "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": None}]}

            def choice(c: ChoiceResult) -> dict[str, Any]:
                return {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}

            return await respond(request, body, prompts, streams, chunk, choice,
                                 {"id": response_id, "object": "text_completion", "created": created})

        return await run_handler(request, handle)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        async def handle(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{
                "id": served_model, "object": "model", "created": created_at, "owned_by": "llm-serving-steps",
                "root": model_root, "max_model_len": engine.max_model_len,
            }]})

        return await run_handler(request, handle)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body("the engine loop is not running", "service_unavailable"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = async_engine.stats
        lines = [
            *render_metric("llm_requests_running", "gauge", "Requests admitted to the engine.", len(engine.running)),
            *render_metric("llm_requests_waiting", "gauge", "Requests queued for admission.", len(engine.waiting)),
            *render_metric("llm_open_streams", "gauge", "HTTP-side request queues open.", async_engine.num_open_streams()),
            *render_metric("llm_requests_finished_total", "counter", "Requests that finished.", stats.requests_finished),
            *render_metric("llm_requests_aborted_total", "counter", "Requests aborted (client gone).", stats.requests_aborted),
            *render_metric("llm_generation_tokens_total", "counter", "Tokens generated.", stats.tokens_generated),
            *render_metric("llm_engine_steps_total", "counter", "Engine steps run.", stats.steps),
        ]
        allocator = getattr(engine, "allocator", None)
        if allocator is not None:
            lines += render_metric("llm_kv_blocks_used", "gauge", "KV cache blocks in use.", allocator.num_used)
            lines += render_metric("llm_kv_blocks_total", "gauge", "KV cache blocks in the pool.", allocator.num_blocks)
        if hasattr(engine, "preemptions"):  # step 07 onwards
            lines += render_metric("llm_preemptions_total", "counter", "Running requests preempted.", engine.preemptions)
            lines += render_metric("llm_requests_swapped", "gauge", "Requests whose KV cache waits in host memory.",
                                   len(engine.swapped))
            lines += render_metric("llm_swapped_out_blocks_total", "counter", "KV blocks copied to host memory.",
                                   engine.swapper.stats.swapped_out_blocks)
        lines += stats.ttft_seconds.render("llm_time_to_first_token_seconds", "Time to first token.")
        lines += stats.tpot_seconds.render("llm_time_per_output_token_seconds", "Time per output token after the first.")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app
