"""Step 11 behind step 08's server: several tokens a step reach a client as correct deltas, a stop string that
falls inside a kept run cuts the text where plain decoding cuts it, and /metrics counts the proposals."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

from common.loading import load_model
from step08_serve.api_server import create_app
from step08_serve.async_engine import AsyncEngine
from step08_serve.launcher import running_server
from step11_speculative_decoding.engine import SpeculativeEngine, SpeculativeEngineConfig

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
MODEL = "tiny-qwen2"  # random weights fall into loops, which n-gram lookup predicts: proposals are kept
PROMPTS = [f"Story number {i} about the sea." for i in range(6)]


def serve(k: int):  # noqa: ANN201
    engine = SpeculativeEngine(load_model(MODEL), SpeculativeEngineConfig(
        device="cpu", attn="torch", block_size=4, num_blocks=400, speculative_tokens=k, speculative_token_cost=0.0))
    return engine, running_server(create_app(AsyncEngine(engine), MODEL, MODEL))


def texts(url: str, stream: bool, **kwargs) -> list[str]:  # noqa: ANN003
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def one(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs
                                                  ).choices[0].message.content
        chunks = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True, **kwargs)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: requests join while others verify
        return list(pool.map(one, PROMPTS))


def test_speculation_behind_the_server_streams_plain_decodings_text() -> None:
    _, server = serve(0)
    with server as url:
        plain = texts(url, stream=False, max_tokens=40)
    stops = [text[len(text) // 2 : len(text) // 2 + 3] for text in plain]
    engine, server = serve(4)
    with server as url:
        assert texts(url, stream=True, max_tokens=40) == plain
        assert texts(url, stream=False, max_tokens=40) == plain
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for prompt, stop, full in zip(PROMPTS, stops, plain, strict=True):  # a stop string amid what was kept
            messages = [{"role": "user", "content": prompt}]
            cut = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                                 stop=[stop])
            assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (full[: full.index(stop)], "stop")
            chunks = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                                    stop=[stop], stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[: full.index(stop)]
        metrics = httpx.get(f"{url}/metrics").text
    assert engine.accepted_tokens > 0
    assert f"llm_speculative_accepted_total {engine.accepted_tokens}" in metrics
    assert not engine.requests and engine.allocator.num_used == 0
