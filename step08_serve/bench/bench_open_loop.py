"""Open-loop benchmark: latency against request rate, and goodput, measured at the client through the official SDK.

A closed loop (bench_serve.py) keeps a fixed number of clients, each waiting for its answer before it sends again:
when the server slows down, the clients slow down with it, so the queue never outgrows their number and the tail
stays hidden. Here requests arrive on their own clock, as users' do, whether or not earlier ones have finished:
past the rate the server sustains, requests queue and the time to first token climbs, which is what this measures.

For each rate of `--request-rates` (requests/s; `inf` sends them all at once), `--num-requests` streaming chat
requests arrive as a Poisson process (exponential gaps between arrivals, seeded). Each asks for an output length
drawn uniformly from `--output-len-range` (ignore_eos, greedy), on a user message of random words of the model's
vocabulary, its length in tokens drawn uniformly from `--prompt-len-range` (the chat template adds its own few
dozen). The lengths are the same at every rate; the words differ, so no rate reuses another's cached prefixes.
Measured at the client, per request: TTFT (sent -> first content chunk), ITL (each gap between content chunks),
TPOT ((E2E - TTFT) / (tokens - 1)), E2E. Per rate: requests completed and failed (with their errors), achieved
requests/s and output tok/s, each latency's mean, p50, p90 and p99, and goodput: completed requests per second
that met both `--goodput-ttft-ms` and `--goodput-tpot-ms`.

By default it starts this project's server with every flag that is not the benchmark's own (as bench_serve.py
does; `--max-num-seqs` is the engine's, default 256). With `--base-url` and `--served-model` it drives a server
that is already running, such as a peer (`transformers serve`); `--model` then only names the tokenizer the prompts
are built from, so give both runs the same one. Writes JSON evidence (by default
runs/step08_serve/open-loop-<device>-<model>.json, ignored by git) and its plot beside it (common/plots/latency.py).

    .venv/bin/python step08_serve/bench/bench_open_loop.py --model random:qwen2.5-7b --device cuda \\
        --request-rates 1,2,4,8,16,inf --label ours
    .venv/bin/python step08_serve/bench/bench_open_loop.py --base-url http://127.0.0.1:8001 \\
        --served-model Qwen/Qwen2.5-7B-Instruct --model Qwen/Qwen2.5-7B-Instruct --label "transformers serve"
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from openai import APIError, AsyncOpenAI, DefaultAsyncHttpxClient

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, at_least, check_args, fail, parse_sizes
from common.steps import engine_class
from common.tokenizer import Tokenizer
from step08_serve.bench.bench_serve import build_parser, engine_argv, server_process
from step08_serve.run import chosen_step

WARMUP_REQUESTS = 2  # before the sweep, not measured: the first requests pay for allocations and compilation
# With --base-url, the engine's flags that still mean something: the tokenizer, and the device and dtype recorded.
EXTERNAL_FLAGS = {"--model", "--device", "--dtype"}


# ----- the command line ----------------------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    """`"1,2,inf"` -> [1.0, 2.0, inf]: request rates, each a number above 0 or inf."""
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        rates = []
    # `not rate > 0` rather than `rate <= 0`: it also refuses nan.
    if not rates or any(not rate > 0 for rate in rates):
        raise CommandLineError(f"--request-rates takes comma-separated numbers above 0 or inf, like 1,2,4,inf "
                               f"(got {text!r})")
    return rates


def parse_range(flag: str, text: str) -> tuple[int, int]:
    """`"100,2000"` -> (100, 2000): the smallest and largest of a uniform draw of whole numbers."""
    try:
        sizes = parse_sizes(flag, text)
    except CommandLineError:
        sizes = []  # refused below, with what a range takes
    if len(sizes) != 2 or sizes[0] > sizes[1]:
        raise CommandLineError(f"{flag} takes MIN,MAX, whole numbers of at least 1 with MIN no more than MAX, "
                               f"like 100,2000 (got {text!r})")
    return sizes[0], sizes[1]


def check_server_choice(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Either this project's server, built from the engine flags, or a running one named by URL and model."""
    if args.base_url is None:
        if args.served_model is not None:
            raise CommandLineError("--served-model names the model of a running server: give its --base-url too")
        return
    if not args.base_url.startswith(("http://", "https://")):
        raise CommandLineError(f"--base-url takes http://HOST:PORT (got {args.base_url!r})")
    if args.served_model is None:
        raise CommandLineError("--base-url needs --served-model: the model id that server answers to")
    engine_flags = {arg.partition("=")[0] for arg in engine_argv(argv, add_bench_arguments) if arg.startswith("--")}
    if engine_flags - EXTERNAL_FLAGS:
        raise CommandLineError(f"{', '.join(sorted(engine_flags - EXTERNAL_FLAGS))} build this project's engine, "
                               "and with --base-url the server is already running: leave them out")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--request-rates", default="1,2,4,8,inf",
                       help="requests/s, one run each; inf sends every request at once (default 1,2,4,8,inf)")
    bench.add_argument("--num-requests", type=at_least(1), default=200, help="requests at each rate (default 200)")
    bench.add_argument("--prompt-len-range", default="100,2000",
                       help="MIN,MAX tokens of each user message, drawn uniformly (default 100,2000)")
    bench.add_argument("--output-len-range", default="50,500",
                       help="MIN,MAX tokens each request generates, drawn uniformly (default 50,500)")
    bench.add_argument("--workload-seed", type=int, default=0, help="seeds the lengths, the words and the arrivals")
    bench.add_argument("--goodput-ttft-ms", type=float, default=1000.0,
                       help="a request counts toward goodput if its TTFT is at most this (default 1000)")
    bench.add_argument("--goodput-tpot-ms", type=float, default=100.0,
                       help="... and its TPOT at most this (default 100)")
    bench.add_argument("--base-url", default=None,
                       help="drive the server already running here (http://HOST:PORT, no /v1) instead of starting ours")
    bench.add_argument("--served-model", default=None, help="with --base-url: the model id that server answers to")
    bench.add_argument("--no-ignore-eos", action="store_true",
                       help="do not send ignore_eos (for a server that refuses the field, as transformers serve does):"
                            " a request may then end early at an end-of-sequence token")
    bench.add_argument("--label", default=None,
                       help="names this run in the evidence and the plot (default: the step, or --served-model)")
    bench.add_argument("--output", type=Path, default=None,
                       help="evidence file (default runs/step08_serve/open-loop-<device>-<model>.json)")


