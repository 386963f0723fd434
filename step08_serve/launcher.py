"""Building the served engine from command-line choices, and running uvicorn in a background thread
(for `--dry-run`, the tests and the benchmark, which talk to a real server over loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only: run.py reads DEFAULT_STEP before anything heavy loads
    from fastapi import FastAPI

    from step08_serve.async_engine import AsyncEngine

# The server drives any step of common/steps.py (`--step`). The default is the final engine, step 16, on every
# device: on a GPU its graphs, fused decode and overlapped host; on a CPU the eager path of step 10 (step 09's budget
# and prefix caching) that steps 12 to 15 run there; on both, output held to a format where a request names one
# (`response_format`), each step bounded by a token budget, and each request's `priority` honoured.
DEFAULT_STEP = "step16_structured_output"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Serve `app` from a background thread; yields the base URL and stops the server on exit."""
    import uvicorn

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def serve(app: FastAPI, async_engine: AsyncEngine, host: str, port: int, grace_s: float) -> None:
    """Serve `app` until SIGTERM or Ctrl-C, then shut down gracefully: `/health` turns 503 and new requests are
    refused at once; those in flight may finish for up to `grace_s` seconds; the rest end with an error their
    clients read (an error event, or a 503); then the engine stops and the process exits 0. A second signal
    stops at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame: object) -> None:
            if self.draining or async_engine.unavailable() is not None:  # a second signal, or nothing to drain
                self.should_exit = self.force_exit = True
                return
            self.draining = True
            print(f"[serve] signal {signal.Signals(sig).name}: no new requests; those running get {grace_s:g} s "
                  "to finish", flush=True)
            loop = asyncio.get_running_loop()  # the handler runs on the loop's thread, between its callbacks
            loop.call_soon_threadsafe(lambda: loop.create_task(self.drain()))

        async def drain(self) -> None:
            await async_engine.shutdown(grace_s)
            self.should_exit = True  # uvicorn closes the connections, then the app's lifespan stops the engine

    DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="info")).run()
