"""A soak: mixed traffic at a steady rate for minutes, then proof that nothing was lost and nothing was kept.

Requests arrive as a Poisson process at `--rate` for `--duration` seconds, each one of the kinds clients send,
in a seeded mix: chat and completions, streamed and not, `n: 2`, a stop string, penalties with sampling,
log-probabilities, and aborts (a streamed request whose client hangs up after its first chunks). Every request
must end as it was sent: answered in full (each choice with its finish reason and the tokens it asked for), or,
for an abort, gone. Meanwhile `/metrics` is read every second: the KV blocks in use and the server's resident
memory. After the run, once the server is idle, the blocks in use must be back to 0 and resident memory within
`--rss-tolerance` of its value at the end of the warm-up: a leak shows as growth across the run.

    .venv/bin/python step08_serve/bench/soak.py --device cpu --model tiny-qwen2 --duration 30 --rate 4
    .venv/bin/python step08_serve/bench/soak.py --model random:qwen2.5-7b --device cuda --duration 300 --rate 8

The evidence (default runs/step08_serve/soak-<device>-<model>.json) holds each kind's outcomes, every failure,
the samples over time and the checks; the exit code is 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, at_least, check_args, fail
from common.loading import load_tokenizer
from common.steps import engine_class
from step08_serve.bench.bench_open_loop import parse_range, poisson_arrivals, prompt_texts, vocabulary_words
from step08_serve.bench.bench_serve import build_parser, engine_argv, server_process
from step08_serve.run import chosen_step


class SoakFailure(RuntimeError):
    """A request did not end as it was sent."""


# ----- the kinds of request ------------------------------------------------------------------------------------


async def chat(client: AsyncOpenAI, model: str, prompt: str, tokens: int) -> str:
    reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})
    expect(reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == tokens,
           f"chat: {reply.usage.completion_tokens} tokens, finish {reply.choices[0].finish_reason}")
    return "answered"


async def chat_stream(client: AsyncOpenAI, model: str, prompt: str, tokens: int) -> str:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    finish, usage = None, None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    expect(finish == "length" and usage is not None and usage.completion_tokens == tokens,
           f"chat-stream: finish {finish}, usage {usage}")
    return "answered"


async def completion_n2(client: AsyncOpenAI, model: str, prompt: str, tokens: int) -> str:
    reply = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens, n=2, temperature=0.8,
                                            seed=7, extra_body={"ignore_eos": True})
    expect(sorted(c.index for c in reply.choices) == [0, 1] and all(c.finish_reason == "length" for c in reply.choices)
           and reply.usage.completion_tokens == 2 * tokens, f"completion-n2: {reply.choices}, {reply.usage}")
    return "answered"


async def completion_stream(client: AsyncOpenAI, model: str, prompt: str, tokens: int) -> str:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    finishes = [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]
    expect(finishes == ["length"], f"completion-stream: finishes {finishes}")
    return "answered"


async def stop_string(client: AsyncOpenAI, model: str, prompt: str, tokens: int) -> str:
    reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=tokens, temperature=0, stop=["e"],
                                                 extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    expect(choice.finish_reason in ("stop", "length") and "e" not in (choice.message.content or ""),
           f"stop: finish {choice.finish_reason}, text {choice.message.content!r}")
    return "answered"


async def penalties(client: AsyncOpenAI, model: str, prompt: str, tokens: int) -> str:
    reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=tokens, temperature=0.8, seed=3, presence_penalty=0.5,
                                                 frequency_penalty=0.5, extra_body={"ignore_eos": True})
    expect(reply.usage.completion_tokens == tokens, f"penalties: {reply.usage.completion_tokens} tokens")
    return "answered"


async def logprobs(client: AsyncOpenAI, model: str, prompt: str, tokens: int) -> str:
    reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=tokens, temperature=0, logprobs=True, top_logprobs=5,
                                                 extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else []
    expect(len(content) == tokens and all(len(t.top_logprobs) == 5 for t in content),
           f"logprobs: {len(content)} entries for {tokens} tokens")
    return "answered"


async def abort(client: AsyncOpenAI, model: str, prompt: str, tokens: int) -> str:
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=tokens, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
    chunks = 0
    async for _ in stream:
        chunks += 1
        if chunks == 2:
            break
    await stream.close()  # the client hangs up: the server must abort the request and free it
    return "aborted"


KINDS: dict[str, Callable[[AsyncOpenAI, str, str, int], Awaitable[str]]] = {
    "chat": chat, "chat-stream": chat_stream, "completion-n2": completion_n2, "completion-stream": completion_stream,
    "stop": stop_string, "penalties": penalties, "logprobs": logprobs, "abort": abort,
}


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise SoakFailure(what)


# ----- watching the server --------------------------------------------------------------------------------------


async def sample(http: httpx.AsyncClient, base_url: str, started: float) -> dict[str, float]:
    """One reading of /metrics: the KV blocks in use, the requests running, the server's resident memory."""
    text = (await http.get(f"{base_url}/metrics")).text
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {"t_s": round(time.perf_counter() - started, 2), "kv_blocks_used": values.get("llm_kv_blocks_used", 0.0),
            "requests_running": values.get("llm_requests_running", 0.0),
            "rss_mib": values.get("process_resident_memory_bytes", 0.0) / 2**20}


