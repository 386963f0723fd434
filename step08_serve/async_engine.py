"""One background thread drives the engine; asyncio request handlers talk to it through queues.

The engine is not thread-safe and `engine.step()` blocks for a whole forward, so it gets a thread of its
own that does nothing else: apply the queued commands (add, abort), run one step, hand each output to the
queue of the request it belongs to, repeat. HTTP handlers run on the asyncio event loop and never touch
the engine directly.

What the server keeps about a request is one record, `Served`: its output queue and its timing. The engine
carries it (`add_request(listener=...)`) and hands it back on each of the request's outputs, so the step thread
finds the queue without a map of request ids.

The ordering that matters: a request's output queue is registered *before* its add command is queued.
The other way round, a fast engine could produce the first token before anyone listens for it, and the
token would be dropped (the registration race).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.engine import Engine
from common.request import RequestOutput
from common.sampling import SamplingParams
from step08_serve.metrics import ServingMetrics

if TYPE_CHECKING:  # the profiler loads only when a profile is asked for
    from common.profiling.profiler import StepProfiler

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error; no request can be served."""


class RequestFailedError(RuntimeError):
    """Handling one request raised inside the engine (`Request.fail`): it ended alone, the others go on."""


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics = ServingMetrics(engine, self.num_open_streams)  # counted by the step thread, read by /metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._open: set[Served] = set()  # the requests whose handler still listens
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self._profiling: _Profiling | None = None  # POST /profile: the next steps run under the profiler (step 05)

    # ----- lifecycle -----------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._profiling is not None:  # stopped mid-profile: the engine's own methods are put back
            self._profiling.profiler.ranges.close()
        close = getattr(self.engine, "close", None)  # an engine with processes of its own (step 04) stops them
        if close is not None:
            close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ----- what handlers call --------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. Leaving early (client gone, task cancelled) aborts the request."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        assert self._loop is not None
        served = Served()
        self._open.add(served)  # registered before the add: no output can arrive unheard
        added: asyncio.Future[None] = self._loop.create_future()
        self._submit(lambda: self._add(served, request_id, prompt_ids, params, priority, added))
        finished = False
        try:
            await added  # a ValueError from the engine (e.g. the request can never fit) surfaces here
            while True:
                item = await served.stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(f"the engine failed on this request: {item.error}")
                yield item
                if finished:
                    return
        finally:
            self._open.discard(served)
            if not finished:
                self._submit(lambda: self._abort(request_id))

    async def profile(self, steps: int) -> dict:
        """Profile the next `steps` steps the loop takes (step 05): the trace's path, and the table of where
        their time went. Steps are taken only while requests run: this waits for traffic."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        assert self._loop is not None
        done: asyncio.Future[dict] = self._loop.create_future()
        self._submit(lambda: self._start_profile(steps, done))
        return await done

    def num_open_streams(self) -> int:
        return len(self._open)

    # ----- the step thread -----------------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _add(self, served: Served, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int,
             added: asyncio.Future[None]) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id, priority=priority, listener=served)
        except ValueError as err:
            self._call_in_loop(_settle, added, err)
            return
        served.added_at = time.perf_counter()
        self.metrics.requests_added.inc()
        self._call_in_loop(_settle, added, None)

    def _abort(self, request_id: str) -> None:
        if self.engine.abort(request_id) is not None:
            self.metrics.requests_aborted.inc()

    def _start_profile(self, steps: int, done: asyncio.Future[dict]) -> None:
        from common.bench import default_output
        from common.profiling.profiler import StepProfiler

        if self._profiling is not None:
            self._call_in_loop(_settle, done, ValueError("a profile is already being taken: wait for its answer"))
            return
        trace = default_output("profile", "server", self.engine.device.type, self.engine.config.model)
        profiler = StepProfiler(self.engine, trace)
        profiler.start()
        self._profiling = _Profiling(profiler, steps, done)

    def _count_profiled_step(self) -> None:
        from common.profiling.profiler import format_report

        profiling = self._profiling
        assert profiling is not None
        profiling.steps_left -= 1
        if profiling.steps_left > 0 and not self._stopping:
            return
        self._profiling = None
        report = profiling.profiler.stop()
        answer = {"trace": report.trace, "table": format_report(report), "summary": report.summary()}
        self._call_in_loop(_settle_with, profiling.done, answer)

    def _run(self) -> None:
        try:
            while not self._stopping:
                while not self._commands.empty():
                    self._commands.get()()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if self._profiling is not None:
                    self._count_profiled_step()
                self.metrics.engine_steps.inc()
                self._record(outputs)
                self._call_in_loop(self._deliver, outputs)
        except BaseException as err:  # a dead loop must fail every waiting request, not hang them
            log.exception("engine step loop failed")
            self.error = err
            self._call_in_loop(self._fail_all, EngineDeadError(f"the engine loop failed: {type(err).__name__}"))

    def _record(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            served: Served | None = out.listener
            if served is None:  # a request the server did not add
                continue
            served.tokens += len(out.new_token_ids)
            if served.first_token_at is None:
                served.first_token_at = now
                self.metrics.ttft_seconds.observe(now - served.added_at)
            if out.finished:
                self.metrics.requests_finished.inc()
                if served.tokens > 1:
                    self.metrics.tpot_seconds.observe((now - served.first_token_at) / (served.tokens - 1))

    def _call_in_loop(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.listener in self._open:  # its handler still listens
                out.listener.stream.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for served in self._open:
            served.stream.put_nowait(error)


@dataclass(eq=False)  # a request's record is itself: kept in a set by identity
class Served:
    """Everything the server keeps about one request: where its outputs go, and its timing for TTFT and TPOT
    (set by the step thread)."""

    stream: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    added_at: float = 0.0  # when the engine took it
    first_token_at: float | None = None
    tokens: int = 0


@dataclass
class _Profiling:
    profiler: StepProfiler
    steps_left: int
    done: asyncio.Future[dict]


def _settle_with(future: asyncio.Future[dict], result: dict) -> None:
    if not future.done():  # the client may have gone
        future.set_result(result)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the handler already gave up (client gone)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
