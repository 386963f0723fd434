"""Faults the server survives (step 08): an exception while handling one request's token (its text, its stop
strings) ends that request alone with an error in the OpenAI envelope; the other requests get their full answers,
`/health` stays 200, and nothing is left behind."""

from __future__ import annotations

import threading

import httpx
import pytest
from openai import APIError, InternalServerError, OpenAI

from common.request import FinishReason, Request
from common.sampling import SamplingParams
from common.steps import STEPS
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
