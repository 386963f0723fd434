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

What can go wrong, and what each costs:
- one request's handling raises inside the engine (`Request.fail`): that request alone ends with an error;
- the step itself raises (an out-of-memory error in a forward, a bug): every request in flight ends with a 503,
  the engine frees what they held, and the server takes no more (`/health` says so at once): a supervisor
  restarts it, since the state of a half-run step cannot be trusted;
- a client stops reading its stream: the step loop never waits for it, and once `max_queued_outputs` outputs wait
  for it unread its request is aborted (`SlowReaderError`);
- shutdown (`shutdown`): no new request is taken, those in flight may finish for a grace period, the rest end
  with an error their clients can read.
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


class UnavailableError(RuntimeError):
    """No request can be served now (a 503)."""


class EngineDeadError(UnavailableError):
    """The step loop stopped on an error; no request can be served."""


class ShuttingDownError(UnavailableError):
    """The server is shutting down: it takes no new request, and ends those still running after a grace period."""


class SlowReaderError(RuntimeError):
    """The client read its stream so slowly that too many outputs waited for it: its request was aborted."""


class RequestFailedError(RuntimeError):
    """Handling one request raised inside the engine (`Request.fail`): it ended alone, the others go on."""


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued_outputs: int = 4096) -> None:
        self.engine = engine
        self.max_queued_outputs = max_queued_outputs  # unread outputs a stream may hold before it is dropped
        self.metrics = ServingMetrics(engine, self.num_open_streams)  # counted by the step thread, read by /metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._open: set[Served] = set()  # the requests whose handler still listens
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.draining = False  # shutting down: no new request is taken
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

    def unavailable(self) -> UnavailableError | None:
        """Why no request can be served now, or None if one can (what `/health` answers)."""
        if self.error is not None:
            return EngineDeadError(f"the engine step failed ({type(self.error).__name__}: {self.error}); this "
                                   "server takes no more requests: restart it")
        if not self.alive:
            return EngineDeadError("the engine loop is not running")
        if self.draining:
            return ShuttingDownError("the server is shutting down: send the request to another server, or retry "
                                     "once it is back")
        return None

    async def shutdown(self, grace_s: float, settle_s: float = 5.0) -> None:
        """Stop taking requests; let those in flight finish for up to `grace_s` seconds; then end the rest with
        `ShuttingDownError` (their handlers answer it: an error event, or a 503) and give their handlers up to
        `settle_s` seconds to let go, which aborts their engine requests."""
        assert self._loop is not None
        self.draining = True
        deadline = self._loop.time() + grace_s
        while self._open and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._open:
            log.warning("shutdown: ending %d requests still running after the %.1f s grace period",
                        len(self._open), grace_s)
            self._fail_all(ShuttingDownError(f"the server shut down before this request finished (it waited "
                                             f"{grace_s:g} s)"))
        deadline = self._loop.time() + settle_s
        while self._open and self._loop.time() < deadline:
            await asyncio.sleep(0.05)

    # ----- what handlers call --------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. Leaving early (client gone, task cancelled) aborts the request."""
        refusal = self.unavailable()
        if refusal is not None:
            raise refusal
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
        refusal = self.unavailable()
        if refusal is not None:
            raise refusal
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
            self._free_all()
            self._call_in_loop(self._fail_all, self.unavailable())

    def _free_all(self) -> None:
        """After a failed step: abort every request the engine holds, so that their KV blocks and any memory
        they hold are given back (the server takes no more; what it held is released all the same)."""
        for request_id in list(self.engine.requests):
            try:
                self._abort(request_id)
            except Exception:  # noqa: BLE001 (a broken request must not keep the others' memory)
                log.exception("could not free request %s after the failed step", request_id)

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
            served = out.listener
            if served not in self._open:  # its handler no longer listens
                continue
            if served.stream.qsize() >= self.max_queued_outputs:  # its client does not read: drop it
                self._drop_slow_reader(served, out.request_id)
                continue
            served.stream.put_nowait(out)

    def _drop_slow_reader(self, served: Served, request_id: str) -> None:
        """Abort the request, forget what waits unread, and leave the error for its handler, if it reads again."""
        log.warning("request %s: %d outputs waited unread; its client is dropped", request_id,
                    served.stream.qsize())
        self._open.discard(served)
        while not served.stream.empty():
            served.stream.get_nowait()
        served.stream.put_nowait(SlowReaderError(f"more than {self.max_queued_outputs} outputs waited unread for "
                                                 "this stream: the request was aborted"))
        self.metrics.slow_readers_dropped.inc()
        self._submit(lambda: self._abort(request_id))

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
