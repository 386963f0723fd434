"""Bursts of long chat requests through step 08's server: every request answered, the server alive after.

Starts the server as a process with the engine flags given (as step08_serve/bench/bench_serve.py does), then for
each burst of `--bursts` (REQUESTSxTOKENS) sends that many streaming chat completions at once, each a user
message of about TOKENS tokens of text, asking for `--max-tokens` tokens. Checked after each burst, and
recorded: every response's status, `/health`, and `/metrics` (no request running or waiting, no KV block in
use). Measured at the client: time to first token (median, 99th percentile, longest) and the time until the
last request finished. Writes JSON evidence (by default runs/step09_chunked_prefill/burst-serve-<device>-<model>.json).

    .venv/bin/python step09_chunked_prefill/bench/bench_burst_serve.py --bursts 8x300 --max-tokens 8
    .venv/bin/python step09_chunked_prefill/bench/bench_burst_serve.py --device cuda --model random:qwen2.5-7b \\
        --step step13_fused_decode --bursts 64x2000,256x4000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from openai import APIError, AsyncOpenAI

from common.bench import default_output, evidence_header, percentile, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail
from common.loading import embedded_tokenizer
from common.steps import engine_class
from step08_serve.bench.bench_serve import engine_argv, server_process
from step08_serve.run import add_engine_arguments, chosen_step

WORDS_ID_RANGE = (1000, 40000)  # ordinary text pieces of the tokenizer: any of them reads back as text


def parse_bursts(text: str) -> list[tuple[int, int]]:
    bursts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", part)
        if not match or int(match[1]) < 1 or int(match[2]) < 1:
            raise CommandLineError(f"--bursts takes REQUESTSxTOKENS pairs like 64x2000,256x4000 (got {text!r})")
        bursts.append((int(match[1]), int(match[2])))
    return bursts


def long_messages(count: int, tokens: int, seed: int) -> list[str]:
    """`count` different user messages of about `tokens` tokens each (random text pieces, decoded)."""
    tokenizer, rng = embedded_tokenizer(), random.Random(seed)
    return [tokenizer.decode([rng.randrange(*WORDS_ID_RANGE) for _ in range(tokens)]) for _ in range(count)]


async def one_chat(client: AsyncOpenAI, model: str, text: str, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter()
            usage = chunk.usage or usage
    except APIError as err:  # a status other than 200, or an error event in the stream
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
    end = time.perf_counter()
    return {"ok": usage is not None and usage.completion_tokens == max_tokens, "ttft_s": (first or end) - start,
            "latency_s": end - start, "prompt_tokens": usage.prompt_tokens if usage else 0}


def scrape(base_url: str) -> dict[str, Any]:
    """/health's status, and the engine's gauges from /metrics."""
    health = httpx.get(f"{base_url}/health", timeout=10).status_code
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    gauges = {}
    for name in ("llm_requests_running", "llm_requests_waiting", "llm_kv_blocks_used"):
        match = re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)
        gauges[name] = float(match[1]) if match else None
    return {"health_status": health, **gauges}


async def burst(base_url: str, model: str, texts: list[str], max_tokens: int) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=1800) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[one_chat(client, model, t, max_tokens) for t in texts])
        elapsed = time.perf_counter() - start
    answered = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] * 1e3 for r in answered] or [float("nan")]
    return {
        "requests": len(texts), "answered": len(answered), "errors": sorted({r["error"] for r in results if not r["ok"] and "error" in r}),
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in answered) if answered else 0,
        "elapsed_s": elapsed, "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
        "ttft_ms_max": max(ttft),
    }


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--bursts", default="8x300", help="REQUESTSxTOKENS, comma-separated, one burst each")
    bench.add_argument("--max-tokens", type=at_least(1), default=16, help="tokens each request generates")
    bench.add_argument("--output", type=Path, default=None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_bench_arguments(parser)
    add_engine_arguments(parser, chosen_step(argv))
    args = parser.parse_args(argv)
    try:
        check_args(args)
        bursts = parse_bursts(args.bursts)
    except CommandLineError as err:
        return fail(err)
    args.max_num_seqs = max(n for n, _ in bursts)
    server_argv = [*engine_argv(argv, add_bench_arguments), "--max-num-seqs", str(args.max_num_seqs)]
    config = engine_class(args.step).config_class.from_args(args)
    device, dtype = config.resolved_device(), config.resolved_dtype()
    header = evidence_header(device, args.model, dtype, step=args.step, max_tokens=args.max_tokens,
                             engine_flags=server_argv)
    output = args.output or default_output("step09_chunked_prefill", "burst-serve", device.type, args.model)
    runs: list[dict[str, Any]] = []
    with server_process(server_argv) as base_url:
        asyncio.run(burst(base_url, args.model, long_messages(2, 64, seed=0), 4))  # warm-up
        for i, (count, tokens) in enumerate(bursts):
            row = {"burst": f"{count}x{tokens}"} | asyncio.run(
                burst(base_url, args.model, long_messages(count, tokens, seed=1 + i), args.max_tokens))
            time.sleep(1.0)  # let the step loop retire the last requests before /metrics is read
            row |= scrape(base_url)
            runs.append(row)
            write_json(output, header | {"runs": runs})
            print(f"[burst {row['burst']}] {row['answered']}/{count} answered, TTFT p50 {row['ttft_ms_p50']:.0f} ms "
                  f"max {row['ttft_ms_max']:.0f} ms, {row['elapsed_s']:.1f} s; /health {row['health_status']}, "
                  f"running {row['llm_requests_running']}, blocks used {row['llm_kv_blocks_used']}", flush=True)
    ok = all(r["answered"] == r["requests"] and r["health_status"] == 200 and not r["llm_requests_running"]
             and not r["llm_kv_blocks_used"] for r in runs)
    print(f"every request answered and nothing left: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
