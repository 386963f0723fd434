"""The host's share of a decode step: what the CPU does per step besides running the model.

Once decode is a CUDA graph, the GPU's work per step is one replay; what remains on the host is Python:
scheduling (step 09's `schedule`), filling the static inputs, and turning sampled ids into text
(`process_tokens`: detokenizing, stop checks). The engine waits for each step's tokens before doing any of
it, so this time adds to every step. Measured here on the CPU with a tiny model and the model's own work
timed apart (the forward is wrapped), at several batch sizes with long prompts. Writes JSON evidence (by
default runs/step14_overlap_scheduling/host-per-step-cpu.json, ignored by git).

    .venv/bin/python step14_overlap_scheduling/bench_host.py --batches 32,128,256
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, check_args, check_at_least, fail, parse_sizes
from common.loading import load_model
from common.sampling import SamplingParams
from step14_overlap_scheduling.engine import OverlapSchedulingEngine, OverlapSchedulingEngineConfig


def timed(totals: dict[str, float], name: str, fn: Callable) -> Callable:
    """`fn`, adding its wall time to `totals[name]` on every call."""
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return wrapper


def host_ms_per_step(batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    loaded = load_model("tiny-llama")
    engine = OverlapSchedulingEngine(loaded, OverlapSchedulingEngineConfig(
        device="cpu", block_size=16, attn="torch", num_blocks=batch * (-(-(prompt_len + steps + 8) // 16)),
        # A budget that prefills every prompt in one step: under a smaller one the first requests would reach
        # max_tokens while the last prompts wait, and the timed steps would hold fewer requests than `batch`.
        max_num_batched_tokens=batch * prompt_len, max_graph_batch=batch))
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    engine.step()  # the prefill, not measured
    engine.step()
    decoding = [r for r in engine.running if r.output_token_ids]
    assert len(decoding) == batch, f"{len(decoding)} of {batch} requests decode: the timed steps would not hold all"
    totals: dict[str, float] = defaultdict(float)
    graphs = engine.graphs
    assert graphs is not None
    graphs.forward = timed(totals, "model forward (the GPU's part)", graphs.forward)
    engine.schedule = timed(totals, "schedule", engine.schedule)
    graphs.inputs.fill = timed(totals, "fill static inputs", graphs.inputs.fill)
    engine.process_tokens = timed(totals, "process tokens (detokenize, stop checks)", engine.process_tokens)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    per_step = {name: 1e3 * t / steps for name, t in totals.items()}
    forward = per_step["model forward (the GPU's part)"]
    per_step["host, all of it"] = 1e3 * total / steps - forward
    return per_step


def main() -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="32,128,256")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--output", type=Path, help="evidence file (default runs/step14_overlap_scheduling/"
                                               "host-per-step-cpu.json, numbered if taken)")
    args = p.parse_args()
    try:  # before the model loads: a bad value is one line and exit code 2
        check_args(args)
        batches = parse_sizes("--batches", args.batches)
        check_at_least("--steps", args.steps, 1)
    except CommandLineError as err:
        return fail(err)
    torch.set_num_threads(1)  # the host's Python is single-threaded; keep the forward from borrowing cores
    header = evidence_header(torch.device("cpu"), "tiny-llama", torch.float32, prompt_len=args.prompt_len,
                             steps=args.steps)
    rows = []
    for batch in batches:
        per_step = host_ms_per_step(batch, args.prompt_len, args.steps)
        rows.append({"batch": batch, "ms_per_step": per_step})
        parts = ", ".join(f"{name} {ms:.2f}" for name, ms in per_step.items())
        print(f"batch {batch}: ms per step: {parts}", flush=True)
    output = args.output or default_output("step14_overlap_scheduling", "host-per-step", "cpu")
    write_json(output, header | {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
