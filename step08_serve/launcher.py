"""Building the served engine from command-line choices, and running uvicorn in a background thread
(for `--dry-run`, the tests and the benchmark, which talk to a real server over loopback)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from common.engine import Engine
from step01_serial.engine import SerialEngine
from step02_paged_kv.engine import PagedEngine
from step03_vectorized_gather.engine import VectorizedGatherEngine
from step06_paged_attention.engine import PagedAttentionEngine
from step07_preemption.engine import PreemptionEngine
from step12_cuda_graph.engine import CudaGraphEngine

# Every step the server can drive. The default is the most capable one whose GPU path has been measured.
STEPS: dict[str, type[Engine]] = {
    "step01_serial": SerialEngine,
    "step02_paged_kv": PagedEngine,
    "step03_vectorized_gather": VectorizedGatherEngine,
    "step06_paged_attention": PagedAttentionEngine,
    "step07_preemption": PreemptionEngine,  # honours each request's `priority`
    "step12_cuda_graph": CudaGraphEngine,  # step 07 with decode replayed as CUDA graphs
}
DEFAULT_STEP = "step07_preemption"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Serve `app` from a background thread; yields the base URL and stops the server on exit."""
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
