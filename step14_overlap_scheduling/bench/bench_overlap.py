"""Where a decode step's time goes, with and without overlap: the GPU's replay, the host's work, the step.

One engine, one batch of requests decoding together, run twice: with `overlap` off (the host waits for each
step's tokens, then processes them, then launches the next step) and on (the next step is launched first).
Per decode step it reports:
- the GPU's time: the step's graph replayed alone, timed with CUDA events (none on a CPU);
- the host's time: the step's wall time less the time the host spent waiting for the GPU's tokens
  (`PendingTokens.wait`): scheduling, filling the static buffers, reading, detokenizing, stop checks;
- the step's wall time, and output tokens per second.
Without overlap a step costs about host + GPU; with it, about the larger of the two.

    .venv/bin/python step14_overlap_scheduling/bench/bench_overlap.py --device cuda --model random:qwen2.5-7b --batches 1,8,64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from common.bench import default_output, evidence_header, fixed_workload, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.loading import EMBEDDED_MODEL
from common.sampling import SamplingParams
from common.timing import graph_replay_ms
from step12_cuda_graph.decode_graphs import PendingTokens
from step14_overlap_scheduling.engine import OverlapSchedulingEngine, OverlapSchedulingEngineConfig


class WaitClock:
    """Adds up the time the host spends in `PendingTokens.wait` (blocked on the GPU) while it is installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.original = PendingTokens.wait

    def __enter__(self) -> WaitClock:
        clock, original = self, self.original

        def wait(tokens: PendingTokens) -> list[int]:
            start = time.perf_counter()
            try:
                return original(tokens)
            finally:
                clock.seconds += time.perf_counter() - start

        PendingTokens.wait = wait  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        PendingTokens.wait = self.original  # type: ignore[method-assign]


def replay_ms(engine: OverlapSchedulingEngine, batch: int, longest: int, repeats: int = 20) -> float | None:
    """The GPU's time for one decode step of `batch` rows whose longest sequence is `longest`: its graph replayed
    alone (None where not captured)."""
    graphs = engine.graphs
    if graphs is None or engine.eager_reason is not None:
        return None
    graph = graphs.graph_for(graphs.bucket_for(batch), sampled=False, longest=longest)
    if graph is None:
        return None
    return graph_replay_ms(graph, repeats)


def decode_run(engine: OverlapSchedulingEngine, batch: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    """Prefill `batch` requests, then time their decode steps to the end."""
    workload = fixed_workload(batch, prompt_len, max_tokens)
    requests = [engine.requests[engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
                for prompt in workload.prompts]
    while not all(r.output_token_ids for r in requests):
        engine.step()  # the prefill (in chunks of the token budget) and the first tokens: not decode steps
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    steps = 0
    with WaitClock() as waited:
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    tokens = batch * (max_tokens - 1)  # all but each request's first token
    return {"decode_steps": steps, "step_ms": 1e3 * wall / steps, "host_ms": 1e3 * (wall - waited.seconds) / steps,
            "waiting_ms": 1e3 * waited.seconds / steps, "tokens_per_s": tokens / wall}


def main() -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt-len", type=at_least(1), default=32)
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--output", type=Path, default=None, help="evidence file (default runs/step14_overlap_scheduling/...)")
    args = p.parse_args()
    try:  # before the model loads: a bad value is one line and exit code 2
        check_args(args)
        batches = parse_sizes("--batches", args.batches)
    except CommandLineError as err:
        return fail(err)
    config = OverlapSchedulingEngineConfig(model=args.model, device=args.device, dtype=args.dtype, overlap=True,
                                           max_num_seqs=max(batches))
    engine = OverlapSchedulingEngine.from_config(config)
    header = evidence_header(engine.device, args.model, engine.model.dtype, step="step14_overlap_scheduling",
                             prompt_len=args.prompt_len, max_tokens=args.max_tokens, graphs=engine.graph_status())
    rows: list[dict[str, Any]] = []
    for batch in batches:
        decode_run(engine, batch, args.prompt_len, 8)  # warm-up on the same shapes
        row: dict[str, Any] = {"batch": batch}
        for overlap in (False, True):
            engine.overlap = overlap  # the same engine and graphs, the launch-ahead switched
            row["overlap" if overlap else "no_overlap"] = decode_run(engine, batch, args.prompt_len, args.max_tokens)
        engine.overlap = True
        row["gpu_ms"] = replay_ms(engine, batch, args.prompt_len + args.max_tokens)
        rows.append(row)
        off, on = row["no_overlap"], row["overlap"]
        gpu = "-" if row["gpu_ms"] is None else f"{row['gpu_ms']:.2f}"
        print(f"batch {batch:3d}: GPU {gpu} ms/step; host {off['host_ms']:.2f} ms; step {off['step_ms']:.2f} ms "
              f"without overlap, {on['step_ms']:.2f} ms with ({on['tokens_per_s'] / off['tokens_per_s']:.2f}x)",
              flush=True)
    output = args.output or default_output("step14_overlap_scheduling", "overlap", engine.device.type, args.model)
    write_json(output, header | {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