# ----- the workload -------------------------------------------------------------------------------------------


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """When each request arrives, in seconds from the first: a Poisson process of `rate` requests/s, whose gaps
    are exponential with mean 1/rate. The same seed gives every rate the same draws, scaled by 1/rate. At inf,
    all at 0."""
    if rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    arrivals = [0.0]
    for _ in range(num_requests - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    return arrivals


def vocabulary_words(tokenizer: Tokenizer) -> list[str]:
    """The vocabulary's plain words (one ASCII word after a space, " the"), without the space: text any server's
    tokenizer reads as ordinary words, and in this one about one token each."""
    words = set()
    for token_id in range(len(tokenizer.hf)):
        text = tokenizer.decode([token_id])
        if text.startswith(" ") and text[1:].isascii() and text[1:].isalpha():
            words.add(text[1:])
    return sorted(words)


def draw_lengths(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                 seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request, uniform within their ranges."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(num_requests)]


def prompt_texts(words: list[str], prompt_lens: Sequence[int], seed: str) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=n)) for n in prompt_lens]


# ----- sending and measuring ----------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, `arrival` and `sent` from the rate's start."""

    output_len: int  # the tokens asked for
    arrival: float
    sent: float = 0.0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """None for a single token: there is no second one to time."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def row(self) -> dict[str, Any]:
        ms = lambda s: None if s is None else round(s * 1e3, 3)  # noqa: E731
        return {"arrival_s": round(self.arrival, 4), "sent_s": round(self.sent, 4), "output_len": self.output_len,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "e2e_ms": ms(self.e2e), "error": self.error}


async def one_request(client: AsyncOpenAI, model: str, text: str, output_len: int, arrival: float,
                      start: float, ignore_eos: bool = True) -> RequestResult:
    """Wait for the request's arrival time, then send it and time its stream. Without `ignore_eos` (a server that
    refuses the field), a request may end early at an end-of-sequence token, and still counts as completed."""
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    sent = time.perf_counter()
    result = RequestResult(output_len, arrival, sent=sent - start)
    chunk_times: list[float] = []
    usage, finish = None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=output_len, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if ignore_eos else None)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:  # the first chunk may carry only the role
                chunk_times.append(time.perf_counter())
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
    except APIError as err:  # a status other than 200, a dropped connection, a timeout, an error event
        result.error = f"{type(err).__name__}: {err}"[:300]
    result.e2e = time.perf_counter() - sent
    if chunk_times:
        result.ttft = chunk_times[0] - sent
        result.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    if usage is not None:
        result.prompt_tokens, result.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    if result.error is None:
        if usage is None:
            result.error = "no usage in the stream (the server ignored stream_options.include_usage)"
        elif usage.completion_tokens != output_len and (ignore_eos or finish != "stop"):
            result.error = f"{usage.completion_tokens} tokens where {output_len} were asked (ignore_eos ignored?)"
        elif result.ttft is None:
            result.error = "no content in the stream"
    return result


async def run_rate(base_url: str, model: str, texts: Sequence[str], output_lens: Sequence[int],
                   arrivals: Sequence[float], ignore_eos: bool = True) -> tuple[list[RequestResult], float]:
    """Every request as a task of its own, sent at its arrival time whatever the others are doing; returns the
    results and the seconds from the first arrival to the last answer."""
    # No cap on connections: the SDK's pool (1000) would hold requests back at the client, a closed loop again.
    http_client = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=1800,
                           http_client=http_client) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[one_request(client, model, text, n, arrival, start, ignore_eos)
                                         for text, n, arrival in zip(texts, output_lens, arrivals)])
        duration = time.perf_counter() - start
    return list(results), duration


# ----- what a rate shows --------------------------------------------------------------------------------------


def stats_ms(seconds: Sequence[float]) -> dict[str, float] | None:
    """Mean, p50, p90 and p99 in milliseconds (numpy's percentile, interpolated); None if there are none."""
    if not seconds:
        return None
    ms = np.asarray(seconds) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def rate_json(rate: float) -> float | str:
    return "inf" if rate == float("inf") else rate  # JSON has no infinity


def summarize(rate: float, results: Sequence[RequestResult], duration: float, ttft_target_ms: float,
              tpot_target_ms: float) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    good = [r for r in done if r.ttft * 1e3 <= ttft_target_ms and (r.tpot is None or r.tpot * 1e3 <= tpot_target_ms)]
    output_tokens = sum(r.completion_tokens for r in done)
    return {
        "request_rate": rate_json(rate),
        "requests_sent": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if r.error is not None)),
        "duration_s": duration,
        # How far the client fell behind its own schedule: large, and the arrivals were not the ones asked for.
        "send_lag_ms_max": max((r.sent - r.arrival) * 1e3 for r in results),
        "send_span_s": max(r.sent for r in results) - min(r.sent for r in results),
        "request_throughput": len(done) / duration, "output_tok_per_s": output_tokens / duration,
        "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in done])) if done else None,
        "completion_tokens_mean": float(np.mean([r.completion_tokens for r in done])) if done else None,
        "ttft_ms": stats_ms([r.ttft for r in done]), "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]), "e2e_ms": stats_ms([r.e2e for r in done]),
        "goodput_req_per_s": len(good) / duration, "goodput_share": len(good) / len(results),
        "requests": [r.row() for r in results],
    }


