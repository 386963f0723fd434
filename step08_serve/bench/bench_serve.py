"""Concurrency benchmark through the official SDK, and the server's overhead against the bare engine.

Starts the server as a separate process (so the clients do not share its interpreter), then for each
concurrency level runs that many streaming clients at once, each sending `--requests-per-client` requests
back to back (32-token prompts as token ids, `--max-tokens` new tokens, ignore_eos). Measured at the client:
TTFT (request sent -> first chunk), TPOT ((latency - TTFT) / (tokens - 1)), output tok/s over the wall time.
Then stops the server and drives the same engine directly with the same requests, at the same
concurrency, for the overhead ratio. Writes JSON evidence (by default
runs/step08_serve/serve-<device>-<model>.json, ignored by git).

Every flag that is not the benchmark's own builds the engine, as on step08_serve/run.py's command line
(`--step` and that step's own flags included): the server is started with them, and the bare engine is
built from them the same way. `--max-num-seqs` is set to the largest concurrency in both.

    .venv/bin/python step08_serve/bench/bench_serve.py --model random:qwen2.5-7b --device cuda --concurrency 1,2,4,8,16,32
    .venv/bin/python step08_serve/bench/bench_serve.py --model random:qwen2.5-7b --device cuda --concurrency 1,8,32 \
        --step step12_cuda_graph --attn triton
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from common.bench import Workload, default_output, evidence_header, fixed_workload, percentile, run_engine, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.steps import engine_class
from step08_serve.launcher import free_port
from step08_serve.run import add_engine_arguments, build_engine, chosen_step


async def one_request(client: AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    assert first is not None and tokens == max_tokens, "a request did not stream what it asked for"
    return first - start, (end - first) / max(tokens - 1, 1), tokens


async def run_clients(base_url: str, model: str, workload: Workload, concurrency: int) -> dict[str, float]:
    per_client = [workload.prompts[i::concurrency] for i in range(concurrency)]
    results: list[tuple[float, float, int]] = []
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600) as client:

        async def client_loop(prompts: list[list[int]]) -> None:
            for prompt in prompts:
                results.append(await one_request(client, model, prompt, workload.output_lens[0]))

        start = time.perf_counter()
        await asyncio.gather(*[client_loop(p) for p in per_client])
        elapsed = time.perf_counter() - start
    ttft = [r[0] * 1e3 for r in results]
    tpot = [r[1] * 1e3 for r in results]
    total = sum(r[2] for r in results)
    return {
        "concurrency": concurrency, "requests": len(results), "output_tokens": total, "elapsed_s": elapsed,
        "output_tok_per_s": total / elapsed,
        "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
        "tpot_ms_p50": statistics.median(tpot), "tpot_ms_p99": percentile(tpot, 0.99),
    }


def wait_healthy(base_url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy in time")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--concurrency", default="1,2,4,8,16,32", help="clients at once, one run per value")
    bench.add_argument("--requests-per-client", type=at_least(1), default=2)
    bench.add_argument("--prompt-len", type=at_least(1), default=32)
    bench.add_argument("--max-tokens", type=at_least(1), default=128)
    bench.add_argument("--no-direct", action="store_true", help="skip the bare-engine comparison")
    bench.add_argument("--output", type=Path, default=None,
                       help="evidence file (default runs/step08_serve/serve-<device>-<model>.json)")


def build_parser(step: str, add_own_arguments: Callable[[argparse.ArgumentParser], None] = add_bench_arguments,
                 description: str | None = __doc__) -> argparse.ArgumentParser:
    """A benchmark's own flags (these, or another benchmark's), then the engine's that the server is started with."""
    # No abbreviated flags: `engine_argv` tells the benchmark's flags from the engine's by their full names.
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_own_arguments(p)
    add_engine_arguments(p, step)
    return p


