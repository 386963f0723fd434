"""Faults the server survives (step 08), each through the official SDK or raw HTTP:
- an exception while handling one request's token (its text, its stop strings) ends that request alone with an
  error in the OpenAI envelope; the other requests get their full answers, `/health` stays 200, nothing is left;
- a failing step (an out-of-memory error in a forward) ends every request in flight with a 503 or an error event,
  `/health` says so at once, and every KV block is freed;
- a client that stops reading its stream is dropped once too many outputs wait for it, and the others go on;
- SIGTERM during 16 streams: the short ones finish, the rest end with an error event within the grace period, new
  requests are refused, and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from openai import APIError, APIStatusError, InternalServerError, OpenAI

from common.loading import load_model
from common.request import FinishReason, Request
from common.sampling import SamplingParams
from common.steps import STEPS
from step08_serve.launcher import free_port, running_server
from tests.test_sampling_controls import ALWAYS_PROPOSE, make_engine
from tests.test_step08_serve import MODEL, Served, chat, client, served  # noqa: F401 (fixtures)

TRIGGER = "\x00fail here"  # a stop string no text contains: the injected fault looks for it


@pytest.fixture()
def faulty_stop_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop-string check that raises for requests carrying TRIGGER among their stop strings."""
    check = Request._cut_at_stop_string

    def failing(self: Request) -> None:
        if TRIGGER in self.params.stop and len(self.output_token_ids) >= 3:
            raise RuntimeError("the stop check broke")
        check(self)

    monkeypatch.setattr(Request, "_cut_at_stop_string", failing)


@pytest.mark.usefixtures("faulty_stop_check")
@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_request_ends_alone(served: tuple[Served, str], client: OpenAI, stream: bool) -> None:
    expected = chat(client, "Tell me about the sea.", max_tokens=16).choices[0].message.content
    answers: dict[str, str] = {}

    def healthy(name: str) -> None:
        answers[name] = chat(client, "Tell me about the sea.", max_tokens=16).choices[0].message.content

    threads = [threading.Thread(target=healthy, args=(f"client {i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    # Not streamed: a 500 (InternalServerError); streamed, after its first chunks: an error event (APIError).
    with pytest.raises(APIError) as failed:
        reply = chat(client, "Tell me about the sea.", max_tokens=16, stop=[TRIGGER], stream=stream)
        for _ in reply:  # streamed: the error arrives as an event after the first chunks
            pass
    for thread in threads:
        thread.join()
    assert "the stop check broke" in str(failed.value)
    assert isinstance(failed.value, InternalServerError) != stream
    assert answers == {f"client {i}": expected for i in range(3)}
    assert httpx.get(f"{served[1]}/health").status_code == 200
    served[0].assert_idle()


@pytest.mark.usefixtures("faulty_stop_check")
@pytest.mark.parametrize(("step", "config"), [("step03_vectorized_gather", {}),
                                              (STEPS[-1].name, {"speculative_tokens": 4, **ALWAYS_PROPOSE})],
                         ids=["step03", "final-speculative"])
def test_the_engine_ends_the_request_with_an_error_output(served: tuple[Served, str], step: str,
                                                          config: dict) -> None:
    """Below the server: the failing request's last output says ERROR and why, its blocks are free, and its
    neighbour finishes normally; also where it emits several verified tokens at once (speculation)."""
    engine = make_engine(served[0].engine.loaded, step, num_blocks=64, **config)
    prompt = "one two three four " * 6  # repeated text: the n-gram proposer finds proposals
    failing = engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop=[TRIGGER]))
    plain = engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
    assert last[failing].finish_reason is FinishReason.ERROR and "the stop check broke" in last[failing].error
    assert last[plain].finish_reason is FinishReason.LENGTH and last[plain].error is None
    assert engine.allocator.num_used == 0 and not engine.requests
    if config:
        assert engine.proposed_tokens > 0  # proposals were verified in this run: the path that emits several tokens


# ----- a failing step ------------------------------------------------------------------------------------------


@pytest.fixture()
def own_server() -> Iterator[tuple[Served, str, OpenAI]]:
    """A server of its own: these tests break it."""
    s = Served(load_model(MODEL), MODEL, num_blocks=600)
    with running_server(s.app) as url:
        yield s, url, OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_a_failing_step_ends_every_request_and_health_says_so(own_server: tuple[Served, str, OpenAI]) -> None:
    served, url, client = own_server
    forward = served.engine.model.forward
    out_of_memory = threading.Event()

    def failing_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if out_of_memory.is_set():
            raise torch.OutOfMemoryError("injected: out of memory in a forward")
        return forward(*args, **kwargs)

    served.engine.model.forward = failing_forward  # type: ignore[method-assign]
    began = threading.Barrier(3)  # two streams and the test
    errors: dict[str, BaseException] = {}

    def streaming(name: str) -> None:
        try:
            reply = chat(client, max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
            for i, _ in enumerate(reply):
                if i == 1:
                    began.wait()
        except APIError as err:
            errors[name] = err

    def whole() -> None:
        try:
            chat(client, max_tokens=1500, extra_body={"ignore_eos": True})
        except APIError as err:
            errors["whole"] = err

    threads = [threading.Thread(target=streaming, args=(f"stream {i}",)) for i in range(2)]
    threads.append(threading.Thread(target=whole))
    for thread in threads:
        thread.start()
    began.wait(timeout=60)
    out_of_memory.set()
    for thread in threads:
        thread.join(timeout=60)
    assert set(errors) == {"stream 0", "stream 1", "whole"}  # every request in flight ended with an error
    assert isinstance(errors["whole"], APIStatusError) and errors["whole"].status_code == 503
    assert all("OutOfMemoryError" in str(err) for err in errors.values())
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "restart it" in health.json()["error"]["message"]
    with pytest.raises(APIStatusError) as refused:  # no new request is taken
        chat(client)
    assert refused.value.status_code == 503
    engine = served.engine
    assert engine.allocator.num_used == 0 and not engine.requests and not engine.running


# ----- a client that stops reading ----------------------------------------------------------------------------


def test_a_client_that_stops_reading_is_dropped_and_the_others_go_on(own_server: tuple[Served, str, OpenAI]
                                                                     ) -> None:
    served, url, client = own_server
    served.async_engine.max_queued_outputs = 32
    expected = chat(client, max_tokens=64, extra_body={"ignore_eos": True}).choices[0].message.content
    host, port = url.removeprefix("http://").split(":")
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes block soon
    reader.connect((host, int(port)))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                       "max_tokens": 2000, "ignore_eos": True, "stream": True,
                       "logprobs": True, "top_logprobs": 20})  # large events: they fill the kernel's buffers sooner
    reader.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    try:  # it never reads: while its outputs pile up, another client is served in full
        deadline = time.monotonic() + 60
        dropped = served.async_engine.metrics.slow_readers_dropped
        while dropped._value.get() == 0:
            assert time.monotonic() < deadline, "the reader was never dropped"
            assert chat(client, max_tokens=64, extra_body={"ignore_eos": True}).choices[0].message.content == expected
        served.assert_idle(timeout=30)  # its request was aborted: no block is held for it
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        reader.close()