TABLE_HEADER = (f"{'rate':>6} {'sent':>5} {'ok':>5} {'fail':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} "
                f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>9} {'E2E p50':>9} {'goodput':>13}")


def table_row(run: dict[str, Any]) -> str:
    """One rate, as TABLE_HEADER's columns (latencies in ms; goodput in req/s and as a share of requests)."""
    ms = lambda name, q: f"{run[name][q]:9.1f}" if run[name] else f"{'-':>9}"  # noqa: E731
    return (f"{run['request_rate']:>6} {run['requests_sent']:5d} {run['completed']:5d} {run['failed']:5d} "
            f"{run['request_throughput']:7.2f} {run['output_tok_per_s']:8.1f} {ms('ttft_ms', 'p50')} "
            f"{ms('ttft_ms', 'p99')} {ms('tpot_ms', 'p50')} {ms('tpot_ms', 'p99')} {ms('itl_ms', 'p99')} "
            f"{ms('e2e_ms', 'p50')} {run['goodput_req_per_s']:6.2f} ({run['goodput_share']:4.0%})")


# ----- the run ------------------------------------------------------------------------------------------------


class ServerError(RuntimeError):
    """The server did not answer the warm-up: a wrong --base-url or --served-model, most often."""


def sweep(base_url: str, model: str, words: list[str], lengths: list[tuple[int, int]], rates: list[float],
          args: argparse.Namespace, header: dict[str, Any], output: Path) -> None:
    """Every rate in turn, its row printed and the evidence rewritten after each (a long sweep keeps what it did)."""
    warmup, _ = asyncio.run(run_rate(base_url, model, prompt_texts(words, [16] * WARMUP_REQUESTS, "warm-up"),
                                     [4] * WARMUP_REQUESTS, [0.0] * WARMUP_REQUESTS, not args.no_ignore_eos))
    errors = [r.error for r in warmup if r.error]
    if errors:
        raise ServerError(f"the warm-up failed at {base_url} for model {model!r}: {errors[0]}")
    prompt_lens, output_lens = [p for p, _ in lengths], [o for _, o in lengths]
    print(TABLE_HEADER, flush=True)
    runs: list[dict[str, Any]] = []
    for i, rate in enumerate(rates):
        # New words at each rate: a prefix cache must not answer one rate's prompts from another's.
        texts = prompt_texts(words, prompt_lens, f"{args.workload_seed}-{i}")
        arrivals = poisson_arrivals(len(lengths), rate, args.workload_seed)
        results, duration = asyncio.run(run_rate(base_url, model, texts, output_lens, arrivals,
                                                 not args.no_ignore_eos))
        runs.append(summarize(rate, results, duration, args.goodput_ttft_ms, args.goodput_tpot_ms))
        print(table_row(runs[-1]), flush=True)
        for error, count in runs[-1]["errors"].items():
            print(f"{'':>6} {count} failed: {error}", flush=True)
        write_json(output, header | {"runs": runs})
    # Again, together: a server's own log lines may have come between the rows above.
    print("\n".join(["", TABLE_HEADER, *map(table_row, runs)]), flush=True)