def engine_argv(argv: Sequence[str],
                add_own_arguments: Callable[[argparse.ArgumentParser], None] = add_bench_arguments) -> list[str]:
    """The command line without the benchmark's own flags: what the server is started with."""
    bench_only = Parser(add_help=False, allow_abbrev=False)
    add_own_arguments(bench_only)
    return bench_only.parse_known_args(argv)[1]


@contextlib.contextmanager
def server_process(server_argv: Sequence[str]) -> Iterator[str]:
    """step08_serve/run.py with these flags, in a process of its own (the clients do not share its
    interpreter) on a free port: yields its base URL once it is healthy, and stops it on exit."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = os.environ | {"NO_PROXY": "127.0.0.1,localhost"}
    server = subprocess.Popen([sys.executable, "step08_serve/run.py", *server_argv, "--port", str(port)], env=env)
    try:
        wait_healthy(base_url, server)
        yield base_url
    finally:
        server.terminate()
        server.wait(timeout=60)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(chosen_step(argv)).parse_args(argv)
    try:  # before the server starts: a bad value is one line and exit code 2
        check_args(args)
        levels = parse_sizes("--concurrency", args.concurrency)
    except CommandLineError as err:
        return fail(err)
    max_requests = max(levels) * args.requests_per_client
    workload = fixed_workload(max_requests, args.prompt_len, args.max_tokens, seed=1)

    args.max_num_seqs = max(levels)
    server_argv = [*engine_argv(argv), "--max-num-seqs", str(args.max_num_seqs)]  # the last of a flag wins
    config = engine_class(args.step).config_class.from_args(args)
    device, dtype = config.resolved_device(), config.resolved_dtype()
    header = evidence_header(device, args.model, dtype, step=args.step, prompt_len=args.prompt_len,
                             max_tokens=args.max_tokens, requests_per_client=args.requests_per_client,
                             engine_flags=server_argv)
    served: list[dict[str, float]] = []
    with server_process(server_argv) as base_url:
        asyncio.run(run_clients(base_url, args.model, fixed_workload(2, args.prompt_len, 8), 2))  # warm-up
        for c in levels:
            requests = Workload(f"c{c}", workload.prompts[: c * args.requests_per_client],
                                workload.output_lens[: c * args.requests_per_client])
            served.append(asyncio.run(run_clients(base_url, args.model, requests, c)))
            print(f"[serve] concurrency {c:3d}: {served[-1]['output_tok_per_s']:8.1f} tok/s  "
                  f"TTFT p50 {served[-1]['ttft_ms_p50']:7.1f} ms  TPOT p50 {served[-1]['tpot_ms_p50']:6.1f} ms", flush=True)

    direct = []
    if not args.no_direct:
        engine = build_engine(args)  # as the server built its own
        run_engine(engine, fixed_workload(2, args.prompt_len, 8), "warmup")
        for c in levels:
            # The same requests, `c` at a time, as the clients sent them.
            tok = elapsed = 0.0
            for r in range(args.requests_per_client):
                batch = Workload(f"c{c}", workload.prompts[r * c:(r + 1) * c], workload.output_lens[r * c:(r + 1) * c])
                m = run_engine(engine, batch, args.step)
                tok += m.output_tokens
                elapsed += m.elapsed_s
            direct.append({"concurrency": c, "output_tok_per_s": tok / elapsed})
            print(f"[engine] concurrency {c:3d}: {direct[-1]['output_tok_per_s']:8.1f} tok/s", flush=True)

    base = served[0]["output_tok_per_s"]
    for row in served:
        row["vs_concurrency_1"] = row["output_tok_per_s"] / base
    for row, d in zip(served, direct):
        row["direct_engine_tok_per_s"] = d["output_tok_per_s"]
        row["server_vs_direct"] = row["output_tok_per_s"] / d["output_tok_per_s"]
    doc = header | {"runs": served}
    output = args.output or default_output("step08_serve", "serve", device.type, args.model)
    write_json(output, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