# ----- SIGTERM ---------------------------------------------------------------------------------------------------


def test_sigterm_lets_short_streams_finish_and_ends_the_rest_within_the_grace_period() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    grace = 3.0
    server = subprocess.Popen([sys.executable, "step08_serve/run.py", "--model", MODEL, "--device", "cpu",
                               "--port", str(port), "--shutdown-grace", str(grace)],
                              env=os.environ | {"NO_PROXY": "127.0.0.1,localhost"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        began = threading.Barrier(17)
        endings: dict[int, tuple[str, float]] = {}

        def stream(i: int) -> None:
            max_tokens = 24 if i % 2 else 1800  # odd: short enough to finish in the grace period
            try:
                reply = chat(client, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
                for n, chunk in enumerate(reply):
                    if n == 0:
                        began.wait()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        endings[i] = (chunk.choices[0].finish_reason, time.monotonic())
            except APIError as err:
                endings[i] = (f"error: {err}", time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        began.wait(timeout=60)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises((APIStatusError, APIError)):  # draining: no new request is taken
            chat(client)
        for thread in threads:
            thread.join(timeout=60)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert sorted(endings) == list(range(16))  # every stream ended with a final chunk or an error
    assert all(endings[i][0] == "length" for i in range(1, 16, 2))
    long_ones = [endings[i] for i in range(0, 16, 2)]
    assert all(ending.startswith("error:") and "shut down" in ending for ending, _ in long_ones)
    assert all(at - signalled < grace + 2 for _, at in long_ones)


def test_the_server_flags_reach_the_step_loop() -> None:
    """--max-queued-outputs bounds each stream's unread outputs; a bad value is one line, before any model loads."""
    from step08_serve.run import build_app, parse_args

    app = build_app(parse_args(["--model", MODEL, "--device", "cpu", "--max-queued-outputs", "7"]))
    assert app.state.async_engine.max_queued_outputs == 7
    refused = subprocess.run([sys.executable, "step08_serve/run.py", "--shutdown-grace", "-1"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "--shutdown-grace" in refused.stderr