async def soak(base_url: str, model: str, prompts: Sequence[str], kinds: Sequence[str], output_lens: Sequence[int],
               arrivals: Sequence[float], warmup_s: float) -> dict[str, Any]:
    """Send every request at its arrival time, watch /metrics meanwhile, then wait for the server to be idle."""
    outcomes: Counter[tuple[str, str]] = Counter()
    failures: list[str] = []
    samples: list[dict[str, float]] = []
    async with (AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600) as client,
                httpx.AsyncClient(timeout=30) as http):
        started = time.perf_counter()

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - started)))
            try:
                outcomes[kinds[i], await KINDS[kinds[i]](client, model, prompts[i], output_lens[i])] += 1
            except Exception as err:  # noqa: BLE001 (every failure is counted and named, none stops the soak)
                outcomes[kinds[i], "failed"] += 1
                failures.append(f"request {i} ({kinds[i]}): {type(err).__name__}: {err}")

        async def watch() -> None:
            while True:
                samples.append(await sample(http, base_url, started))
                await asyncio.sleep(1.0)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(send(i) for i in range(len(kinds))))
        watcher.cancel()
        traffic_s = time.perf_counter() - started
        idle = await sample(http, base_url, started)
        deadline = time.perf_counter() + 30
        while (idle["kv_blocks_used"] or idle["requests_running"]) and time.perf_counter() < deadline:
            await asyncio.sleep(0.5)  # aborted requests are freed by the step loop: give it a moment
            idle = await sample(http, base_url, started)
    after_warmup = next((s for s in samples if s["t_s"] >= warmup_s), samples[-1])
    named = {f"{kind} {outcome}": n for (kind, outcome), n in sorted(outcomes.items())}
    return {"traffic_s": traffic_s, "outcomes": named, "failures": failures, "samples": samples,
            "rss_mib_after_warmup": after_warmup["rss_mib"], "idle": idle}


def checks(result: dict[str, Any], requests: int, rss_tolerance: float) -> dict[str, Any]:
    """What must hold after a soak: none lost, no KV block held, resident memory back near its warm value."""
    ended = sum(result["outcomes"].values())
    failed = sum(n for name, n in result["outcomes"].items() if name.endswith(" failed"))
    rss_ratio = result["idle"]["rss_mib"] / result["rss_mib_after_warmup"] if result["rss_mib_after_warmup"] else None
    return {
        "lost_requests": requests - ended + failed,
        "kv_blocks_used_after": result["idle"]["kv_blocks_used"],
        "requests_running_after": result["idle"]["requests_running"],
        "rss_after_vs_warm": rss_ratio,
        "passed": (ended == requests and failed == 0 and result["idle"]["kv_blocks_used"] == 0
                   and result["idle"]["requests_running"] == 0
                   and rss_ratio is not None and rss_ratio <= 1 + rss_tolerance),
    }