def write_plot_beside(evidence: Path) -> None:
    try:
        from common.plots.latency import write_plot

        print(f"wrote {write_plot([evidence], evidence.with_suffix('.png'))}")
    except ImportError as err:  # matplotlib is a test extra, not a dependency of the engine
        print(f"no plot written ({err}); pip install matplotlib, then python scripts/plot_open_loop.py {evidence}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(chosen_step(argv), add_bench_arguments, __doc__).parse_args(argv)
    try:  # before the server starts: a bad value is one line and exit code 2
        check_args(args)
        rates = parse_rates(args.request_rates)
        prompt_range = parse_range("--prompt-len-range", args.prompt_len_range)
        output_range = parse_range("--output-len-range", args.output_len_range)
        for flag, value in (("--goodput-ttft-ms", args.goodput_ttft_ms), ("--goodput-tpot-ms", args.goodput_tpot_ms)):
            if not value > 0:
                raise CommandLineError(f"{flag} must be more than 0 (got {value})")
        check_server_choice(args, argv)
    except CommandLineError as err:
        return fail(err)
    from common.loading import load_tokenizer  # loads transformers: only once the command line is accepted

    external = args.base_url is not None
    model = args.served_model if external else args.model
    label = args.label or (args.served_model if external else args.step)
    config = engine_class(args.step).config_class.from_args(args)  # with --base-url: the device and dtype given
    device, dtype = config.resolved_device(), config.resolved_dtype()
    words = vocabulary_words(load_tokenizer(args.model))
    lengths = draw_lengths(args.num_requests, prompt_range, output_range, args.workload_seed)
    workload = {
        "arrivals": "poisson", "request_rates": [rate_json(r) for r in rates], "num_requests": args.num_requests,
        "prompt_len": {"distribution": "uniform integers", "min": prompt_range[0], "max": prompt_range[1],
                       "mean_drawn": float(np.mean([p for p, _ in lengths])),
                       "text": f"random words of {args.model}'s vocabulary, in the served model's chat template"},
        "output_len": {"distribution": "uniform integers", "min": output_range[0], "max": output_range[1],
                       "mean_drawn": float(np.mean([o for _, o in lengths]))},
        "seed": args.workload_seed, "temperature": 0, "ignore_eos": not args.no_ignore_eos,
    }
    goodput = {"ttft_ms": args.goodput_ttft_ms, "tpot_ms": args.goodput_tpot_ms}
    if external:
        server: dict[str, Any] = {"server": "external", "base_url": args.base_url.rstrip("/"), "served_model": model}
    else:
        server = {"server": "step08_serve/run.py", "step": args.step, "max_num_seqs": args.max_num_seqs,
                  "engine_flags": engine_argv(argv, add_bench_arguments)}
    header = evidence_header(device, model, dtype, label=label, **server, workload=workload, goodput=goodput)
    output = args.output or default_output("step08_serve", "open-loop", device.type, model)
    try:
        if external:
            sweep(server["base_url"], model, words, lengths, rates, args, header, output)
        else:
            with server_process(server["engine_flags"]) as base_url:
                sweep(base_url, model, words, lengths, rates, args, header, output)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_plot_beside(output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