# ----- the command line -------------------------------------------------------------------------------------------


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    soak_args = parser.add_argument_group("soak")
    soak_args.add_argument("--duration", type=at_least(1, float), default=300.0,
                           help="seconds of traffic (default 300)")
    soak_args.add_argument("--rate", type=at_least(0, float), default=4.0,
                           help="requests per second, arriving as a Poisson process (default 4)")
    soak_args.add_argument("--warmup", type=at_least(0, float), default=None,
                           help="seconds after which resident memory is taken as the reference (default: a fifth)")
    soak_args.add_argument("--prompt-words", type=at_least(1), default=64, help="words in each prompt (default 64)")
    soak_args.add_argument("--output-len-range", default="16,64",
                           help="MIN,MAX new tokens per request (default 16,64)")
    soak_args.add_argument("--rss-tolerance", type=at_least(0, float), default=0.05,
                           help="how far above its warm value resident memory may end (default 0.05)")
    soak_args.add_argument("--traffic-seed", type=int, default=0, help="seed of the kinds, lengths and arrivals")
    soak_args.add_argument("--output", type=Path, default=None,
                           help="evidence file (default runs/step08_serve/soak-<device>-<model>.json)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(chosen_step(argv), add_soak_arguments, __doc__).parse_args(argv)
    try:
        check_args(args)
        low, high = parse_range("--output-len-range", args.output_len_range)
        if args.rate <= 0:
            raise CommandLineError(f"--rate must be above 0, got {args.rate}")
    except CommandLineError as err:
        return fail(err)
    requests = max(1, round(args.rate * args.duration))
    rng = random.Random(args.traffic_seed)
    kinds = [rng.choice(sorted(KINDS)) for _ in range(requests)]
    output_lens = [rng.randint(low, high) for _ in range(requests)]
    words = vocabulary_words(load_tokenizer(args.model))
    prompts = prompt_texts(words, [args.prompt_words] * requests, f"soak-{args.traffic_seed}")
    arrivals = poisson_arrivals(requests, args.rate, args.traffic_seed)
    warmup_s = args.duration / 5 if args.warmup is None else args.warmup

    server_argv = engine_argv(argv, add_soak_arguments)
    config = engine_class(args.step).config_class.from_args(args)
    header = evidence_header(config.resolved_device(), args.model, config.resolved_dtype(), step=args.step,
                             duration_s=args.duration, rate=args.rate, requests=requests, kinds=sorted(KINDS),
                             prompt_words=args.prompt_words, output_len_range=[low, high],
                             traffic_seed=args.traffic_seed, warmup_s=warmup_s, rss_tolerance=args.rss_tolerance,
                             engine_flags=server_argv)
    with server_process(server_argv) as base_url:
        result = asyncio.run(soak(base_url, args.model, prompts, kinds, output_lens, arrivals, warmup_s))
    result["checks"] = checks(result, requests, args.rss_tolerance)
    output = args.output or default_output("step08_serve", "soak", config.resolved_device().type, args.model)
    write_json(output, header | result)
    c = result["checks"]
    rss = "unknown" if c["rss_after_vs_warm"] is None else f"{c['rss_after_vs_warm']:.3f}x"
    print(f"[soak] {requests} requests over {result['traffic_s']:.0f} s: {c['lost_requests']} lost, "
          f"{c['kv_blocks_used_after']:.0f} KV blocks used after, resident memory {rss} its warm value: "
          f"{'PASSED' if c['passed'] else 'FAILED'}")
    for failure in result["failures"][:10]:
        print(f"[soak] {failure}")
    return 0 if c["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
